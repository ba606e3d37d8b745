//! The checkpoint doctor: streams every MoE layer of a checkpoint and reports what is broken or
//! suspicious, with a location and a one-line explanation (see `docs/TROUBLESHOOTING.md`).
//!
//! Unlike [`Checkpoint::load_layer`], which stops at the first error, the doctor looks at every
//! tensor and keeps going. It reads one expert's tensors at a time straight from the memory map
//! (rayon over the experts of a layer), so memory stays bounded for any checkpoint size.
//!
//! ```no_run
//! # fn main() -> megamoe::Result<()> {
//! use megamoe::diagnostics::doctor::{examine, DoctorOptions};
//! let ck = megamoe::checkpoint::Checkpoint::open("path/to/checkpoint")?;
//! let report = examine(&ck, &DoctorOptions::default())?;
//! print!("{}", report.render_table());
//! std::process::exit(report.exit_code());
//! # }
//! ```

use super::report::{Finding, Report, Severity};
use crate::checkpoint::{Checkpoint, Naming, Proj};
use crate::config::ScoringFunc;
use crate::error::{MegaError, Result};
use crate::formats::{e2m1, e4m3, scale_layout, WeightFormat};
use rayon::prelude::*;
use safetensors::Dtype;
use std::path::PathBuf;
use tracing::{debug, info};

/// Options of [`examine`].
#[derive(Clone, Debug)]
pub struct DoctorOptions {
    /// Only these layers (default: every MoE layer in the checkpoint).
    pub layers: Option<Vec<usize>>,
    /// BF16 originals the checkpoint was quantized from: a safetensors file, or a directory with
    /// `model.safetensors` / a sharded index, holding the same `.weight` names.
    pub reference: Option<PathBuf>,
    /// Show an indicatif progress bar on stderr.
    pub progress: bool,
    /// Robust z-score (of log-norm against the layer's median) above which an expert's norm is
    /// an outlier.
    pub outlier_z: f64,
    /// ... and only when its norm is also this many times above (or below) the median.
    pub outlier_ratio: f64,
    /// `--reference`: a stored weight is flagged when its error exceeds the error of a correct
    /// quantization by this factor.
    pub reference_factor: f64,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        DoctorOptions {
            layers: None,
            reference: None,
            progress: false,
            outlier_z: 6.0,
            outlier_ratio: 4.0,
            reference_factor: 2.0,
        }
    }
}

/// Finding codes (stable; documented in `docs/TROUBLESHOOTING.md`).
pub mod codes {
    /// `config.json` or the tensor headers cannot be read.
    pub const CHECKPOINT_UNREADABLE: &str = "checkpoint_unreadable";
    /// A tensor the config requires is absent.
    pub const MISSING_TENSOR: &str = "missing_tensor";
    /// A tensor's dtype is not one the format allows.
    pub const DTYPE_MISMATCH: &str = "dtype_mismatch";
    /// A tensor's shape disagrees with `config.json`.
    pub const SHAPE_MISMATCH: &str = "shape_mismatch";
    /// A block-scale tensor's shape only fits the padded 128x4 swizzled layout.
    pub const PADDED_SCALE_LAYOUT: &str = "padded_scale_layout";
    /// `weight_scale_2` missing, zero, negative or non-finite.
    pub const BAD_GLOBAL_SCALE: &str = "bad_global_scale";
    /// `input_scale` zero, negative or non-finite.
    pub const BAD_INPUT_SCALE: &str = "bad_input_scale";
    /// `input_scale` absent (W4A4 unavailable).
    pub const MISSING_INPUT_SCALE: &str = "missing_input_scale";
    /// The global scale implies weights far larger than any real model has.
    pub const IMPLAUSIBLE_GLOBAL_SCALE: &str = "implausible_global_scale";
    /// NaN block-scale bytes (e4m3 0x7F/0xFF, e8m0 0xFF).
    pub const NAN_BLOCK_SCALES: &str = "nan_block_scales";
    /// Negative e4m3 block scales.
    pub const NEGATIVE_BLOCK_SCALES: &str = "negative_block_scales";
    /// Subnormal e4m3 block scales.
    pub const SUBNORMAL_BLOCK_SCALES: &str = "subnormal_block_scales";
    /// 16/32-element blocks whose codes are all zero.
    pub const ZERO_BLOCKS: &str = "zero_blocks";
    /// Every block scale at the minimum (or every code zero): the projection computes ~0.
    pub const DEAD_EXPERT: &str = "dead_expert";
    /// An expert's dequantized norm is an outlier within its layer.
    pub const NORM_OUTLIER: &str = "norm_outlier";
    /// Non-finite BF16 weights.
    pub const NON_FINITE_WEIGHTS: &str = "non_finite_weights";
    /// W1 and W3 global scales differ by more than 2x.
    pub const W1_W3_SCALE_MISMATCH: &str = "w1_w3_scale_mismatch";
    /// W1 and W3 global scales differ (normal for ModelOpt; matters for one-alpha kernels).
    pub const W1_W3_SCALES_DIFFER: &str = "w1_w3_scales_differ";
    /// Expert tensors missing for some experts / present beyond `n_routed_experts`.
    pub const EXPERT_SET: &str = "expert_set";
    /// The expert format cannot be determined.
    pub const UNKNOWN_FORMAT: &str = "unknown_format";
    /// Non-finite router weights.
    pub const NON_FINITE_ROUTER: &str = "non_finite_router";
    /// NaN / Inf router bias.
    pub const NAN_ROUTER_BIAS: &str = "nan_router_bias";
    /// No router bias on a score-routed layer.
    pub const MISSING_ROUTER_BIAS: &str = "missing_router_bias";
    /// `tid2eid` ids outside `0..E`.
    pub const TID2EID_OUT_OF_RANGE: &str = "tid2eid_out_of_range";
    /// `tid2eid` rows naming one expert twice.
    pub const TID2EID_REPEATED: &str = "tid2eid_repeated";
    /// `tid2eid` on a layer that is not hash-routed.
    pub const TID2EID_UNUSED: &str = "tid2eid_unused";
    /// `--reference`: the stored weight is far from the original and no hypothesis explains it.
    pub const REFERENCE_MISMATCH: &str = "reference_mismatch";
    /// `--reference`: nibble order reversed (element 2j stored in the high nibble).
    pub const NIBBLES_REVERSED: &str = "nibbles_reversed";
    /// `--reference`: W1 (gate) and W3 (up) swapped.
    pub const W1_W3_SWAPPED: &str = "w1_w3_swapped";
    /// `--reference`: scales stored in the 128x4 swizzled layout but declared row-major.
    pub const SCALES_SWIZZLED: &str = "scales_swizzled";
    /// `--reference`: global scale stored as its reciprocal.
    pub const GLOBAL_SCALE_RECIPROCAL: &str = "global_scale_reciprocal";
    /// `--reference`: the weights belong to another expert.
    pub const EXPERTS_PERMUTED: &str = "experts_permuted";
    /// `--reference`: rows of the weight are permuted.
    pub const ROWS_PERMUTED: &str = "rows_permuted";
}

/// Per-projection numbers gathered while examining one expert.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ProjStats {
    /// Frobenius norm of the dequantized weight (`None` when it could not be decoded).
    pub norm: Option<f64>,
    /// NVFP4 `weight_scale_2`, when readable.
    pub global_scale: Option<f32>,
    /// Whether the projection was flagged dead.
    pub dead: bool,
}

/// Shape of a projection: `(rows, cols)` = (out, in).
pub(crate) fn proj_shape(ck: &Checkpoint, p: Proj) -> (usize, usize) {
    let c = ck.config();
    match p {
        Proj::W2 => (c.hidden_size, c.moe_intermediate_size),
        _ => (c.moe_intermediate_size, c.hidden_size),
    }
}

/// `w1` / `w2` / `w3`.
pub(crate) fn proj_label(p: Proj) -> &'static str {
    match p {
        Proj::W1 => "W1",
        Proj::W2 => "W2",
        Proj::W3 => "W3",
    }
}

/// Examines `ck` (the layers of `opts.layers`, default all) and returns every finding.
///
/// Errors only when the request itself is impossible (a layer that is not in the checkpoint, an
/// unreadable `--reference`); everything wrong inside the checkpoint becomes a [`Finding`].
pub fn examine(ck: &Checkpoint, opts: &DoctorOptions) -> Result<Report> {
    let all = ck.moe_layers();
    let layers = match &opts.layers {
        Some(ls) => {
            if let Some(bad) = ls.iter().find(|l| !all.contains(l)) {
                return Err(MegaError::Input(format!(
                    "layer {bad} is not in the checkpoint {}; it has MoE layers {all:?}",
                    ck.dir().display()
                )));
            }
            ls.clone()
        }
        None => all,
    };
    let reference = match &opts.reference {
        Some(p) => Some(super::compare::ReferenceWeights::open(p)?),
        None => None,
    };
    let mut report =
        Report { checkpoint: ck.dir().display().to_string(), layers: layers.clone(), ..Report::default() };
    let e_cfg = ck.config().n_routed_experts;
    let total: u64 = layers.iter().map(|&l| ck.experts_present(l).len().max(e_cfg) as u64).sum();
    let pb = progress_bar(opts.progress, total);
    info!(
        "doctor: {} ({} layer(s), naming {}, quant {:?})",
        ck.dir().display(),
        layers.len(),
        ck.naming().name(),
        ck.quant().experts
    );
    for &layer in &layers {
        if let Some(pb) = &pb {
            pb.set_message(format!("layer {layer}"));
        }
        examine_layer(ck, layer, opts, reference.as_ref(), &mut report, pb.as_ref());
    }
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    report.sort();
    info!(
        "doctor: {} error(s), {} warning(s), {} info",
        report.count(Severity::Error),
        report.count(Severity::Warning),
        report.count(Severity::Info)
    );
    Ok(report)
}

fn progress_bar(show: bool, total: u64) -> Option<indicatif::ProgressBar> {
    if !show {
        return None;
    }
    let pb = indicatif::ProgressBar::new(total);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("doctor {msg} [{bar:40}] {pos}/{len} experts ({eta})")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    Some(pb)
}

fn examine_layer(
    ck: &Checkpoint,
    layer: usize,
    opts: &DoctorOptions,
    reference: Option<&super::compare::ReferenceWeights>,
    report: &mut Report,
    pb: Option<&indicatif::ProgressBar>,
) {
    let cfg = ck.config();
    let e_n = cfg.n_routed_experts;
    report.findings.extend(check_router(ck, layer));
    report.findings.extend(check_shared(ck, layer));

    // The expert set: every expert 0..E present, none beyond.
    let present = ck.experts_present(layer);
    let beyond: Vec<usize> = present.iter().copied().filter(|&e| e >= e_n).collect();
    for &e in &beyond {
        report.findings.push(
            Finding::new(
                Severity::Error,
                codes::EXPERT_SET,
                format!("tensors for expert {e}, but config.json says n_routed_experts = {e_n}"),
            )
            .layer(layer)
            .expert(e),
        );
    }
    let missing: Vec<usize> = (0..e_n).filter(|e| present.binary_search(e).is_err()).collect();
    if !missing.is_empty() && missing.len() < e_n {
        for &e in &missing {
            report.findings.push(
                Finding::new(
                    Severity::Error,
                    codes::EXPERT_SET,
                    "no tensors for this expert (every expert 0..n_routed_experts must be present)",
                )
                .layer(layer)
                .expert(e)
                .tensor(format!("{}.*", ck.naming().expert_module(layer, e, Proj::W1))),
            );
        }
    } else if missing.len() == e_n && e_n > 0 {
        report.findings.push(
            Finding::new(
                Severity::Error,
                codes::EXPERT_SET,
                format!("no routed-expert tensors at all (config.json says n_routed_experts = {e_n})"),
            )
            .layer(layer),
        );
    }

    let format = match ck.expert_format(layer) {
        Ok(f) => f,
        Err(e) => {
            report.findings.push(
                Finding::new(
                    Severity::Error,
                    codes::UNKNOWN_FORMAT,
                    format!("cannot tell the expert format: {e}"),
                )
                .layer(layer),
            );
            return;
        }
    };
    info!("doctor: layer {layer}: {format:?} experts, {} present", present.len());

    let experts: Vec<usize> = (0..e_n).filter(|e| present.binary_search(e).is_ok()).collect();
    let results: Vec<(usize, Vec<Finding>, [ProjStats; 3])> = experts
        .par_iter()
        .map(|&e| {
            let mut findings = Vec::new();
            let mut stats = [ProjStats::default(); 3];
            for (i, p) in Proj::ALL.into_iter().enumerate() {
                stats[i] = examine_proj(ck, layer, e, p, format, &mut findings);
            }
            debug!(
                "doctor: layer {layer} expert {e}: {} finding(s), norms {:?}",
                findings.len(),
                stats.map(|s| s.norm)
            );
            if let Some(pb) = pb {
                pb.inc(1);
            }
            (e, findings, stats)
        })
        .collect();
    if let Some(pb) = pb {
        pb.inc((e_n - experts.len().min(e_n)) as u64);
    }
    let mut stats_of = Vec::with_capacity(results.len());
    for (e, f, s) in results {
        report.findings.extend(f);
        report.tensors_examined += 3;
        stats_of.push((e, s));
    }

    // Layer-level comparisons across experts.
    if format == WeightFormat::Nvfp4 {
        report.findings.extend(check_w13(ck, layer, &stats_of));
    }
    for (i, p) in Proj::ALL.into_iter().enumerate() {
        report.findings.extend(norm_outliers(ck, layer, p, i, &stats_of, opts));
    }

    if let Some(r) = reference {
        super::compare::compare_layer(ck, layer, format, r, opts, report);
    }
}

/// Dtype check; returns a finding when `got` is not allowed.
fn dtype_finding(
    layer: usize,
    expert: Option<usize>,
    name: &str,
    got: Dtype,
    allowed: &[Dtype],
    what: &str,
) -> Option<Finding> {
    if allowed.contains(&got) {
        return None;
    }
    let list: Vec<String> = allowed.iter().map(|d| format!("{d:?}")).collect();
    let mut f = Finding::new(
        Severity::Error,
        codes::DTYPE_MISMATCH,
        format!("dtype {got:?}, expected {} ({what})", list.join(" or ")),
    )
    .layer(layer)
    .tensor(name);
    f.expert = expert;
    Some(f)
}

/// A scalar f32 tensor's value, or a finding saying why not.
fn read_scalar(ck: &Checkpoint, name: &str) -> std::result::Result<f32, String> {
    let v = ck.tensor(name).map_err(|e| e.to_string())?;
    if v.shape().iter().product::<usize>() != 1 || v.shape().len() > 1 {
        return Err(format!("shape {:?}, expected a scalar [] or [1]", v.shape()));
    }
    crate::tensor_io::to_f32(name, &v).map(|(_, x)| x[0]).map_err(|e| e.to_string())
}

/// Squared E2M1 magnitudes of both nibbles of a byte, summed.
fn byte_sq_table() -> [f64; 256] {
    let mut t = [0.0f64; 256];
    for (b, v) in t.iter_mut().enumerate() {
        let lo = e2m1::decode(b as u8 & 0xF) as f64;
        let hi = e2m1::decode(b as u8 >> 4) as f64;
        *v = lo * lo + hi * hi;
    }
    t
}

/// Checks one projection of one expert; pushes findings, returns its numbers.
fn examine_proj(
    ck: &Checkpoint,
    layer: usize,
    expert: usize,
    p: Proj,
    format: WeightFormat,
    out: &mut Vec<Finding>,
) -> ProjStats {
    let (rows, cols) = proj_shape(ck, p);
    let m = ck.naming().expert_module(layer, expert, p);
    let at = |f: Finding| f.layer(layer).expert(expert);
    let mut stats = ProjStats::default();
    let wname = format!("{m}.weight");
    let Some((wdt, wshape)) = ck.store().info(&wname).map(|(d, s)| (d, s.to_vec())) else {
        out.push(at(Finding::new(
            Severity::Error,
            codes::MISSING_TENSOR,
            format!("missing ({format:?} {} weights of the expert)", proj_label(p)),
        )
        .tensor(&wname)));
        return stats;
    };
    let label = proj_label(p);
    let why = if p == Proj::W2 {
        "[hidden_size, moe_intermediate_size] from config.json"
    } else {
        "[moe_intermediate_size, hidden_size] from config.json"
    };
    match format {
        WeightFormat::Bf16 => {
            if let Some(f) =
                dtype_finding(layer, Some(expert), &wname, wdt, &[Dtype::BF16], "BF16 expert weights")
            {
                out.push(f);
                return stats;
            }
            if wshape != [rows, cols] {
                out.push(at(shape_finding(&wname, &wshape, &[rows, cols], why)));
                return stats;
            }
            let Ok(v) = ck.tensor(&wname) else { return stats };
            let (mut bad, mut sum) = (0usize, 0.0f64);
            for c in v.data().chunks_exact(2) {
                let x = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                if x.is_finite() {
                    sum += (x as f64) * (x as f64);
                } else {
                    bad += 1;
                }
            }
            if bad > 0 {
                out.push(at(Finding::new(
                    Severity::Error,
                    codes::NON_FINITE_WEIGHTS,
                    format!("{bad} non-finite value(s) in the {label} weights"),
                )
                .tensor(&wname)));
            }
            stats.norm = Some(sum.sqrt());
            stats
        }
        WeightFormat::Nvfp4 | WeightFormat::Mxfp4 => {
            let nv = format == WeightFormat::Nvfp4;
            let block = format.block_size().expect("FP4 formats have a block size");
            let ok_w = if nv { [Dtype::U8, Dtype::I8] } else { [Dtype::I8, Dtype::U8] };
            let mut ok = true;
            if let Some(f) = dtype_finding(layer, Some(expert), &wname, wdt, &ok_w, "packed E2M1 codes") {
                out.push(f);
                ok = false;
            } else if wshape != [rows, cols / 2] {
                out.push(at(shape_finding(
                    &wname,
                    &wshape,
                    &[rows, cols / 2],
                    &format!("{why}, two codes per byte"),
                )));
                ok = false;
            }
            // Block scales.
            let sname = if nv {
                format!("{m}.weight_scale")
            } else if ck.has(&format!("{m}.scale")) || !ck.has(&format!("{m}.weight_scale")) {
                format!("{m}.scale")
            } else {
                format!("{m}.weight_scale")
            };
            let scols = cols / block;
            let Some((sdt, sshape)) = ck.store().info(&sname).map(|(d, s)| (d, s.to_vec())) else {
                out.push(at(Finding::new(
                    Severity::Error,
                    codes::MISSING_TENSOR,
                    format!("missing: {label} block scales (one per {block} elements)"),
                )
                .tensor(&sname)));
                return stats;
            };
            let ok_s = if nv { [Dtype::F8_E4M3, Dtype::U8] } else { [Dtype::F8_E8M0, Dtype::U8] };
            if let Some(f) = dtype_finding(layer, Some(expert), &sname, sdt, &ok_s, "8-bit block scales") {
                out.push(f);
                ok = false;
            } else if sshape != [rows, scols] {
                let padded = [scale_layout::padded_rows(rows), scale_layout::padded_cols(scols)];
                let swz_len = scale_layout::swizzled_len(rows, scols);
                if sshape == padded || (sshape.len() == 1 && sshape[0] == swz_len && swz_len != rows * scols)
                {
                    out.push(at(Finding::new(
                        Severity::Error,
                        codes::PADDED_SCALE_LAYOUT,
                        format!(
                            "{label} block scales have shape {sshape:?}, which only fits the padded 128x4 swizzled \
                             layout (rows padded to 128, columns to 4) of [{rows}, {scols}] scales; checkpoints \
                             store them row-major [{rows}, {scols}]: un-swizzle and crop before saving"
                        ),
                    )
                    .tensor(&sname)));
                } else {
                    out.push(at(shape_finding(
                        &sname,
                        &sshape,
                        &[rows, scols],
                        &format!("one scale per {block} elements"),
                    )));
                }
                ok = false;
            }
            // Global / input scales (NVFP4).
            if nv {
                let g = format!("{m}.weight_scale_2");
                if !ck.has(&g) {
                    out.push(at(Finding::new(
                        Severity::Error,
                        codes::BAD_GLOBAL_SCALE,
                        "missing: NVFP4 needs the per-tensor global scale weight_scale_2",
                    )
                    .tensor(&g)));
                } else {
                    match read_scalar(ck, &g) {
                        Ok(x) if crate::formats::nvfp4::valid_global_scale(x) => stats.global_scale = Some(x),
                        Ok(x) => out.push(at(Finding::new(
                            Severity::Error,
                            codes::BAD_GLOBAL_SCALE,
                            format!(
                                "weight_scale_2 = {x}: the {label} weights dequantize to {}",
                                if x == 0.0 { "zero" } else { "garbage/NaN" }
                            ),
                        )
                        .tensor(&g))),
                        Err(msg) => out
                            .push(at(Finding::new(Severity::Error, codes::BAD_GLOBAL_SCALE, msg).tensor(&g))),
                    }
                }
                let is = format!("{m}.input_scale");
                if !ck.has(&is) {
                    out.push(at(Finding::new(
                        Severity::Warning,
                        codes::MISSING_INPUT_SCALE,
                        "missing input_scale: W4A4 (NVFP4 activations) is unavailable; W4A16/W4A8 are fine",
                    )
                    .tensor(&is)));
                } else {
                    match read_scalar(ck, &is) {
                        Ok(x) if x.is_finite() && x > 0.0 => {}
                        Ok(x) => out.push(at(Finding::new(
                            Severity::Error,
                            codes::BAD_INPUT_SCALE,
                            format!(
                                "input_scale = {x}: NVFP4 activation quantization divides by it, giving Inf/NaN \
                                 in W4A4 (Blackwell native NVFP4 kernels)"
                            ),
                        )
                        .tensor(&is))),
                        Err(msg) => out.push(at(Finding::new(Severity::Error, codes::BAD_INPUT_SCALE, msg).tensor(&is))),
                    }
                }
            }
            if !ok {
                return stats;
            }
            let (Ok(wv), Ok(sv)) = (ck.tensor(&wname), ck.tensor(&sname)) else { return stats };
            let scan = scan_fp4(wv.data(), sv.data(), cols, block, nv);
            if scan.nan > 0 {
                let (r, c) = (scan.first_nan / scols.max(1), scan.first_nan % scols.max(1));
                out.push(at(Finding::new(
                    Severity::Error,
                    codes::NAN_BLOCK_SCALES,
                    format!(
                        "{} of {} {label} block scales are NaN (first at [{r}, {c}], byte 0x{:02X}): uninitialised \
                         or corrupt scales (0x7F is NaN in e4m3) — every affected block decodes to NaN",
                        scan.nan,
                        scan.blocks,
                        sv.data()[scan.first_nan]
                    ),
                )
                .tensor(&sname)));
            }
            if scan.negative > 0 {
                out.push(at(Finding::new(
                    Severity::Warning,
                    codes::NEGATIVE_BLOCK_SCALES,
                    format!(
                        "{} {label} block scales are negative (sign bit set); quantizers never write those — \
                         integer bytes cast numerically, or corrupt data?",
                        scan.negative
                    ),
                )
                .tensor(&sname)));
            }
            if scan.subnormal > 0 {
                out.push(at(Finding::new(
                    Severity::Info,
                    codes::SUBNORMAL_BLOCK_SCALES,
                    format!(
                        "{} of {} {label} block scales are e4m3 subnormals (< 2^-6); legal, but decoders that \
                         flush or mis-decode subnormals get these blocks wrong",
                        scan.subnormal, scan.blocks
                    ),
                )
                .tensor(&sname)));
            }
            let dead = scan.blocks > 0 && (scan.at_min == scan.blocks || scan.zero_blocks == scan.blocks);
            if dead {
                stats.dead = true;
                let why = if scan.zero_blocks == scan.blocks {
                    "every code is zero".to_string()
                } else {
                    format!(
                        "all {} block scales are at the minimum ({})",
                        scan.blocks,
                        if nv { "e4m3 <= 2^-9" } else { "e8m0 2^-127" }
                    )
                };
                out.push(at(Finding::new(
                    Severity::Error,
                    codes::DEAD_EXPERT,
                    format!("{label} is dead: {why}, so it computes ~0 for every token routed here"),
                )
                .tensor(&sname)));
            } else if scan.zero_blocks > 0 {
                out.push(at(Finding::new(
                    Severity::Info,
                    codes::ZERO_BLOCKS,
                    format!(
                        "{} of {} {label} blocks have all codes zero ({:.2}%)",
                        scan.zero_blocks,
                        scan.blocks,
                        100.0 * scan.zero_blocks as f64 / scan.blocks as f64
                    ),
                )
                .tensor(&wname)));
            }
            let g = if nv { stats.global_scale.map(f64::from) } else { Some(1.0) };
            if let Some(g) = g {
                stats.norm = Some(scan.sum_sq.sqrt() * g);
                // The largest weight magnitude the scales allow: real LLM weights stay far below.
                let amax = 6.0 * scan.max_scale * g;
                if nv && amax > 1e3 {
                    out.push(at(Finding::new(
                        if amax > 1e5 { Severity::Error } else { Severity::Warning },
                        codes::IMPLAUSIBLE_GLOBAL_SCALE,
                        format!(
                            "weight_scale_2 = {g:.4e} makes the largest {label} weight {amax:.3e}; ModelOpt's global \
                             scale is amax/2688 (a multiplier, typically < 1e-2) — is it stored as its reciprocal \
                             (compressed-tensors convention)?"
                        ),
                    )
                    .tensor(format!("{m}.weight_scale_2"))));
                }
            }
            stats
        }
    }
}

fn shape_finding(name: &str, got: &[usize], expected: &[usize], why: &str) -> Finding {
    Finding::new(
        Severity::Error,
        codes::SHAPE_MISMATCH,
        format!("shape {got:?}, expected {expected:?} ({why})"),
    )
    .tensor(name)
}

/// Counts over one FP4 projection's codes and scales.
#[derive(Debug, Default)]
struct Fp4Scan {
    blocks: usize,
    nan: usize,
    first_nan: usize,
    negative: usize,
    subnormal: usize,
    at_min: usize,
    zero_blocks: usize,
    /// Sum of squared dequantized values without the global scale (NaN blocks skipped).
    sum_sq: f64,
    /// Largest finite block-scale magnitude.
    max_scale: f64,
}

fn scan_fp4(packed: &[u8], scales: &[u8], cols: usize, block: usize, nv: bool) -> Fp4Scan {
    let sq = byte_sq_table();
    let mut s = Fp4Scan { blocks: scales.len(), ..Fp4Scan::default() };
    let bytes_per_block = block / 2;
    for (i, (&b, codes)) in scales.iter().zip(packed.chunks_exact(bytes_per_block)).enumerate() {
        let zero = codes.iter().all(|&c| c & 0x77 == 0);
        s.zero_blocks += zero as usize;
        let value = if nv {
            if e4m3::is_nan(b) {
                if s.nan == 0 {
                    s.first_nan = i;
                }
                s.nan += 1;
                continue;
            }
            let mag = b & 0x7F;
            s.negative += (b & 0x80 != 0 && mag != 0) as usize;
            s.subnormal += (mag & 0x78 == 0 && mag != 0) as usize;
            s.at_min += (mag <= 1) as usize;
            e4m3::decode(b).abs() as f64
        } else {
            if b == 0xFF {
                if s.nan == 0 {
                    s.first_nan = i;
                }
                s.nan += 1;
                continue;
            }
            s.at_min += (b == 0) as usize;
            // 2^(b-127) in f64 (e8m0 reaches below f32's normal range, so not e8m0::decode).
            (b as f64 - 127.0).exp2()
        };
        s.max_scale = s.max_scale.max(value);
        let codes_sq: f64 = codes.iter().map(|&c| sq[c as usize]).sum();
        s.sum_sq += value * value * codes_sq;
    }
    debug_assert_eq!(packed.len() * 2, scales.len() * block, "cols {cols}");
    s
}

/// W1/W3 global scales: a per-expert warning when they differ by more than 2x, and one per-layer
/// note when they differ at all.
fn check_w13(ck: &Checkpoint, layer: usize, stats: &[(usize, [ProjStats; 3])]) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut ratios = Vec::new();
    for (e, s) in stats {
        let (Some(g1), Some(g3)) = (s[0].global_scale, s[2].global_scale) else { continue };
        if g1 == g3 {
            continue;
        }
        let r = g3 as f64 / g1 as f64;
        ratios.push(r);
        if !(0.5..=2.0).contains(&r) {
            out.push(
                Finding::new(
                    Severity::Warning,
                    codes::W1_W3_SCALE_MISMATCH,
                    format!(
                        "W1 and W3 weight_scale_2 differ by {r:.4}x (w3/w1 = {g3:.4e}/{g1:.4e}); a kernel that fuses \
                         W1/W3 with one alpha computes gate or up {r:.2}x off"
                    ),
                )
                .layer(layer)
                .expert(*e)
                .tensor(format!("{}.weight_scale_2", ck.naming().expert_module(layer, *e, Proj::W3))),
            );
        }
    }
    if !ratios.is_empty() {
        let lo = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        out.push(
            Finding::new(
                Severity::Info,
                codes::W1_W3_SCALES_DIFFER,
                format!(
                    "{} of {} experts have W1/W3 weight_scale_2 that differ (w3/w1 in [{lo:.4}, {hi:.4}]); megamoe keeps \
                     one alpha per projection, but kernels that fuse W1/W3 with a single alpha are off by that ratio",
                    ratios.len(),
                    stats.len()
                ),
            )
            .layer(layer),
        );
    }
    out
}

/// Experts whose dequantized norm is far from the layer's median (robust z-score of log-norm).
fn norm_outliers(
    ck: &Checkpoint,
    layer: usize,
    p: Proj,
    i: usize,
    stats: &[(usize, [ProjStats; 3])],
    opts: &DoctorOptions,
) -> Vec<Finding> {
    let logs: Vec<(usize, f64)> = stats
        .iter()
        .filter(|(_, s)| !s[i].dead)
        .filter_map(|(e, s)| s[i].norm.filter(|n| n.is_finite() && *n > 0.0).map(|n| (*e, n.ln())))
        .collect();
    if logs.len() < 4 {
        return Vec::new();
    }
    let med = median(logs.iter().map(|x| x.1).collect());
    let mad = median(logs.iter().map(|x| (x.1 - med).abs()).collect());
    // Floor the spread so near-identical experts do not make tiny differences "outliers".
    let sigma = (1.4826 * mad).max(0.05);
    let mut out = Vec::new();
    for (e, l) in logs {
        let z = (l - med) / sigma;
        let ratio = (l - med).exp();
        if z.abs() > opts.outlier_z && (ratio > opts.outlier_ratio || ratio < 1.0 / opts.outlier_ratio) {
            let what =
                if ratio > 1.0 { "blown up (global scale wrong or reciprocal?)" } else { "nearly dead" };
            out.push(
                Finding::new(
                    Severity::Warning,
                    codes::NORM_OUTLIER,
                    format!(
                        "{} dequantized norm is {ratio:.3}x the layer median (robust z {z:.1}): {what}",
                        proj_label(p)
                    ),
                )
                .layer(layer)
                .expert(e)
                .tensor(format!("{}.weight", ck.naming().expert_module(layer, e, p))),
            );
        }
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Router weight, bias and `tid2eid`.
fn check_router(ck: &Checkpoint, layer: usize) -> Vec<Finding> {
    let cfg = ck.config();
    let (e, h, k) = (cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok);
    let n: Naming = ck.naming();
    let mut out = Vec::new();
    let at = |f: Finding| f.layer(layer);
    let wname = n.router_weight(layer);
    match ck.tensor(&wname) {
        Err(_) => {
            out.push(at(Finding::new(Severity::Error, codes::MISSING_TENSOR, "missing router weight [E, H]")
                .tensor(&wname)))
        }
        Ok(v) => {
            if let Some(f) = dtype_finding(
                layer,
                None,
                &wname,
                v.dtype(),
                &[Dtype::BF16, Dtype::F32, Dtype::F16],
                "router weight",
            ) {
                out.push(f);
            } else if v.shape() != [e, h] {
                out.push(at(shape_finding(
                    &wname,
                    v.shape(),
                    &[e, h],
                    "[n_routed_experts, hidden_size] from config.json",
                )));
            } else if let Ok((_, w)) = crate::tensor_io::to_f32(&wname, &v) {
                let bad = w.iter().filter(|x| !x.is_finite()).count();
                if bad > 0 {
                    out.push(at(Finding::new(
                        Severity::Error,
                        codes::NON_FINITE_ROUTER,
                        format!(
                            "{bad} non-finite router weight(s): scores become NaN and top-k picks garbage"
                        ),
                    )
                    .tensor(&wname)));
                }
            }
        }
    }
    let bname = n.router_bias(layer);
    if ck.has(&bname) {
        if let Ok(v) = ck.tensor(&bname) {
            if let Some(f) = dtype_finding(
                layer,
                None,
                &bname,
                v.dtype(),
                &[Dtype::F32, Dtype::BF16, Dtype::F16],
                "router bias",
            ) {
                out.push(f);
            } else if v.shape() != [e] {
                out.push(at(shape_finding(&bname, v.shape(), &[e], "[n_routed_experts] from config.json")));
            } else if let Ok((_, b)) = crate::tensor_io::to_f32(&bname, &v) {
                let bad: Vec<usize> = (0..b.len()).filter(|&i| !b[i].is_finite()).collect();
                if let Some(&first) = bad.first() {
                    out.push(at(Finding::new(
                        Severity::Error,
                        codes::NAN_ROUTER_BIAS,
                        format!(
                            "{} non-finite router bias value(s) (first: expert {first} = {}): top-k of scores+bias \
                             picks the same expert k times or none",
                            bad.len(),
                            b[first]
                        ),
                    )
                    .tensor(&bname)));
                }
            }
        }
    } else if !cfg.is_hash_layer(layer) && cfg.scoring_func != ScoringFunc::Softmax {
        out.push(at(Finding::new(
            Severity::Warning,
            codes::MISSING_ROUTER_BIAS,
            "no router bias on a score-routed layer: experts are chosen by the scores alone (DeepSeek-V4 adds \
             gate.bias / e_score_correction_bias)",
        )
        .tensor(&bname)));
    }
    let tname = n.tid2eid(layer);
    if cfg.is_hash_layer(layer) {
        match ck.tensor(&tname) {
            Err(_) => out.push(at(Finding::new(
                Severity::Error,
                codes::MISSING_TENSOR,
                format!(
                    "missing: layer {layer} is hash-routed (num_hash_layers = {}) and needs tid2eid",
                    cfg.num_hash_layers
                ),
            )
            .tensor(&tname))),
            Ok(v) => {
                if let Some(f) =
                    dtype_finding(layer, None, &tname, v.dtype(), &[Dtype::I64, Dtype::I32], "expert ids")
                {
                    out.push(f);
                } else if v.shape().len() != 2 || v.shape()[1] != k {
                    out.push(at(shape_finding(
                        &tname,
                        v.shape(),
                        &[cfg.vocab_size, k],
                        "[vocab_size, num_experts_per_tok]",
                    )));
                } else if let Ok((shape, ids)) = crate::tensor_io::to_i64(&tname, &v) {
                    if shape[0] != cfg.vocab_size {
                        out.push(at(Finding::new(
                            Severity::Warning,
                            codes::SHAPE_MISMATCH,
                            format!(
                                "{} rows, but config.json says vocab_size = {}",
                                shape[0], cfg.vocab_size
                            ),
                        )
                        .tensor(&tname)));
                    }
                    out.extend(check_tid2eid(&ids, k, e).into_iter().map(|f| at(f.tensor(&tname))));
                }
            }
        }
    } else if ck.has(&tname) {
        out.push(at(Finding::new(
            Severity::Info,
            codes::TID2EID_UNUSED,
            format!(
                "tid2eid present but the layer is score-routed (num_hash_layers = {}); it is ignored",
                cfg.num_hash_layers
            ),
        )
        .tensor(&tname)));
    }
    out
}

/// Out-of-range ids and rows that name one expert twice.
fn check_tid2eid(ids: &[i64], k: usize, e: usize) -> Vec<Finding> {
    let mut out = Vec::new();
    let bad: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] < 0 || ids[i] >= e as i64).collect();
    if let Some(&p) = bad.first() {
        out.push(Finding::new(
            Severity::Error,
            codes::TID2EID_OUT_OF_RANGE,
            format!(
                "{} expert id(s) outside 0..{e} (first: {} at [{}, {}]): out-of-bounds expert access",
                bad.len(),
                ids[p],
                p / k,
                p % k
            ),
        ));
    }
    let mut repeated = 0usize;
    let mut first = None;
    for (r, row) in ids.chunks_exact(k.max(1)).enumerate() {
        let dup = (0..row.len()).any(|i| row[i + 1..].contains(&row[i]));
        if dup {
            repeated += 1;
            first.get_or_insert(r);
        }
    }
    if let Some(r) = first {
        out.push(Finding::new(
            Severity::Warning,
            codes::TID2EID_REPEATED,
            format!(
                "{repeated} row(s) name one expert more than once (first: token {r} -> {:?}); such tokens get that \
                 expert's output twice",
                &ids[r * k..(r + 1) * k]
            ),
        ));
    }
    out
}

/// The shared expert's presence, dtypes and shapes.
fn check_shared(ck: &Checkpoint, layer: usize) -> Vec<Finding> {
    let cfg = ck.config();
    let n = ck.naming();
    let mut out = Vec::new();
    let any = ck.store().names_with_prefix(&n.shared_prefix(layer)).next().is_some();
    if cfg.n_shared_experts == 0 {
        if any {
            out.push(
                Finding::new(
                    Severity::Error,
                    codes::SHAPE_MISMATCH,
                    "shared-expert tensors present but config.json says n_shared_experts = 0",
                )
                .layer(layer)
                .tensor(format!("{}*", n.shared_prefix(layer))),
            );
        }
        return out;
    }
    let (h, is) = (cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size);
    for p in Proj::ALL {
        let (r, c) = if p == Proj::W2 { (h, is) } else { (is, h) };
        let name = format!("{}.weight", n.shared_module(layer, p));
        match ck.store().info(&name) {
            None => out.push(
                Finding::new(
                    Severity::Error,
                    codes::MISSING_TENSOR,
                    "missing shared-expert weight (n_shared_experts > 0)",
                )
                .layer(layer)
                .tensor(&name),
            ),
            Some((d, s)) => {
                if let Some(f) =
                    dtype_finding(layer, None, &name, d, &[Dtype::BF16, Dtype::F8_E4M3], "shared expert")
                {
                    out.push(f);
                } else if s != [r, c] {
                    out.push(
                        shape_finding(&name, s, &[r, c], "n_shared_experts * moe_intermediate_size")
                            .layer(layer),
                    );
                } else if d == Dtype::BF16 {
                    if let Ok(v) = ck.tensor(&name) {
                        let bad = v
                            .data()
                            .chunks_exact(2)
                            .filter(|c| !half::bf16::from_le_bytes([c[0], c[1]]).is_finite())
                            .count();
                        if bad > 0 {
                            out.push(
                                Finding::new(
                                    Severity::Error,
                                    codes::NON_FINITE_WEIGHTS,
                                    format!("{bad} non-finite shared-expert weight(s)"),
                                )
                                .layer(layer)
                                .tensor(&name),
                            );
                        }
                    }
                }
            }
        }
    }
    out
}

/// A report for a checkpoint that cannot even be opened (`config.json` or headers broken).
pub fn unreadable(dir: &std::path::Path, err: &MegaError) -> Report {
    let mut r = Report { checkpoint: dir.display().to_string(), ..Report::default() };
    r.findings.push(Finding::new(Severity::Error, codes::CHECKPOINT_UNREADABLE, err.to_string()));
    r
}

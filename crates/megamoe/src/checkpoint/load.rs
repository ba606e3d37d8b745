//! Loading and validating one MoE layer into a [`MoeLayer`].

use super::layer::{DenseData, DenseProj, ExpertProj, MoeLayer, ProjData, RouterWeights, SharedExpert};
use super::naming::Proj;
use super::{check_expert_range, Checkpoint};
use crate::config::{QuantSource, ScoringFunc};
use crate::error::{MegaError, Result};
use crate::formats::{e4m3, e8m0, WeightFormat};
use crate::forward::Mode;
use half::bf16;
use rayon::prelude::*;
use safetensors::Dtype;
use std::ops::Range;

/// Options of [`Checkpoint::load_layer_with`].
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Treat a missing or invalid NVFP4 `input_scale` as an error (W4A4 needs it); otherwise it is
    /// a warning and the layer's `input_scale` is `None`.
    pub require_input_scale: bool,
    /// Show a progress bar: `Some(true)` always, `Some(false)` never, `None` when many experts
    /// (>= 64) are loaded.
    pub progress: Option<bool>,
}

impl LoadOptions {
    /// The options a forward in `mode` needs (W4A4 requires `input_scale`).
    pub fn for_mode(mode: Mode) -> LoadOptions {
        LoadOptions { require_input_scale: mode == Mode::W4A4, progress: None }
    }
}

/// A loaded layer and the warnings raised while validating it (each also logged with `tracing`).
#[derive(Clone, Debug)]
pub struct LoadedLayer {
    /// The layer.
    pub layer: MoeLayer,
    /// Non-fatal findings (e.g. W1/W3 global scales that differ, unusable `input_scale`).
    pub warnings: Vec<String>,
}

/// Number of elements of a shape.
fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

fn check_dtype(name: &str, got: Dtype, allowed: &[Dtype], what: &str) -> Result<()> {
    if allowed.contains(&got) {
        Ok(())
    } else {
        let list: Vec<String> = allowed.iter().map(|d| format!("{d:?}")).collect();
        Err(MegaError::tensor(name, format!("dtype {got:?}, expected {} ({what})", list.join(" or "))))
    }
}

fn check_shape(name: &str, got: &[usize], expected: &[usize], why: &str) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(MegaError::tensor(name, format!("shape {got:?}, expected {expected:?} ({why})")))
    }
}

/// Fails when any byte of a `[rows, cols]` byte matrix is NaN, reporting count and first position.
/// Shared with the backends that validate layers built in code (`is_nan`: e.g. [`crate::formats::e4m3::is_nan`]).
pub(crate) fn scan_nan_bytes(
    name: &str,
    data: &[u8],
    cols: usize,
    is_nan: fn(u8) -> bool,
    what: &str,
) -> Result<()> {
    let mut count = 0usize;
    let mut first = None;
    for (i, &b) in data.iter().enumerate() {
        if is_nan(b) {
            count += 1;
            first.get_or_insert(i);
        }
    }
    match first {
        None => Ok(()),
        Some(i) => Err(MegaError::tensor(
            name,
            format!(
                "{count} NaN {what} byte(s) (first at [{}, {}], byte 0x{:02X}) — uninitialised or corrupt scales",
                i / cols.max(1),
                i % cols.max(1),
                data[i]
            ),
        )),
    }
}

/// A scalar f32 (shape `[]` or `[1]`, dtype F32/BF16/F16).
fn scalar_f32(ck: &Checkpoint, name: &str) -> Result<f32> {
    let v = ck.tensor(name)?;
    if numel(v.shape()) != 1 || v.shape().len() > 1 {
        return Err(MegaError::tensor(name, format!("shape {:?}, expected a scalar [] or [1]", v.shape())));
    }
    Ok(crate::tensor_io::to_f32(name, &v)?.1[0])
}

fn positive_finite(name: &str, x: f32) -> Result<f32> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(MegaError::tensor(name, format!("value {x}, expected a finite value > 0")))
    }
}

/// Copies a tensor's bytes into `dst` (exact size checked by the caller's shape check).
fn copy_bytes(ck: &Checkpoint, name: &str, dst: &mut [u8]) -> Result<()> {
    let v = ck.tensor(name)?;
    if v.data().len() != dst.len() {
        return Err(MegaError::tensor(name, format!("{} bytes, expected {}", v.data().len(), dst.len())));
    }
    dst.copy_from_slice(v.data());
    Ok(())
}

/// Progress reporting shared by the expert copies.
struct Progress(Option<indicatif::ProgressBar>);

impl Progress {
    fn new(show: bool, len: u64, layer: usize) -> Progress {
        if !show {
            return Progress(None);
        }
        let pb = indicatif::ProgressBar::new(len);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} expert projections ({eta})")
        {
            pb.set_style(style.progress_chars("=> "));
        }
        pb.set_message(format!("loading layer {layer}"));
        Progress(Some(pb))
    }
    fn inc(&self) {
        if let Some(pb) = &self.0 {
            pb.inc(1);
        }
    }
    fn finish(&self) {
        if let Some(pb) = &self.0 {
            pb.finish_and_clear();
        }
    }
}

impl Checkpoint {
    /// Loads layer `layer` whole (every routed expert `0..E`) with default options
    /// (`input_scale` optional).
    pub fn load_layer(&self, layer: usize) -> Result<LoadedLayer> {
        self.load_layer_experts(layer, 0..self.config().n_routed_experts)
    }

    /// Loads the routed experts `experts` (global ids, a rank's contiguous range) of layer
    /// `layer`, with the router and the shared expert whole, and default options. Only those
    /// experts' tensors are read and host memory is proportional to the range; the result has
    /// `expert_range == experts` and expert tensors of `experts.len()` experts. An empty or
    /// reversed range, or one beyond `n_routed_experts`, is an error naming the layer, the range
    /// and E.
    pub fn load_layer_experts(&self, layer: usize, experts: Range<usize>) -> Result<LoadedLayer> {
        self.load_layer_experts_with(layer, experts, &LoadOptions::default())
    }

    /// Loads layer `layer` for a forward in `mode` (W4A4 requires valid `input_scale`s).
    pub fn load_layer_for(&self, layer: usize, mode: Mode) -> Result<LoadedLayer> {
        self.load_layer_with(layer, &LoadOptions::for_mode(mode))
    }

    /// The routed-expert format of `layer`, as the quantization description declares it for
    /// expert 0's W1 (honouring `exclude_modules`) or, without a description, as its tensors say.
    pub fn expert_format(&self, layer: usize) -> Result<WeightFormat> {
        self.expert_format_at(layer, 0)
    }

    /// [`Checkpoint::expert_format`] as expert `expert`'s W1 declares it (a range load asks the
    /// first expert it reads, so it touches no tensor outside its range).
    fn expert_format_at(&self, layer: usize, expert: usize) -> Result<WeightFormat> {
        let module = self.naming().expert_module(layer, expert, Proj::W1);
        if self.quant().source != QuantSource::None {
            let declared = self.quant().expert_quant(&module);
            return declared.expert_format().ok_or_else(|| {
                MegaError::Config(format!(
                    "routed experts (`{module}`) are declared as {declared:?}, which megamoe cannot run \
                     (supported: NVFP4, MXFP4, BF16)"
                ))
            });
        }
        // No description: decide from the tensors.
        let w = format!("{module}.weight");
        let (dt, _) =
            self.store().info(&w).ok_or_else(|| MegaError::tensor(&w, "missing from the checkpoint"))?;
        if self.has(&format!("{module}.weight_scale_2")) {
            return Ok(WeightFormat::Nvfp4);
        }
        match dt {
            Dtype::BF16 => Ok(WeightFormat::Bf16),
            Dtype::U8 | Dtype::I8 => {
                for s in ["scale", "weight_scale"] {
                    if let Some((sd, _)) = self.store().info(&format!("{module}.{s}")) {
                        return match sd {
                            Dtype::F8_E4M3 => Err(MegaError::tensor(
                                format!("{module}.weight_scale_2"),
                                "missing: NVFP4 (e4m3 block scales) needs the global scale weight_scale_2",
                            )),
                            _ => Ok(WeightFormat::Mxfp4),
                        };
                    }
                }
                Err(MegaError::tensor(
                    format!("{module}.scale"),
                    "missing: packed FP4 weights need block scales (`scale` for MXFP4, `weight_scale` + \
                     `weight_scale_2` for NVFP4)",
                ))
            }
            d => Err(MegaError::tensor(
                w,
                format!("dtype {d:?}: routed experts must be NVFP4 (U8), MXFP4 (I8/U8) or BF16"),
            )),
        }
    }

    /// Loads and validates layer `layer` whole into one host copy (see the module docs for the
    /// checks).
    pub fn load_layer_with(&self, layer: usize, opts: &LoadOptions) -> Result<LoadedLayer> {
        self.load_layer_experts_with(layer, 0..self.config().n_routed_experts, opts)
    }

    /// [`Checkpoint::load_layer_experts`] with options: loads and validates the routed experts
    /// `experts` of layer `layer` (router and shared expert whole), ending with
    /// [`MoeLayer::validate`].
    pub fn load_layer_experts_with(
        &self,
        layer: usize,
        experts: Range<usize>,
        opts: &LoadOptions,
    ) -> Result<LoadedLayer> {
        let layers = self.moe_layers();
        if !layers.contains(&layer) {
            return Err(MegaError::Input(format!(
                "layer {layer} is not in the checkpoint {}; it has MoE layers {layers:?}",
                self.dir().display()
            )));
        }
        let cfg = self.config().clone();
        check_expert_range(layer, &experts, cfg.n_routed_experts)?;
        let mut warnings = Vec::new();
        let router = self.load_router(layer, &mut warnings)?;
        let format = self.expert_format_at(layer, experts.start)?;
        self.check_expert_set(layer)?;
        let show = opts.progress.unwrap_or(experts.len() >= 64);
        let progress = Progress::new(show, 3 * experts.len() as u64, layer);
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let ex = &experts;
        let w1 = self.load_proj(layer, ex, Proj::W1, format, i, h, opts, &mut warnings, &progress);
        let w2 = w1.and_then(|w1| {
            Ok((w1, self.load_proj(layer, ex, Proj::W2, format, h, i, opts, &mut warnings, &progress)?))
        });
        let w3 = w2.and_then(|(w1, w2)| {
            Ok((w1, w2, self.load_proj(layer, ex, Proj::W3, format, i, h, opts, &mut warnings, &progress)?))
        });
        progress.finish();
        let (w1, w2, w3) = w3?;
        if let (ProjData::Nvfp4 { global_scale: g1, .. }, ProjData::Nvfp4 { global_scale: g3, .. }) =
            (&w1.data, &w3.data)
        {
            self.warn_w13_mismatch(layer, experts.start, g1, g3, &mut warnings);
        }
        if let (
            ProjData::Nvfp4 { input_scale: Some(s1), .. },
            ProjData::Nvfp4 { input_scale: Some(s3), .. },
        ) = (&w1.data, &w3.data)
        {
            if let Some(e) = s1.iter().zip(s3).position(|(a, b)| a != b) {
                warnings.push(format!(
                    "layer {layer}: W1 and W3 input_scale differ (first: expert {}, {} vs {}); W4A4 quantizes \
                     the shared L1 input with W1's",
                    experts.start + e,
                    s1[e],
                    s3[e]
                ));
            }
        }
        let shared = self.load_shared(layer)?;
        let layer = MoeLayer { index: layer, expert_range: experts, config: cfg, router, w1, w2, w3, shared };
        layer.validate()?;
        for w in &warnings {
            tracing::warn!("{w}");
        }
        Ok(LoadedLayer { layer, warnings })
    }

    fn load_router(&self, layer: usize, warnings: &mut Vec<String>) -> Result<RouterWeights> {
        let cfg = self.config();
        let (e, h, k) = (cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok);
        let n = self.naming();
        let wname = n.router_weight(layer);
        let v = self.tensor(&wname)?;
        check_dtype(&wname, v.dtype(), &[Dtype::BF16, Dtype::F32, Dtype::F16], "router weight")?;
        check_shape(&wname, v.shape(), &[e, h], "[n_routed_experts, hidden_size] from config.json")?;
        let (_, weight) = crate::tensor_io::to_f32(&wname, &v)?;
        if let Some(p) = weight.iter().position(|x| !x.is_finite()) {
            return Err(MegaError::tensor(
                &wname,
                format!("non-finite value {} at [{}, {}]", weight[p], p / h, p % h),
            ));
        }
        let bname = n.router_bias(layer);
        let bias = if self.has(&bname) {
            let v = self.tensor(&bname)?;
            check_dtype(&bname, v.dtype(), &[Dtype::F32, Dtype::BF16, Dtype::F16], "router bias")?;
            check_shape(&bname, v.shape(), &[e], "[n_routed_experts] from config.json")?;
            let (_, b) = crate::tensor_io::to_f32(&bname, &v)?;
            if let Some(p) = b.iter().position(|x| !x.is_finite()) {
                return Err(MegaError::tensor(&bname, format!("non-finite value {} at [{p}]", b[p])));
            }
            Some(b)
        } else {
            if !cfg.is_hash_layer(layer) && cfg.scoring_func != ScoringFunc::Softmax {
                warnings.push(format!(
                    "layer {layer}: no router bias `{bname}`; experts are chosen by the scores alone"
                ));
            }
            None
        };
        let tname = n.tid2eid(layer);
        let tid2eid = if cfg.is_hash_layer(layer) {
            if !self.has(&tname) {
                return Err(MegaError::tensor(
                    &tname,
                    format!(
                        "missing: layer {layer} is hash-routed (num_hash_layers = {}) and needs tid2eid",
                        cfg.num_hash_layers
                    ),
                ));
            }
            let v = self.tensor(&tname)?;
            check_dtype(&tname, v.dtype(), &[Dtype::I64, Dtype::I32], "expert ids")?;
            check_shape(
                &tname,
                v.shape(),
                &[cfg.vocab_size, k],
                "[vocab_size, num_experts_per_tok] from config.json",
            )?;
            let (_, ids) = crate::tensor_io::to_i64(&tname, &v)?;
            let bad: Vec<usize> =
                ids.iter().enumerate().filter(|(_, &x)| x < 0 || x >= e as i64).map(|(p, _)| p).collect();
            if let Some(&p) = bad.first() {
                return Err(MegaError::tensor(
                    &tname,
                    format!(
                        "{} expert id(s) outside 0..{e} (first: {} at [{}, {}])",
                        bad.len(),
                        ids[p],
                        p / k,
                        p % k
                    ),
                ));
            }
            Some(ids.into_iter().map(|x| x as i32).collect())
        } else {
            if self.has(&tname) {
                warnings.push(format!(
                    "layer {layer}: `{tname}` present but the layer is score-routed (num_hash_layers = {}); ignored",
                    cfg.num_hash_layers
                ));
            }
            None
        };
        Ok(RouterWeights { weight, bias, tid2eid })
    }

    /// Every expert `0..E` must be present, and none beyond.
    fn check_expert_set(&self, layer: usize) -> Result<()> {
        let e = self.config().n_routed_experts;
        let present = self.experts_present(layer);
        if let Some(&bad) = present.iter().find(|&&x| x >= e) {
            return Err(MegaError::Config(format!(
                "layer {layer} has tensors for expert {bad} (`{}.*`) but config.json says n_routed_experts = {e}",
                self.naming().expert_module(layer, bad, Proj::W1)
            )));
        }
        Ok(())
    }

    /// One projection of the routed experts `experts` (global ids), stacked in range order.
    #[allow(clippy::too_many_arguments)]
    fn load_proj(
        &self,
        layer: usize,
        experts: &Range<usize>,
        p: Proj,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        opts: &LoadOptions,
        warnings: &mut Vec<String>,
        progress: &Progress,
    ) -> Result<ExpertProj> {
        let e_n = experts.len();
        let n = self.naming();
        let modules: Vec<String> = experts.clone().map(|e| n.expert_module(layer, e, p)).collect();
        let why_w = if p == Proj::W2 {
            "[hidden_size, moe_intermediate_size] from config.json"
        } else {
            "[moe_intermediate_size, hidden_size] from config.json"
        };
        // Metadata checks first, sequentially, so the first error reported is deterministic.
        let info = |name: &str| -> Result<(Dtype, Vec<usize>)> {
            self.store().info(name).map(|(d, s)| (d, s.to_vec())).ok_or_else(|| {
                MegaError::tensor(
                    name,
                    format!("missing from the checkpoint (expected {format:?} expert weights)"),
                )
            })
        };
        let scale_name = |m: &str| -> String {
            // MXFP4 block scales are `scale` in the official release, `weight_scale` in some exports.
            let s = format!("{m}.scale");
            if self.has(&s) {
                s
            } else if self.has(&format!("{m}.weight_scale")) {
                format!("{m}.weight_scale")
            } else {
                s
            }
        };
        // FP4 blocks must tile the input dimension exactly (no partial blocks in these formats).
        let block = format.block_size().unwrap_or(1);
        if !cols.is_multiple_of(block) {
            return Err(MegaError::Config(format!(
                "layer {layer} {p:?}: input size {cols} is not a multiple of the {format:?} block ({block}); \
                 check hidden_size / moe_intermediate_size in config.json"
            )));
        }
        let scales_why = format!("one scale per {block} elements, row-major");
        let data = match format {
            WeightFormat::Nvfp4 => {
                for m in &modules {
                    let w = format!("{m}.weight");
                    let (d, s) = info(&w)?;
                    check_dtype(&w, d, &[Dtype::U8, Dtype::I8], "NVFP4 packed E2M1 codes")?;
                    check_shape(&w, &s, &[rows, cols / 2], &format!("{why_w}, two codes per byte"))?;
                    let sc = format!("{m}.weight_scale");
                    let (d, s) = info(&sc)?;
                    check_dtype(&sc, d, &[Dtype::F8_E4M3, Dtype::U8], "NVFP4 e4m3 block scales")?;
                    check_shape(&sc, &s, &[rows, cols / block], &scales_why)?;
                    info(&format!("{m}.weight_scale_2"))?;
                }
                let mut global_scale = Vec::with_capacity(e_n);
                for m in &modules {
                    let name = format!("{m}.weight_scale_2");
                    let g = scalar_f32(self, &name)?;
                    crate::formats::nvfp4::check_global_scale(&name, g)?;
                    global_scale.push(g);
                }
                // input_scale: needed by W4A4 only.
                let mut inputs = Vec::with_capacity(e_n);
                let mut problems: Vec<String> = Vec::new();
                for m in &modules {
                    let name = format!("{m}.input_scale");
                    let r = if self.has(&name) {
                        scalar_f32(self, &name).and_then(|x| positive_finite(&name, x))
                    } else {
                        Err(MegaError::tensor(
                            &name,
                            "missing (W4A4 needs the static activation global scale)",
                        ))
                    };
                    match r {
                        Ok(x) => inputs.push(x),
                        // W4A4 quantizes the L1 input with W1's input_scale (as the goldens do), so
                        // W3's is only compared with it below, never required.
                        Err(err) if opts.require_input_scale && p != Proj::W3 => return Err(err),
                        Err(err) => problems.push(err.to_string()),
                    }
                }
                let input_scale = if problems.is_empty() {
                    Some(inputs)
                } else {
                    warnings.push(format!(
                        "layer {layer} {p:?}: {} expert(s) without a usable input_scale, so W4A4 is unavailable \
                         for this layer (first: {})",
                        problems.len(),
                        problems[0]
                    ));
                    None
                };
                let scale = |m: &String| format!("{m}.weight_scale");
                let (packed, scales) = self.stack_fp4(
                    &modules,
                    rows,
                    cols,
                    block,
                    &scale,
                    (e4m3::is_nan, "e4m3 scale"),
                    progress,
                )?;
                ProjData::Nvfp4 { packed, scales, global_scale, input_scale }
            }
            WeightFormat::Mxfp4 => {
                for m in &modules {
                    let w = format!("{m}.weight");
                    let (d, s) = info(&w)?;
                    check_dtype(&w, d, &[Dtype::I8, Dtype::U8], "MXFP4 packed E2M1 codes")?;
                    check_shape(&w, &s, &[rows, cols / 2], &format!("{why_w}, two codes per byte"))?;
                    let sc = scale_name(m);
                    let (d, s) = info(&sc)?;
                    check_dtype(&sc, d, &[Dtype::F8_E8M0, Dtype::U8], "MXFP4 e8m0 block scales")?;
                    check_shape(&sc, &s, &[rows, cols / block], &scales_why)?;
                }
                let (packed, scales) = self.stack_fp4(
                    &modules,
                    rows,
                    cols,
                    block,
                    &|m: &String| scale_name(m),
                    (e8m0::is_nan, "e8m0 scale"),
                    progress,
                )?;
                ProjData::Mxfp4 { packed, scales }
            }
            WeightFormat::Bf16 => {
                for m in &modules {
                    let w = format!("{m}.weight");
                    let (d, s) = info(&w)?;
                    check_dtype(&w, d, &[Dtype::BF16], "BF16 expert weights")?;
                    check_shape(&w, &s, &[rows, cols], why_w)?;
                }
                let per = rows * cols;
                let mut weight = vec![bf16::ZERO; e_n * per];
                let results: Vec<Result<()>> = weight
                    .par_chunks_mut(per)
                    .zip(modules.par_iter())
                    .map(|(dst, m)| {
                        let name = format!("{m}.weight");
                        copy_bytes(self, &name, bytemuck::cast_slice_mut(dst))?;
                        if let Some(i) = dst.iter().position(|x| !x.is_finite()) {
                            return Err(MegaError::tensor(
                                name,
                                format!("non-finite value {} at [{}, {}]", dst[i], i / cols, i % cols),
                            ));
                        }
                        progress.inc();
                        Ok(())
                    })
                    .collect();
                results.into_iter().collect::<Result<()>>()?;
                ProjData::Bf16 { weight }
            }
        };
        Ok(ExpertProj { experts: e_n, rows, cols, data })
    }

    /// Copies every expert's packed FP4 codes and block scales (one per `block` inputs) into one
    /// stacked pair, in parallel, scanning the scales for NaN bytes. The first error reported is
    /// that of the lowest-numbered expert.
    #[allow(clippy::too_many_arguments)]
    fn stack_fp4(
        &self,
        modules: &[String],
        rows: usize,
        cols: usize,
        block: usize,
        scale_name: &(dyn Fn(&String) -> String + Sync),
        (is_nan, what): (fn(u8) -> bool, &str),
        progress: &Progress,
    ) -> Result<(Vec<u8>, Vec<u8>)> {
        let (pk, sc) = (rows * cols / 2, rows * cols / block);
        let mut packed = vec![0u8; modules.len() * pk];
        let mut scales = vec![0u8; modules.len() * sc];
        let results: Vec<Result<()>> = packed
            .par_chunks_mut(pk)
            .zip(scales.par_chunks_mut(sc))
            .zip(modules.par_iter())
            .map(|((dp, ds), m)| {
                copy_bytes(self, &format!("{m}.weight"), dp)?;
                let sname = scale_name(m);
                copy_bytes(self, &sname, ds)?;
                scan_nan_bytes(&sname, ds, cols / block, is_nan, what)?;
                progress.inc();
                Ok(())
            })
            .collect();
        results.into_iter().collect::<Result<()>>()?;
        Ok((packed, scales))
    }

    /// Warns about experts (global ids; `g1[0]` is expert `first`) whose W1 and W3 global scales
    /// differ.
    fn warn_w13_mismatch(
        &self,
        layer: usize,
        first: usize,
        g1: &[f32],
        g3: &[f32],
        warnings: &mut Vec<String>,
    ) {
        let diff: Vec<(usize, f32)> = g1
            .iter()
            .zip(g3)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(e, (a, b))| (first + e, b / a))
            .collect();
        if diff.is_empty() {
            return;
        }
        const SHOWN: usize = 8;
        let list: Vec<String> =
            diff.iter().take(SHOWN).map(|(e, r)| format!("expert {e}: w3/w1 = {r:.6}")).collect();
        let more =
            if diff.len() > SHOWN { format!(", and {} more", diff.len() - SHOWN) } else { String::new() };
        warnings.push(format!(
            "layer {layer}: {} expert(s) have W1 and W3 weight_scale_2 that differ ({}{more}); both are kept \
             (one global scale per projection), so the math stays exact, but kernels that fuse W1/W3 with one \
             alpha would be wrong",
            diff.len(),
            list.join(", ")
        ));
    }

    fn load_shared(&self, layer: usize) -> Result<Option<SharedExpert>> {
        let cfg = self.config();
        let n = self.naming();
        let prefix = n.shared_prefix(layer);
        let any = self.store().names_with_prefix(&prefix).next().is_some();
        if cfg.n_shared_experts == 0 {
            if any {
                return Err(MegaError::Config(format!(
                    "layer {layer} has shared-expert tensors (`{prefix}*`) but config.json says n_shared_experts = 0"
                )));
            }
            return Ok(None);
        }
        let (h, is) = (cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size);
        let w1 = self.load_dense(&n.shared_module(layer, Proj::W1), is, h)?;
        let w2 = self.load_dense(&n.shared_module(layer, Proj::W2), h, is)?;
        let w3 = self.load_dense(&n.shared_module(layer, Proj::W3), is, h)?;
        Ok(Some(SharedExpert { w1, w2, w3 }))
    }

    fn load_dense(&self, module: &str, rows: usize, cols: usize) -> Result<DenseProj> {
        let wname = format!("{module}.weight");
        let why = "[n_shared_experts * moe_intermediate_size, hidden_size] (or its transpose for w2) from config.json";
        let v = self.tensor(&wname).map_err(|_| {
            MegaError::tensor(&wname, "missing from the checkpoint (config.json has n_shared_experts > 0)")
        })?;
        check_dtype(
            &wname,
            v.dtype(),
            &[Dtype::BF16, Dtype::F8_E4M3],
            "shared expert: BF16 or FP8 128x128-block",
        )?;
        check_shape(&wname, v.shape(), &[rows, cols], why)?;
        let data = match v.dtype() {
            Dtype::BF16 => {
                let w: Vec<bf16> =
                    v.data().chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect();
                if let Some(i) = w.iter().position(|x| !x.is_finite()) {
                    return Err(MegaError::tensor(
                        &wname,
                        format!("non-finite value {} at [{}, {}]", w[i], i / cols, i % cols),
                    ));
                }
                DenseData::Bf16(w)
            }
            _ => {
                scan_nan_bytes(&wname, v.data(), cols, e4m3::is_nan, "e4m3 weight")?;
                let [br, bc] = super::fp8_scale_grid(rows, cols);
                let sname = ["scale", "weight_scale_inv", "weight_scale"]
                    .iter()
                    .map(|s| format!("{module}.{s}"))
                    .find(|s| self.has(s))
                    .ok_or_else(|| {
                        MegaError::tensor(
                            format!("{module}.scale"),
                            "missing: FP8 weights need 128x128 block scales (`scale` or `weight_scale_inv`)",
                        )
                    })?;
                let sv = self.tensor(&sname)?;
                check_dtype(
                    &sname,
                    sv.dtype(),
                    &[Dtype::F8_E8M0, Dtype::U8, Dtype::F32, Dtype::BF16],
                    "FP8 block scales",
                )?;
                check_shape(&sname, sv.shape(), &[br, bc], "[ceil(rows/128), ceil(cols/128)]")?;
                let scale: Vec<f32> = match sv.dtype() {
                    Dtype::F8_E8M0 | Dtype::U8 => {
                        scan_nan_bytes(&sname, sv.data(), bc, e8m0::is_nan, "e8m0 scale")?;
                        sv.data().iter().map(|&b| e8m0::decode(b)).collect()
                    }
                    _ => {
                        let s = crate::tensor_io::to_f32(&sname, &sv)?.1;
                        if let Some(i) = s.iter().position(|x| !(x.is_finite() && *x > 0.0)) {
                            return Err(MegaError::tensor(
                                &sname,
                                format!(
                                    "value {} at [{}, {}], expected a finite value > 0",
                                    s[i],
                                    i / bc,
                                    i % bc
                                ),
                            ));
                        }
                        s
                    }
                };
                DenseData::Fp8Block { weight: v.data().to_vec(), scale }
            }
        };
        Ok(DenseProj { rows, cols, data })
    }
}

//! Stage-by-stage comparison of a backend with the reference (`megamoe trace`).
//!
//! Both sides run the same forward with a [`StageTrace`]; every [`Stage`] (in pipeline order) is
//! compared: amax, NaN/Inf counts, cosine similarity and relative L2 error, against a threshold
//! per stage and mode. The first stage over its threshold is where the bug is (everything after
//! it inherits the error). Slots whose chosen expert differs (near-ties in the router) are left
//! out of the per-slot comparisons so a legitimate tie flip does not look like a kernel bug.

use crate::backend::MoeEngine;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::tensor_io::OwnedTensor;
use crate::trace::{Stage, StageTrace};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use tracing::{debug, info};

/// Largest magnitude and non-finite counts of one tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TensorStats {
    /// Largest finite magnitude.
    pub amax: f32,
    /// NaN count.
    pub nan: usize,
    /// +-Inf count.
    pub inf: usize,
}

impl TensorStats {
    /// Stats of `v`.
    pub fn of(v: &[f32]) -> TensorStats {
        let mut s = TensorStats::default();
        for &x in v {
            if x.is_nan() {
                s.nan += 1;
            } else if x.is_infinite() {
                s.inf += 1;
            } else {
                s.amax = s.amax.max(x.abs());
            }
        }
        s
    }
}

/// One stage of the comparison.
#[derive(Clone, Debug, Serialize)]
pub struct StageRow {
    /// The stage.
    pub stage: Stage,
    /// Shape (the reference's).
    pub shape: Vec<usize>,
    /// Backend numbers (`None`: the backend did not record this stage).
    pub backend: Option<TensorStats>,
    /// Reference numbers.
    pub reference: Option<TensorStats>,
    /// Cosine similarity over the compared elements.
    pub cosine: Option<f64>,
    /// Relative L2 error `|b - r| / |r|` over the compared elements.
    pub rel_error: Option<f64>,
    /// Elements that differ (exact stages: ids, counts).
    pub mismatches: usize,
    /// The threshold this stage is held to.
    pub threshold: f64,
    /// Whether the stage is over its threshold (or its NaN/Inf counts differ).
    pub diverged: bool,
    /// A short remark (masked slots, not recorded, ...).
    pub note: String,
}

/// The comparison of a final output with a user-captured tensor (`--expect`).
#[derive(Clone, Debug, Serialize)]
pub struct ExpectRow {
    /// Tensor name in the expect file.
    pub tensor: String,
    /// Backend output vs the captured tensor.
    pub backend_rel_error: f64,
    /// Cosine of backend output and the captured tensor.
    pub backend_cosine: f64,
    /// Reference output vs the captured tensor.
    pub reference_rel_error: f64,
    /// Cosine of reference output and the captured tensor.
    pub reference_cosine: f64,
    /// NaN/Inf in the captured tensor.
    pub expected_stats: TensorStats,
}

/// The whole comparison.
#[derive(Clone, Debug, Serialize)]
pub struct TraceReport {
    /// The mode compared.
    pub mode: Mode,
    /// One row per stage, in [`Stage::ALL`] order.
    pub rows: Vec<StageRow>,
    /// The first stage over its threshold.
    pub first_divergence: Option<Stage>,
    /// Routing slots left out of per-slot comparisons because the chosen expert differs.
    pub masked_slots: usize,
    /// `--expect`, when given.
    pub expect: Option<ExpectRow>,
}

/// The relative-error threshold of `stage` in `mode` (for ids and counts: the largest fraction of
/// elements allowed to differ, near-ties in the router).
pub fn threshold(stage: Stage, mode: Mode) -> f64 {
    let exact = mode == Mode::W4A16;
    match stage {
        Stage::RouterScores | Stage::TopkWeights => 1e-4,
        Stage::TopkIds | Stage::PlanCounts => 0.02,
        Stage::InputQuant => {
            if exact {
                1e-6
            } else {
                1e-2
            }
        }
        Stage::L1Gate | Stage::L1Up => {
            if exact {
                1e-3
            } else {
                1e-2
            }
        }
        Stage::Activation => {
            if exact {
                1e-2
            } else {
                2e-2
            }
        }
        Stage::ActivationQuant => {
            if exact {
                1e-2
            } else {
                5e-2
            }
        }
        Stage::L2Out => {
            if exact {
                5e-3
            } else {
                2e-2
            }
        }
        Stage::SharedOut => 1e-3,
        Stage::Output => {
            if exact {
                2e-3
            } else {
                2e-2
            }
        }
    }
}

/// Cosine similarity and relative L2 error of `b` against `r` (f64 sums, non-finite -> NaN/Inf).
pub fn similarity(b: &[f32], r: &[f32]) -> (f64, f64) {
    let (mut bb, mut rr, mut br, mut dd) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in b.iter().zip(r) {
        let (x, y) = (x as f64, y as f64);
        bb += x * x;
        rr += y * y;
        br += x * y;
        dd += (x - y) * (x - y);
    }
    let cos = if bb == 0.0 && rr == 0.0 { 1.0 } else { br / (bb.sqrt() * rr.sqrt()).max(1e-300) };
    let rel = if rr == 0.0 && dd == 0.0 { 0.0 } else { (dd / rr.max(1e-300)).sqrt() };
    (cos, rel)
}

/// Which rows of a `[rows, width]` stage tensor take part, given the masked slots.
fn keep_rows(stage: Stage, rows: usize, k: usize, masked: &[bool]) -> Vec<bool> {
    let per_slot = matches!(
        stage,
        Stage::L1Gate | Stage::L1Up | Stage::Activation | Stage::ActivationQuant | Stage::L2Out
    );
    let per_token = matches!(stage, Stage::TopkWeights | Stage::Output);
    (0..rows)
        .map(|r| {
            if per_slot {
                !masked.get(r).copied().unwrap_or(false)
            } else if per_token {
                !(0..k).any(|j| masked.get(r * k + j).copied().unwrap_or(false))
            } else {
                true
            }
        })
        .collect()
}

/// Compares two traces stage by stage. `top_k` is the layer's k (for the slot masks).
pub fn compare(backend: &StageTrace, reference: &StageTrace, mode: Mode, top_k: usize) -> TraceReport {
    // Slots whose expert differs: masked from per-slot stages.
    let masked: Vec<bool> = match (backend.get(Stage::TopkIds), reference.get(Stage::TopkIds)) {
        (Some(b), Some(r)) if b.data.len() == r.data.len() => {
            b.data.iter().zip(&r.data).map(|(x, y)| x != y).collect()
        }
        _ => Vec::new(),
    };
    let masked_slots = masked.iter().filter(|&&m| m).count();
    let mut rows = Vec::with_capacity(Stage::ALL.len());
    for stage in Stage::ALL {
        let thr = threshold(stage, mode);
        let (b, r) = (backend.get(stage), reference.get(stage));
        let mut row = StageRow {
            stage,
            shape: r.or(b).map(|t| t.shape.clone()).unwrap_or_default(),
            backend: b.map(|t| TensorStats::of(&t.data)),
            reference: r.map(|t| TensorStats::of(&t.data)),
            cosine: None,
            rel_error: None,
            mismatches: 0,
            threshold: thr,
            diverged: false,
            note: String::new(),
        };
        match (b, r) {
            (Some(b), Some(r)) if b.shape == r.shape => {
                let n_rows = r.shape.first().copied().unwrap_or(1).max(1);
                let width = r.data.len() / n_rows;
                let keep = keep_rows(stage, n_rows, top_k, &masked);
                let dropped = keep.iter().filter(|&&k| !k).count();
                let (mut bv, mut rv) = (Vec::new(), Vec::new());
                for (i, &k) in keep.iter().enumerate() {
                    if k && width > 0 {
                        bv.extend_from_slice(&b.data[i * width..(i + 1) * width]);
                        rv.extend_from_slice(&r.data[i * width..(i + 1) * width]);
                    }
                }
                let (cos, rel) = similarity(&bv, &rv);
                row.cosine = Some(cos);
                row.rel_error = Some(rel);
                row.mismatches = bv.iter().zip(&rv).filter(|(x, y)| x != y).count();
                let (sb, sr) = (TensorStats::of(&b.data), TensorStats::of(&r.data));
                let nonfinite_differs = sb.nan != sr.nan || sb.inf != sr.inf;
                row.diverged = nonfinite_differs
                    || match stage {
                        Stage::TopkIds => row.mismatches as f64 > thr * bv.len() as f64,
                        Stage::PlanCounts => {
                            let moved: f64 = bv.iter().zip(&rv).map(|(x, y)| (x - y).abs() as f64).sum();
                            let total: f64 = rv.iter().map(|&y| y as f64).sum::<f64>().max(1.0);
                            moved / 2.0 > thr * total
                        }
                        // NaN errors count as diverged.
                        _ => rel.is_nan() || rel > thr,
                    };
                if nonfinite_differs {
                    row.note =
                        format!("NaN/Inf: backend {}/{}, reference {}/{}", sb.nan, sb.inf, sr.nan, sr.inf);
                } else if dropped > 0 {
                    row.note = format!("{dropped} row(s) with a different expert left out");
                }
            }
            (Some(b), Some(r)) => {
                row.diverged = true;
                row.note = format!("shape {:?} vs reference {:?}", b.shape, r.shape);
            }
            (None, Some(_)) => row.note = "not recorded by the backend".into(),
            (Some(_), None) => row.note = "not recorded by the reference".into(),
            (None, None) => row.note = "not recorded".into(),
        }
        debug!(
            "trace: {} rel {:?} cos {:?} diverged {}",
            stage.name(),
            row.rel_error,
            row.cosine,
            row.diverged
        );
        rows.push(row);
    }
    let first_divergence = rows.iter().find(|r| r.diverged).map(|r| r.stage);
    TraceReport { mode, rows, first_divergence, masked_slots, expect: None }
}

/// What one traced forward of both sides produced.
pub struct TraceRun {
    /// The comparison.
    pub report: TraceReport,
    /// The backend's stages.
    pub backend_trace: StageTrace,
    /// The reference's stages.
    pub reference_trace: StageTrace,
    /// The backend's output.
    pub backend_out: ForwardOutput,
    /// The reference's output.
    pub reference_out: ForwardOutput,
}

/// Runs `backend` and `reference` (e.g. a clean [`crate::backend::cpu::CpuEngine`]) on `input`
/// with traces and compares them. `top_k` is the layer's k.
pub fn run(
    backend: &mut dyn MoeEngine,
    reference: &mut dyn MoeEngine,
    input: &ForwardInput<'_>,
    mode: Mode,
    top_k: usize,
) -> Result<TraceRun> {
    info!("trace: backend {}, reference {}, mode {mode}", backend.describe(), reference.describe());
    let mut bt = StageTrace::default();
    let backend_out = backend.forward(input, mode, Some(&mut bt))?;
    let mut rt = StageTrace::default();
    let reference_out = reference.forward(input, mode, Some(&mut rt))?;
    let report = compare(&bt, &rt, mode, top_k);
    match report.first_divergence {
        Some(s) => info!("trace: first divergence at {}", s.name()),
        None => info!("trace: no stage diverges"),
    }
    Ok(TraceRun { report, backend_trace: bt, reference_trace: rt, backend_out, reference_out })
}

/// Compares both outputs with a captured tensor.
pub fn compare_expect(
    tensor: &str,
    expected: &[f32],
    backend_y: &[f32],
    reference_y: &[f32],
) -> Result<ExpectRow> {
    if expected.len() != backend_y.len() {
        return Err(MegaError::tensor(
            tensor,
            format!("{} elements, but the forward produced {} ([T, H])", expected.len(), backend_y.len()),
        ));
    }
    let (bc, br) = similarity(backend_y, expected);
    let (rc, rr) = similarity(reference_y, expected);
    Ok(ExpectRow {
        tensor: tensor.to_string(),
        backend_rel_error: br,
        backend_cosine: bc,
        reference_rel_error: rr,
        reference_cosine: rc,
        expected_stats: TensorStats::of(expected),
    })
}

/// Writes every stage of both sides: `dir/backend.safetensors` and `dir/reference.safetensors`
/// (F32 tensors named by [`Stage::name`]).
pub fn dump(dir: &Path, backend: &StageTrace, reference: &StageTrace) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| MegaError::file(dir, e))?;
    for (file, t) in [("backend.safetensors", backend), ("reference.safetensors", reference)] {
        let tensors: BTreeMap<String, OwnedTensor> = t
            .stages
            .iter()
            .map(|s| (s.stage.name().to_string(), OwnedTensor::f32(&s.shape, &s.data)))
            .collect();
        crate::tensor_io::write_safetensors(&dir.join(file), &tensors)?;
    }
    info!("trace: stages written to {}", dir.display());
    Ok(())
}

fn fmt_opt(x: Option<f64>, prec: usize) -> String {
    x.map(|v| format!("{v:.prec$e}")).unwrap_or_else(|| "-".into())
}

impl TraceReport {
    /// A plain-text table for terminals.
    pub fn render_table(&self) -> String {
        let mut out = format!(
            "{:<17} {:>10} {:>10} {:>9} {:>9} {:>11} {:>10} {:>9}  \n",
            "stage", "amax(b)", "amax(ref)", "nan/inf b", "nan/inf r", "cosine", "rel err", "limit"
        );
        for r in &self.rows {
            let nf = |s: Option<TensorStats>| s.map(|s| format!("{}/{}", s.nan, s.inf)).unwrap_or("-".into());
            let amax = |s: Option<TensorStats>| s.map(|s| format!("{:.3e}", s.amax)).unwrap_or("-".into());
            let cos = r.cosine.map(|c| format!("{c:.6}")).unwrap_or("-".into());
            let mark = if Some(r.stage) == self.first_divergence {
                "  <== first divergence"
            } else if r.diverged {
                "  x"
            } else {
                ""
            };
            out.push_str(&format!(
                "{:<17} {:>10} {:>10} {:>9} {:>9} {:>11} {:>10} {:>9.1e}{mark}{}\n",
                r.stage.name(),
                amax(r.backend),
                amax(r.reference),
                nf(r.backend),
                nf(r.reference),
                cos,
                fmt_opt(r.rel_error, 2),
                r.threshold,
                if r.note.is_empty() { String::new() } else { format!("  ({})", r.note) }
            ));
        }
        if self.masked_slots > 0 {
            out.push_str(&format!(
                "{} routing slot(s) chose a different expert (router near-ties?) and were left out of per-slot stages\n",
                self.masked_slots
            ));
        }
        match self.first_divergence {
            Some(s) => out.push_str(&format!("first divergence: {} — {}\n", s.name(), stage_hint(s))),
            None => out.push_str("no stage diverges: the backend agrees with the reference\n"),
        }
        if let Some(e) = &self.expect {
            out.push_str(&format!(
                "expect `{}`: backend rel err {:.3e} (cos {:.6}), reference rel err {:.3e} (cos {:.6}){}\n",
                e.tensor,
                e.backend_rel_error,
                e.backend_cosine,
                e.reference_rel_error,
                e.reference_cosine,
                if e.expected_stats.nan + e.expected_stats.inf > 0 {
                    format!(
                        "; the captured tensor has {} NaN / {} Inf",
                        e.expected_stats.nan, e.expected_stats.inf
                    )
                } else {
                    String::new()
                }
            ));
        }
        out
    }
}

/// What a first divergence at `stage` usually means (DESIGN.md failure modes).
pub fn stage_hint(stage: Stage) -> &'static str {
    match stage {
        Stage::RouterScores => "router GEMM or score function (sqrt(softplus) / sigmoid / softmax) differs",
        Stage::TopkIds => {
            "top-k selection: bias not added, NaN scores, local vs global expert ids, -1 routes"
        }
        Stage::TopkWeights => "weight normalisation or routed_scaling_factor (applied twice or not at all)",
        Stage::PlanCounts => "token permutation / per-expert counting",
        Stage::InputQuant => "activation quantization (input_scale missing/0, wrong block size or rounding)",
        Stage::L1Gate | Stage::L1Up => {
            "expert weights as the kernel reads them: scale layout (swizzled vs row-major), nibble order, \
             gate/up swap, global scale (reciprocal, one alpha for W1/W3), e4m3 subnormals"
        }
        Stage::Activation => "SwiGLU epilogue: clamp/limit, silu, or the routing weight applied wrongly",
        Stage::ActivationQuant => "quantization of the activation between L1 and L2",
        Stage::L2Out => "W2 (down) weights as read by the kernel, or its scales / global scale",
        Stage::SharedOut => "shared expert weights or its FP8 block scales",
        Stage::Output => "combine: slot sum, shared expert added, or overflow of the output dtype",
    }
}

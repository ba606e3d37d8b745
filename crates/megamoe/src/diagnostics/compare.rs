//! `doctor --reference`: each stored projection against the BF16 weights it was quantized from.
//!
//! The stored weight's relative error is put next to the error a correct quantization of the
//! reference gives (quantized here with [`crate::formats`]). When the stored error is far above,
//! the doctor tests hypotheses: it re-reads the stored bytes under the inverse of a known fault
//! (nibbles swapped back, W1/W3 exchanged, scales un-swizzled, global scale inverted, another
//! expert's or a row-permuted copy) and names the fault whose inverse brings the error down to
//! the correct-quantization level.

use super::doctor::{codes, proj_label, proj_shape, DoctorOptions};
use super::report::{Finding, ReferenceRow, Report, Severity};
use crate::checkpoint::{Checkpoint, Naming, Proj, TensorStore};
use crate::error::{MegaError, Result};
use crate::formats::{mxfp4, nvfp4, scale_layout, WeightFormat};
use rayon::prelude::*;
use std::path::Path;
use tracing::{debug, info};

/// The BF16 (or F32/F16) originals, memory-mapped.
pub struct ReferenceWeights {
    store: TensorStore,
    path: String,
}

impl ReferenceWeights {
    /// Opens a safetensors file or a checkpoint directory (`model.safetensors` or an index).
    pub fn open(path: &Path) -> Result<ReferenceWeights> {
        let store = if path.is_dir() {
            TensorStore::open_dir(path)?
        } else if path.exists() {
            TensorStore::open_files(&[path.to_path_buf()])?
        } else {
            return Err(MegaError::file(
                path,
                "reference not found (a safetensors file or a checkpoint directory)",
            ));
        };
        info!("doctor: reference {} ({} tensors)", path.display(), store.names().count());
        Ok(ReferenceWeights { store, path: path.display().to_string() })
    }

    /// The reference matrix stored under `name` (or its name in the other naming scheme), as f32.
    fn get(&self, name: &str, naming: Naming) -> Option<Result<(Vec<usize>, Vec<f32>)>> {
        let other = if naming == Naming::DeepSeekV4 { Naming::Hf } else { Naming::DeepSeekV4 };
        let alt = naming.rename(name, other);
        let found = [name, alt.as_str()].into_iter().find(|n| self.store.has(n))?;
        Some(self.store.tensor(found).and_then(|v| crate::tensor_io::to_f32(found, &v)))
    }
}

/// Relative L2 error `|a - b| / |b|` in f64; non-finite values make it infinite.
pub fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = x as f64 - y as f64;
        num += d * d;
        den += (y as f64) * (y as f64);
    }
    let r = (num / den.max(1e-300)).sqrt();
    if r.is_finite() {
        r
    } else {
        f64::INFINITY
    }
}

/// The raw stored parts of one FP4 projection.
#[derive(Clone)]
struct Stored {
    packed: Vec<u8>,
    scales: Vec<u8>,
    global: f32,
}

fn read_stored(ck: &Checkpoint, layer: usize, e: usize, p: Proj, format: WeightFormat) -> Option<Stored> {
    let m = ck.naming().expert_module(layer, e, p);
    let packed = ck.tensor(&format!("{m}.weight")).ok()?.data().to_vec();
    let (scales, global) = match format {
        WeightFormat::Nvfp4 => {
            let s = ck.tensor(&format!("{m}.weight_scale")).ok()?.data().to_vec();
            let g = ck.tensor(&format!("{m}.weight_scale_2")).ok()?;
            let g = crate::tensor_io::to_f32("weight_scale_2", &g).ok()?.1.first().copied()?;
            (s, g)
        }
        WeightFormat::Mxfp4 => {
            let name = [format!("{m}.scale"), format!("{m}.weight_scale")].into_iter().find(|n| ck.has(n))?;
            (ck.tensor(&name).ok()?.data().to_vec(), 1.0)
        }
        WeightFormat::Bf16 => (Vec::new(), 1.0),
    };
    Some(Stored { packed, scales, global })
}

/// Dequantizes stored parts as the checkpoint declares them; `None` when the sizes do not fit.
fn dequant(s: &Stored, rows: usize, cols: usize, format: WeightFormat) -> Option<Vec<f32>> {
    match format {
        WeightFormat::Nvfp4 => {
            nvfp4::Nvfp4Matrix::from_parts(rows, cols, s.packed.clone(), s.scales.clone(), s.global)
                .ok()
                .map(|m| m.dequantize())
        }
        WeightFormat::Mxfp4 => mxfp4::Mxfp4Matrix::from_parts(rows, cols, s.packed.clone(), s.scales.clone())
            .ok()
            .map(|m| m.dequantize()),
        WeightFormat::Bf16 => (s.packed.len() == rows * cols * 2).then(|| {
            s.packed.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }),
    }
}

/// The error a correct quantization of `reference` has.
fn expected_error(reference: &[f32], rows: usize, cols: usize, format: WeightFormat) -> Option<f64> {
    let deq = match format {
        WeightFormat::Nvfp4 => nvfp4::quantize(reference, rows, cols).ok()?.dequantize(),
        WeightFormat::Mxfp4 => mxfp4::quantize(reference, rows, cols).ok()?.dequantize(),
        // BF16 experts: the reference itself rounded to bf16.
        WeightFormat::Bf16 => reference.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
    };
    Some(rel_error(&deq, reference))
}

/// The stored rows reordered to match the reference: each reference row takes the stored row
/// with the highest cosine over the first (up to) 128 columns — enough to tell rows apart, and
/// O(rows^2 * 128) rather than O(rows^2 * cols). Only run when every cheaper hypothesis failed.
fn rows_matched(stored: &[f32], reference: &[f32], cols: usize) -> Vec<f32> {
    let n = cols.min(128);
    let unit = |r: &[f32]| -> Vec<f32> {
        let norm = r[..n].iter().map(|&x| x * x).sum::<f32>().sqrt().max(1e-30);
        r[..n].iter().map(|&x| x / norm).collect()
    };
    let s_units: Vec<Vec<f32>> = stored.chunks_exact(cols).map(unit).collect();
    reference
        .par_chunks_exact(cols)
        .flat_map_iter(|r| {
            let u = unit(r);
            let best = s_units
                .iter()
                .enumerate()
                .map(|(i, s)| (i, s.iter().zip(&u).map(|(a, b)| a * b).sum::<f32>()))
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map_or(0, |x| x.0);
            stored[best * cols..(best + 1) * cols].to_vec()
        })
        .collect()
}

/// One verdict: `ok` or a cause code, with the error that supports it.
struct Verdict {
    code: &'static str,
    error: f64,
    explanation: String,
}

#[allow(clippy::too_many_arguments)]
fn diagnose(
    ck: &Checkpoint,
    layer: usize,
    e: usize,
    p: Proj,
    format: WeightFormat,
    stored: &Stored,
    reference: &[f32],
    limit: f64,
) -> Option<Verdict> {
    let (rows, cols) = proj_shape(ck, p);
    let fits = |deq: Option<Vec<f32>>| -> Option<f64> {
        let err = rel_error(&deq?, reference);
        (err <= limit).then_some(err)
    };
    let fp4 = format != WeightFormat::Bf16;
    // 1. Nibble order reversed.
    if fp4 {
        let mut s = stored.clone();
        s.packed.iter_mut().for_each(|b| *b = b.rotate_left(4));
        if let Some(error) = fits(dequant(&s, rows, cols, format)) {
            return Some(Verdict {
                code: codes::NIBBLES_REVERSED,
                error,
                explanation:
                    "with the two nibbles of every byte swapped the weights match: the nibble order is \
                              reversed (element 2j belongs in the LOW nibble)"
                        .into(),
            });
        }
    }
    // 2. W1 and W3 swapped.
    if p != Proj::W2 {
        let other = if p == Proj::W1 { Proj::W3 } else { Proj::W1 };
        if let Some(s) = read_stored(ck, layer, e, other, format) {
            if let Some(error) = fits(dequant(&s, rows, cols, format)) {
                return Some(Verdict {
                    code: codes::W1_W3_SWAPPED,
                    error,
                    explanation: format!(
                        "the stored {} matches this reference: gate (W1) and up (W3) are swapped",
                        proj_label(other)
                    ),
                });
            }
        }
    }
    // 3. Scales stored in the swizzled 128x4 layout but declared row-major.
    if let Some(block) = format.block_size() {
        let scols = cols / block;
        if stored.scales.len() == scale_layout::swizzled_len(rows, scols) {
            if let Ok(un) = scale_layout::from_swizzled(&stored.scales, rows, scols) {
                let s = Stored { scales: un, ..stored.clone() };
                if let Some(error) = fits(dequant(&s, rows, cols, format)) {
                    return Some(Verdict {
                        code: codes::SCALES_SWIZZLED,
                        error,
                        explanation:
                            "read through the 128x4 swizzled layout the scales match: they were saved \
                                      swizzled (a kernel's layout) under a row-major name"
                                .into(),
                    });
                }
            }
        }
    }
    // 4. Global scale stored as its reciprocal.
    if format == WeightFormat::Nvfp4 && stored.global.is_finite() && stored.global != 0.0 {
        let s = Stored { global: 1.0 / stored.global, ..stored.clone() };
        if let Some(error) = fits(dequant(&s, rows, cols, format)) {
            return Some(Verdict {
                code: codes::GLOBAL_SCALE_RECIPROCAL,
                error,
                explanation: format!(
                    "with weight_scale_2 = 1/{:.4e} the weights match: the global scale is stored as its reciprocal \
                     (compressed-tensors' divisor) instead of ModelOpt's multiplier",
                    stored.global
                ),
            });
        }
    }
    // 5. Another expert's weights.
    for other in ck.experts_present(layer) {
        if other == e || other >= ck.config().n_routed_experts {
            continue;
        }
        if let Some(s) = read_stored(ck, layer, other, p, format) {
            if let Some(error) = fits(dequant(&s, rows, cols, format)) {
                return Some(Verdict {
                    code: codes::EXPERTS_PERMUTED,
                    error,
                    explanation: format!(
                        "the stored expert {other} matches this reference: experts are permuted"
                    ),
                });
            }
        }
    }
    // 6. Rows permuted.
    if let Some(deq) = dequant(stored, rows, cols, format) {
        let error = rel_error(&rows_matched(&deq, reference, cols), reference);
        if error <= limit {
            return Some(Verdict {
                code: codes::ROWS_PERMUTED,
                error,
                explanation: "matching each reference row with its most similar stored row makes the weights agree: the rows (output features) are \
                              permuted"
                    .into(),
            });
        }
    }
    None
}

/// Compares every projection of `layer` that the reference holds; adds rows and findings.
pub(crate) fn compare_layer(
    ck: &Checkpoint,
    layer: usize,
    format: WeightFormat,
    refw: &ReferenceWeights,
    opts: &DoctorOptions,
    report: &mut Report,
) {
    let naming = ck.naming();
    let jobs: Vec<(usize, Proj)> = ck
        .experts_present(layer)
        .into_iter()
        .filter(|&e| e < ck.config().n_routed_experts)
        .flat_map(|e| Proj::ALL.into_iter().map(move |p| (e, p)))
        .collect();
    let results: Vec<(Option<ReferenceRow>, Vec<Finding>)> = jobs
        .par_iter()
        .map(|&(e, p)| {
            let (rows, cols) = proj_shape(ck, p);
            let name = format!("{}.weight", naming.expert_module(layer, e, p));
            let at = |f: Finding| f.layer(layer).expert(e).tensor(&name);
            let Some(got) = refw.get(&name, naming) else { return (None, Vec::new()) };
            let reference = match got {
                Ok((shape, v)) if shape == [rows, cols] => v,
                Ok((shape, _)) => {
                    let f = Finding::new(
                        Severity::Warning,
                        codes::SHAPE_MISMATCH,
                        format!("reference {} has shape {shape:?}, expected [{rows}, {cols}]; not compared", refw.path),
                    );
                    return (None, vec![at(f)]);
                }
                Err(err) => {
                    let f = Finding::new(Severity::Warning, codes::SHAPE_MISMATCH, format!("reference unreadable: {err}"));
                    return (None, vec![at(f)]);
                }
            };
            let Some(stored) = read_stored(ck, layer, e, p, format) else { return (None, Vec::new()) };
            // Undecodable tensors (wrong sizes) are already findings of the checkpoint checks.
            let Some(deq) = dequant(&stored, rows, cols, format) else { return (None, Vec::new()) };
            let Some(expected) = expected_error(&reference, rows, cols, format) else { return (None, Vec::new()) };
            let stored_error = rel_error(&deq, &reference);
            // A floor so that exact formats (BF16, or a reference already on the FP4 grid) have room.
            let limit = opts.reference_factor * expected.max(1e-3);
            let mut row = ReferenceRow {
                layer,
                expert: e,
                tensor: name.clone(),
                stored_error,
                expected_error: expected,
                verdict: "ok".into(),
            };
            debug!("doctor: {name}: stored error {stored_error:.4e}, expected {expected:.4e}");
            if stored_error <= limit {
                return (Some(row), Vec::new());
            }
            let label = proj_label(p);
            let f = match diagnose(ck, layer, e, p, format, &stored, &reference, limit) {
                Some(v) => {
                    row.verdict = v.code.to_string();
                    Finding::new(
                        Severity::Error,
                        v.code,
                        format!(
                            "{label} is {stored_error:.3} away from its BF16 original (a correct {format:?} \
                             quantization: {expected:.3}); {} ({:.3})",
                            v.explanation, v.error
                        ),
                    )
                }
                None => {
                    row.verdict = codes::REFERENCE_MISMATCH.to_string();
                    Finding::new(
                        Severity::Error,
                        codes::REFERENCE_MISMATCH,
                        format!(
                            "{label} is {stored_error:.3} away from its BF16 original (a correct {format:?} \
                             quantization: {expected:.3}) and no tested fault (nibble order, W1/W3 swap, swizzled \
                             scales, reciprocal global scale, permuted experts or rows) explains it"
                        ),
                    )
                }
            };
            (Some(row), vec![at(f)])
        })
        .collect();
    for (row, f) in results {
        report.reference.extend(row);
        report.findings.extend(f);
    }
}

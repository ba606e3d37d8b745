//! [`MoeLayer::validate`]: the one place where a layer's consistency is checked. Every engine
//! (the CPU reference, the CUDA runtime) calls it before touching the data, so a layer built in
//! code, sliced for a rank or corrupted on disk fails with an error naming the tensor instead of
//! a panic or garbage. The loader checks the same facts on the files (with file names) and then
//! calls this too. [`MoeLayer::validate_scale_bytes`] is the O(weights) part (every block-scale
//! byte, every FP8 weight byte): run once where a layer enters a device (the CUDA upload) — the
//! loader already scanned the files — never per forward.

use super::load::scan_nan_bytes;
use super::{DenseData, DenseProj, ExpertProj, MoeLayer, ProjData};
use crate::error::{MegaError, Result};
use crate::formats::{e4m3, e8m0};

impl MoeLayer {
    /// Checks that every buffer has the size the config and the expert range imply, that global
    /// scales are finite, that an FP8 shared expert has finite positive block multipliers, and
    /// that the router's tensors fit `E` and `k`. Cost: O(experts + router), not O(weights).
    pub fn validate(&self) -> Result<()> {
        let c = &self.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        if h == 0 || i == 0 || e == 0 {
            return Err(MegaError::Config(format!(
                "hidden_size={h}, moe_intermediate_size={i}, n_routed_experts={e}"
            )));
        }
        if c.num_experts_per_tok == 0 || c.num_experts_per_tok > e {
            return Err(MegaError::Config(format!(
                "num_experts_per_tok={} must be in 1..={e}",
                c.num_experts_per_tok
            )));
        }
        let r = &self.expert_range;
        check_expert_range(self.index, r, e)?;
        self.check_router()?;
        check_expert_proj(self, &self.w1, "w1", i, h)?;
        check_expert_proj(self, &self.w3, "w3", i, h)?;
        check_expert_proj(self, &self.w2, "w2", h, i)?;
        if self.w1.format() != self.w2.format() || self.w1.format() != self.w3.format() {
            return Err(MegaError::tensor(
                format!("layers.{}.ffn.experts", self.index),
                format!(
                    "w1, w2 and w3 have different formats ({:?}, {:?}, {:?})",
                    self.w1.format(),
                    self.w2.format(),
                    self.w3.format()
                ),
            ));
        }
        if let Some(s) = &self.shared {
            let is = s.w1.rows;
            check_dense(self, &s.w1, "w1", is, h)?;
            check_dense(self, &s.w3, "w3", is, h)?;
            check_dense(self, &s.w2, "w2", h, is)?;
        }
        Ok(())
    }

    /// [`Self::validate`] plus the byte scans: no block-scale byte is NaN (e4m3 0x7F/0xFF, e8m0
    /// 0xFF; named per expert by global id) and an FP8 shared expert has no NaN weight byte.
    pub fn validate_scale_bytes(&self) -> Result<()> {
        self.validate()?;
        for (p, proj) in [(&self.w1, "w1"), (&self.w3, "w3"), (&self.w2, "w2")] {
            scan_expert_proj(self, p, proj)?;
        }
        if let Some(s) = &self.shared {
            for (p, proj) in [(&s.w1, "w1"), (&s.w3, "w3"), (&s.w2, "w2")] {
                if let DenseData::Fp8Block { weight, .. } = &p.data {
                    let name = format!("layers.{}.ffn.shared_experts.{proj}.weight", self.index);
                    scan_nan_bytes(&name, weight, p.cols, e4m3::is_nan, "e4m3 weight")?;
                }
            }
        }
        Ok(())
    }

    fn check_router(&self) -> Result<()> {
        let c = &self.config;
        let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        let base = format!("layers.{}.ffn.gate", self.index);
        expect_len(&format!("{base}.weight"), "weight", self.router.weight.len(), e * h)?;
        if let Some(b) = &self.router.bias {
            expect_len(&format!("{base}.bias"), "bias", b.len(), e)?;
        }
        if let Some(t) = &self.router.tid2eid {
            let name = format!("{base}.tid2eid");
            if t.is_empty() || !t.len().is_multiple_of(k) {
                return Err(MegaError::tensor(
                    name,
                    format!("has {} entries, expected [vocab, k={k}] with vocab >= 1", t.len()),
                ));
            }
            if let Some((i, v)) = t.iter().enumerate().find(|(_, &v)| v < 0 || v as usize >= e) {
                return Err(MegaError::tensor(name, format!("entry {i} = {v} is outside 0..{e}")));
            }
        }
        Ok(())
    }
}

pub(super) fn expect_len(name: &str, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(MegaError::tensor(name, format!("{what} has {got} elements, expected {want}")));
    }
    Ok(())
}

/// One projection of the routed experts: `[E_local, rows, cols]` in its format, finite global
/// scales (named per expert, by global id).
fn check_expert_proj(layer: &MoeLayer, p: &ExpertProj, proj: &str, rows: usize, cols: usize) -> Result<()> {
    let name = format!("layers.{}.ffn.experts.*.{proj}", layer.index);
    let e = layer.expert_range.len();
    if p.experts != e || p.rows != rows || p.cols != cols {
        return Err(MegaError::tensor(
            &name,
            format!(
                "shape [{}, {}, {}], expected [E={e} (experts {:?}), {rows}, {cols}]",
                p.experts, p.rows, p.cols, layer.expert_range
            ),
        ));
    }
    let n = e * rows * cols;
    let format = p.format();
    let block = format.block_size().unwrap_or(1);
    if !cols.is_multiple_of(block) {
        return Err(MegaError::tensor(
            &name,
            format!("{cols} columns, {format} needs a multiple of {block}"),
        ));
    }
    match &p.data {
        ProjData::Nvfp4 { packed, scales, global_scale, input_scale } => {
            expect_len(&name, "weight (packed)", packed.len(), n / 2)?;
            expect_len(&name, "weight_scale", scales.len(), n / block)?;
            expect_len(&name, "weight_scale_2", global_scale.len(), e)?;
            if let Some((x, &g)) =
                global_scale.iter().enumerate().find(|(_, &g)| !crate::formats::nvfp4::valid_global_scale(g))
            {
                crate::formats::nvfp4::check_global_scale(&expert_name(layer, proj, x, "weight_scale_2"), g)?;
            }
            if let Some(s) = input_scale {
                expect_len(&name, "input_scale", s.len(), e)?;
            }
        }
        ProjData::Mxfp4 { packed, scales } => {
            expect_len(&name, "weight (packed)", packed.len(), n / 2)?;
            expect_len(&name, "scale", scales.len(), n / block)?;
        }
        ProjData::Bf16 { weight } => expect_len(&name, "weight", weight.len(), n)?,
    }
    Ok(())
}

/// One projection of the shared expert: shape, and for FP8 finite positive block multipliers.
fn check_dense(layer: &MoeLayer, p: &DenseProj, proj: &str, rows: usize, cols: usize) -> Result<()> {
    let base = format!("layers.{}.ffn.shared_experts.{proj}", layer.index);
    let name = format!("{base}.weight");
    if p.rows != rows || p.cols != cols {
        return Err(MegaError::tensor(
            name,
            format!("shape [{}, {}], expected [{rows}, {cols}]", p.rows, p.cols),
        ));
    }
    match &p.data {
        DenseData::Bf16(w) => expect_len(&name, "weight", w.len(), rows * cols),
        DenseData::Fp8Block { weight, scale } => {
            expect_len(&name, "weight", weight.len(), rows * cols)?;
            let [br, bc] = super::fp8_scale_grid(rows, cols);
            expect_len(&name, "scale", scale.len(), br * bc)?;
            if let Some((i, v)) = scale.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v > 0.0)) {
                return Err(MegaError::tensor(
                    format!("{base}.scale"),
                    format!("block {i} is {v}, expected a finite value > 0"),
                ));
            }
            Ok(())
        }
    }
}

/// The name of expert `x` (local index)'s tensor `t` of projection `proj`, by global id.
fn expert_name(layer: &MoeLayer, proj: &str, x: usize, t: &str) -> String {
    format!("layers.{}.ffn.experts.{}.{proj}.{t}", layer.index, layer.expert_range.start + x)
}

/// No NaN block-scale byte in one routed projection (sizes already checked), scanned per expert
/// so that the error names it: `[rows, cols / block]` scale bytes each.
fn scan_expert_proj(layer: &MoeLayer, p: &ExpertProj, proj: &str) -> Result<()> {
    let Some(block) = p.format().block_size() else { return Ok(()) };
    let (per_expert, scols) = ((p.rows * p.cols / block).max(1), (p.cols / block).max(1));
    let (scales, is_nan, tensor, what): (&[u8], fn(u8) -> bool, _, _) = match &p.data {
        ProjData::Nvfp4 { scales, .. } => (scales, e4m3::is_nan, "weight_scale", "e4m3 scale"),
        ProjData::Mxfp4 { scales, .. } => (scales, e8m0::is_nan, "scale", "e8m0 scale"),
        ProjData::Bf16 { .. } => return Ok(()),
    };
    scales
        .chunks(per_expert)
        .enumerate()
        .try_for_each(|(x, sc)| scan_nan_bytes(&expert_name(layer, proj, x, tensor), sc, scols, is_nan, what))
}

/// An expert range (of a range load, a layer, a slice) must be a non-empty `start..end` with
/// `end <= E`: the one check the loader, the validator and the slicers call.
pub(crate) fn check_expert_range(layer: usize, experts: &std::ops::Range<usize>, e: usize) -> Result<()> {
    let problem = if experts.start > experts.end {
        "is reversed"
    } else if experts.is_empty() {
        "is empty"
    } else if experts.end > e {
        "goes beyond the layer's routed experts"
    } else {
        return Ok(());
    };
    Err(MegaError::Input(format!(
        "layer {layer}: expert range {experts:?} {problem}; expected start..end with \
         start < end <= E = {e} (n_routed_experts)"
    )))
}

#[cfg(test)]
mod tests {
    use crate::checkpoint::ProjData;
    use crate::error::MegaError;
    use crate::formats::WeightFormat;
    use crate::synthetic;

    /// A zero, negative or non-finite NVFP4 global scale is refused by name (the loader, the file
    /// reader and `doctor` apply the same rule, `formats::nvfp4::valid_global_scale`).
    #[test]
    fn refuses_a_global_scale_that_is_not_finite_and_positive() {
        let cfg = synthetic::tiny_config();
        let layer = synthetic::random_layer(&cfg, WeightFormat::Nvfp4, 3, false, 7);
        layer.validate().unwrap();
        for g in [0.0f32, -0.5, f32::NAN, f32::INFINITY] {
            let mut l = layer.clone();
            let ProjData::Nvfp4 { global_scale, .. } = &mut l.w3.data else { panic!("an NVFP4 layer") };
            global_scale[2] = g;
            match l.validate() {
                Err(MegaError::Tensor { tensor, msg }) => {
                    assert_eq!(tensor, "layers.3.ffn.experts.2.w3.weight_scale_2", "{g}");
                    assert!(msg.contains("finite positive"), "{msg}");
                }
                other => panic!("global scale {g}: expected an error naming the tensor, got {other:?}"),
            }
        }
        layer.validate().unwrap();
    }
}

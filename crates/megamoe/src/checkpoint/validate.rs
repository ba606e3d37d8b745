//! [`MoeLayer::validate`]: the one place where a layer's consistency is checked. Every engine
//! (the CPU reference, the CUDA runtime) calls it before touching the data, so a layer built in
//! code, sliced for a rank or corrupted on disk fails with an error naming the tensor instead of
//! a panic or garbage. The loader checks the same facts on the files (with file names) and then
//! calls this too.

use super::load::scan_nan_bytes;
use super::{DenseData, DenseProj, ExpertProj, MoeLayer, ProjData};
use crate::error::{MegaError, Result};
use crate::formats::{e4m3, e8m0};

impl MoeLayer {
    /// Checks that every buffer has the size the config and the expert range imply, that global
    /// scales are finite, that no block-scale byte is NaN (e4m3 0x7F/0xFF, e8m0 0xFF), that an
    /// FP8 shared expert has finite positive block multipliers and no NaN weight bytes, and that
    /// the router's tensors fit `E` and `k`.
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
        if r.start > r.end || r.end > e {
            return Err(MegaError::Config(format!(
                "layer {}: expert range {r:?} is not inside the layer's {e} routed experts",
                self.index
            )));
        }
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
/// scales, no NaN block-scale bytes (named per expert, by global id).
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
    let expert_name = |x: usize, t: &str| {
        format!("layers.{}.ffn.experts.{}.{proj}.{t}", layer.index, layer.expert_range.start + x)
    };
    // Per expert, so that the error names it: `[rows, cols / block]` scale bytes each.
    let scan = |scales: &[u8], is_nan: fn(u8) -> bool, tensor: &str, what: &str| {
        let (per_expert, scols) = ((rows * cols / block).max(1), (cols / block).max(1));
        scales
            .chunks(per_expert)
            .enumerate()
            .try_for_each(|(x, sc)| scan_nan_bytes(&expert_name(x, tensor), sc, scols, is_nan, what))
    };
    match &p.data {
        ProjData::Nvfp4 { packed, scales, global_scale, input_scale } => {
            expect_len(&name, "weight (packed)", packed.len(), n / 2)?;
            expect_len(&name, "weight_scale", scales.len(), n / block)?;
            expect_len(&name, "weight_scale_2", global_scale.len(), e)?;
            if let Some((x, g)) = global_scale.iter().enumerate().find(|(_, g)| !g.is_finite()) {
                return Err(MegaError::tensor(
                    expert_name(x, "weight_scale_2"),
                    format!("is {g}, expected a finite global scale"),
                ));
            }
            if let Some(s) = input_scale {
                expect_len(&name, "input_scale", s.len(), e)?;
            }
            scan(scales, e4m3::is_nan, "weight_scale", "e4m3 scale")?;
        }
        ProjData::Mxfp4 { packed, scales } => {
            expect_len(&name, "weight (packed)", packed.len(), n / 2)?;
            expect_len(&name, "scale", scales.len(), n / block)?;
            scan(scales, e8m0::is_nan, "scale", "e8m0 scale")?;
        }
        ProjData::Bf16 { weight } => expect_len(&name, "weight", weight.len(), n)?,
    }
    Ok(())
}

/// One projection of the shared expert: shape, and for FP8 no NaN weight bytes and finite
/// positive block multipliers.
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
            expect_len(&name, "scale", scale.len(), rows.div_ceil(128) * cols.div_ceil(128))?;
            scan_nan_bytes(&name, weight, cols, e4m3::is_nan, "e4m3 weight")?;
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

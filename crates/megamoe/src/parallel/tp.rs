//! Tensor-parallel experts: each of `tp` ranks holds `1/tp` of every expert's intermediate
//! dimension `I`.
//!
//! Slice `p` is the intermediate features `p*I/tp .. (p+1)*I/tp`: rows of W1 and W3 (`[I, H]`,
//! their block scales run along H and are cut with the rows) and columns of W2 (`[H, I]`, whose
//! block scales run along I: the slice must start and end on a scale block, so `I/tp` must be a
//! multiple of the format's block, 16 for NVFP4 and 32 for MXFP4). Per-expert scales (NVFP4
//! `global_scale`, `input_scale`) are kept whole. SwiGLU, the routing weight and the activation
//! quantizers of W4A8 (128-blocks) and W4A4 (16-blocks) act per feature or per block of features,
//! so a slice computes exactly its part of the activation; its W2 output is a partial sum over
//! its features, and the partials of the `tp` ranks are added in TP-rank order on the home rank
//! (not bitwise equal to the unsliced sum: the reduction over I is split; within ~1e-6 relative).
//! The sliced layer is an ordinary [`MoeLayer`] whose `moe_intermediate_size` is `I/tp`.

use crate::checkpoint::{ExpertProj, MoeLayer, ProjData};
use crate::error::{MegaError, Result};
use std::ops::Range;

/// The intermediate features of TP slice `tp_rank` of `tp` over `inter` features, checked
/// against the weight format's scale block (`block`, `None` for unscaled weights).
pub fn inter_slice(inter: usize, tp: usize, tp_rank: usize, block: Option<usize>) -> Result<Range<usize>> {
    if tp == 0 || tp_rank >= tp {
        return Err(MegaError::Input(format!("tp rank {tp_rank} is outside a TP degree of {tp}")));
    }
    if !inter.is_multiple_of(tp) {
        return Err(MegaError::Input(format!(
            "--tp {tp}: moe_intermediate_size {inter} does not split into {tp} equal slices"
        )));
    }
    let per = inter / tp;
    if let Some(b) = block {
        if !per.is_multiple_of(b) {
            return Err(MegaError::Input(format!(
                "--tp {tp}: a slice of {per} intermediate features breaks W2's {b}-element scale \
                 blocks (moe_intermediate_size {inter} / {tp} must be a multiple of {b})"
            )));
        }
    }
    Ok(tp_rank * per..(tp_rank + 1) * per)
}

/// `layer` with only TP slice `tp_rank` of `tp` of every routed expert's intermediate dimension
/// (router and shared expert kept whole; see the module docs). `tp == 1` returns a copy.
pub fn slice_inter(layer: &MoeLayer, tp: usize, tp_rank: usize) -> Result<MoeLayer> {
    let inter = layer.config.moe_intermediate_size;
    let r = inter_slice(inter, tp, tp_rank, layer.format().block_size())
        .map_err(|e| MegaError::Input(format!("layer {}: {e}", layer.index)))?;
    let mut out = layer.clone();
    if tp == 1 {
        return Ok(out);
    }
    out.config.moe_intermediate_size = r.len();
    out.w1 = slice_rows(&layer.w1, &r);
    out.w3 = slice_rows(&layer.w3, &r);
    out.w2 = slice_cols(&layer.w2, &r);
    Ok(out)
}

/// Elements (or bytes) per matrix row of `p` in each of its arrays: codes, block scales.
fn per_row(p: &ExpertProj) -> (usize, usize) {
    match &p.data {
        ProjData::Nvfp4 { .. } => (p.cols / 2, p.cols / crate::formats::nvfp4::BLOCK),
        ProjData::Mxfp4 { .. } => (p.cols / 2, p.cols / crate::formats::mxfp4::BLOCK),
        ProjData::Bf16 { .. } => (p.cols, 0),
    }
}

/// Rows `r` of every expert matrix of `p` (`[E, rows, cols]`).
fn slice_rows(p: &ExpertProj, r: &Range<usize>) -> ExpertProj {
    let (codes, scales) = per_row(p);
    let cut = |v: &[u8], per: usize| -> Vec<u8> {
        (0..p.experts)
            .flat_map(|e| v[(e * p.rows + r.start) * per..(e * p.rows + r.end) * per].to_vec())
            .collect()
    };
    let data = match &p.data {
        ProjData::Nvfp4 { packed, scales: s, global_scale, input_scale } => ProjData::Nvfp4 {
            packed: cut(packed, codes),
            scales: cut(s, scales),
            global_scale: global_scale.clone(),
            input_scale: input_scale.clone(),
        },
        ProjData::Mxfp4 { packed, scales: s } => {
            ProjData::Mxfp4 { packed: cut(packed, codes), scales: cut(s, scales) }
        }
        ProjData::Bf16 { weight } => ProjData::Bf16 {
            weight: (0..p.experts)
                .flat_map(|e| weight[(e * p.rows + r.start) * p.cols..(e * p.rows + r.end) * p.cols].to_vec())
                .collect(),
        },
    };
    ExpertProj { experts: p.experts, rows: r.len(), cols: p.cols, data }
}

/// Columns `c` of every expert matrix of `p` (`[E, rows, cols]`); `c` lies on scale blocks.
fn slice_cols(p: &ExpertProj, c: &Range<usize>) -> ExpertProj {
    let (codes, scales) = per_row(p);
    let rows = p.experts * p.rows;
    // Each array's per-row span of the columns `c`, in that array's units.
    let cut = |v: &[u8], per: usize, unit_cols: usize| -> Vec<u8> {
        let (a, b) = (c.start / unit_cols, c.end / unit_cols);
        (0..rows).flat_map(|row| v[row * per + a..row * per + b].to_vec()).collect()
    };
    let data = match &p.data {
        ProjData::Nvfp4 { packed, scales: s, global_scale, input_scale } => ProjData::Nvfp4 {
            packed: cut(packed, codes, 2),
            scales: cut(s, scales, crate::formats::nvfp4::BLOCK),
            global_scale: global_scale.clone(),
            input_scale: input_scale.clone(),
        },
        ProjData::Mxfp4 { packed, scales: s } => ProjData::Mxfp4 {
            packed: cut(packed, codes, 2),
            scales: cut(s, scales, crate::formats::mxfp4::BLOCK),
        },
        ProjData::Bf16 { weight } => ProjData::Bf16 {
            weight: (0..rows)
                .flat_map(|row| weight[row * p.cols + c.start..row * p.cols + c.end].to_vec())
                .collect(),
        },
    };
    ExpertProj { experts: p.experts, rows: p.rows, cols: c.len(), data }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::WeightFormat;
    use crate::synthetic;

    #[test]
    fn slices_are_valid_layers_that_cover_the_intermediate_dimension() {
        let cfg = synthetic::tiny_config(); // I = 128
        for format in [WeightFormat::Nvfp4, WeightFormat::Mxfp4, WeightFormat::Bf16] {
            let layer = synthetic::random_layer(&cfg, format, 1, false, 8);
            let parts: Vec<MoeLayer> = (0..2).map(|p| slice_inter(&layer, 2, p).unwrap()).collect();
            for part in &parts {
                part.validate().unwrap();
                assert_eq!(part.config.moe_intermediate_size, 64);
            }
            // W1 rows and W2 columns of the two slices put back together are the whole matrices.
            let bytes = |p: &ExpertProj| format!("{:?}", p.data);
            assert_ne!(bytes(&parts[0].w1), bytes(&parts[1].w1));
            let (a, b) = (&parts[0].w2, &parts[1].w2);
            if let (
                ProjData::Bf16 { weight: wa },
                ProjData::Bf16 { weight: wb },
                ProjData::Bf16 { weight: w },
            ) = (&a.data, &b.data, &layer.w2.data)
            {
                for row in 0..layer.w2.experts * layer.w2.rows {
                    assert_eq!(&w[row * 128..row * 128 + 64], &wa[row * 64..(row + 1) * 64]);
                    assert_eq!(&w[row * 128 + 64..(row + 1) * 128], &wb[row * 64..(row + 1) * 64]);
                }
            }
        }
    }

    #[test]
    fn a_slice_that_breaks_a_scale_block_is_an_error() {
        let layer = synthetic::random_layer(&synthetic::tiny_config(), WeightFormat::Mxfp4, 1, false, 8);
        // 128 / 8 = 16 features: not a multiple of MXFP4's 32-element block.
        let e = slice_inter(&layer, 8, 0).unwrap_err().to_string();
        assert!(e.contains("--tp 8") && e.contains("32-element") && e.contains("layer 1"), "{e}");
        let e = slice_inter(&layer, 3, 0).unwrap_err().to_string();
        assert!(e.contains("does not split"), "{e}");
        assert!(inter_slice(128, 2, 2, None).is_err());
    }
}

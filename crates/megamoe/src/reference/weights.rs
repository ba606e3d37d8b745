//! Row-at-a-time views of expert and dense weight matrices: the reference never materialises a
//! whole dequantized copy of the experts, it dequantizes one row into a small buffer and uses it
//! for every token routed to that expert.

use crate::checkpoint::{DenseData, DenseProj, ExpertProj, ProjData};
use crate::formats as fmt;
use fmt::{mxfp4, nvfp4};
use half::bf16;

/// One `rows x cols` matrix, readable row by row. Values are `row(r)[c] * alpha`.
#[derive(Clone, Copy)]
pub(crate) struct MatView<'a> {
    kind: Kind<'a>,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The NVFP4 global scale (`weight_scale_2`), applied after accumulation; 1 otherwise.
    pub alpha: f32,
}

#[derive(Clone, Copy)]
enum Kind<'a> {
    Nvfp4 { packed: &'a [u8], scales: &'a [u8] },
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
    Bf16(&'a [bf16]),
    Fp8Block { weight: &'a [u8], scale: &'a [f32] },
}

impl<'a> MatView<'a> {
    /// Expert `e` of an expert-stacked projection (shapes must have been checked by
    /// [`crate::checkpoint::MoeLayer::validate`]).
    pub fn expert(p: &'a ExpertProj, e: usize) -> Self {
        let n = p.rows * p.cols;
        let (kind, alpha) = match &p.data {
            ProjData::Nvfp4 { packed, scales, global_scale, .. } => (
                Kind::Nvfp4 {
                    packed: &packed[e * n / 2..(e + 1) * n / 2],
                    scales: &scales[e * n / nvfp4::BLOCK..(e + 1) * n / nvfp4::BLOCK],
                },
                global_scale[e],
            ),
            ProjData::Mxfp4 { packed, scales } => (
                Kind::Mxfp4 {
                    packed: &packed[e * n / 2..(e + 1) * n / 2],
                    scales: &scales[e * n / mxfp4::BLOCK..(e + 1) * n / mxfp4::BLOCK],
                },
                1.0,
            ),
            ProjData::Bf16 { weight } => (Kind::Bf16(&weight[e * n..(e + 1) * n]), 1.0),
        };
        MatView { kind, rows: p.rows, cols: p.cols, alpha }
    }

    /// A dense projection (shared expert).
    pub fn dense(p: &'a DenseProj) -> Self {
        let kind = match &p.data {
            DenseData::Bf16(w) => Kind::Bf16(w),
            DenseData::Fp8Block { weight, scale } => Kind::Fp8Block { weight, scale },
        };
        MatView { kind, rows: p.rows, cols: p.cols, alpha: 1.0 }
    }

    /// Dequantizes row `r` (without `alpha`) into `out` (`cols` values).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match self.kind {
            Kind::Nvfp4 { packed, scales } => decode_fp4_row(
                &packed[r * c / 2..(r + 1) * c / 2],
                &scales[r * c / nvfp4::BLOCK..(r + 1) * c / nvfp4::BLOCK],
                nvfp4::BLOCK,
                fmt::e4m3::decode,
                out,
            ),
            Kind::Mxfp4 { packed, scales } => decode_fp4_row(
                &packed[r * c / 2..(r + 1) * c / 2],
                &scales[r * c / mxfp4::BLOCK..(r + 1) * c / mxfp4::BLOCK],
                mxfp4::BLOCK,
                fmt::e8m0::decode,
                out,
            ),
            Kind::Bf16(w) => {
                for (o, v) in out.iter_mut().zip(&w[r * c..(r + 1) * c]) {
                    *o = v.to_f32();
                }
            }
            Kind::Fp8Block { weight, scale } => {
                let scale_row = &scale[crate::checkpoint::fp8_scale_index(r, 0, c)..];
                for (j, (o, &b)) in out.iter_mut().zip(&weight[r * c..(r + 1) * c]).enumerate() {
                    *o = fmt::e4m3::decode(b) * scale_row[j / crate::checkpoint::FP8_WEIGHT_BLOCK];
                }
            }
        }
    }
}

/// `e2m1 * block scale` for one packed row, one 16-entry table per block (the product is exact
/// in f32: 2 + 4 significant bits), so this equals the formats module's `dequantize_row`.
#[inline]
fn decode_fp4_row(packed: &[u8], scales: &[u8], block: usize, scale: fn(u8) -> f32, out: &mut [f32]) {
    for ((p, &s), o) in packed.chunks_exact(block / 2).zip(scales).zip(out.chunks_exact_mut(block)) {
        let sc = scale(s);
        let lut: [f32; 16] = fmt::e2m1::VALUES.map(|v| v * sc);
        for (pair, &b) in o.chunks_exact_mut(2).zip(p) {
            pair[0] = lut[(b & 15) as usize];
            pair[1] = lut[(b >> 4) as usize];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_decode_equals_formats_dequantize_row() {
        let cols = 64;
        let packed: Vec<u8> = (0..cols / 2).map(|i| (i * 37 + 11) as u8).collect();
        // Every e4m3 class: zero, subnormals, normals, the largest; every e8m0 range.
        let nv_scales = [0x00u8, 0x01, 0x3F, 0x7E];
        let mx_scales = [0u8, 127];
        let (mut a, mut b) = (vec![0.0f32; cols], vec![0.0f32; cols]);
        decode_fp4_row(&packed, &nv_scales, nvfp4::BLOCK, fmt::e4m3::decode, &mut a);
        fmt::nvfp4::dequantize_row(&packed, &nv_scales, &mut b);
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        decode_fp4_row(&packed, &mx_scales, mxfp4::BLOCK, fmt::e8m0::decode, &mut a);
        fmt::mxfp4::dequantize_row(&packed, &mx_scales, &mut b);
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

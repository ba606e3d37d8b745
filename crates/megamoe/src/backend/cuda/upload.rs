//! Host-side checks of a layer against what the kernels support, and the one-time upload of the
//! routed experts, the shared expert and the router into the device layouts of
//! [`crate::backend::gpu_layout`] (gate/up rows interleaved for the fused SwiGLU epilogue).

use super::device_buf::DevBuf;
use super::kernels::{router_smem, wf_code, MAX_STATIC_SMEM};
use crate::backend::gpu_layout::{self, L1_INTERLEAVE};
use crate::checkpoint::{DenseData, DenseProj, MoeLayer, ProjData};
use crate::error::{MegaError, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The routed experts on the device (layouts as in `kernels/gemm.cu`).
pub(super) struct ExpertsDev {
    /// Weight-format code of `gemm.cu` ([`wf_code`]).
    pub(super) wf: i32,
    /// W1/W3 codes (or bf16) `[E][2I][..]`, gate/up rows interleaved in blocks of [`L1_INTERLEAVE`].
    pub(super) w13q: DevBuf,
    /// W1/W3 block scales, interleaved like `w13q` (FP4 formats).
    pub(super) w13s: Option<DevBuf>,
    /// W2 codes (or bf16) `[E][H][..]`.
    pub(super) w2q: DevBuf,
    /// W2 block scales (FP4 formats).
    pub(super) w2s: Option<DevBuf>,
    /// NVFP4 weight global scales `[E][2]` f32 = (w1, w3).
    pub(super) alpha13: Option<DevBuf>,
    /// NVFP4 W2 global scales `[E]` f32.
    pub(super) alpha2: Option<DevBuf>,
    /// NVFP4 activation global scales of the L1 input `[E]` f32 (W4A4).
    pub(super) in1: Option<DevBuf>,
    /// NVFP4 activation global scales of the L2 input `[E]` f32 (W4A4).
    pub(super) in2: Option<DevBuf>,
    /// Host copies of the input scales (W4A4 checks and trace dequantization).
    pub(super) in1_host: Option<Vec<f32>>,
    pub(super) in2_host: Option<Vec<f32>>,
}

impl ExpertsDev {
    /// Experts with weights and block scales only (MXFP4, BF16); NVFP4 adds its global and
    /// activation scales.
    fn weights_only(wf: i32, w13q: DevBuf, w13s: Option<DevBuf>, w2q: DevBuf, w2s: Option<DevBuf>) -> Self {
        ExpertsDev {
            wf,
            w13q,
            w13s,
            w2q,
            w2s,
            alpha13: None,
            alpha2: None,
            in1: None,
            in2: None,
            in1_host: None,
            in2_host: None,
        }
    }
}

/// The shared expert on the device: one dense group in `gemm.cu`'s bf16 (2) or FP8 (3) format.
pub(super) struct SharedDev {
    /// Weight-format code of `gemm.cu` (2 bf16, 3 fp8 with 128x128 block scales).
    pub(super) wf: i32,
    /// The shared expert's intermediate size I_s.
    pub(super) inter: usize,
    /// W1/W3 `[2 I_s][H]`, gate/up rows interleaved like the routed experts.
    pub(super) w13q: DevBuf,
    /// FP8 scales of `w13q`, expanded per row and per 64 columns.
    pub(super) w13s: Option<DevBuf>,
    /// W2 `[H][I_s]`.
    pub(super) w2q: DevBuf,
    /// FP8 scales of `w2q`, expanded like `w13s`.
    pub(super) w2s: Option<DevBuf>,
}

/// The router on the device (layouts as in `kernels/router.cu`).
pub(super) struct RouterDev {
    /// Gate weight `[E, H]` f32.
    pub(super) weight: DevBuf,
    /// Score-correction bias `[E]` f32.
    pub(super) bias: Option<DevBuf>,
    /// Hash routing table `[vocab, K]` i32 (hash layers).
    pub(super) tid2eid: Option<DevBuf>,
    /// Rows of `tid2eid` (0 without one): token ids must be below it.
    pub(super) vocab: usize,
}

/// Checks the layer's shapes against what the kernels support (before anything is uploaded).
pub(super) fn check_layer(layer: &MoeLayer) -> Result<()> {
    let c = &layer.config;
    let (h, i, e, k) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
    let step = gpu_layout::K_STEP;
    if h == 0 || i == 0 || h % step != 0 || i % step != 0 {
        return Err(MegaError::Config(format!(
            "the CUDA backend needs H and I to be positive multiples of {step} (H={h}, I={i})"
        )));
    }
    if e == 0 || k == 0 || k > 32 || k > e {
        return Err(MegaError::Config(format!("the CUDA backend needs 1 <= k <= min(32, E) (k={k}, E={e})")));
    }
    if router_smem(e) > MAX_STATIC_SMEM {
        return Err(MegaError::Config(format!(
            "router: E={e} needs {} bytes of shared memory (limit {MAX_STATIC_SMEM})",
            router_smem(e)
        )));
    }
    for (name, p, rows, cols) in [("w1", &layer.w1, i, h), ("w2", &layer.w2, h, i), ("w3", &layer.w3, i, h)] {
        if p.experts != e || p.rows != rows || p.cols != cols {
            return Err(MegaError::tensor(
                format!("layers.{}.ffn.experts.*.{name}", layer.index),
                format!("is [{}, {}, {}], expected [{e}, {rows}, {cols}]", p.experts, p.rows, p.cols),
            ));
        }
        if p.format() != layer.format() {
            return Err(MegaError::tensor(
                format!("layers.{}.ffn.experts.*.{name}", layer.index),
                "has a different format than w1",
            ));
        }
    }
    if let Some(s) = &layer.shared {
        let is = s.w1.rows;
        if is % step != 0
            || s.w1.cols != h
            || s.w3.rows != is
            || s.w3.cols != h
            || s.w2.rows != h
            || s.w2.cols != is
        {
            return Err(MegaError::Config(format!(
                "shared expert: w1 [{}, {}], w3 [{}, {}], w2 [{}, {}]: expected [I_s, {h}] / [{h}, I_s] with I_s % {step} == 0",
                s.w1.rows, s.w1.cols, s.w3.rows, s.w3.cols, s.w2.rows, s.w2.cols
            )));
        }
    }
    Ok(())
}

/// Bounds `max_tokens` so that every slot index and grid size fits the kernels' `int` / `u32`:
/// `max_tokens * k` slots must not exceed `i32::MAX` (and so neither may the tile counts).
pub(super) fn check_max_tokens(layer: &MoeLayer, max_tokens: usize) -> Result<()> {
    let c = &layer.config;
    let (e, k) = (c.n_routed_experts, c.num_experts_per_tok);
    if max_tokens == 0 {
        return Err(MegaError::Input("max_tokens must be at least 1".into()));
    }
    let slots = max_tokens.checked_mul(k).filter(|&s| s <= i32::MAX as usize).ok_or_else(|| {
        MegaError::Input(format!(
            "max_tokens={max_tokens} with k={k} gives more than i32::MAX ({}) slots, the kernels' index range",
            i32::MAX
        ))
    })?;
    let tiles = gpu_layout::max_tiles(slots, e, gpu_layout::MIN_BLOCK_M);
    if tiles > u32::MAX as usize {
        return Err(MegaError::Input(format!(
            "max_tokens={max_tokens}: {tiles} GEMM tiles exceed a u32 grid dimension"
        )));
    }
    Ok(())
}

/// Checks that tensor `name` has `want` elements.
fn len_check(name: String, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(MegaError::tensor(name, format!("has {got} elements, expected {want}")));
    }
    Ok(())
}

/// Checks and uploads the routed experts (W1/W3 interleaved into one L1 matrix per expert).
pub(super) fn upload_experts(stream: &Arc<CudaStream>, layer: &MoeLayer) -> Result<ExpertsDev> {
    let c = &layer.config;
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let nm = |p: &str, t: &str| format!("layers.{}.ffn.experts.*.{p}.{t}", layer.index);
    let il = |g: &[u8], u: &[u8], len: usize| gpu_layout::interleave_gate_up(g, u, e, i, len, L1_INTERLEAVE);
    let wf = wf_code(layer.format());
    // FP4 codes and block scales (`block` elements per scale), gate/up rows interleaved.
    let fp4 = |p1: &[u8], s1: &[u8], p2: &[u8], s2: &[u8], p3: &[u8], s3: &[u8], block: usize| {
        Ok::<_, MegaError>(ExpertsDev::weights_only(
            wf,
            DevBuf::from_host(stream, &il(p1, p3, h / 2)?, "w13")?,
            Some(DevBuf::from_host(stream, &il(s1, s3, h / block)?, "w13 scales")?),
            DevBuf::from_host(stream, p2, "w2")?,
            Some(DevBuf::from_host(stream, s2, "w2 scales")?),
        ))
    };
    match (&layer.w1.data, &layer.w2.data, &layer.w3.data) {
        (
            ProjData::Nvfp4 { packed: p1, scales: s1, global_scale: g1, input_scale: in1 },
            ProjData::Nvfp4 { packed: p2, scales: s2, global_scale: g2, input_scale: in2 },
            ProjData::Nvfp4 { packed: p3, scales: s3, global_scale: g3, .. },
        ) => {
            for (n, p, s, g, r, cc) in
                [("w1", p1, s1, g1, i, h), ("w2", p2, s2, g2, h, i), ("w3", p3, s3, g3, i, h)]
            {
                len_check(nm(n, "weight"), p.len(), e * r * cc / 2)?;
                len_check(nm(n, "weight_scale"), s.len(), e * r * cc / 16)?;
                len_check(nm(n, "weight_scale_2"), g.len(), e)?;
            }
            let mut a13 = Vec::with_capacity(2 * e);
            for x in 0..e {
                a13.push(g1[x]);
                a13.push(g3[x]);
            }
            let in1_host = in1.clone().filter(|v| v.len() == e);
            let in2_host = in2.clone().filter(|v| v.len() == e);
            let weights = fp4(p1, s1, p2, s2, p3, s3, 16)?;
            Ok(ExpertsDev {
                alpha13: Some(DevBuf::from_host(stream, &a13, "alpha13")?),
                alpha2: Some(DevBuf::from_host(stream, g2, "alpha2")?),
                in1: in1_host.as_ref().map(|v| DevBuf::from_host(stream, v, "input_scale w1")).transpose()?,
                in2: in2_host.as_ref().map(|v| DevBuf::from_host(stream, v, "input_scale w2")).transpose()?,
                in1_host,
                in2_host,
                ..weights
            })
        }
        (
            ProjData::Mxfp4 { packed: p1, scales: s1 },
            ProjData::Mxfp4 { packed: p2, scales: s2 },
            ProjData::Mxfp4 { packed: p3, scales: s3 },
        ) => {
            for (n, p, s, r, cc) in [("w1", p1, s1, i, h), ("w2", p2, s2, h, i), ("w3", p3, s3, i, h)] {
                len_check(nm(n, "weight"), p.len(), e * r * cc / 2)?;
                len_check(nm(n, "scale"), s.len(), e * r * cc / 32)?;
            }
            fp4(p1, s1, p2, s2, p3, s3, 32)
        }
        (ProjData::Bf16 { weight: w1 }, ProjData::Bf16 { weight: w2 }, ProjData::Bf16 { weight: w3 }) => {
            for (n, w, r, cc) in [("w1", w1, i, h), ("w2", w2, h, i), ("w3", w3, i, h)] {
                len_check(nm(n, "weight"), w.len(), e * r * cc)?;
            }
            let (b1, b3): (&[u16], &[u16]) = (bytemuck::cast_slice(w1), bytemuck::cast_slice(w3));
            let w13 = gpu_layout::interleave_gate_up(b1, b3, e, i, h, L1_INTERLEAVE)?;
            Ok(ExpertsDev::weights_only(
                wf,
                DevBuf::from_host(stream, &w13, "w13")?,
                None,
                DevBuf::from_host(stream, bytemuck::cast_slice::<_, u16>(w2), "w2")?,
                None,
            ))
        }
        _ => Err(MegaError::tensor(
            format!("layers.{}.ffn.experts", layer.index),
            "w1, w2 and w3 have different formats",
        )),
    }
}

/// Checks and uploads the shared expert (hidden size `h`).
pub(super) fn upload_shared(
    stream: &Arc<CudaStream>,
    s: &crate::checkpoint::SharedExpert,
    h: usize,
) -> Result<SharedDev> {
    let is = s.w1.rows;
    let dense = |d: &DenseProj, name: &str| -> Result<(i32, Vec<u8>, Option<Vec<f32>>)> {
        match &d.data {
            DenseData::Bf16(w) => {
                len_check(format!("shared_experts.{name}.weight"), w.len(), d.rows * d.cols)?;
                Ok((2, bytemuck::cast_slice::<_, u8>(w).to_vec(), None))
            }
            DenseData::Fp8Block { weight, scale } => {
                len_check(format!("shared_experts.{name}.weight"), weight.len(), d.rows * d.cols)?;
                let sc = gpu_layout::expand_block_scales(scale, d.rows, d.cols)
                    .map_err(|e| MegaError::tensor(format!("shared_experts.{name}.scale"), e.to_string()))?;
                Ok((3, weight.clone(), Some(sc)))
            }
        }
    };
    let (f1, b1, s1) = dense(&s.w1, "w1")?;
    let (f3, b3, s3) = dense(&s.w3, "w3")?;
    let (f2, b2, s2) = dense(&s.w2, "w2")?;
    if f1 != f2 || f1 != f3 {
        return Err(MegaError::tensor("shared_experts", "w1, w2 and w3 have different formats"));
    }
    // Interleave gate/up rows (bf16 rows are 2h bytes, fp8 rows h bytes; scales h/64 per row).
    let row_bytes = if f1 == 2 { 2 * h } else { h };
    let w13 = gpu_layout::interleave_gate_up(&b1, &b3, 1, is, row_bytes, L1_INTERLEAVE)?;
    let w13s = match (s1, s3) {
        (Some(a), Some(b)) => Some(DevBuf::from_host(
            stream,
            &gpu_layout::interleave_gate_up(&a, &b, 1, is, h / gpu_layout::K_STEP, L1_INTERLEAVE)?,
            "shared w13 scales",
        )?),
        _ => None,
    };
    Ok(SharedDev {
        wf: f1,
        inter: is,
        w13q: DevBuf::from_host(stream, &w13, "shared w13")?,
        w13s,
        w2q: DevBuf::from_host(stream, &b2, "shared w2")?,
        w2s: s2.map(|v| DevBuf::from_host(stream, &v, "shared w2 scales")).transpose()?,
    })
}

/// Checks and uploads the router (gate weight, bias, hash table).
pub(super) fn upload_router(stream: &Arc<CudaStream>, layer: &MoeLayer) -> Result<RouterDev> {
    let c = &layer.config;
    let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    let r = &layer.router;
    len_check(format!("layers.{}.ffn.gate.weight", layer.index), r.weight.len(), e * h)?;
    if let Some(b) = &r.bias {
        len_check(format!("layers.{}.ffn.gate.bias", layer.index), b.len(), e)?;
    }
    let mut vocab = 0;
    if let Some(t) = &r.tid2eid {
        let name = format!("layers.{}.ffn.gate.tid2eid", layer.index);
        if t.len() % k != 0 {
            return Err(MegaError::tensor(name, format!("has {} entries, not a multiple of k={k}", t.len())));
        }
        if let Some((i, v)) = t.iter().enumerate().find(|(_, &v)| v < 0 || v as usize >= e) {
            return Err(MegaError::tensor(name, format!("entry {i} = {v} is outside 0..{e}")));
        }
        vocab = t.len() / k;
    }
    Ok(RouterDev {
        weight: DevBuf::from_host(stream, &r.weight, "gate.weight")?,
        bias: r.bias.as_ref().map(|b| DevBuf::from_host(stream, b, "gate.bias")).transpose()?,
        tid2eid: r.tid2eid.as_ref().map(|t| DevBuf::from_host(stream, t, "gate.tid2eid")).transpose()?,
        vocab,
    })
}

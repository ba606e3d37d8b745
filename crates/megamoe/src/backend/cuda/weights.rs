//! [`LayerWeights`]: one MoE layer resident on one device, in the layouts of the GEMM families
//! chosen for it (routed experts and shared expert may use different ones). Built from a
//! validated [`MoeLayer`] and independent of it afterwards: the caller may drop the host copy,
//! so a whole-model load holds about one layer on the host at a time.

use super::buffer::{err, DevBuf};
use super::device::CudaDevice;
use super::gemm::{self, GemmWeights};
use super::knobs::W4a8Fp8;
use crate::backend::gpu_layout::K_STEP;
use crate::checkpoint::{MoeLayer, ProjData};
use crate::config::MoeConfig;
use crate::error::{MegaError, Result};
use crate::formats::WeightFormat;
use crate::forward::Mode;
use std::ops::Range;
use std::sync::Arc;

/// The router on the device (layouts as in `kernels/router.cu`).
pub(crate) struct RouterDev {
    /// Gate weight `[E, H]` f32.
    pub weight: DevBuf,
    /// Score-correction bias `[E]` f32.
    pub bias: Option<DevBuf>,
    /// Hash routing table `[vocab, K]` i32 (hash layers).
    pub tid2eid: Option<DevBuf>,
    /// Rows of `tid2eid` (0 without one).
    pub vocab: usize,
    /// Forwards of at least this many tokens take `moe_router_logits_tiled` (`usize::MAX`: none).
    pub tiled_from: usize,
}

/// One layer on one device.
pub struct LayerWeights {
    pub(crate) device: Arc<CudaDevice>,
    pub(crate) index: usize,
    pub(crate) config: MoeConfig,
    pub(crate) expert_range: Range<usize>,
    pub(crate) format: WeightFormat,
    pub(crate) router: RouterDev,
    pub(crate) experts: GemmWeights,
    pub(crate) shared: Option<GemmWeights>,
    /// The routed experts again in the FP8 W4A8 layout (MXFP4 on sm_90a), for W4A8 prefill.
    pub(crate) w4a8: Option<gemm::w4a8::W4a8Experts>,
    /// NVFP4 activation global scales of the L1 / L2 inputs `[E_local]` f32 (W4A4).
    pub(crate) in1: Option<DevBuf>,
    pub(crate) in2: Option<DevBuf>,
    /// Host copies of the input scales (trace dequantization).
    pub(crate) in1_host: Option<Vec<f32>>,
    pub(crate) in2_host: Option<Vec<f32>>,
    /// The modes this layer can run in, or why not (decided once, by the reference's rule).
    modes: Vec<(Mode, std::result::Result<(), String>)>,
}

/// The dynamic shared memory of the router's top-k kernel for `e` experts.
pub(crate) fn router_smem(e: usize) -> usize {
    2 * e * 4 + e
}

/// Checks what the CUDA kernels need beyond a valid layer: H and I multiples of [`K_STEP`],
/// 1 <= k <= 32, a router whose top-k fits shared memory.
/// What a layer will hold on the device, estimated from its shapes before anything is packed
/// (the packed layouts keep a checkpoint's bytes per weight: NVFP4 0.5625, MXFP4 0.53125, bf16 2,
/// rows padded to 128-row groups; the W4A8 copy of MXFP4 experts as much again; the shared expert
/// as bf16; the router as f32). An upper bound within about 1% of what the uploads allocate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DeviceBytes {
    /// Routed experts in the GEMM family's layout (with their per-group alphas).
    pub experts: usize,
    /// The FP8 W4A8 copy of MXFP4 experts (both GEMMs or the L2's; sm_90a), or 0.
    pub w4a8: usize,
    /// The shared expert (bf16).
    pub shared: usize,
    /// Router weight, bias and hash table.
    pub router: usize,
}

impl DeviceBytes {
    /// The estimate for `layer`, with the W4A8 copy of the GEMMs `w4a8` names (`None`: none).
    pub fn estimate(layer: &MoeLayer, w4a8: Option<W4a8Fp8>) -> DeviceBytes {
        let per_weight = WeightFormat::bytes_per_weight;
        let padded = crate::backend::gpu_layout::tc::padded_rows;
        // The packed matrices: L1 = W1 and W3 interleaved ([2I, H]), L2 = W2 ([H, I]), rows padded
        // to 128-row groups, plus per-group alphas (per-row ones for the W4A8 copy).
        let (e, (r1, c1), (r2, c2)) = (
            layer.w1.experts,
            (layer.w1.rows + layer.w3.rows, layer.w1.cols),
            (layer.w2.rows, layer.w2.cols),
        );
        let side = |rows: usize, cols: usize, bpw: f64, alpha_per_row: bool| {
            let alphas = if alpha_per_row { 4 * padded(rows) } else { 8 * (padded(rows) / 128) };
            e * ((padded(rows) * cols) as f64 * bpw).ceil() as usize + e * alphas
        };
        let bpw = per_weight(layer.w1.format());
        let experts = side(r1, c1, bpw, false) + side(r2, c2, bpw, false);
        let w8 = |rows: usize, cols: usize| side(rows, cols, 0.53125, true);
        let w4a8 = match w4a8 {
            Some(W4a8Fp8::Both) => w8(r1, c1) + w8(r2, c2),
            Some(W4a8Fp8::L2) => w8(r2, c2),
            Some(W4a8Fp8::Off) | None => 0,
        };
        let shared = layer
            .shared
            .as_ref()
            .map_or(0, |s| 2 * padded(s.w1.rows + s.w3.rows) * s.w1.cols + 2 * padded(s.w2.rows) * s.w2.cols);
        let r = &layer.router;
        let router = 4
            * (r.weight.len()
                + r.bias.as_ref().map_or(0, |b| b.len())
                + r.tid2eid.as_ref().map_or(0, |t| t.len()));
        DeviceBytes { experts, w4a8, shared, router }
    }

    /// The whole estimate.
    pub fn total(&self) -> usize {
        self.experts + self.w4a8 + self.shared + self.router
    }
}

/// Fewer bytes than `free` may leave the context: the allocator's granularity and the kernels'
/// modules need some. Keep this much of the free memory unclaimed by weights.
const DEVICE_RESERVE_BYTES: usize = 256 << 20;

/// Refuses layer `index` when its estimated bytes exceed the device's `free` memory (less a
/// reserve), with the sizes a user can act on.
pub(crate) fn check_device_fits(need: &DeviceBytes, free: usize, total: usize, index: usize) -> Result<()> {
    let mb = |b: usize| b as f64 / 1e6;
    if need.total() + DEVICE_RESERVE_BYTES <= free {
        return Ok(());
    }
    Err(MegaError::Input(format!(
        "layer {index} does not fit the GPU: it needs ~{:.0} MB of device memory (routed experts {:.0} MB{}, \
         shared expert {:.0} MB, router {:.0} MB) plus a {:.0} MB reserve, and {:.0} MB of {:.0} MB are free; \
         shard the experts over more GPUs (expert parallelism), or free device memory",
        mb(need.total()),
        mb(need.experts),
        if need.w4a8 > 0 { format!(", their W4A8 copy {:.0} MB (asked for by MEGAMOE_W4A8_FP8=1 or l2; unset, the layer holds one copy)", mb(need.w4a8)) } else { String::new() },
        mb(need.shared),
        mb(need.router),
        mb(DEVICE_RESERVE_BYTES),
        mb(free),
        mb(total),
    )))
}

fn check_supported(layer: &MoeLayer) -> Result<()> {
    let c = &layer.config;
    let (h, i, e, k) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
    if h % K_STEP != 0 || i % K_STEP != 0 {
        return Err(MegaError::Config(format!(
            "the CUDA backend needs H and I to be positive multiples of {K_STEP} (H={h}, I={i})"
        )));
    }
    if k > super::params::MAX_TOPK as usize {
        return Err(MegaError::Config(format!(
            "the CUDA backend needs k <= {} (k={k})",
            super::params::MAX_TOPK
        )));
    }
    if router_smem(e) > super::launch::DEFAULT_SMEM_LIMIT {
        return Err(MegaError::Config(format!(
            "router: E={e} needs {} bytes of shared memory (limit {})",
            router_smem(e),
            super::launch::DEFAULT_SMEM_LIMIT
        )));
    }
    if let Some(s) = &layer.shared {
        if s.w1.rows % K_STEP != 0 {
            return Err(MegaError::Config(format!(
                "shared expert: I_s={} must be a multiple of {K_STEP}",
                s.w1.rows
            )));
        }
    }
    Ok(())
}

impl LayerWeights {
    /// Validates `layer` ([`MoeLayer::validate_scale_bytes`], then what the kernels need) and uploads it in
    /// the layout of the first GEMM family that holds it exactly (`MEGAMOE_GEMM` prefers one).
    pub fn upload(device: &Arc<CudaDevice>, layer: &MoeLayer) -> Result<LayerWeights> {
        Self::upload_with(device, layer, None)
    }

    /// As [`Self::upload`], preferring the GEMM family named `family` (`tc`, `simt`; one that
    /// cannot hold the layer exactly falls back to the next, with a warning).
    pub fn upload_with(
        device: &Arc<CudaDevice>,
        layer: &MoeLayer,
        family: Option<&str>,
    ) -> Result<LayerWeights> {
        // The one O(weights) scan of a layer, where it enters the device (never per forward).
        layer.validate_scale_bytes()?;
        Self::upload_validated(device, layer, family)
    }

    /// [`Self::upload_with`] for a layer that [`MoeLayer::validate_scale_bytes`] already passed.
    pub(super) fn upload_validated(
        device: &Arc<CudaDevice>,
        layer: &MoeLayer,
        family: Option<&str>,
    ) -> Result<LayerWeights> {
        check_supported(layer)?;
        let c = &layer.config;
        // Refused before the first allocation when the layer cannot fit the free device memory.
        let w4a8_gemms = gemm::w4a8::fp8_gemms(device, layer);
        let (free, total) = device.memory_info()?;
        check_device_fits(&DeviceBytes::estimate(layer, w4a8_gemms.clone().ok()), free, total, layer.index)?;
        let t0 = std::time::Instant::now();
        let experts = gemm::choose_experts(device, layer, family)?.upload_experts(device, layer)?;
        let w4a8 = gemm::w4a8::upload(device, layer, &w4a8_gemms)?;
        let shared = match &layer.shared {
            Some(s) => {
                Some(gemm::choose_shared(device, s, family)?.upload_shared(device, s, c.hidden_size)?)
            }
            None => None,
        };
        let router = upload_router(device, layer)?;
        let (in1_host, in2_host) = match (&layer.w1.data, &layer.w2.data) {
            (ProjData::Nvfp4 { input_scale: a, .. }, ProjData::Nvfp4 { input_scale: b, .. }) => {
                (a.clone(), b.clone())
            }
            _ => (None, None),
        };
        let up = |v: &Option<Vec<f32>>, what: &str| v.as_ref().map(|v| device.upload(v, what)).transpose();
        let modes = Mode::ALL
            .into_iter()
            .map(|m| (m, crate::reference::check_mode(layer, m).map_err(|e| e.to_string())))
            .collect();
        let w = LayerWeights {
            device: device.clone(),
            index: layer.index,
            config: c.clone(),
            expert_range: layer.expert_range.clone(),
            format: layer.format(),
            router,
            in1: up(&in1_host, "input_scale w1")?,
            in2: up(&in2_host, "input_scale w2")?,
            in1_host,
            in2_host,
            experts,
            shared,
            w4a8,
            modes,
        };
        tracing::info!(
            layer = layer.index,
            experts = ?layer.expert_range,
            format = %layer.format(),
            family = w.experts.kernels.family(),
            shared_family = w.shared.as_ref().map(|s| s.kernels.family()),
            mb = w.device_bytes() as f64 / 1e6,
            ms = t0.elapsed().as_millis() as u64,
            "layer uploaded"
        );
        Ok(w)
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
    /// Layer index in the model.
    pub fn index(&self) -> usize {
        self.index
    }
    /// The model's MoE hyper-parameters.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }
    /// Global ids of the routed experts held.
    pub fn expert_range(&self) -> Range<usize> {
        self.expert_range.clone()
    }
    /// Routed experts held.
    pub fn local_experts(&self) -> usize {
        self.expert_range.len()
    }
    /// The routed experts' storage format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }
    /// Whether the layer routes by `tid2eid[input_ids]`.
    pub fn is_hash(&self) -> bool {
        self.router.tid2eid.is_some()
    }
    /// Rows of the hash table (0 on score-routed layers): token ids must be below it.
    pub fn vocab(&self) -> usize {
        self.router.vocab
    }
    /// The shared expert's intermediate size (0 without one).
    pub fn shared_inter(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.inter)
    }
    /// GEMM families of the routed and the shared expert (e.g. `("tc", Some("tc"))`).
    pub fn families(&self) -> (&'static str, Option<&'static str>) {
        (self.experts.kernels.family(), self.shared.as_ref().map(|s| s.kernels.family()))
    }
    /// Whether W4A8 prefill launches run the FP8 kernels — the L2 at least, the L1 too unless
    /// `MEGAMOE_W4A8_FP8=l2` (MXFP4 experts on sm_90a whose rows fit e4m3 exactly); otherwise W4A8
    /// runs on the bf16 tensor-core path.
    pub fn w4a8_on_fp8(&self) -> bool {
        self.w4a8.is_some()
    }
    /// Whether W4A8 prefill launches run their L1 on the FP8 kernels too (`MEGAMOE_W4A8_FP8=1`).
    pub fn w4a8_l1_on_fp8(&self) -> bool {
        self.w4a8.as_ref().is_some_and(|w| w.l1.is_some())
    }
    /// [`Self::families`] as a label: `tc`, or `tc/simt` when the shared expert's differs.
    pub fn family_label(&self) -> String {
        match self.families() {
            (f, Some(s)) if s != f => format!("{f}/{s}"),
            (f, _) => f.to_string(),
        }
    }
    /// Device bytes of the weights (router, experts, shared expert, scales).
    pub fn device_bytes(&self) -> usize {
        let opt = |b: &Option<DevBuf>| b.as_ref().map_or(0, DevBuf::bytes);
        self.router.weight.bytes()
            + opt(&self.router.bias)
            + opt(&self.router.tid2eid)
            + self.experts.bytes()
            + self.w4a8.as_ref().map_or(0, |w| w.bytes())
            + self.shared.as_ref().map_or(0, GemmWeights::bytes)
            + opt(&self.in1)
            + opt(&self.in2)
    }
    /// Checks that the layer can run in `mode` (W4A8: H, I multiples of 128; W4A4: NVFP4 with
    /// input scales), with the reference's own error.
    pub fn check_mode(&self, mode: Mode) -> Result<()> {
        match self.modes.iter().find(|(m, _)| *m == mode) {
            Some((_, Ok(()))) => Ok(()),
            Some((_, Err(why))) => Err(MegaError::Input(why.clone())),
            None => Err(err(format!("mode {mode} unknown"))),
        }
    }
}

impl Drop for LayerWeights {
    fn drop(&mut self) {
        // Kernels on any stream may still read these buffers.
        let _ = self.device.synchronize();
    }
}

/// Uploads the router (gate weight, bias, hash table); sizes were checked by `validate`.
fn upload_router(dev: &CudaDevice, layer: &MoeLayer) -> Result<RouterDev> {
    let r = &layer.router;
    let k = layer.config.num_experts_per_tok;
    Ok(RouterDev {
        weight: dev.upload(&r.weight, "gate.weight")?,
        bias: r.bias.as_ref().map(|b| dev.upload(b, "gate.bias")).transpose()?,
        tid2eid: r.tid2eid.as_ref().map(|t| dev.upload(t, "gate.tid2eid")).transpose()?,
        vocab: r.tid2eid.as_ref().map_or(0, |t| t.len() / k),
        tiled_from: super::knobs::router_tiled_from(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu_layout::{tc, w4a8 as w8};
    use crate::synthetic;

    /// The estimate bounds what the packers produce (and so what the uploads allocate) from above,
    /// within 2%, for every weight format, the W4A8 copy and the shared expert.
    #[test]
    fn device_bytes_estimate_bounds_the_packed_layers() {
        // I = 320: 640 L1 rows pad to 640, the shared expert's to its own groups; I = 384 (a
        // multiple of 128) for the W4A8 copy, whose K must be.
        for (format, inter) in
            WeightFormat::ALL.into_iter().map(|f| (f, 320)).chain([(WeightFormat::Mxfp4, 384)])
        {
            let cfg = crate::config::MoeConfig {
                hidden_size: 384,
                moe_intermediate_size: inter,
                n_routed_experts: 6,
                ..synthetic::tiny_config()
            };
            let layer = synthetic::random_layer(&cfg, format, 1, false, 5);
            let (l1, l2) = (tc::pack_l1(&layer.w1, &layer.w3).unwrap(), tc::pack_l2(&layer.w2).unwrap());
            let experts = l1.bytes.len() + l2.bytes.len() + 4 * (l1.alpha.len() + l2.alpha.len());
            let s = layer.shared.as_ref().unwrap();
            let bf = |p| tc::dense_as_bf16(p).unwrap();
            let (is, h) = (s.w1.rows, cfg.hidden_size);
            let shared = 2
                * (tc::pack_dense_l1(&bf(&s.w1), &bf(&s.w3), is, h).unwrap().len()
                    + tc::pack_dense_l2(&bf(&s.w2), h, is).unwrap().len())
                / 2;
            let w4a8 = (inter % 128 == 0).then(|| {
                let (a, b) = (w8::pack_l1(&layer.w1, &layer.w3).unwrap(), w8::pack_l2(&layer.w2).unwrap());
                a.bytes.len() + b.bytes.len() + 4 * (a.row_alpha.len() + b.row_alpha.len())
            });
            let est = DeviceBytes::estimate(&layer, w4a8.map(|_| W4a8Fp8::Both));
            let within = |got: usize, want: usize, what: &str| {
                assert!(
                    want <= got && got as f64 <= want as f64 * 1.02 + 64.0,
                    "{format} {what}: estimate {got}, packed {want}"
                );
            };
            within(est.experts, experts, "experts");
            within(est.shared, shared, "shared");
            if let Some(w) = w4a8 {
                within(est.w4a8, w, "w4a8");
                let l2 = w8::pack_l2(&layer.w2).unwrap();
                let l2_only = DeviceBytes::estimate(&layer, Some(W4a8Fp8::L2)).w4a8;
                within(l2_only, l2.bytes.len() + 4 * l2.row_alpha.len(), "w4a8 l2");
            }
            assert!(est.router >= 4 * layer.router.weight.len());
        }
    }

    #[test]
    fn a_layer_larger_than_free_memory_is_refused_with_the_sizes() {
        let need = DeviceBytes { experts: 30_000_000_000, w4a8: 0, shared: 132_000_000, router: 11_000_000 };
        assert!(check_device_fits(&need, 40_000_000_000, 140_000_000_000, 3).is_ok());
        let e = check_device_fits(&need, 20_000_000_000, 140_000_000_000, 3).unwrap_err().to_string();
        for want in [
            "layer 3 does not fit the GPU",
            "30143 MB",
            "routed experts 30000 MB",
            "20000 MB of 140000 MB are free",
        ] {
            assert!(e.contains(want), "{e}");
        }
        let w8 = DeviceBytes { w4a8: 1_000_000, ..need };
        let e = check_device_fits(&w8, 1_000_000, 2_000_000, 0).unwrap_err().to_string();
        assert!(e.contains("MEGAMOE_W4A8_FP8=1"), "{e}");
    }
}

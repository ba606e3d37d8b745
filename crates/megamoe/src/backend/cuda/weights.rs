//! [`LayerWeights`]: one MoE layer resident on one device, in the layouts of the GEMM families
//! chosen for it (routed experts and shared expert may use different ones). Built from a
//! validated [`MoeLayer`] and independent of it afterwards: the caller may drop the host copy,
//! so a whole-model load holds about one layer on the host at a time.

use super::buffer::{err, DevBuf};
use super::device::CudaDevice;
use super::gemm::{self, GemmWeights};
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
fn check_supported(layer: &MoeLayer) -> Result<()> {
    let c = &layer.config;
    let (h, i, e, k) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
    if h % K_STEP != 0 || i % K_STEP != 0 {
        return Err(MegaError::Config(format!(
            "the CUDA backend needs H and I to be positive multiples of {K_STEP} (H={h}, I={i})"
        )));
    }
    if k > 32 {
        return Err(MegaError::Config(format!("the CUDA backend needs k <= 32 (k={k})")));
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
        let t0 = std::time::Instant::now();
        let experts = gemm::choose_experts(device, layer, family)?.upload_experts(device, layer)?;
        let w4a8 = gemm::w4a8::upload(device, layer)?;
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
    /// Whether W4A8 prefill launches run the FP8 kernels (MXFP4 experts on sm_90a whose rows fit
    /// e4m3 exactly); otherwise W4A8 runs on the bf16 tensor-core path.
    pub fn w4a8_on_fp8(&self) -> bool {
        self.w4a8.is_some()
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
    })
}

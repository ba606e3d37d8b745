//! [`CudaModel`]: every MoE layer of a model on one device, loaded once, run through one
//! [`Workspace`] on one stream. Layers are uploaded one at a time from a caller's iterator (a
//! checkpoint's `load_layer` or a synthetic generator), so the host holds about one layer at a
//! time. [`CudaModel::enqueue_residual_norm`] is the residual stream between layers of a model run
//! (`h += y`, next input `bf16(h / rms(h))`).

use super::device::CudaDevice;
use super::launch::{LaunchCfg, StreamRef};
use super::params::ResidualNormParams;
use super::weights::LayerWeights;
use super::workspace::Workspace;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use std::sync::Arc;

/// A model's MoE layers on one device, with one workspace.
pub struct CudaModel {
    device: Arc<CudaDevice>,
    layers: Vec<LayerWeights>,
    workspace: Workspace,
}

impl CudaModel {
    /// Uploads every layer `layers` yields (each dropped on the host right after its upload) and
    /// allocates one workspace for forwards of up to `max_tokens` tokens through any of them.
    /// `family` prefers a GEMM family (see [`LayerWeights::upload_with`]); `progress` is called
    /// after each upload with the layer just uploaded.
    pub fn load(
        device: &Arc<CudaDevice>,
        layers: impl IntoIterator<Item = Result<MoeLayer>>,
        max_tokens: usize,
        family: Option<&str>,
        mut progress: impl FnMut(&LayerWeights),
    ) -> Result<CudaModel> {
        let mut up = Vec::new();
        for layer in layers {
            let layer = layer?;
            let w = LayerWeights::upload_with(device, &layer, family)?;
            drop(layer);
            progress(&w);
            up.push(w);
        }
        if up.is_empty() {
            return Err(MegaError::Input("a model needs at least one MoE layer".into()));
        }
        let workspace = Workspace::for_layers(&up.iter().collect::<Vec<_>>(), max_tokens)?;
        Ok(CudaModel { device: device.clone(), layers: up, workspace })
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
    /// The layers, in load order.
    pub fn layers(&self) -> &[LayerWeights] {
        &self.layers
    }
    /// The layer with model index `index`.
    pub fn layer(&self, index: usize) -> Option<&LayerWeights> {
        self.layers.iter().find(|l| l.index() == index)
    }
    /// The shared workspace.
    pub fn workspace(&self) -> &Workspace {
        &self.workspace
    }
    /// The shared workspace, to [`Workspace::prepare`] it for a mode.
    pub fn workspace_mut(&mut self) -> &mut Workspace {
        &mut self.workspace
    }
    /// Device bytes of all layers' weights.
    pub fn weights_bytes(&self) -> usize {
        self.layers.iter().map(LayerWeights::device_bytes).sum()
    }

    /// Enqueues `hs += y; x = bf16(hs / rms(hs))` over `[tokens, hidden]` (f32 `hs` and `y`, bf16
    /// `x`, device pointers).
    ///
    /// # Safety
    /// The three pointers must hold `tokens * hidden` elements each.
    pub unsafe fn enqueue_residual_norm(
        &self,
        hs: u64,
        y: u64,
        x: u64,
        tokens: usize,
        hidden: usize,
        stream: StreamRef,
    ) -> Result<()> {
        let p = ResidualNormParams { hs, y, x, t: tokens as i32, h: hidden as i32 };
        self.device.core.residual_norm.launch(stream, &LaunchCfg::grid((tokens as u32, 1, 1), 0), &p)
    }
}

//! Loading layers from a checkpoint directory (megamoe's loader: safetensors, ModelOpt NVFP4,
//! official MXFP4, BF16; DeepSeek and HF naming), whole or one expert-parallel rank's range.

use crate::errors::to_py;
use megamoe::checkpoint::{Checkpoint, LoadOptions, MoeLayer};
use megamoe::forward::Mode;
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

/// The layers `layers` (all MoE layers when `None`) of the checkpoint at `path`, with the experts
/// `experts` (global ids; all when `None`), checked for `mode` (W4A4 requires valid
/// `input_scale`s). Returns the layers and the loader's warnings.
pub fn load(
    path: &str,
    layers: Option<Vec<usize>>,
    experts: Option<(usize, usize)>,
    mode: Mode,
) -> PyResult<(Vec<MoeLayer>, Vec<String>)> {
    let ck = Checkpoint::open(path).map_err(to_py)?;
    let present = ck.moe_layers();
    let wanted = layers.unwrap_or_else(|| present.clone());
    if let Some(&l) = wanted.iter().find(|l| !present.contains(l)) {
        return Err(PyValueError::new_err(format!(
            "layer: {path} has no MoE layer {l} (MoE layers present: {present:?})"
        )));
    }
    let e = ck.config().n_routed_experts;
    let range = experts.map_or(0..e, |(a, b)| a..b);
    let opts = LoadOptions { progress: Some(false), ..LoadOptions::for_mode(mode) };
    let mut out = Vec::with_capacity(wanted.len());
    let mut warnings = Vec::new();
    for l in wanted {
        let loaded = ck.load_layer_experts_with(l, range.clone(), &opts).map_err(to_py)?;
        warnings.extend(loaded.warnings);
        out.push(loaded.layer);
    }
    Ok((out, warnings))
}

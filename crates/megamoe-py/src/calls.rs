//! The checked arguments of one call (forward, route, experts): every tensor checked against the
//! layer ([`LayerInfo`]) and the layer's device before any backend sees it, so the CPU and CUDA
//! paths raise the same errors for the same mistakes.

use crate::args::Dim;
use crate::capsule::Borrowed;
use crate::dlpack::{Device, Elem};
use megamoe::checkpoint::MoeLayer;
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;
use std::ops::Range;

/// What the binding knows of one loaded layer (independent of where it lives).
#[derive(Clone, Debug)]
pub struct LayerInfo {
    /// Layer index in the model.
    pub index: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// Routed experts of the model E.
    pub experts: usize,
    /// Experts per token k.
    pub top_k: usize,
    /// Global ids of the experts held.
    pub expert_range: Range<usize>,
    /// Whether the layer routes by `tid2eid[input_ids]`.
    pub hash: bool,
    /// Rows of `tid2eid` (0 without one).
    pub vocab: usize,
    /// Whether the layer has a shared expert.
    pub shared: bool,
    /// Expert weight format (`nvfp4`, `mxfp4`, `bf16`).
    pub format: String,
    /// W1's `input_scale` per held expert (NVFP4 checkpoints that have one): the global scale
    /// W4A4 quantizes each expert's input under.
    pub w1_input_scale: Option<Vec<f32>>,
}

impl LayerInfo {
    /// The description of `layer`.
    pub fn of(layer: &MoeLayer) -> LayerInfo {
        let c = &layer.config;
        LayerInfo {
            index: layer.index,
            hidden: c.hidden_size,
            inter: c.moe_intermediate_size,
            experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            expert_range: layer.expert_range.clone(),
            hash: layer.is_hash(),
            vocab: layer.router.tid2eid.as_ref().map_or(0, |t| t.len() / c.num_experts_per_tok.max(1)),
            shared: layer.shared.is_some(),
            format: format!("{:?}", layer.format()).to_lowercase(),
            w1_input_scale: match &layer.w1.data {
                megamoe::checkpoint::ProjData::Nvfp4 { input_scale, .. } => input_scale.clone(),
                _ => None,
            },
        }
    }
}

/// Dtypes of `x` on `device`: bf16, and on the CPU also float32 (rounded to bf16 once).
fn x_dtypes(device: Device) -> &'static [Elem] {
    match device {
        Device::Cpu => &[Elem::Bf16, Elem::F32],
        Device::Cuda(_) => &[Elem::Bf16],
    }
}

/// Dtypes of expert ids on `device`: int32 (the kernels' type), and on the CPU also int64.
fn topk_id_dtypes(device: Device) -> &'static [Elem] {
    match device {
        Device::Cpu => &[Elem::I32, Elem::I64],
        Device::Cuda(_) => &[Elem::I32],
    }
}

/// Dtypes of the output `y`.
const Y_DTYPES: &[Elem] = &[Elem::F32, Elem::Bf16];
/// Dtypes of token ids.
const TOKEN_ID_DTYPES: &[Elem] = &[Elem::I32, Elem::I64];

/// Checks `x` `[T, H]` and returns T.
fn check_x(info: &LayerInfo, device: Device, x: &Borrowed) -> PyResult<usize> {
    let t = x.rows(2, &format!("[T, H={}]", info.hidden))?;
    x.input(device, x_dtypes(device), &[Dim("T", t), Dim("H", info.hidden)])?;
    Ok(t)
}

/// Checks the token ids of a hash layer (required there, `[T]`); others ignore them.
fn check_input_ids<'a>(
    info: &LayerInfo,
    device: Device,
    t: usize,
    ids: Option<&'a Borrowed>,
) -> PyResult<Option<&'a Borrowed>> {
    if !info.hash {
        return Ok(None);
    }
    let ids = ids.ok_or_else(|| {
        PyValueError::new_err(format!(
            "input_ids: layer {} is hash-routed (tid2eid): input_ids [T={t}] are required",
            info.index
        ))
    })?;
    ids.input(device, TOKEN_ID_DTYPES, &[Dim("T", t)])?;
    Ok(Some(ids))
}

/// A checked whole forward: `y = routed(x) + shared(x)` with the layer's own router.
pub struct ForwardCall<'a> {
    /// Tokens T.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub tokens: usize,
    /// `[T, H]` bf16 (CPU: or f32).
    pub x: &'a Borrowed,
    /// `[T]` i32/i64 (hash layers).
    pub input_ids: Option<&'a Borrowed>,
    /// Output `[T, H]` f32 or bf16.
    pub y: &'a Borrowed,
    /// Optional output `[T, k]` i32 (CPU: or i64): the chosen experts.
    pub topk_ids: Option<&'a Borrowed>,
    /// Optional output `[T, k]` f32: the routing weights.
    pub topk_weights: Option<&'a Borrowed>,
}

impl<'a> ForwardCall<'a> {
    /// Checks every tensor against `info` on `device`.
    pub fn check(
        info: &LayerInfo,
        device: Device,
        x: &'a Borrowed,
        input_ids: Option<&'a Borrowed>,
        y: &'a Borrowed,
        topk_ids: Option<&'a Borrowed>,
        topk_weights: Option<&'a Borrowed>,
    ) -> PyResult<Self> {
        let t = check_x(info, device, x)?;
        let input_ids = check_input_ids(info, device, t, input_ids)?;
        let (th, tk) = ([Dim("T", t), Dim("H", info.hidden)], [Dim("T", t), Dim("k", info.top_k)]);
        y.output(device, Y_DTYPES, &th)?;
        if let Some(v) = topk_ids {
            v.output(device, topk_id_dtypes(device), &tk)?;
        }
        if let Some(v) = topk_weights {
            v.output(device, &[Elem::F32], &tk)?;
        }
        Ok(ForwardCall { tokens: t, x, input_ids, y, topk_ids, topk_weights })
    }
}

/// A checked router call.
pub struct RouteCall<'a> {
    /// Tokens T.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub tokens: usize,
    /// `[T, H]`.
    pub x: &'a Borrowed,
    /// `[T]` (hash layers).
    pub input_ids: Option<&'a Borrowed>,
    /// Output `[T, k]` i32 (CPU: or i64), global ids.
    pub topk_ids: &'a Borrowed,
    /// Output `[T, k]` f32.
    pub topk_weights: &'a Borrowed,
}

impl<'a> RouteCall<'a> {
    /// Checks every tensor against `info` on `device`.
    pub fn check(
        info: &LayerInfo,
        device: Device,
        x: &'a Borrowed,
        input_ids: Option<&'a Borrowed>,
        topk_ids: &'a Borrowed,
        topk_weights: &'a Borrowed,
    ) -> PyResult<Self> {
        let t = check_x(info, device, x)?;
        let input_ids = check_input_ids(info, device, t, input_ids)?;
        let tk = [Dim("T", t), Dim("k", info.top_k)];
        topk_ids.output(device, topk_id_dtypes(device), &tk)?;
        topk_weights.output(device, &[Elem::F32], &tk)?;
        Ok(RouteCall { tokens: t, x, input_ids, topk_ids, topk_weights })
    }
}

/// A checked experts call under the caller's routing (vLLM's convention).
pub struct ExpertsCall<'a> {
    /// Tokens T.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub tokens: usize,
    /// `[T, H]`.
    pub x: &'a Borrowed,
    /// `[T, k]` global ids, -1 = not here.
    pub topk_ids: &'a Borrowed,
    /// The dtype of `topk_ids`.
    pub topk_ids_elem: Elem,
    /// `[T, k]` f32.
    pub topk_weights: &'a Borrowed,
    /// Output `[T, H]` f32 or bf16: the routed sum of the experts held (no shared expert).
    pub y: &'a Borrowed,
}

impl<'a> ExpertsCall<'a> {
    /// Checks every tensor against `info` on `device`.
    pub fn check(
        info: &LayerInfo,
        device: Device,
        x: &'a Borrowed,
        topk_ids: &'a Borrowed,
        topk_weights: &'a Borrowed,
        y: &'a Borrowed,
    ) -> PyResult<Self> {
        let t = check_x(info, device, x)?;
        let tk = [Dim("T", t), Dim("k", info.top_k)];
        let topk_ids_elem = topk_ids.input(device, topk_id_dtypes(device), &tk)?;
        topk_weights.input(device, &[Elem::F32], &tk)?;
        y.output(device, Y_DTYPES, &[Dim("T", t), Dim("H", info.hidden)])?;
        Ok(ExpertsCall { tokens: t, x, topk_ids, topk_ids_elem, topk_weights, y })
    }
}

/// Checks a vLLM `expert_map` (`[E]` int32: global id -> local id, -1 for experts elsewhere)
/// against the experts a layer holds: megamoe plans global ids over its contiguous
/// `expert_range`, so the map must be exactly `e - start` inside the range and -1 outside.
pub fn check_expert_map(info: &LayerInfo, map: &[i32]) -> PyResult<()> {
    if map.len() != info.experts {
        return Err(PyValueError::new_err(format!(
            "expert_map: {} entries, expected [E={}]",
            map.len(),
            info.experts
        )));
    }
    let r = &info.expert_range;
    for (g, &m) in map.iter().enumerate() {
        let want = if r.contains(&g) { (g - r.start) as i32 } else { -1 };
        if m != want {
            return Err(PyValueError::new_err(format!(
                "expert_map[{g}] = {m}, expected {want}: layer {} holds the experts {}..{} (global ids) and \
                 maps expert g to g - {} there, -1 elsewhere",
                info.index, r.start, r.end, r.start
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(range: Range<usize>) -> LayerInfo {
        LayerInfo {
            index: 3,
            hidden: 8,
            inter: 4,
            experts: 6,
            top_k: 2,
            expert_range: range,
            hash: false,
            vocab: 0,
            shared: true,
            format: "nvfp4".into(),
            w1_input_scale: None,
        }
    }

    #[test]
    fn expert_map_of_a_range() {
        assert!(check_expert_map(&info(2..4), &[-1, -1, 0, 1, -1, -1]).is_ok());
        assert!(check_expert_map(&info(0..6), &[0, 1, 2, 3, 4, 5]).is_ok());
    }

    #[test]
    fn expert_map_mismatch_names_the_entry() {
        pyo3::Python::initialize();
        let e = check_expert_map(&info(2..4), &[-1, -1, 1, 0, -1, -1]).unwrap_err();
        assert!(e.to_string().contains("expert_map[2] = 1, expected 0"), "{e}");
        let e = check_expert_map(&info(2..4), &[0; 5]).unwrap_err();
        assert!(e.to_string().contains("5 entries, expected [E=6]"), "{e}");
    }
}

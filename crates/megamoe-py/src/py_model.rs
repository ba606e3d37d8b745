//! The native classes: [`NativeModel`] (every loaded layer on one device, one workspace) and
//! [`NativeLayer`] (one of its layers). Every call takes all of its tensors, outputs included,
//! as DLPack-capable objects and a raw stream handle; the Python package (`megamoe/__init__.py`)
//! allocates outputs and picks the caller's stream.

use crate::backend::{parse_device, parse_mode, Backend, Loaded};
use crate::calls::{check_expert_map, ExpertsCall, ForwardCall, LayerInfo, RouteCall};
use crate::capsule::{borrow, Borrowed};
use crate::dlpack::{Device, Elem};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

/// Borrows an optional argument.
fn opt(obj: Option<&Bound<'_, PyAny>>, name: &str, stream: u64) -> PyResult<Option<Borrowed>> {
    obj.filter(|o| !o.is_none()).map(|o| borrow(o, name, stream)).transpose()
}

/// Layers loaded on one device with one workspace (see `megamoe.Model`).
#[pyclass(module = "megamoe._megamoe", frozen)]
pub struct NativeModel {
    loaded: Arc<Loaded>,
    warnings: Vec<String>,
}

/// One layer of a [`NativeModel`] (see `megamoe.MoELayer`).
#[pyclass(module = "megamoe._megamoe", frozen)]
pub struct NativeLayer {
    loaded: Arc<Loaded>,
    pos: usize,
}

#[pymethods]
impl NativeModel {
    /// Loads layers `layers` (all MoE layers when None) of the checkpoint directory `path`, with
    /// the routed experts `experts` (a (start, end) range of global ids; all when None), onto
    /// `device` ("cpu", "cuda", "cuda:N") for forwards in `mode` of up to `max_tokens` tokens.
    #[staticmethod]
    #[pyo3(signature = (path, layers=None, device="cuda:0", mode="w4a16", max_tokens=4096, experts=None))]
    fn load(
        py: Python<'_>,
        path: &str,
        layers: Option<Vec<usize>>,
        device: &str,
        mode: &str,
        max_tokens: usize,
        experts: Option<(usize, usize)>,
    ) -> PyResult<NativeModel> {
        let (device, mode) = (parse_device(device)?, parse_mode(mode)?);
        let path = path.to_string();
        let (loaded, warnings) = py.detach(move || -> PyResult<_> {
            let (layers, warnings) = crate::checkpoint::load(&path, layers, experts, mode)?;
            Ok((Loaded::new(layers, device, mode, max_tokens)?, warnings))
        })?;
        Ok(NativeModel { loaded: Arc::new(loaded), warnings })
    }

    /// A one-layer model from host tensors (ModelOpt NVFP4 or MXFP4 experts; names in the docs of
    /// `megamoe.MoELayer.from_tensors`); `config` is a config.json as text.
    #[staticmethod]
    #[pyo3(signature = (config, layer, tensors, device="cuda:0", mode="w4a16", max_tokens=4096, expert_start=0, scale_layout="row_major"))]
    #[allow(clippy::too_many_arguments)]
    fn from_tensors(
        py: Python<'_>,
        config: &str,
        layer: usize,
        tensors: &Bound<'_, PyDict>,
        device: &str,
        mode: &str,
        max_tokens: usize,
        expert_start: usize,
        scale_layout: &str,
    ) -> PyResult<NativeModel> {
        let (device, mode) = (parse_device(device)?, parse_mode(mode)?);
        let layout = crate::tensors::parse_layout(scale_layout)?;
        let l = crate::tensors::layer_from_tensors(config, layer, tensors, expert_start, layout)?;
        let loaded = py.detach(move || Loaded::new(vec![l], device, mode, max_tokens))?;
        Ok(NativeModel { loaded: Arc::new(loaded), warnings: Vec::new() })
    }

    /// Model indices of the loaded layers, in load order.
    #[getter]
    fn layers(&self) -> Vec<usize> {
        self.loaded.infos.iter().map(|i| i.index).collect()
    }

    /// The layer with model index `index`.
    fn layer(&self, index: usize) -> PyResult<NativeLayer> {
        Ok(NativeLayer { loaded: self.loaded.clone(), pos: self.loaded.position(index)? })
    }

    /// "cpu" or "cuda:N".
    #[getter]
    fn device(&self) -> String {
        self.loaded.device.to_string()
    }

    /// The execution mode.
    #[getter]
    fn mode(&self) -> &'static str {
        self.loaded.mode.name()
    }

    /// The loader's warnings (non-fatal findings in the checkpoint).
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.warnings.clone()
    }

    /// Waits for the device, then returns and clears the status bits set by forwards since the
    /// last call (1: a token id outside tid2eid, 2: an expert id outside -1..E). 0 on the CPU,
    /// which raises on such ids instead.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn take_status(&self, py: Python<'_>) -> PyResult<u32> {
        match &self.loaded.backend {
            Backend::Cpu(_) => Ok(0),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => py.detach(|| c.take_status()),
        }
    }

    /// (weights, workspace) device bytes; (0, 0) on the CPU.
    fn device_bytes(&self) -> (usize, usize) {
        match &self.loaded.backend {
            Backend::Cpu(_) => (0, 0),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.device_bytes(),
        }
    }
}

impl NativeLayer {
    fn info(&self) -> &LayerInfo {
        &self.loaded.infos[self.pos]
    }
    fn dev(&self) -> Device {
        self.loaded.device
    }
}

#[pymethods]
impl NativeLayer {
    /// `y = routed(x) + shared(x)` with the layer's router; `topk_ids` / `topk_weights`, when
    /// given, receive the routing. Enqueued on `stream` on CUDA.
    #[pyo3(signature = (x, input_ids, y, topk_ids=None, topk_weights=None, stream=0))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        input_ids: Option<&Bound<'_, PyAny>>,
        y: &Bound<'_, PyAny>,
        topk_ids: Option<&Bound<'_, PyAny>>,
        topk_weights: Option<&Bound<'_, PyAny>>,
        stream: u64,
    ) -> PyResult<()> {
        let (xb, yb) = (borrow(x, "x", stream)?, borrow(y, "y", stream)?);
        let ib = opt(input_ids, "input_ids", stream)?;
        let (ti, tw) = (opt(topk_ids, "topk_ids", stream)?, opt(topk_weights, "topk_weights", stream)?);
        let c = ForwardCall::check(self.info(), self.dev(), &xb, ib.as_ref(), &yb, ti.as_ref(), tw.as_ref())?;
        match &self.loaded.backend {
            Backend::Cpu(b) => b.forward(py, self.pos, &c, self.loaded.mode),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.forward(self.pos, &c, self.loaded.mode, stream),
        }
    }

    /// The router only: `topk_ids` `[T, k]` (global ids) and `topk_weights` `[T, k]`.
    #[pyo3(signature = (x, input_ids, topk_ids, topk_weights, stream=0))]
    fn route(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        input_ids: Option<&Bound<'_, PyAny>>,
        topk_ids: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        let xb = borrow(x, "x", stream)?;
        let ib = opt(input_ids, "input_ids", stream)?;
        let (ti, tw) = (borrow(topk_ids, "topk_ids", stream)?, borrow(topk_weights, "topk_weights", stream)?);
        let c = RouteCall::check(self.info(), self.dev(), &xb, ib.as_ref(), &ti, &tw)?;
        match &self.loaded.backend {
            Backend::Cpu(b) => b.route(py, self.pos, &c),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.route(self.pos, &c, stream),
        }
    }

    /// The routed experts under the caller's routing (vLLM's FusedMoE convention: global ids, -1
    /// for experts elsewhere; an `expert_map` must agree with the layer's expert range); no
    /// shared expert. `y` `[T, H]` receives the sum.
    #[pyo3(signature = (x, topk_ids, topk_weights, y, expert_map=None, stream=0))]
    #[allow(clippy::too_many_arguments)]
    fn experts(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        topk_ids: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        y: &Bound<'_, PyAny>,
        expert_map: Option<&Bound<'_, PyAny>>,
        stream: u64,
    ) -> PyResult<()> {
        let xb = borrow(x, "x", stream)?;
        let (ti, tw) = (borrow(topk_ids, "topk_ids", stream)?, borrow(topk_weights, "topk_weights", stream)?);
        let yb = borrow(y, "y", stream)?;
        let c = ExpertsCall::check(self.info(), self.dev(), &xb, &ti, &tw, &yb)?;
        if let Some(m) = opt(expert_map, "expert_map", stream)? {
            self.check_map(&m, stream)?;
        }
        match &self.loaded.backend {
            Backend::Cpu(b) => b.experts(py, self.pos, &c, self.loaded.mode),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.experts(self.pos, &c, self.loaded.mode, stream),
        }
    }

    /// Model index of the layer.
    #[getter]
    fn index(&self) -> usize {
        self.info().index
    }
    /// Hidden size H.
    #[getter]
    fn hidden_size(&self) -> usize {
        self.info().hidden
    }
    /// Expert intermediate size I.
    #[getter]
    fn intermediate_size(&self) -> usize {
        self.info().inter
    }
    /// Routed experts of the model E.
    #[getter]
    fn num_experts(&self) -> usize {
        self.info().experts
    }
    /// Experts per token k.
    #[getter]
    fn top_k(&self) -> usize {
        self.info().top_k
    }
    /// (start, end) global ids of the experts held.
    #[getter]
    fn expert_range(&self) -> (usize, usize) {
        (self.info().expert_range.start, self.info().expert_range.end)
    }
    /// Whether the layer routes by `tid2eid[input_ids]`.
    #[getter]
    fn is_hash(&self) -> bool {
        self.info().hash
    }
    /// Rows of tid2eid (0 on score-routed layers).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.info().vocab
    }
    /// Whether the layer has a shared expert.
    #[getter]
    fn has_shared_expert(&self) -> bool {
        self.info().shared
    }
    /// Expert weight format ("nvfp4", "mxfp4", "bf16").
    #[getter]
    fn format(&self) -> String {
        self.info().format.clone()
    }
    /// "cpu" or "cuda:N".
    #[getter]
    fn device(&self) -> String {
        self.loaded.device.to_string()
    }
    /// The execution mode.
    #[getter]
    fn mode(&self) -> &'static str {
        self.loaded.mode.name()
    }
    /// W1's `input_scale` per held expert (None without one): the global scale the W4A4 experts
    /// quantize their input under.
    #[getter]
    fn input_scales(&self) -> Option<Vec<f32>> {
        self.info().w1_input_scale.clone()
    }
}

impl NativeLayer {
    /// Checks `expert_map` `[E]` int32 against the layer's expert range (device maps: once).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn check_map(&self, m: &Borrowed, stream: u64) -> PyResult<()> {
        use crate::args::Dim;
        let info = self.info();
        m.input(self.dev(), &[Elem::I32], &[Dim("E", info.experts)])?;
        match &self.loaded.backend {
            // SAFETY: checked host, contiguous, int32.
            Backend::Cpu(_) => check_expert_map(info, unsafe { m.host_slice::<i32>()? }),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => {
                b.check_expert_map(m.desc.ptr, info.experts, stream, |v| check_expert_map(info, v))
            }
        }
    }
}

//! Where a loaded model lives ([`Backend`]: host layers for the reference, or a CUDA model with one
//! workspace), and [`Loaded`]: the backend with the layers' descriptions, the device and the mode.

use crate::calls::LayerInfo;
use crate::cpu::CpuBackend;
use crate::dlpack::Device;
use crate::errors::to_py;
use megamoe::checkpoint::MoeLayer;
use megamoe::forward::Mode;
use megamoe::reference;
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;
use std::sync::Arc;

/// The engine of a loaded model.
pub enum Backend {
    /// The exact reference on the host.
    Cpu(CpuBackend),
    /// megamoe's CUDA runtime.
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaBackend>),
}

/// A loaded model: every layer on one device, run in one mode.
pub struct Loaded {
    /// The engine.
    pub backend: Backend,
    /// The layers, in load order.
    pub infos: Vec<LayerInfo>,
    /// The device.
    pub device: Device,
    /// The execution mode.
    pub mode: Mode,
}

/// Parses `cpu`, `cuda` (device 0) or `cuda:N`.
pub fn parse_device(s: &str) -> PyResult<Device> {
    let t = s.trim().to_ascii_lowercase();
    if t == "cpu" {
        return Ok(Device::Cpu);
    }
    if t == "cuda" {
        return Ok(Device::Cuda(0));
    }
    if let Some(n) = t.strip_prefix("cuda:") {
        if let Ok(i) = n.parse::<usize>() {
            return Ok(Device::Cuda(i));
        }
    }
    Err(PyValueError::new_err(format!("device: {s:?}, expected \"cpu\", \"cuda\" or \"cuda:N\"")))
}

/// Parses a mode name (`w4a16`, `w4a8`, `w4a4`).
pub fn parse_mode(s: &str) -> PyResult<Mode> {
    s.parse::<Mode>().map_err(|e| PyValueError::new_err(format!("mode: {e}")))
}

impl Loaded {
    /// Puts `layers` on `device` for forwards in `mode` of up to `max_tokens` tokens (the CUDA
    /// workspace's size; the CPU has no limit). Every layer is validated first.
    pub fn new(layers: Vec<MoeLayer>, device: Device, mode: Mode, max_tokens: usize) -> PyResult<Loaded> {
        if layers.is_empty() {
            return Err(PyValueError::new_err("layers: a model needs at least one MoE layer"));
        }
        let infos: Vec<LayerInfo> = layers.iter().map(LayerInfo::of).collect();
        for l in &layers {
            reference::check_mode(l, mode).map_err(to_py)?;
        }
        let backend = match device {
            Device::Cpu => {
                for l in &layers {
                    l.validate_scale_bytes().map_err(to_py)?;
                }
                Backend::Cpu(CpuBackend { layers: layers.into_iter().map(Arc::new).collect() })
            }
            Device::Cuda(ordinal) => cuda_backend(ordinal, layers, max_tokens, mode)?,
        };
        Ok(Loaded { backend, infos, device, mode })
    }

    /// The load-order position of the layer with model index `index`.
    pub fn position(&self, index: usize) -> PyResult<usize> {
        self.infos.iter().position(|i| i.index == index).ok_or_else(|| {
            let held: Vec<usize> = self.infos.iter().map(|i| i.index).collect();
            PyValueError::new_err(format!("layer: {index} is not loaded (layers held: {held:?})"))
        })
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(ordinal: usize, layers: Vec<MoeLayer>, max_tokens: usize, mode: Mode) -> PyResult<Backend> {
    Ok(Backend::Cuda(Box::new(crate::cuda::CudaBackend::load(ordinal, layers, max_tokens, mode)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_: usize, _: Vec<MoeLayer>, _: usize, _: Mode) -> PyResult<Backend> {
    Err(pyo3::exceptions::PyRuntimeError::new_err(
        "device: this build of megamoe has no CUDA support (built without the `cuda` feature)",
    ))
}

//! Taking a tensor from Python through DLPack: `__dlpack__` (with the consumer's stream, asking
//! for a versioned capsule first) or a capsule the caller made. The capsule is borrowed: it stays
//! alive in the returned [`Borrowed`] for as long as the call uses the memory, and its own
//! destructor (the producer's) frees the tensor afterwards; nothing is copied.

use crate::dlpack::{DLManagedTensor, DLManagedTensorVersioned, DescError, TensorDesc, MAJOR_VERSION};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

const VERSIONED: &std::ffi::CStr = c"dltensor_versioned";
const LEGACY: &std::ffi::CStr = c"dltensor";

/// `DLDeviceType` of CUDA device memory and of managed memory, which take a stream.
const DL_CUDA: i64 = 2;
const DL_CUDA_MANAGED: i64 = 13;

/// A tensor borrowed from a Python object for the duration of one call.
pub struct Borrowed {
    /// The argument's name (for error messages).
    pub name: String,
    /// What the tensor is.
    pub desc: TensorDesc,
    /// The capsule whose tensor `desc` describes; keeps the memory alive.
    _capsule: Py<PyAny>,
}

/// The stream handle to give a producer's `__dlpack__(stream=...)` for work enqueued on `stream`
/// (a raw `cudaStream_t`): DLPack reserves 0, so the legacy default stream is 1.
fn producer_stream(stream: u64) -> i64 {
    if stream == 0 {
        1
    } else {
        stream as i64
    }
}

/// Borrows `obj` (any object with `__dlpack__`, or a DLPack capsule) as argument `name`. For a
/// CUDA tensor the producer is asked to make it ready on `stream`, the stream the work will be
/// enqueued on (no host synchronisation: producers order streams with events).
pub fn borrow(obj: &Bound<'_, PyAny>, name: &str, stream: u64) -> PyResult<Borrowed> {
    let capsule = if obj.is_instance_of::<PyCapsule>() {
        obj.clone()
    } else if obj.hasattr("__dlpack__")? {
        export(obj, name, stream)?
    } else {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected a DLPack-capable array (torch, numpy, cupy, jax, ...), got {}",
            obj.get_type().name()?
        )));
    };
    let desc = read_capsule(&capsule, name)?;
    Ok(Borrowed { name: name.to_string(), desc, _capsule: capsule.unbind() })
}

/// Calls `obj.__dlpack__`, with `stream` for CUDA tensors and `max_version=(1, 0)` when the
/// producer understands it (DLPack >= 1.0), else the legacy call.
fn export<'py>(obj: &Bound<'py, PyAny>, name: &str, stream: u64) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let dev_type: Option<i64> = if obj.hasattr("__dlpack_device__")? {
        let d = obj.call_method0("__dlpack_device__")?;
        Some(d.get_item(0)?.extract()?)
    } else {
        None
    };
    let kwargs = PyDict::new(py);
    if matches!(dev_type, Some(DL_CUDA) | Some(DL_CUDA_MANAGED)) {
        kwargs.set_item("stream", producer_stream(stream))?;
    }
    let versioned = kwargs.copy()?;
    versioned.set_item("max_version", PyTuple::new(py, [MAJOR_VERSION, 0])?)?;
    match obj.call_method("__dlpack__", (), Some(&versioned)) {
        Ok(c) => Ok(c),
        // Producers older than DLPack 1.0 reject `max_version`.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method("__dlpack__", (), Some(&kwargs)),
        Err(e) => Err(PyValueError::new_err(format!("{name}: __dlpack__ failed: {e}"))),
    }
}

/// Reads the tensor of a `dltensor_versioned` or `dltensor` capsule.
fn read_capsule(capsule: &Bound<'_, PyAny>, name: &str) -> PyResult<TensorDesc> {
    let raw = capsule.as_ptr();
    // SAFETY: `raw` is a live object; the capsule API checks the type and the name.
    let desc = unsafe {
        if pyo3::ffi::PyCapsule_IsValid(raw, VERSIONED.as_ptr()) == 1 {
            let m =
                pyo3::ffi::PyCapsule_GetPointer(raw, VERSIONED.as_ptr()) as *const DLManagedTensorVersioned;
            if m.is_null() {
                return Err(PyValueError::new_err(format!("{name}: empty DLPack capsule")));
            }
            if (*m).version.major != MAJOR_VERSION {
                return Err(PyValueError::new_err(format!(
                    "{name}: DLPack version {}.{} is not supported (expected {MAJOR_VERSION}.x)",
                    (*m).version.major,
                    (*m).version.minor
                )));
            }
            TensorDesc::read(&(*m).dl_tensor, (*m).flags)
        } else if pyo3::ffi::PyCapsule_IsValid(raw, LEGACY.as_ptr()) == 1 {
            let m = pyo3::ffi::PyCapsule_GetPointer(raw, LEGACY.as_ptr()) as *const DLManagedTensor;
            if m.is_null() {
                return Err(PyValueError::new_err(format!("{name}: empty DLPack capsule")));
            }
            TensorDesc::read(&(*m).dl_tensor, 0)
        } else {
            pyo3::ffi::PyErr_Clear();
            return Err(PyTypeError::new_err(format!(
                "{name}: not a live DLPack capsule (expected the name 'dltensor' or 'dltensor_versioned'; \
                 a capsule can be consumed only once)"
            )));
        }
    };
    desc.map_err(|e| match e {
        DescError::Malformed(m) => PyValueError::new_err(format!("{name}: malformed DLPack tensor: {m}")),
        DescError::UnsupportedDevice(d) => PyValueError::new_err(format!(
            "{name}: DLPack device type {d} is not supported (expected CPU or CUDA memory)"
        )),
    })
}

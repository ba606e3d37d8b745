//! Checks of one tensor argument against what a call expects: dtype (`TypeError`), shape, device,
//! contiguity and writability (`ValueError`), each message naming the argument, what it got and
//! what was expected. Host slices of checked CPU arguments for the reference path.

use crate::capsule::Borrowed;
use crate::dlpack::{dtype_name, Device, Elem};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::PyResult;

/// One expected dimension: its symbol in messages (`T`, `H`, `k`) and its size.
#[derive(Clone, Copy, Debug)]
pub struct Dim(pub &'static str, pub usize);

/// Formats dims as `[T=3, H=256]`.
fn dims_text(dims: &[Dim]) -> String {
    let inner: Vec<String> = dims.iter().map(|d| format!("{}={}", d.0, d.1)).collect();
    format!("[{}]", inner.join(", "))
}

impl Borrowed {
    /// Checks the dtype against `allowed` and returns it.
    pub fn dtype(&self, allowed: &[Elem]) -> PyResult<Elem> {
        match self.desc.elem {
            Some(e) if allowed.contains(&e) => Ok(e),
            _ => Err(PyTypeError::new_err(format!(
                "{}: dtype {}, expected {}",
                self.name,
                dtype_name(self.desc.raw_dtype),
                allowed.iter().map(|e| e.name()).collect::<Vec<_>>().join(" or ")
            ))),
        }
    }

    /// Checks the shape against `dims` exactly.
    pub fn shape(&self, dims: &[Dim]) -> PyResult<()> {
        let ok =
            self.desc.shape.len() == dims.len() && self.desc.shape.iter().zip(dims).all(|(&s, d)| s == d.1);
        if ok {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{}: shape {:?}, expected {}",
                self.name,
                self.desc.shape,
                dims_text(dims)
            )))
        }
    }

    /// The size of the first dimension of a tensor of rank `rank` (T from `x`), checking the rank.
    pub fn rows(&self, rank: usize, what: &str) -> PyResult<usize> {
        if self.desc.shape.len() != rank {
            return Err(PyValueError::new_err(format!(
                "{}: shape {:?}, expected {what}",
                self.name, self.desc.shape
            )));
        }
        Ok(self.desc.shape[0])
    }

    /// Checks that the tensor is on `device`.
    pub fn device(&self, device: Device) -> PyResult<()> {
        if self.desc.device == device {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{}: on {}, expected {device} (the layer's device)",
                self.name, self.desc.device
            )))
        }
    }

    /// Checks that the tensor is compact row-major.
    pub fn contiguous(&self) -> PyResult<()> {
        if self.desc.contiguous {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{}: not contiguous (row-major, compact); pass a contiguous tensor (e.g. .contiguous())",
                self.name
            )))
        }
    }

    /// Checks that the tensor may be written.
    pub fn writable(&self) -> PyResult<()> {
        if self.desc.read_only {
            Err(PyValueError::new_err(format!("{}: the producer marked this tensor read-only", self.name)))
        } else {
            Ok(())
        }
    }

    /// All the checks of an input: device, contiguity, dtype, shape. Returns the dtype.
    pub fn input(&self, device: Device, allowed: &[Elem], dims: &[Dim]) -> PyResult<Elem> {
        let e = self.dtype(allowed)?;
        self.shape(dims)?;
        self.device(device)?;
        self.contiguous()?;
        Ok(e)
    }

    /// All the checks of an output: as [`Self::input`], and writable.
    pub fn output(&self, device: Device, allowed: &[Elem], dims: &[Dim]) -> PyResult<Elem> {
        let e = self.input(device, allowed, dims)?;
        self.writable()?;
        Ok(e)
    }

    /// The host elements of a checked CPU tensor of element type `T`.
    ///
    /// # Safety
    /// The tensor must have been checked (CPU, contiguous, dtype of `T`'s size) and stay alive and
    /// unaliased by writers for the returned lifetime (the caller holds `self`).
    pub unsafe fn host_slice<T>(&self) -> PyResult<&[T]> {
        let n = self.desc.numel();
        if n == 0 {
            return Ok(&[]);
        }
        self.aligned::<T>()?;
        Ok(std::slice::from_raw_parts(self.desc.ptr as *const T, n))
    }

    /// As [`Self::host_slice`], mutable (a checked, writable output).
    ///
    /// # Safety
    /// As [`Self::host_slice`], and no other reference to the memory may exist meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn host_slice_mut<T>(&self) -> PyResult<&mut [T]> {
        let n = self.desc.numel();
        if n == 0 {
            return Ok(&mut []);
        }
        self.aligned::<T>()?;
        Ok(std::slice::from_raw_parts_mut(self.desc.ptr as *mut T, n))
    }

    fn aligned<T>(&self) -> PyResult<()> {
        if self.desc.ptr.is_multiple_of(std::mem::align_of::<T>() as u64) && self.desc.ptr != 0 {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{}: address 0x{:x} is not aligned to its element size",
                self.name, self.desc.ptr
            )))
        }
    }
}

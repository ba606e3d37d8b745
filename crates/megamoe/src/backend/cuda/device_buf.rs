//! Raw device allocations and the small helpers every other file of the backend shares: backend
//! errors, [`DevBuf`] (an allocation addressed by raw pointer) and kernel-argument pointers.

use crate::error::{MegaError, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::ffi::c_void;
use std::sync::Arc;

/// A [`MegaError::Backend`] from the CUDA backend.
pub(super) fn err(msg: impl std::fmt::Display) -> MegaError {
    MegaError::backend("cuda", msg)
}

/// Maps a driver error to a backend error that says what was being done.
pub(super) fn derr(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> MegaError + '_ {
    move |e| err(format!("{what}: {e}"))
}

/// One device allocation, addressed by raw pointer (kernels take `CUdeviceptr`s).
pub(super) struct DevBuf {
    _slice: CudaSlice<u8>,
    pub(super) ptr: u64,
    pub(super) bytes: usize,
}

impl DevBuf {
    /// `bytes` zeroed bytes (at least 16, so that an empty tensor still has a valid pointer).
    pub(super) fn zeros(stream: &Arc<CudaStream>, bytes: usize, what: &str) -> Result<Self> {
        let slice = stream.alloc_zeros::<u8>(bytes.max(16)).map_err(derr(what))?;
        let ptr = slice.device_ptr(stream).0;
        Ok(DevBuf { _slice: slice, ptr, bytes })
    }

    /// A copy of `data` on the device (synchronous: the host slice may be dropped afterwards).
    pub(super) fn from_host<T: bytemuck::Pod>(
        stream: &Arc<CudaStream>,
        data: &[T],
        what: &str,
    ) -> Result<Self> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let b = Self::zeros(stream, bytes.len(), what)?;
        if !bytes.is_empty() {
            // SAFETY: the destination holds at least `bytes.len()` bytes.
            unsafe { cudarc::driver::result::memcpy_htod_async(b.ptr, bytes, stream.cu_stream()) }
                .map_err(derr(what))?;
            stream.synchronize().map_err(derr(what))?;
        }
        Ok(b)
    }
}

/// The pointer of an optional buffer, or null (kernels treat null as "absent").
pub(super) fn opt_ptr(b: &Option<DevBuf>) -> u64 {
    b.as_ref().map_or(0, |b| b.ptr)
}

/// A lazily allocated buffer (`buffers.rs`), or an error if the forward did not allocate it first.
pub(super) fn lazy<'a>(b: &'a Option<DevBuf>, what: &str) -> Result<&'a DevBuf> {
    b.as_ref().ok_or_else(|| err(format!("internal: the {what} buffer was not allocated before the forward")))
}

/// A kernel argument: the address of a live local whose type matches the kernel's parameter.
pub(super) fn p<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

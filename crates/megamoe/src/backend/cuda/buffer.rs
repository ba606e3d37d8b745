//! Raw device allocations and the small helpers every other file of the backend shares: backend
//! errors and [`DevBuf`] (an allocation addressed by raw pointer, as the parameter structs take).

use crate::error::{MegaError, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// A [`MegaError::Backend`] from the CUDA backend.
pub(crate) fn err(msg: impl std::fmt::Display) -> MegaError {
    MegaError::backend("cuda", msg)
}

/// Maps a driver error to a backend error that says what was being done.
pub(crate) fn derr(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> MegaError + '_ {
    move |e| err(format!("{what}: {e}"))
}

/// One device allocation, addressed by raw pointer (kernels take `CUdeviceptr`s).
pub struct DevBuf {
    _slice: CudaSlice<u8>,
    ptr: u64,
    bytes: usize,
}

impl DevBuf {
    /// `bytes` zeroed bytes (at least 16, so that an empty tensor still has a valid pointer).
    pub(crate) fn zeros(stream: &Arc<CudaStream>, bytes: usize, what: &str) -> Result<Self> {
        let slice = stream
            .alloc_zeros::<u8>(bytes.max(16))
            .map_err(|e| err(format!("allocating {what} ({bytes} bytes): {e}")))?;
        let ptr = slice.device_ptr(stream).0;
        Ok(DevBuf { _slice: slice, ptr, bytes })
    }

    /// A copy of `data` on the device (synchronous: the host slice may be dropped afterwards).
    pub(crate) fn from_host<T: bytemuck::Pod>(
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

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `data` into the buffer at byte `offset` (synchronous).
    pub fn write<T: bytemuck::Pod>(&self, stream: &Arc<CudaStream>, offset: usize, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if offset.checked_add(bytes.len()).is_none_or(|end| end > self.bytes) {
            return Err(err(format!(
                "write of {} bytes at {offset} past a {}-byte buffer",
                bytes.len(),
                self.bytes
            )));
        }
        if !bytes.is_empty() {
            // SAFETY: the range was checked against the allocation.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(self.ptr + offset as u64, bytes, stream.cu_stream())
            }
            .map_err(derr("copying to the device"))?;
        }
        stream.synchronize().map_err(derr("copying to the device"))
    }

    /// Reads `n` values of `T` from byte `offset` (synchronous).
    pub fn read<T: bytemuck::Pod + Default>(
        &self,
        stream: &Arc<CudaStream>,
        offset: usize,
        n: usize,
    ) -> Result<Vec<T>> {
        let len = n * std::mem::size_of::<T>();
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(err(format!("read of {len} bytes at {offset} past a {}-byte buffer", self.bytes)));
        }
        let mut v = vec![T::default(); n];
        if n > 0 {
            // SAFETY: the range was checked against the allocation.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut v,
                    self.ptr + offset as u64,
                    stream.cu_stream(),
                )
            }
            .map_err(derr("copying from the device"))?;
        }
        stream.synchronize().map_err(derr("copying from the device"))?;
        Ok(v)
    }
}

/// The pointer of an optional buffer, or null (kernels treat null as "absent").
pub(crate) fn opt_ptr(b: &Option<DevBuf>) -> u64 {
    b.as_ref().map_or(0, |b| b.ptr)
}

/// A lazily allocated buffer (`workspace.rs`), or an error if the forward did not allocate it first.
pub(crate) fn lazy<'a>(b: &'a Option<DevBuf>, what: &str) -> Result<&'a DevBuf> {
    b.as_ref().ok_or_else(|| err(format!("internal: the {what} buffer was not allocated before the forward")))
}

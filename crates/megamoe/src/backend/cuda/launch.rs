//! Typed kernel launch: a [`Kernel<P>`] is one loaded entry point whose only argument is the
//! parameter struct `P` (from [`super::params`]), launched through `cuLaunchKernelEx` with the
//! block size the kernel was built for, dynamic shared memory above 48 KB (opted in once at load),
//! thread-block clusters and programmatic dependent launch when a launch asks for them. A
//! struct passed by value is also where a kernel's TMA descriptors (`CUtensorMap`, 64-byte
//! aligned, `__grid_constant__`) travel.

use super::buffer::{derr, err};
use crate::error::Result;
use cudarc::driver::{sys, CudaFunction, CudaModule};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

/// The shared memory every kernel may use without opting in.
pub const DEFAULT_SMEM_LIMIT: usize = 48 * 1024;

/// A stream to enqueue on: the caller's (e.g. PyTorch's current stream) or one of ours. Copyable
/// and untied to any wrapper, so servers can pass raw `cudaStream_t`s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamRef(pub(crate) sys::CUstream);

impl StreamRef {
    /// Wraps a raw CUDA stream handle.
    ///
    /// # Safety
    /// `stream` must be a live stream of the device's primary context (or null, the legacy
    /// default stream) for as long as work is enqueued on it.
    pub unsafe fn from_raw(stream: sys::CUstream) -> Self {
        StreamRef(stream)
    }
    /// The raw handle.
    pub fn raw(self) -> sys::CUstream {
        self.0
    }
}

// SAFETY: a CUstream handle may be used from any thread of the process.
unsafe impl Send for StreamRef {}
// SAFETY: as above; the handle itself is immutable.
unsafe impl Sync for StreamRef {}

/// Records `event` on `stream` (a fork or join point of a forward; captured into graphs).
pub(crate) fn record(event: &cudarc::driver::CudaEvent, stream: StreamRef) -> Result<()> {
    // SAFETY: both handles are live for the duration of the call.
    unsafe { cudarc::driver::result::event::record(event.cu_event(), stream.0) }
        .map_err(derr("cuEventRecord"))
}

/// Makes `stream` wait for the work recorded in `event`.
pub(crate) fn wait(stream: StreamRef, event: &cudarc::driver::CudaEvent) -> Result<()> {
    // SAFETY: both handles are live for the duration of the call.
    unsafe {
        cudarc::driver::result::stream::wait_event(
            stream.0,
            event.cu_event(),
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(derr("cuStreamWaitEvent"))
}

/// The element type of a TMA tensor map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TmaElem {
    /// bf16 (2 bytes).
    Bf16,
    /// Raw bytes (e4m3).
    U8,
    /// f32.
    F32,
}

impl TmaElem {
    fn bytes(self) -> usize {
        match self {
            TmaElem::Bf16 => 2,
            TmaElem::U8 => 1,
            TmaElem::F32 => 4,
        }
    }
}

/// The TMA tensor map of a row-major bf16 matrix `[rows, cols]` at `ptr`, read in boxes of
/// `box_rows` rows x 64 columns (128 bytes) with the 128-byte swizzle that `wgmma`'s K-major
/// shared-memory descriptors expect; rows past `rows` read as zeros.
pub(crate) fn tma_2d_bf16(
    ptr: u64,
    rows: usize,
    cols: usize,
    box_rows: usize,
) -> Result<super::params::TmaDesc> {
    tma_2d(ptr, TmaElem::Bf16, rows, cols, cols, (64, box_rows), true)
}

/// The TMA tensor map of a row-major `[rows, cols]` matrix of `elem` at `ptr` with a row pitch of
/// `pitch` elements, read in boxes of `boxes = (columns, rows)`; `swizzle128`: the 128-byte
/// swizzle of `wgmma`'s K-major tiles (the box must then be 128 bytes wide). Out-of-range
/// elements read as zeros.
pub(crate) fn tma_2d(
    ptr: u64,
    elem: TmaElem,
    rows: usize,
    cols: usize,
    pitch: usize,
    boxes: (usize, usize),
    swizzle128: bool,
) -> Result<super::params::TmaDesc> {
    let eb = elem.bytes();
    let (bc, br) = boxes;
    let ok = ptr.is_multiple_of(16)
        && (pitch * eb).is_multiple_of(16)
        && pitch >= cols
        && rows > 0
        && cols > 0
        && (1..=256).contains(&br)
        && (1..=256).contains(&bc)
        && (bc * eb).is_multiple_of(16)
        && (!swizzle128 || bc * eb == 128);
    if !ok {
        return Err(err(format!(
            "tensor map of a [{rows}, {cols}] {elem:?} matrix (pitch {pitch}) at 0x{ptr:x}, box {bc} x {br}: needs a \
             16-byte aligned address and pitch, boxes of 1..=256 with 16-byte rows (128 bytes when swizzled)"
        )));
    }
    let dims = [cols as u64, rows as u64];
    let strides = [(pitch * eb) as u64];
    let what = || format!("[{rows}, {cols}] {elem:?}, box {bc} x {br}");
    encode_tiled(elem, ptr, &dims, &strides, &[bc as u32, br as u32], swizzle128, what)
}

/// The TMA tensor map of packed weight matrices read a chunk of `box_groups` consecutive 128-row
/// groups at a time (the wgmma producer's one copy per chunk): raw bytes at `ptr` as
/// `[matrices][groups][chunks][group_bytes]` (`gpu_layout::tc`: a group's blocks of one 64-k chunk
/// are `group_bytes` contiguous bytes, chunks after each other, groups after all their chunks),
/// mapped as 5 dimensions {256, group_bytes / 256, chunks, groups, matrices} with boxes of {256,
/// group_bytes / 256, 1, box_groups, 1}: one box lands as `box_groups` whole group chunks after
/// each other; groups past the matrix's last read as zeros (and count in the box's bytes).
pub(crate) fn tma_weight_groups(
    ptr: u64,
    group_bytes: usize,
    chunks: usize,
    groups: usize,
    matrices: usize,
    box_groups: usize,
) -> Result<super::params::TmaDesc> {
    const ROW: usize = 256;
    let ok = ptr.is_multiple_of(16)
        && group_bytes.is_multiple_of(ROW)
        && (1..=256).contains(&(group_bytes / ROW))
        && chunks > 0
        && groups > 0
        && matrices > 0
        && (1..=256).contains(&box_groups);
    if !ok {
        return Err(err(format!(
            "weight-group tensor map at 0x{ptr:x} ({matrices} matrices x {groups} groups x {chunks} chunks of \
             {group_bytes} bytes, {box_groups} groups a box): needs a 16-byte aligned address, groups of a \
             multiple of {ROW} bytes (at most 256 rows of {ROW}) and 1..=256 groups a box"
        )));
    }
    let dims = [ROW as u64, (group_bytes / ROW) as u64, chunks as u64, groups as u64, matrices as u64];
    let gb = group_bytes as u64;
    let strides = [ROW as u64, gb, chunks as u64 * gb, (groups * chunks) as u64 * gb];
    let boxes = [ROW as u32, (group_bytes / ROW) as u32, 1, box_groups as u32, 1];
    let what = || format!("{matrices} x {groups} x {chunks} x {group_bytes} B, {box_groups} groups a box");
    encode_tiled(TmaElem::U8, ptr, &dims, &strides, &boxes, false, what)
}

/// `cuTensorMapEncodeTiled` of a rank-`dims.len()` map (strides of dimensions 1.. in bytes), no
/// interleave, 256-byte L2 promotion, zeros out of range; `swizzle128` the 128-byte swizzle.
fn encode_tiled(
    elem: TmaElem,
    ptr: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    swizzle128: bool,
    what: impl Fn() -> String,
) -> Result<super::params::TmaDesc> {
    use sys::{
        CUtensorMapDataType as Dt, CUtensorMapFloatOOBfill as Oob, CUtensorMapInterleave as Il,
        CUtensorMapL2promotion as L2, CUtensorMapSwizzle as Sw,
    };
    assert!(
        (1..=5).contains(&dims.len()) && strides.len() + 1 == dims.len() && boxes.len() == dims.len(),
        "internal: a tensor map's ranks"
    );
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let step = [1u32; 5];
    let dt = match elem {
        TmaElem::Bf16 => Dt::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        TmaElem::U8 => Dt::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        TmaElem::F32 => Dt::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    };
    let sw = if swizzle128 { Sw::CU_TENSOR_MAP_SWIZZLE_128B } else { Sw::CU_TENSOR_MAP_SWIZZLE_NONE };
    // SAFETY: dims, boxes and step hold `rank` values, strides `rank - 1` (asserted above); encoding
    // only writes `map`.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dt,
            dims.len() as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            step.as_ptr(),
            Il::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sw,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            Oob::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| err(format!("cuTensorMapEncodeTiled ({}): {e}", what())))?;
    Ok(super::params::TmaDesc(map.opaque))
}

/// Grid, shared memory and launch attributes of one launch.
#[derive(Clone, Copy, Debug, Default)]
pub struct LaunchCfg {
    /// Grid `(x, y, z)`.
    pub grid: (u32, u32, u32),
    /// Dynamic shared memory (bytes); must not exceed what the kernel was loaded with.
    pub smem: u32,
    /// Thread-block cluster dimensions (sm_90+), if any.
    pub cluster: Option<(u32, u32, u32)>,
    /// Allow programmatic dependent launch (the kernel may start before its predecessor ends and
    /// must `griddepcontrol.wait` before reading its outputs).
    pub pdl: bool,
    /// A cooperative launch: every CTA of the grid resident at once (the kernel has grid barriers;
    /// the launch fails rather than starting a grid that cannot all be resident).
    pub cooperative: bool,
}

impl LaunchCfg {
    /// A plain launch of `grid` with `smem` bytes of dynamic shared memory.
    pub fn grid(grid: (u32, u32, u32), smem: usize) -> Self {
        LaunchCfg { grid, smem: smem as u32, ..Default::default() }
    }
}

/// One kernel entry point taking parameter struct `P`.
pub struct Kernel<P> {
    func: CudaFunction,
    name: String,
    threads: u32,
    max_smem: usize,
    _p: PhantomData<fn(P)>,
}

impl<P> std::fmt::Debug for Kernel<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel").field("name", &self.name).field("threads", &self.threads).finish()
    }
}

impl<P: Copy> Kernel<P> {
    /// Loads entry point `name` of `module`, to be launched with `threads` threads per CTA and up
    /// to `max_smem` bytes of dynamic shared memory (opted in here whenever it is nonzero: the 48 KB
    /// default bounds static + dynamic together, so a kernel with static shared memory needs the
    /// opt-in even at or below 48 KB of dynamic — without it the slice kernel's four-CTA build, 48 KB
    /// + 7.75 KB static, could not launch and its cluster-occupancy query answered 0).
    pub fn load(module: &Arc<CudaModule>, name: &str, threads: u32, max_smem: usize) -> Result<Self> {
        let func = module.load_function(name).map_err(derr(&format!("kernel {name}")))?;
        if max_smem > 0 {
            // SAFETY: a valid function handle and a documented attribute.
            unsafe {
                cudarc::driver::result::function::set_function_attribute(
                    func.cu_function(),
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    max_smem as i32,
                )
            }
            .map_err(|e| {
                err(format!("kernel {name}: opting in to {max_smem} bytes of shared memory: {e}"))
            })?;
        }
        Ok(Kernel { func, name: name.to_string(), threads, max_smem, _p: PhantomData })
    }

    /// The entry point's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many CTAs of this kernel one SM holds at once with `smem` bytes of dynamic shared memory.
    pub fn ctas_per_sm(&self, smem: usize) -> Result<usize> {
        // SAFETY: a valid function handle; the block size is the one the kernel is launched with.
        let n = unsafe {
            cudarc::driver::result::occupancy::max_active_block_per_multiprocessor(
                self.func.cu_function(),
                self.threads as i32,
                smem,
            )
        }
        .map_err(|e| err(format!("kernel {}: occupancy query: {e}", self.name)))?;
        Ok(n.max(0) as usize)
    }

    /// How many clusters of `cluster` CTAs (x) of this kernel the GPU runs at once with `smem`
    /// bytes of dynamic shared memory each.
    pub fn max_active_clusters(&self, cluster: u32, smem: usize) -> Result<usize> {
        let cfg = LaunchCfg { cluster: Some((cluster, 1, 1)), ..LaunchCfg::grid((cluster, 1, 1), smem) };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: a valid function handle; the config lives for the call.
        unsafe {
            self.with_config(StreamRef(std::ptr::null_mut()), &cfg, |config| {
                sys::cuOccupancyMaxActiveClusters(&mut n, self.func.cu_function(), config).result()
            })
        }
        .map_err(|e| err(format!("kernel {}: cluster occupancy query: {e}", self.name)))?;
        Ok(n.max(0) as usize)
    }

    /// Calls `f` with the driver's launch config of `cfg` on `stream` (grid, this kernel's block,
    /// shared memory, and the cluster / programmatic / cooperative attributes it asks for).
    ///
    /// # Safety
    /// `f` must not keep the config past its return (it points at a local attribute array).
    unsafe fn with_config<R>(
        &self,
        stream: StreamRef,
        cfg: &LaunchCfg,
        f: impl FnOnce(&sys::CUlaunchConfig) -> R,
    ) -> R {
        let mut attrs: [sys::CUlaunchAttribute; 3] = std::mem::zeroed();
        let mut n = 0;
        if let Some((x, y, z)) = cfg.cluster {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = x;
            attrs[n].value.clusterDim.y = y;
            attrs[n].value.clusterDim.z = z;
            n += 1;
        }
        if cfg.pdl {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cfg.cooperative {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attrs[n].value.cooperative = 1;
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid.0,
            gridDimY: cfg.grid.1,
            gridDimZ: cfg.grid.2,
            blockDimX: self.threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: cfg.smem,
            hStream: stream.0,
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        f(&config)
    }

    /// Enqueues one launch on `stream`.
    ///
    /// # Safety
    /// Every device pointer in `params` must cover the extent the kernel reads or writes for this
    /// grid, and stay valid until the launch completes.
    pub unsafe fn launch(&self, stream: StreamRef, cfg: &LaunchCfg, params: &P) -> Result<()> {
        if cfg.smem as usize > self.max_smem.max(DEFAULT_SMEM_LIMIT) {
            return Err(err(format!(
                "kernel {}: {} bytes of shared memory requested, loaded for {}",
                self.name, cfg.smem, self.max_smem
            )));
        }
        if cfg.grid.0 == 0 || cfg.grid.1 == 0 || cfg.grid.2 == 0 {
            return Ok(());
        }
        let mut args = [params as *const P as *mut c_void];
        self.with_config(stream, cfg, |config| {
            sys::cuLaunchKernelEx(config, self.func.cu_function(), args.as_mut_ptr(), std::ptr::null_mut())
        })
        .result()
        .map_err(|e| err(format!("launching {} (grid {:?}, {} B smem): {e}", self.name, cfg.grid, cfg.smem)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes a weight-group map cannot take are refused before the driver is asked (so this runs
    /// without a GPU), naming what was expected.
    #[test]
    fn weight_group_maps_refuse_shapes_tma_cannot_take() {
        let bad = [
            (0x1008, 4608, 112, 48, 48, 3),      // address not 16-byte aligned
            (0x1000, 4600, 112, 48, 48, 3),      // a group's chunk not whole 256-byte rows
            (0x1000, 256 * 257, 112, 48, 48, 3), // more than 256 rows of 256 bytes
            (0x1000, 4608, 112, 48, 48, 0),      // no group a box
            (0x1000, 4608, 112, 48, 48, 257),    // more than a box dimension holds
            (0x1000, 4608, 0, 48, 48, 3),        // no chunks
            (0x1000, 4608, 112, 48, 0, 3),       // no matrices
        ];
        for (ptr, gb, ch, g, m, b) in bad {
            let e = tma_weight_groups(ptr, gb, ch, g, m, b).unwrap_err().to_string();
            assert!(e.contains("weight-group tensor map") && e.contains("16-byte aligned"), "{e}");
        }
    }
}

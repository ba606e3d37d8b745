//! The NCCL transport: one rank per process (one GPU each), the all-to-all as grouped
//! `ncclSend` / `ncclRecv` on a stream of the rank's GPU.
//!
//! **Library.** NCCL is loaded at run time (like the driver and NVRTC), so the crate builds and
//! runs without it: `MEGAMOE_NCCL_LIB` (a path), else `libnccl.so.2`, else `libnccl.so`. cudarc
//! 0.19's own `nccl` module is not used: its loader looks only for `libnccl.so` and
//! `libnccl.so.<CUDA major>` (not the `libnccl.so.2` that NCCL's packages and pip's
//! `nvidia-nccl-cu*` ship) and panics when none loads; binding the ten functions used here through
//! `libloading` gives an error instead. NVLink SHARP / multicast is kept off: `NCCL_NVLS_ENABLE=0`
//! is set before the communicator is created unless the caller set it.
//!
//! **Bootstrap.** A communicator needs the world size, the rank and one [`NcclId`] made by one
//! rank and given to all: [`NcclId::new`] + [`NcclId::to_hex`] / [`NcclId::from_hex`] for a
//! server's own launcher, or [`NcclId::publish`] / [`NcclId::wait_for`] through a file (what
//! `megamoe launch` does: rank 0 writes it atomically, the others wait for it; on several hosts
//! the file lies on a shared filesystem, or the hex travels through the host launcher's own
//! channel).
//!
//! **Failure.** No call waits unboundedly: communicator creation runs on a helper thread and is
//! abandoned after the timeout; an exchange polls its stream and `ncclCommGetAsyncError` until a
//! deadline, then calls `ncclCommAbort` (so peers blocked in the same collective fail too) and
//! returns an error naming the rank. A peer process that dies makes the survivors' NCCL report an
//! error (or time out), never hang.
//!
//! **Data path.** [`Transport::exchange`] takes host buffers: staged into device buffers, sent and
//! received on the device, copied back (the host-slice path of [`super::EpRank`]; a device-resident
//! dispatch would hand the device buffers to the same grouped send/recv directly).

use super::transport::{check_args, Transport};
use crate::backend::cuda::ep::{DeviceExchange, Lane};
use crate::backend::cuda::{CudaDevice, DevBuf, StreamRef};
use crate::error::{MegaError, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

type NcclResult = c_int;
type Comm = *mut c_void;
const NCCL_SUCCESS: NcclResult = 0;
const NCCL_IN_PROGRESS: NcclResult = 7;
const NCCL_UINT8: c_int = 1;

/// NCCL's `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawId {
    internal: [c_char; 128],
}

struct Api {
    _lib: libloading::Library,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut RawId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, RawId, c_int) -> NcclResult,
    comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult,
}

fn err(msg: impl std::fmt::Display) -> MegaError {
    MegaError::backend("nccl", msg)
}

fn load() -> std::result::Result<Api, String> {
    let mut names: Vec<String> = Vec::new();
    if let Ok(p) = std::env::var("MEGAMOE_NCCL_LIB") {
        names.push(p);
    }
    names.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    let mut tried = Vec::new();
    for name in &names {
        // SAFETY: loading NCCL runs its (well-behaved) initialisers only.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib).map_err(|e| format!("{name}: {e}")),
            Err(e) => tried.push(format!("{name} ({e})")),
        }
    }
    Err(format!(
        "NCCL could not be loaded (tried {}); set MEGAMOE_NCCL_LIB to libnccl.so.2's path or add its directory \
         to LD_LIBRARY_PATH (pip's nvidia-nccl-cu13 puts it in site-packages/nvidia/nccl/lib)",
        tried.join(", ")
    ))
}

fn bind(lib: libloading::Library) -> std::result::Result<Api, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol has the C signature of NCCL's header (nccl.h, 2.x), which the
            // field's type spells out.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("missing {}: {e}", $name))?
        };
    }
    Ok(Api {
        get_version: sym!("ncclGetVersion"),
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_abort: sym!("ncclCommAbort"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        get_error_string: sym!("ncclGetErrorString"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        _lib: lib,
    })
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(err)
}

impl Api {
    fn check(&self, r: NcclResult, what: &str) -> Result<()> {
        if r == NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let msg = unsafe { CStr::from_ptr((self.get_error_string)(r)) }.to_string_lossy().into_owned();
        Err(err(format!("{what}: {msg} (ncclResult {r})")))
    }
}

/// The NCCL version of the loaded library (e.g. 22703 for 2.27.3).
pub fn version() -> Result<i32> {
    let a = api()?;
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer.
    a.check(unsafe { (a.get_version)(&mut v) }, "ncclGetVersion")?;
    Ok(v)
}

/// A communicator's unique id (made once, by one rank, and given to every rank).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}...)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id from `ncclGetUniqueId` (needs the NCCL library, not a GPU).
    pub fn new() -> Result<Self> {
        let a = api()?;
        let mut raw = RawId { internal: [0; 128] };
        // SAFETY: `raw` is a valid out-pointer of the id's size.
        a.check(unsafe { (a.get_unique_id)(&mut raw) }, "ncclGetUniqueId")?;
        Ok(NcclId(raw.internal.map(|c| c as u8)))
    }

    /// 256 hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`Self::to_hex`]'s form.
    pub fn from_hex(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.len() != 256 || !s.is_ascii() {
            return Err(MegaError::Input(format!(
                "an NCCL id is 256 hex digits, got {} characters",
                s.len()
            )));
        }
        let mut id = [0u8; 128];
        for (i, b) in id.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| {
                MegaError::Input(format!("an NCCL id has a non-hex digit near position {}", 2 * i))
            })?;
        }
        Ok(NcclId(id))
    }

    /// Writes the id to `path` atomically (a temporary file renamed into place).
    pub fn publish(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, self.to_hex()).map_err(|e| MegaError::file(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| MegaError::file(path, e))
    }

    /// Waits up to `timeout` for [`Self::publish`] to create `path`, then reads it.
    pub fn wait_for(path: &Path, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(s) = std::fs::read_to_string(path) {
                return Self::from_hex(&s).map_err(|e| MegaError::file(path, e));
            }
            if Instant::now() >= deadline {
                return Err(MegaError::file(
                    path,
                    format!(
                        "the NCCL id did not appear within {:.0} s (did rank 0 start?)",
                        timeout.as_secs_f64()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One rank of an NCCL group (see the module docs).
pub struct NcclTransport {
    comm: Comm,
    rank: usize,
    world: usize,
    device: Arc<CudaDevice>,
    stream: Arc<cudarc::driver::CudaStream>,
    sendbuf: Option<DevBuf>,
    recvbuf: Option<DevBuf>,
    timeout: Duration,
    aborted: bool,
}

// SAFETY: the communicator is used by one thread at a time (`&mut self`); NCCL communicators may
// move between threads.
unsafe impl Send for NcclTransport {}

impl NcclTransport {
    /// Joins the group `id` as `rank` of `world` on CUDA device `ordinal`. Creation is a
    /// collective: it returns when every rank has joined, or fails after `timeout`.
    pub fn new(rank: usize, world: usize, id: NcclId, ordinal: usize, timeout: Duration) -> Result<Self> {
        if rank >= world {
            return Err(MegaError::Input(format!("rank {rank} is outside a world of {world} ranks")));
        }
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            // Before NCCL reads its environment (at the first communicator); see the module docs.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let a = api()?;
        let device = CudaDevice::open(ordinal)?;
        let stream = device.new_stream()?;
        let (tx, rx) = std::sync::mpsc::channel();
        let dev = device.clone();
        std::thread::spawn(move || {
            let res = dev.bind().and_then(|_| {
                let mut comm: Comm = std::ptr::null_mut();
                let raw = RawId { internal: id.0.map(|b| b as c_char) };
                // SAFETY: `comm` is a valid out-pointer; rank < world (checked).
                a.check(
                    unsafe { (a.comm_init_rank)(&mut comm, world as c_int, raw, rank as c_int) },
                    "ncclCommInitRank",
                )
                .map(|_| comm as usize)
            });
            let _ = tx.send(res);
        });
        let comm = match rx.recv_timeout(timeout) {
            Ok(r) => r? as Comm,
            Err(_) => {
                return Err(err(format!(
                    "rank {rank}: ncclCommInitRank did not complete within {:.0} s (a rank missing, or a \
                     different id / world size across ranks?)",
                    timeout.as_secs_f64()
                )))
            }
        };
        tracing::info!(rank, world, ordinal, "NCCL communicator ready");
        Ok(NcclTransport {
            comm,
            rank,
            world,
            device,
            stream,
            sendbuf: None,
            recvbuf: None,
            timeout,
            aborted: false,
        })
    }

    fn ensure(slot: &mut Option<DevBuf>, device: &CudaDevice, bytes: usize, what: &str) -> Result<u64> {
        if slot.as_ref().is_none_or(|b| b.bytes() < bytes) {
            *slot = None;
            *slot = Some(device.alloc(bytes.next_power_of_two().max(1 << 16), what)?);
        }
        Ok(slot.as_ref().expect("just set").ptr())
    }

    /// Posts one `ncclSend` (`send`) or `ncclRecv` of `bytes` bytes at device address `ptr` with
    /// peer `peer` on stream `s`, inside an open group.
    ///
    /// # Safety
    /// `[ptr, ptr + bytes)` must be device memory of this rank's GPU that stays valid (and, for a
    /// receive, unused) until the stream passes the group; `s` a stream of that GPU.
    unsafe fn post(
        &self,
        a: &Api,
        send: bool,
        ptr: u64,
        bytes: usize,
        peer: usize,
        s: *mut c_void,
    ) -> Result<()> {
        let (r, what) = if send {
            ((a.send)(ptr as *const c_void, bytes, NCCL_UINT8, peer as c_int, self.comm, s), "ncclSend")
        } else {
            ((a.recv)(ptr as *mut c_void, bytes, NCCL_UINT8, peer as c_int, self.comm, s), "ncclRecv")
        };
        a.check(r, what)
    }

    /// Waits for the transport's own stream (the host-buffer path), as [`Self::wait_stream`].
    fn wait(&mut self, what: &str) -> Result<()> {
        self.wait_stream(StreamRef(self.stream.cu_stream()), what)
    }

    /// Waits for `stream` (where device rounds were enqueued) while watching NCCL's async error
    /// state, until the transport's timeout: a peer that died or stopped exchanging is an error
    /// naming this rank, never a hang. Aborts the communicator on failure.
    pub fn wait_stream(&mut self, stream: StreamRef, what: &str) -> Result<()> {
        let r = self.poll(stream, what);
        if let Err(e) = &r {
            self.abort(&e.to_string());
        }
        r
    }

    fn poll(&mut self, stream: StreamRef, what: &str) -> Result<()> {
        let a = api()?;
        let deadline = Instant::now() + self.timeout;
        loop {
            // SAFETY: the caller's stream is alive for the call.
            let q = unsafe { cudarc::driver::sys::cuStreamQuery(stream.raw()) };
            match q {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    return Err(err(format!("rank {}: {what}: the stream failed ({other:?})", self.rank)))
                }
            }
            let mut st = NCCL_SUCCESS;
            // SAFETY: `comm` is a live communicator, `st` a valid out-pointer.
            a.check(unsafe { (a.comm_get_async_error)(self.comm, &mut st) }, "ncclCommGetAsyncError")?;
            if st != NCCL_SUCCESS && st != NCCL_IN_PROGRESS {
                a.check(st, &format!("rank {}: {what}", self.rank))?;
            }
            if Instant::now() >= deadline {
                return Err(err(format!(
                    "rank {}: {what} did not complete within {:.0} s (a peer died or stopped exchanging)",
                    self.rank,
                    self.timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn exchange_inner(&mut self, send: &[Vec<u8>], recv_lens: &[usize]) -> Result<Vec<Vec<u8>>> {
        let a = api()?;
        self.device.bind()?;
        let (stotal, rtotal): (usize, usize) = (send.iter().map(Vec::len).sum(), recv_lens.iter().sum());
        let sptr = Self::ensure(&mut self.sendbuf, &self.device, stotal, "nccl send staging")?;
        let rptr = Self::ensure(&mut self.recvbuf, &self.device, rtotal, "nccl receive staging")?;
        let s = self.stream.cu_stream();
        let mut off = 0u64;
        for b in send.iter().filter(|b| !b.is_empty()) {
            // SAFETY: the staging buffer holds `stotal` bytes.
            unsafe { cudarc::driver::result::memcpy_htod_async(sptr + off, b, s) }
                .map_err(|e| err(format!("staging the send buffers: {e}")))?;
            off += b.len() as u64;
        }
        // SAFETY: group calls bracket the sends and receives below.
        a.check(unsafe { (a.group_start)() }, "ncclGroupStart")?;
        let (mut so, mut ro) = (0u64, 0u64);
        let mut posted = Ok(());
        for p in 0..self.world {
            let (sl, rl) = (send[p].len(), recv_lens[p]);
            if sl > 0 && posted.is_ok() {
                // SAFETY: [sptr+so, +sl) lies in the staging buffer; the stream belongs to the comm's device.
                posted = unsafe { self.post(a, true, sptr + so, sl, p, s as *mut c_void) };
            }
            if rl > 0 && posted.is_ok() {
                // SAFETY: as above, for the receive staging buffer.
                posted = unsafe { self.post(a, false, rptr + ro, rl, p, s as *mut c_void) };
            }
            so += sl as u64;
            ro += rl as u64;
        }
        // SAFETY: closes the group opened above (also after a failed post).
        let ended = a.check(unsafe { (a.group_end)() }, "ncclGroupEnd");
        posted?;
        ended?;
        let mut out: Vec<Vec<u8>> = recv_lens.iter().map(|&n| vec![0u8; n]).collect();
        let mut off = 0u64;
        for buf in out.iter_mut().filter(|b| !b.is_empty()) {
            // SAFETY: the receive staging buffer holds `rtotal` bytes; `buf` stays alive until the
            // wait below.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(buf.as_mut_slice(), rptr + off, s) }
                .map_err(|e| err(format!("copying received data back: {e}")))?;
            off += buf.len() as u64;
        }
        self.wait("the all-to-all")?;
        Ok(out)
    }
}

impl Transport for NcclTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn exchange(&mut self, send: &[Vec<u8>], recv_lens: &[usize]) -> Result<Vec<Vec<u8>>> {
        check_args(self.rank, self.world, send, recv_lens)?;
        if self.aborted {
            return Err(err(format!("rank {}: the communicator was aborted", self.rank)));
        }
        let r = self.exchange_inner(send, recv_lens);
        if let Err(e) = &r {
            self.abort(&e.to_string());
        }
        r
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        tracing::warn!(rank = self.rank, reason, "aborting the NCCL communicator");
        if let Ok(a) = api() {
            // SAFETY: `comm` is live and aborted once.
            unsafe { (a.comm_abort)(self.comm) };
        }
    }

    fn describe(&self) -> String {
        format!("nccl rank {}/{} on GPU {}", self.rank, self.world, self.device.ordinal())
    }
}

/// The device-resident rounds of [`crate::backend::cuda::ep`]: one rank per process, each lane's
/// messages as grouped `ncclSend` / `ncclRecv` on the rank's stream (NCCL operations are
/// captured into CUDA graphs). Errors surface at the next [`NcclTransport::wait_stream`].
impl DeviceExchange for NcclTransport {
    fn world(&self) -> usize {
        self.world
    }

    fn local_ranks(&self) -> std::ops::Range<usize> {
        self.rank..self.rank + 1
    }

    fn all_to_all(&mut self, lanes: &[Vec<Lane>], streams: &[StreamRef]) -> Result<()> {
        crate::backend::cuda::ep::check_round(1, lanes, streams)?;
        if self.aborted {
            return Err(err(format!("rank {}: the communicator was aborted", self.rank)));
        }
        let a = api()?;
        self.device.bind()?;
        let s = streams[0].raw() as *mut c_void;
        // SAFETY: group calls bracket the sends and receives below.
        a.check(unsafe { (a.group_start)() }, "ncclGroupStart")?;
        let mut posted = Ok(());
        for lane in lanes[0].iter().filter(|l| l.bytes > 0) {
            for p in 0..self.world {
                let off = (p * lane.bytes) as u64;
                // SAFETY: the lane's buffers hold world * bytes on this rank's GPU
                // (`DeviceEpRank::new`); the stream belongs to the same device.
                if posted.is_ok() {
                    posted = unsafe { self.post(a, true, lane.send + off, lane.bytes, p, s) };
                }
                if posted.is_ok() {
                    posted = unsafe { self.post(a, false, lane.recv + off, lane.bytes, p, s) };
                }
            }
        }
        // SAFETY: closes the group opened above (also after a failed post).
        let ended = a.check(unsafe { (a.group_end)() }, "ncclGroupEnd");
        let r = posted.and(ended);
        if let Err(e) = &r {
            self.abort(&e.to_string());
        }
        r
    }

    fn wait(&mut self, stream: StreamRef, what: &str) -> Result<()> {
        self.wait_stream(stream, what)
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        // Abort rather than destroy: it never waits on peers that may be gone.
        self.abort("the transport was dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_hex_and_files() {
        let mut raw = [0u8; 128];
        raw.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 37) as u8);
        let id = NcclId(raw);
        assert_eq!(NcclId::from_hex(&id.to_hex()).unwrap(), id);
        assert!(NcclId::from_hex("abc").is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id");
        id.publish(&path).unwrap();
        assert_eq!(NcclId::wait_for(&path, Duration::from_secs(1)).unwrap(), id);
        let e = NcclId::wait_for(&dir.path().join("none"), Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("did not appear"), "{e}");
    }
}

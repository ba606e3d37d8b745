//! The device all-to-all: [`Lane`]s of fixed-size messages, the [`DeviceExchange`] trait, and
//! [`SharedGpuExchange`] (every rank of the group on this process's GPU, one stream each).
//!
//! The NCCL implementation (one rank per process) is in `parallel/nccl.rs`: grouped
//! `ncclSend` / `ncclRecv` of the same lanes on the rank's stream.

use crate::backend::cuda::buffer::derr;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::launch::{self, StreamRef};
use crate::error::{MegaError, Result};
use cudarc::driver::CudaEvent;
use std::sync::Arc;

/// One message kind of an all-to-all round, `bytes` per peer: the rank sends
/// `[send + d * bytes, +bytes)` to rank `d` and receives rank `s`'s into `[recv + s * bytes, +bytes)`,
/// for every rank of the group, itself included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lane {
    /// Device address of the message to rank 0 (the others follow, `bytes` apart).
    pub send: u64,
    /// Device address the message from rank 0 lands at.
    pub recv: u64,
    /// Bytes per peer.
    pub bytes: usize,
}

/// An all-to-all of device buffers, enqueued on streams (no host synchronisation; capturable in a
/// CUDA graph where the implementation is). Every round is a collective: all ranks of the group
/// enqueue the same rounds in the same order, with the same lanes' sizes.
pub trait DeviceExchange {
    /// Ranks in the group.
    fn world(&self) -> usize;

    /// The ranks this endpoint drives from this thread, in order: one (NCCL: a process per rank)
    /// or all of them (ranks sharing one GPU).
    fn local_ranks(&self) -> std::ops::Range<usize>;

    /// Enqueues one round: `lanes[i]` of the i-th local rank, on `streams[i]`.
    fn all_to_all(&mut self, lanes: &[Vec<Lane>], streams: &[StreamRef]) -> Result<()>;

    /// Waits on the host for `stream`, where rounds were enqueued (outside a forward: to read
    /// results back). NCCL bounds the wait and watches for failed peers.
    fn wait(&mut self, stream: StreamRef, what: &str) -> Result<()>;
}

/// Checks one round's arguments: a lane list and a stream per local rank, the same sizes from all.
pub(crate) fn check_round(local: usize, lanes: &[Vec<Lane>], streams: &[StreamRef]) -> Result<()> {
    if lanes.len() != local || streams.len() != local {
        return Err(MegaError::Input(format!(
            "an all-to-all round needs the lanes and the stream of each of the {local} local ranks (got {} and {})",
            lanes.len(),
            streams.len()
        )));
    }
    let sizes = |l: &[Lane]| l.iter().map(|l| l.bytes).collect::<Vec<_>>();
    if let Some((i, l)) = lanes.iter().enumerate().find(|(_, l)| sizes(l) != sizes(&lanes[0])) {
        return Err(MegaError::Input(format!(
            "local rank {i}'s messages ({:?} bytes) differ from rank 0's ({:?})",
            sizes(l),
            sizes(&lanes[0])
        )));
    }
    Ok(())
}

/// Every rank of the group on one GPU: a round is, on each destination's stream, a wait for every
/// source's "sent" event and device-to-device copies of the messages, then a wait for every
/// rank's "received" event (so no rank rewrites a send buffer a peer has not copied yet). Events
/// and copies are captured into a graph like kernels when the streams are part of one capture.
pub struct SharedGpuExchange {
    device: Arc<CudaDevice>,
    sent: Vec<CudaEvent>,
    received: Vec<CudaEvent>,
}

impl SharedGpuExchange {
    /// An exchange for `world` ranks on `device`.
    pub fn new(device: &Arc<CudaDevice>, world: usize) -> Result<Self> {
        let ev = || (0..world).map(|_| device.new_event(false)).collect::<Result<Vec<_>>>();
        Ok(SharedGpuExchange { device: device.clone(), sent: ev()?, received: ev()? })
    }
}

impl DeviceExchange for SharedGpuExchange {
    fn world(&self) -> usize {
        self.sent.len()
    }

    fn local_ranks(&self) -> std::ops::Range<usize> {
        0..self.sent.len()
    }

    fn all_to_all(&mut self, lanes: &[Vec<Lane>], streams: &[StreamRef]) -> Result<()> {
        let w = self.world();
        check_round(w, lanes, streams)?;
        self.device.bind()?;
        for (ev, &s) in self.sent.iter().zip(streams) {
            launch::record(ev, s)?;
        }
        for d in 0..w {
            for s in 0..w {
                launch::wait(streams[d], &self.sent[s])?;
                for (to, from) in lanes[d].iter().zip(&lanes[s]) {
                    let b = to.bytes as u64;
                    // SAFETY: each lane's buffers hold `world * bytes` (the ranks' constructors),
                    // and the copy is ordered after the source's sent event.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            to.recv + s as u64 * b,
                            from.send + d as u64 * b,
                            to.bytes,
                            streams[d].raw(),
                        )
                    }
                    .map_err(derr("the shared-GPU all-to-all copy"))?;
                }
            }
            launch::record(&self.received[d], streams[d])?;
        }
        for &s in streams {
            for ev in &self.received {
                launch::wait(s, ev)?;
            }
        }
        Ok(())
    }

    fn wait(&mut self, stream: StreamRef, what: &str) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's stream is alive for the call.
        unsafe { cudarc::driver::result::stream::synchronize(stream.raw()) }.map_err(derr(what))
    }
}

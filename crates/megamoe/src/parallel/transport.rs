//! The one interface between ranks: a variable all-to-all of byte buffers.
//!
//! Dispatch and combine ([`super::dispatch`], [`super::combine`]) are written once against
//! [`Transport`]; [`super::inproc`] (ranks = threads of one process) and `super::nccl` (ranks =
//! processes, NCCL grouped send/recv) implement it. Every call is a collective: all ranks of the
//! group call [`Transport::exchange`] the same number of times, in the same order. A rank that
//! fails calls [`Transport::abort`] (dropping a transport mid-protocol does too), after which every
//! other rank's pending and later exchanges return an error naming the failed rank instead of
//! waiting forever; waits are also bounded by a timeout.

use crate::error::{MegaError, Result};

/// A group of ranks exchanging byte buffers.
pub trait Transport: Send {
    /// This rank.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world(&self) -> usize;

    /// One variable all-to-all round: `send[d]` goes to rank `d` (this rank included, `send.len()
    /// == world`); returns the buffers every rank `s` sent to this one, in rank order, where
    /// `recv_lens[s]` bytes are expected from `s` (a different length is an error naming `s`).
    fn exchange(&mut self, send: &[Vec<u8>], recv_lens: &[usize]) -> Result<Vec<Vec<u8>>>;

    /// Ends the group with `reason`: every rank's pending and later exchanges fail.
    fn abort(&mut self, reason: &str);

    /// A one-line description (`inproc rank 1/3`, `nccl rank 0/8 on GPU 0`).
    fn describe(&self) -> String;
}

/// Checks the shape of one exchange's arguments (shared by the implementations).
pub(crate) fn check_args(rank: usize, world: usize, send: &[Vec<u8>], recv_lens: &[usize]) -> Result<()> {
    if send.len() != world || recv_lens.len() != world {
        return Err(MegaError::Input(format!(
            "rank {rank}: an exchange needs one send buffer and one receive length per rank of {world} \
             (got {} and {})",
            send.len(),
            recv_lens.len()
        )));
    }
    Ok(())
}

/// Exchanges one `u64` vector with every rank (the same length `n` from all): `send[d]` to rank `d`.
pub fn exchange_u64(t: &mut dyn Transport, send: &[Vec<u64>], n: usize) -> Result<Vec<Vec<u64>>> {
    let bytes: Vec<Vec<u8>> = send.iter().map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let got = t.exchange(&bytes, &vec![8 * n; t.world()])?;
    Ok(got
        .iter()
        .map(|b| b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
        .collect())
}

/// Checks that every rank of the group passes the same `fingerprint` (a configuration's numbers:
/// shapes, grid, message sizes), in one round: a rank that differs is an error naming it and
/// `what` (on every rank, so none waits for it), and the transport is aborted.
pub fn agree(t: &mut dyn Transport, fingerprint: &[u64], what: &str) -> Result<()> {
    let w = t.world();
    let got = exchange_u64(t, &vec![fingerprint.to_vec(); w], fingerprint.len())?;
    if let Some(s) = got.iter().position(|v| v.as_slice() != fingerprint) {
        let msg = format!(
            "rank {s} runs a different {what} than rank {} ({:?} vs {:?})",
            t.rank(),
            got[s],
            fingerprint
        );
        t.abort(&msg);
        return Err(MegaError::Input(msg));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::inproc;
    use std::time::Duration;

    #[test]
    fn agree_names_the_rank_that_differs() {
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = inproc::group(3, Duration::from_secs(10))
                .into_iter()
                .map(|mut t| {
                    s.spawn(move || {
                        let fp = [7, 8, if t.rank() == 2 { 10 } else { 9 }];
                        agree(&mut t, &fp, "device EP group")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, res) in results.iter().enumerate() {
            let e = res.as_ref().unwrap_err().to_string();
            let other = if r == 2 { 0 } else { 2 };
            assert!(e.contains(&format!("rank {other} runs a different device EP group")), "rank {r}: {e}");
        }
        let ok: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = inproc::group(2, Duration::from_secs(10))
                .into_iter()
                .map(|mut t| s.spawn(move || agree(&mut t, &[1, 2], "x")))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ok.iter().all(Result::is_ok));
    }
}

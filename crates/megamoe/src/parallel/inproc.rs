//! The in-process transport: the ranks of a group are threads of one process, exchanging host
//! buffers through per-(source, destination) FIFO queues under one mutex.
//!
//! A round pushes this rank's `world` buffers, then waits (on a condition variable, with a
//! timeout) until every rank's buffer for it has arrived. The group fails as a whole: a rank that
//! calls [`Transport::abort`], or whose endpoint is dropped while its thread panics, marks the
//! group aborted and wakes everyone, and a rank waiting past the timeout aborts it too (naming the
//! ranks it waited for). An endpoint dropped normally only "leaves": ranks still exchanging with it
//! then fail instead of waiting. The same transport serves CPU engines and CUDA engines sharing
//! one GPU (one stream each; the results are copied to the host, exchanged, copied back).

use super::transport::{check_args, Transport};
use crate::error::{MegaError, Result};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The default bound on one wait of an exchange.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

struct State {
    /// `queues[src * world + dst]`.
    queues: Vec<VecDeque<Vec<u8>>>,
    /// Why the group ended, once it has.
    aborted: Option<String>,
    /// Ranks that left the group normally.
    left: Vec<bool>,
}

struct Hub {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves the state consistent (every update
        // is a single push or flag), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One rank's endpoint of an in-process group (see the module docs).
pub struct InProcTransport {
    hub: Arc<Hub>,
    rank: usize,
    timeout: Duration,
}

/// Creates the `world` endpoints of one in-process group; endpoint `r` is rank `r`. `timeout`
/// bounds each wait (e.g. [`DEFAULT_TIMEOUT`]).
pub fn group(world: usize, timeout: Duration) -> Vec<InProcTransport> {
    let hub = Arc::new(Hub {
        world,
        state: Mutex::new(State {
            queues: (0..world * world).map(|_| VecDeque::new()).collect(),
            aborted: None,
            left: vec![false; world],
        }),
        cv: Condvar::new(),
    });
    (0..world).map(|rank| InProcTransport { hub: hub.clone(), rank, timeout }).collect()
}

fn err(msg: String) -> MegaError {
    MegaError::backend("inproc", msg)
}

impl InProcTransport {
    fn fail(&self, st: &mut State, reason: String) {
        if st.aborted.is_none() {
            st.aborted = Some(reason);
        }
        self.hub.cv.notify_all();
    }
}

impl Transport for InProcTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.hub.world
    }

    fn exchange(&mut self, send: &[Vec<u8>], recv_lens: &[usize]) -> Result<Vec<Vec<u8>>> {
        let (w, me) = (self.hub.world, self.rank);
        check_args(me, w, send, recv_lens)?;
        let mut st = self.hub.lock();
        if let Some(why) = &st.aborted {
            return Err(err(format!("rank {me}: the group was aborted: {why}")));
        }
        for (d, buf) in send.iter().enumerate() {
            st.queues[me * w + d].push_back(buf.clone());
        }
        self.hub.cv.notify_all();
        let deadline = Instant::now() + self.timeout;
        loop {
            let missing: Vec<usize> = (0..w).filter(|&s| st.queues[s * w + me].is_empty()).collect();
            if missing.is_empty() {
                break;
            }
            if let Some(why) = &st.aborted {
                return Err(err(format!("rank {me}: the group was aborted: {why}")));
            }
            if let Some(&gone) = missing.iter().find(|&&s| st.left[s]) {
                let why = format!("rank {gone} left the group while rank {me} waited for its data");
                self.fail(&mut st, why.clone());
                return Err(err(why));
            }
            let now = Instant::now();
            if now >= deadline {
                let why = format!(
                    "rank {me} timed out after {:.1} s waiting for rank(s) {missing:?}",
                    self.timeout.as_secs_f64()
                );
                self.fail(&mut st, why.clone());
                return Err(err(why));
            }
            st = self.hub.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        let mut out = Vec::with_capacity(w);
        for (s, &len) in recv_lens.iter().enumerate() {
            let buf = st.queues[s * w + me].pop_front().expect("checked non-empty");
            if buf.len() != len {
                let why = format!(
                    "rank {me} expected {len} bytes from rank {s} and got {} (the ranks disagree on \
                     the exchange: different inputs or configs?)",
                    buf.len()
                );
                self.fail(&mut st, why.clone());
                return Err(err(why));
            }
            out.push(buf);
        }
        Ok(out)
    }

    fn abort(&mut self, reason: &str) {
        let mut st = self.hub.lock();
        let why = format!("rank {} aborted: {reason}", self.rank);
        self.fail(&mut st, why);
    }

    fn describe(&self) -> String {
        format!("inproc rank {}/{}", self.rank, self.hub.world)
    }
}

impl Drop for InProcTransport {
    fn drop(&mut self) {
        let mut st = self.hub.lock();
        if std::thread::panicking() {
            let why = format!("rank {} died (its thread panicked)", self.rank);
            self.fail(&mut st, why);
        } else {
            st.left[self.rank] = true;
            self.hub.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_delivers_every_buffer_in_rank_order() {
        let eps = group(3, Duration::from_secs(10));
        let out: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = eps
                .into_iter()
                .map(|mut t| {
                    s.spawn(move || {
                        let r = t.rank() as u8;
                        let send: Vec<Vec<u8>> = (0..3u8).map(|d| vec![r * 10 + d; d as usize + 1]).collect();
                        let lens = vec![t.rank() + 1; 3];
                        t.exchange(&send, &lens).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (me, got) in out.iter().enumerate() {
            for (s, buf) in got.iter().enumerate() {
                assert_eq!(buf, &vec![s as u8 * 10 + me as u8; me + 1]);
            }
        }
    }

    #[test]
    fn a_wrong_length_and_a_timeout_are_errors() {
        let mut eps = group(2, Duration::from_millis(200));
        let mut b = eps.pop().unwrap();
        let mut a = eps.pop().unwrap();
        // Rank 1 never exchanges: rank 0 times out, naming rank 1.
        let e = a.exchange(&[vec![], vec![]], &[0, 0]).unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("[1]"), "{e}");
        // The group is aborted for rank 1 as well.
        let e = b.exchange(&[vec![], vec![]], &[0, 0]).unwrap_err().to_string();
        assert!(e.contains("aborted"), "{e}");
    }
}

//! [`EpRank`]: one rank's forward through dispatch, experts and combine, over any [`Transport`].
//!
//! Every rank of the group calls [`EpRank::forward`] with its own home tokens (possibly none):
//!
//! 1. route the home tokens; start the shared expert on them (it runs beside steps 2-4);
//! 2. counts round: to every rank, a fingerprint of the configuration and the number of tokens
//!    it will receive (a rank whose fingerprint differs ends the group with an error naming it);
//! 3. dispatch round: each token once per destination rank ([`DispatchLayout`]);
//! 4. the local experts on the received tokens (the engine's range plan), one result row per held
//!    slot; combine round: the rows back to their home ranks;
//! 5. wait for the shared expert; the fixed-order sum ([`combine::reduce`]).
//!
//! Any error (this rank's or the transport's) aborts the transport first, so no other rank waits
//! for this one.

use super::combine;
use super::dispatch::{DispatchLayout, Received};
use super::engine::RankEngine;
use super::payload::{CombinePayload, DispatchPayload};
use super::topology::Topology;
use super::transport::{exchange_u64, Transport};
use crate::config::MoeConfig;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardOutput, Mode};
use half::bf16;
use std::ops::Range;
use std::time::Instant;

/// The payload formats of the two exchanges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExchangeOptions {
    /// Hidden states to the expert ranks.
    pub dispatch: DispatchPayload,
    /// Expert results back to the home ranks.
    pub combine: CombinePayload,
}

/// What every rank of a group must agree on.
#[derive(Clone, Debug)]
pub struct EpConfig {
    /// The layer index (part of the fingerprint).
    pub layer: usize,
    /// The whole layer's MoE config (the full intermediate size, not a TP slice).
    pub config: MoeConfig,
    /// The rank grid.
    pub topo: Topology,
    /// Payload formats.
    pub exchange: ExchangeOptions,
}

/// Seconds and bytes of one rank's forward.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankTimings {
    /// Router.
    pub route_s: f64,
    /// Counts and dispatch rounds, encoding and decoding included.
    pub dispatch_s: f64,
    /// The local experts.
    pub experts_s: f64,
    /// Combine round and the home rank's sum.
    pub combine_s: f64,
    /// Time spent waiting for the shared expert after the exchange (0 when fully overlapped).
    pub shared_wait_s: f64,
    /// The whole forward.
    pub total_s: f64,
    /// Tokens this rank received for its experts.
    pub received_tokens: usize,
    /// Bytes this rank sent to other ranks (dispatch + combine, itself excluded).
    pub sent_bytes: usize,
}

/// One rank: its engine, its transport endpoint and the group's configuration.
pub struct EpRank {
    engine: Box<dyn RankEngine>,
    transport: Box<dyn Transport>,
    cfg: EpConfig,
    held: Range<usize>,
}

fn mode_code(m: Mode) -> u64 {
    match m {
        Mode::W4A16 => 1,
        Mode::W4A8 => 2,
        Mode::W4A4 => 3,
    }
}

impl EpRank {
    /// Rank `transport.rank()` of `cfg.topo` with `engine` (which must hold that rank's experts).
    pub fn new(engine: Box<dyn RankEngine>, transport: Box<dyn Transport>, cfg: EpConfig) -> Result<Self> {
        let (r, w) = (transport.rank(), transport.world());
        if w != cfg.topo.world() {
            return Err(MegaError::Input(format!(
                "rank {r}: the transport has {w} ranks but ep {} x tp {} needs {}",
                cfg.topo.ep,
                cfg.topo.tp,
                cfg.topo.world()
            )));
        }
        cfg.exchange.dispatch.check(cfg.config.hidden_size)?;
        let held = cfg.topo.shard(cfg.config.n_routed_experts, r)?.experts;
        Ok(EpRank { engine, transport, cfg, held })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// The engine.
    pub fn engine(&self) -> &dyn RankEngine {
        self.engine.as_ref()
    }

    /// The transport's description.
    pub fn describe(&self) -> String {
        format!("{}: {}", self.transport.describe(), self.engine.describe())
    }

    /// Ends the group (every other rank's exchanges fail with `reason`).
    pub fn abort(&mut self, reason: &str) {
        self.transport.abort(reason);
    }

    fn fingerprint(&self, mode: Mode) -> [u64; 10] {
        let c = &self.cfg.config;
        let x = &self.cfg.exchange;
        [
            0x6d65_6761_6d6f_6501, // "megamoe" + protocol version 1
            self.cfg.layer as u64,
            c.hidden_size as u64,
            c.moe_intermediate_size as u64,
            c.n_routed_experts as u64,
            c.num_experts_per_tok as u64,
            (self.cfg.topo.ep as u64) << 32 | self.cfg.topo.tp as u64,
            mode_code(mode),
            x.dispatch as u64,
            x.combine as u64,
        ]
    }

    /// One forward of this rank's home tokens `x` `[T, H]` (and `input_ids` `[T]` on hash layers),
    /// collectively with every other rank of the group. Returns `y`, the routing and the timings.
    pub fn forward(
        &mut self,
        x: &[bf16],
        input_ids: Option<&[i64]>,
        mode: Mode,
    ) -> Result<(ForwardOutput, RankTimings)> {
        match self.forward_inner(x, input_ids, mode) {
            Ok(v) => Ok(v),
            Err(e) => {
                let msg = e.to_string();
                self.transport.abort(&msg);
                Err(MegaError::backend("ep", format!("rank {}: {msg}", self.rank())))
            }
        }
    }

    fn forward_inner(
        &mut self,
        x: &[bf16],
        input_ids: Option<&[i64]>,
        mode: Mode,
    ) -> Result<(ForwardOutput, RankTimings)> {
        let t_start = Instant::now();
        let c = self.cfg.config.clone();
        let (h, k, e) = (c.hidden_size, c.num_experts_per_tok, c.n_routed_experts);
        let topo = self.cfg.topo;
        let opts = self.cfg.exchange;
        if !x.len().is_multiple_of(h) {
            return Err(MegaError::Input(format!("x has {} elements, not a multiple of H={h}", x.len())));
        }
        let slice = c.moe_intermediate_size / topo.tp;
        if mode == Mode::W4A8 && topo.tp > 1 && !slice.is_multiple_of(128) {
            return Err(MegaError::Input(format!(
                "--tp {}: mode w4a8 quantizes the activation in 128-element blocks of the intermediate \
                 dimension, and a slice of {slice} (moe_intermediate_size {} / {}) breaks them",
                topo.tp, c.moe_intermediate_size, topo.tp
            )));
        }
        let mut tm = RankTimings::default();

        let t0 = Instant::now();
        let (ids, wts) = self.engine.route(x, input_ids)?;
        tm.route_s = t0.elapsed().as_secs_f64();
        self.engine.shared_begin(x)?;
        // From here on the shared expert runs; it is joined on every path out.
        let exchanged = self.exchange_and_experts(x, &ids, &wts, mode, &mut tm);
        let t3 = Instant::now();
        let shared = self.engine.shared_end();
        tm.shared_wait_s = t3.elapsed().as_secs_f64();
        let (_, results) = exchanged?;
        let shared = shared?;
        let t4 = Instant::now();
        let y = combine::reduce(&ids, k, h, e, &topo, &results, opts.combine, &shared)?;
        tm.combine_s += t4.elapsed().as_secs_f64();
        tm.total_s = t_start.elapsed().as_secs_f64();
        Ok((ForwardOutput { y, topk_ids: ids, topk_weights: wts }, tm))
    }

    /// Steps 2-4: the counts, dispatch and combine rounds around the local experts. Returns the
    /// layout and the result messages from every rank.
    fn exchange_and_experts(
        &mut self,
        x: &[bf16],
        ids: &[i32],
        wts: &[f32],
        mode: Mode,
        tm: &mut RankTimings,
    ) -> Result<(DispatchLayout, Vec<Vec<u8>>)> {
        let c = &self.cfg.config;
        let (h, k, e) = (c.hidden_size, c.num_experts_per_tok, c.n_routed_experts);
        let topo = self.cfg.topo;
        let opts = self.cfg.exchange;
        let (me, w) = (self.rank(), topo.world());
        let t1 = Instant::now();
        let layout = DispatchLayout::build(ids, k, e, &topo)?;
        // Counts round: the fingerprint and the number of tokens for each destination.
        let fp = self.fingerprint(mode);
        let counts: Vec<Vec<u64>> =
            layout.tokens.iter().map(|l| fp.iter().copied().chain([l.len() as u64]).collect()).collect();
        let got = exchange_u64(self.transport.as_mut(), &counts, fp.len() + 1)?;
        for (s, v) in got.iter().enumerate() {
            if v[..fp.len()] != fp {
                return Err(MegaError::Input(format!(
                    "rank {s} runs a different configuration than rank {me} (layer, H, I, E, k, ep x tp, mode, \
                     payloads: {:?} vs {:?})",
                    &v[1..fp.len()],
                    &fp[1..]
                )));
            }
        }
        // Dispatch round.
        let per = DispatchLayout::token_bytes(opts.dispatch, h, k);
        let send = layout.encode(x, ids, wts, h, k, opts.dispatch);
        tm.sent_bytes +=
            send.iter().enumerate().filter(|(d, _)| *d != me).map(|(_, b)| b.len()).sum::<usize>();
        let lens: Vec<usize> = got.iter().map(|v| v[fp.len()] as usize * per).collect();
        let bufs = self.transport.exchange(&send, &lens)?;
        drop(send);
        let recv = Received::decode(&bufs, me, &self.held, h, k, opts.dispatch)?;
        drop(bufs);
        tm.received_tokens = recv.tokens();
        tm.dispatch_s = t1.elapsed().as_secs_f64();

        // The local experts.
        let t2 = Instant::now();
        let rows = self.engine.expert_slots(&recv.x, &recv.ids, &recv.weights, mode)?;
        tm.experts_s = t2.elapsed().as_secs_f64();

        // Combine round.
        let t3 = Instant::now();
        let back = combine::encode_results(&recv, &rows, h, k, opts.combine)?;
        drop(rows);
        tm.sent_bytes +=
            back.iter().enumerate().filter(|(d, _)| *d != me).map(|(_, b)| b.len()).sum::<usize>();
        let lens = combine::expected_bytes(&layout, h, opts.combine);
        debug_assert_eq!(lens.len(), w);
        let results = self.transport.exchange(&back, &lens)?;
        tm.combine_s = t3.elapsed().as_secs_f64();
        Ok((layout, results))
    }
}

//! [`DeviceEpRank`]: one expert-parallel rank whose dispatch and combine stay on the device.
//!
//! A forward is three enqueue phases around two all-to-all rounds (see the module docs), on the
//! rank's stream, with no host synchronisation and no allocation: every message has the size fixed
//! before the forward (`rows` per source and destination: the largest home batch of the forward, the
//! same on every rank, at most the `cap` the buffers were sized for), so the whole forward can be
//! captured in a CUDA graph (one per batch size, as servers capture them).

use super::exchange::Lane;
use crate::backend::cuda::buffer::{derr, err, DevBuf};
use crate::backend::cuda::engine::CudaEngine;
use crate::backend::cuda::io::{DType, DeviceTensor, X};
use crate::backend::cuda::launch::{self, LaunchCfg, StreamRef};
use crate::backend::cuda::params::*;
use crate::backend::cuda::workspace::bytes;
use crate::backend::MoeEngine;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardOutput, Mode};
use crate::parallel::DispatchPayload;
use std::ops::Range;
use std::sync::Arc;

/// The device buffers of the exchange (`kernels/ep_exchange.cu` has their layouts).
struct ExchangeBufs {
    /// Every rank's expert range `[world][2]` i32.
    ranges: DevBuf,
    /// Home token -> row at each destination `[world, cap]` i32.
    dest_row: DevBuf,
    /// Row at a destination -> home token `[world, cap]` i32.
    src_token: DevBuf,
    /// How the hidden states travel (the payload's own send / receive buffers).
    rows: RowBufs,
    send_ids: DevBuf,
    send_w: DevBuf,
    /// The received hidden states as the experts read them `[world * cap, H]` bf16.
    recv_x: DevBuf,
    recv_ids: DevBuf,
    recv_w: DevBuf,
    /// This rank's partial sums of the rows it received `[world * cap, H]` f32 (sent back).
    part: DevBuf,
    /// The partial sums of this rank's home tokens, from every rank `[world, cap, H]` f32.
    back: DevBuf,
}

/// The hidden states' messages, by payload.
#[allow(clippy::large_enum_variant)] // one per rank, built once and never moved in a forward
enum RowBufs {
    /// `[world, cap, H]` bf16 sent (received straight into `recv_x`).
    Bf16 { send_x: DevBuf },
    /// `[world, cap, H]` e4m3 codes and `[world, cap, H / 128]` f32 scales, sent and received
    /// (`moe_ep_unpack` restores `recv_x`).
    Fp8 { send_q: DevBuf, send_s: DevBuf, recv_q: DevBuf, recv_s: DevBuf },
}

impl RowBufs {
    fn all(&self) -> Vec<&DevBuf> {
        match self {
            RowBufs::Bf16 { send_x } => vec![send_x],
            RowBufs::Fp8 { send_q, send_s, recv_q, recv_s } => vec![send_q, send_s, recv_q, recv_s],
        }
    }
}

/// A forward between its dispatch and its reduce.
#[derive(Clone, Copy, Debug)]
struct Inflight {
    /// Home tokens.
    t: usize,
    /// Rows per message.
    rows: usize,
    /// Whether the shared expert was forked (the reduce joins it).
    shared: bool,
}

/// One rank of a device-resident EP group (see the module docs).
pub struct DeviceEpRank {
    pub(super) eng: CudaEngine,
    rank: usize,
    world: usize,
    cap: usize,
    bufs: ExchangeBufs,
    /// Every rank's experts (global ids).
    ranges: Vec<Range<usize>>,
    /// The forward in flight.
    inflight: Option<Inflight>,
}

// SAFETY: as `CudaRankEngine`: the engine's graph stays `None` (groups capture their own), and
// device memory, streams and the context may be used from any thread once bound.
unsafe impl Send for DeviceEpRank {}

impl DeviceEpRank {
    /// Uploads rank `rank`'s `layer` (its experts, TP slice, the whole router and shared expert)
    /// for a group whose ranks own `ranges` (global expert ids, one range per rank), with room for
    /// `cap` home tokens per forward on every rank; hidden states travel as `payload` (bf16, or
    /// FP8: DeepSeek's `act_quant`, half the bytes, exact in W4A8; NVFP4 is the host exchange's).
    pub fn new(
        layer: Arc<MoeLayer>,
        rank: usize,
        ranges: &[Range<usize>],
        cap: usize,
        payload: DispatchPayload,
    ) -> Result<Self> {
        let world = ranges.len();
        if rank >= world || cap == 0 {
            return Err(MegaError::Input(format!(
                "device EP rank {rank} of {world}: the rank must be in the group and cap at least 1 (got {cap})"
            )));
        }
        let held = layer.expert_range.clone();
        if ranges[rank] != held {
            return Err(MegaError::Input(format!(
                "device EP rank {rank}: its layer holds experts {held:?} but the group gives it {:?}",
                ranges[rank]
            )));
        }
        let c = layer.config.clone();
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        if !h.is_multiple_of(8) {
            return Err(MegaError::Input(format!(
                "device EP: hidden size {h} is not a multiple of 8 (rows are copied 16 bytes at a time)"
            )));
        }
        if let Some(r) = ranges.iter().find(|r| r.end > c.n_routed_experts || r.start > r.end) {
            return Err(MegaError::Input(format!(
                "device EP: range {r:?} is outside the layer's {} experts",
                c.n_routed_experts
            )));
        }
        if payload == DispatchPayload::Nvfp4 {
            return Err(MegaError::Input(
                "the device exchange sends bf16 or fp8 rows (nvfp4: --exchange host)".into(),
            ));
        }
        payload.check(h)?;
        let rows = world
            .checked_mul(cap)
            .ok_or_else(|| MegaError::Input("device EP: world x cap overflows".into()))?;
        let eng = CudaEngine::new(layer, rows)?;
        let dev = eng.device.clone();
        let z = |dims: &[usize], what: &str| dev.alloc(bytes(dims, what)?, what);
        let table: Vec<i32> = ranges.iter().flat_map(|r| [r.start as i32, r.end as i32]).collect();
        let bufs = ExchangeBufs {
            ranges: dev.upload(&table, "ep expert ranges")?,
            dest_row: z(&[world, cap, 4], "ep dest_row")?,
            src_token: z(&[world, cap, 4], "ep src_token")?,
            rows: match payload {
                DispatchPayload::Fp8 => RowBufs::Fp8 {
                    send_q: z(&[world, cap, h], "ep send fp8 rows")?,
                    send_s: z(&[world, cap, h / 128, 4], "ep send fp8 scales")?,
                    recv_q: z(&[world, cap, h], "ep received fp8 rows")?,
                    recv_s: z(&[world, cap, h / 128, 4], "ep received fp8 scales")?,
                },
                _ => RowBufs::Bf16 { send_x: z(&[world, cap, h, 2], "ep send x")? },
            },
            send_ids: z(&[world, cap, k, 4], "ep send ids")?,
            send_w: z(&[world, cap, k, 4], "ep send weights")?,
            recv_x: z(&[world, cap, h, 2], "ep received x")?,
            recv_ids: z(&[world, cap, k, 4], "ep received ids")?,
            recv_w: z(&[world, cap, k, 4], "ep received weights")?,
            part: z(&[world, cap, h, 4], "ep partial sums")?,
            back: z(&[world, cap, h, 4], "ep returned sums")?,
        };
        Ok(DeviceEpRank { eng, rank, world, cap, bufs, ranges: ranges.to_vec(), inflight: None })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Home tokens per forward at most (the largest message, in rows).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The rank's own stream (what [`super::DeviceEpGroup`] enqueues on).
    pub fn stream(&self) -> StreamRef {
        self.eng.stream_ref()
    }

    /// One line: the engine, the experts held, the message size.
    pub fn describe(&self) -> String {
        let w = &self.eng.weights;
        format!(
            "device EP rank {}/{}: {}, experts {:?}, I {}, up to {} rows per message, {} rows",
            self.rank,
            self.world,
            self.eng.describe(),
            w.expert_range(),
            w.config().moe_intermediate_size,
            self.cap,
            if self.is_fp8() { "fp8" } else { "bf16" }
        )
    }

    /// The numbers every rank of a group must share (layer, shapes, world, the ranges' table,
    /// capacity): compared across processes once, before the first forward
    /// ([`crate::parallel::transport::agree`]), so a rank built differently is an error, not a
    /// mismatched message.
    pub fn fingerprint(&self) -> Vec<u64> {
        let w = &self.eng.weights;
        let c = w.config();
        let mut v = vec![
            0x6d65_6761_6d6f_6502, // "megamoe" + device-exchange protocol version 2
            w.index() as u64,
            c.hidden_size as u64,
            c.moe_intermediate_size as u64,
            c.n_routed_experts as u64,
            c.num_experts_per_tok as u64,
            self.world as u64,
            self.cap as u64,
            u64::from(self.is_fp8()),
        ];
        v.extend(self.ranges.iter().flat_map(|r| [r.start as u64, r.end as u64]));
        v
    }

    /// Bytes of weights this rank holds on the device.
    pub fn held_bytes(&self) -> usize {
        self.eng.weights.device_bytes()
    }

    fn is_fp8(&self) -> bool {
        matches!(self.bufs.rows, RowBufs::Fp8 { .. })
    }

    /// Bytes this rank sends in a forward of `rows` message rows, to itself included.
    pub fn sent_bytes(&self, rows: usize) -> usize {
        let lanes = self.dispatch_lanes_of(rows).into_iter().chain(self.combine_lanes_of(rows));
        lanes.map(|l| l.bytes).sum::<usize>() * self.world
    }

    /// Makes `mode`'s lazy scratch exist (before a graph capture: no allocation may happen in one).
    pub fn prepare(&mut self, mode: Mode) -> Result<()> {
        self.eng.weights.check_mode(mode)?;
        self.eng.ws.prepare(mode, false)
    }

    /// Phase 1: routes the home tokens `x` `[T, H]` bf16 (`input_ids` `[T, 1]` on hash layers) into
    /// the engine's `topk` buffers, starts the shared expert on the workspace's side stream, and
    /// packs the messages to every rank, `rows` rows each (`T <= rows <= cap`; every rank of the
    /// group passes the same `rows`).
    pub fn enqueue_dispatch(
        &mut self,
        x: &DeviceTensor,
        input_ids: Option<&DeviceTensor>,
        rows: usize,
        stream: StreamRef,
    ) -> Result<()> {
        let c = self.eng.weights.config();
        let (t, h, k, e) = (x.rows, c.hidden_size, c.num_experts_per_tok, c.n_routed_experts);
        if t > rows || rows > self.cap || rows == 0 {
            return Err(MegaError::Input(format!(
                "device EP rank {}: {t} home tokens in messages of {rows} rows; the group takes 1..={} rows \
                 and at most that many tokens per rank",
                self.rank, self.cap
            )));
        }
        X.check(x, t, h)?;
        if self.inflight.is_some() {
            return Err(MegaError::Input(format!(
                "device EP rank {}: a forward is already in flight (enqueue_reduce ends it)",
                self.rank
            )));
        }
        let (w, ws, dev) = (&self.eng.weights, &self.eng.ws, &self.eng.device);
        let ids = DeviceTensor::new(self.eng.io.topk_ids.ptr(), t, k, DType::I32);
        let wts = DeviceTensor::new(self.eng.io.topk_w.ptr(), t, k, DType::F32);
        w.enqueue_route(ws, x, input_ids, &ids, &wts, stream)?;
        let shared = t > 0 && w.shared_inter() > 0;
        if shared {
            // The shared expert needs only x: it runs beside the exchange and the routed experts.
            let side = StreamRef(ws.side.cu_stream());
            launch::record(&ws.fork, stream)?;
            launch::wait(side, &ws.fork)?;
            w.enqueue_shared(ws, x, side)?;
            launch::record(&ws.join, side)?;
        }
        dev.bind()?;
        let b = &self.bufs;
        let pack = EpPackParams {
            topk_ids: ids.ptr,
            topk_w: wts.ptr,
            ranges: b.ranges.ptr(),
            dest_row: b.dest_row.ptr(),
            src_token: b.src_token.ptr(),
            send_ids: b.send_ids.ptr(),
            send_w: b.send_w.ptr(),
            status: ws.status.ptr(),
            t: t as i32,
            k: k as i32,
            cap: rows as i32,
            e: e as i32,
        };
        let (send_x, send_q, send_s) = match &b.rows {
            RowBufs::Bf16 { send_x } => (send_x.ptr(), 0, 0),
            RowBufs::Fp8 { send_q, send_s, .. } => (0, send_q.ptr(), send_s.ptr()),
        };
        let copy = EpRowsParams {
            x: x.ptr,
            src_token: b.src_token.ptr(),
            send_x,
            send_q,
            send_s,
            h: h as i32,
            cap: rows as i32,
        };
        let world = self.world as u32;
        // SAFETY: the buffers hold [world, cap >= rows(, k | H)] (allocated so), the routing [t <= rows, k].
        unsafe {
            dev.core.ep_pack.launch(stream, &LaunchCfg::grid((world, 1, 1), 0), &pack)?;
            dev.core.ep_rows.launch(stream, &LaunchCfg::grid((rows as u32, world, 1), 0), &copy)?;
        }
        self.inflight = Some(Inflight { t, rows, shared });
        Ok(())
    }

    /// The message rows of the forward in flight (the capacity when none is).
    fn rows(&self) -> usize {
        self.inflight.map_or(self.cap, |f| f.rows)
    }

    /// The dispatch round's messages of the forward in flight: hidden states, ids, weights.
    pub fn dispatch_lanes(&self) -> Vec<Lane> {
        self.dispatch_lanes_of(self.rows())
    }

    /// The dispatch round's messages of `rows` rows.
    fn dispatch_lanes_of(&self, rows: usize) -> Vec<Lane> {
        let c = self.eng.weights.config();
        let (h, k, b) = (c.hidden_size, c.num_experts_per_tok, &self.bufs);
        let mut lanes = match &b.rows {
            RowBufs::Fp8 { send_q, send_s, recv_q, recv_s } => vec![
                Lane { send: send_q.ptr(), recv: recv_q.ptr(), bytes: rows * h },
                Lane { send: send_s.ptr(), recv: recv_s.ptr(), bytes: rows * (h / 128) * 4 },
            ],
            RowBufs::Bf16 { send_x } => {
                vec![Lane { send: send_x.ptr(), recv: b.recv_x.ptr(), bytes: rows * h * 2 }]
            }
        };
        lanes.push(Lane { send: b.send_ids.ptr(), recv: b.recv_ids.ptr(), bytes: rows * k * 4 });
        lanes.push(Lane { send: b.send_w.ptr(), recv: b.recv_w.ptr(), bytes: rows * k * 4 });
        lanes
    }

    /// Phase 2: this rank's experts over every row it received (`world * cap` rows; empty rows
    /// carry only -1 ids and plan nothing), each row's slots summed in slot order into `part`.
    pub fn enqueue_experts(&self, mode: Mode, stream: StreamRef) -> Result<()> {
        if self.inflight.is_none() {
            return Err(MegaError::Input(format!(
                "device EP rank {}: enqueue_experts before enqueue_dispatch",
                self.rank
            )));
        }
        let c = self.eng.weights.config();
        let (h, k, rows, b) = (c.hidden_size, c.num_experts_per_tok, self.world * self.rows(), &self.bufs);
        let ids = DeviceTensor::new(b.recv_ids.ptr(), rows, k, DType::I32);
        let x = DeviceTensor::new(b.recv_x.ptr(), rows, h, DType::Bf16);
        let w = DeviceTensor::new(b.recv_w.ptr(), rows, k, DType::F32);
        let part = DeviceTensor::new(b.part.ptr(), rows, h, DType::F32);
        if let RowBufs::Fp8 { recv_q, recv_s, .. } = &b.rows {
            let p = EpUnpackParams {
                q: recv_q.ptr(),
                s: recv_s.ptr(),
                ids: b.recv_ids.ptr(),
                x: b.recv_x.ptr(),
                rows: rows as i32,
                h: h as i32,
                k: k as i32,
            };
            self.eng.device.bind()?;
            // SAFETY: the received buffers hold [world * cap >= rows] rows of their widths.
            unsafe {
                self.eng.device.core.ep_unpack.launch(stream, &LaunchCfg::grid((rows as u32, 1, 1), 0), &p)?
            };
        }
        self.eng.weights.enqueue_routed(&self.eng.ws, &ids, &x, &w, &part, false, mode, stream)
    }

    /// Forgets a forward whose enqueueing failed half-way (the next dispatch may start).
    pub fn abandon(&mut self) {
        self.inflight = None;
    }

    /// The combine round's message: the partial sums of the rows each rank sent here.
    pub fn combine_lanes(&self) -> Vec<Lane> {
        self.combine_lanes_of(self.rows())
    }

    fn combine_lanes_of(&self, rows: usize) -> Vec<Lane> {
        let h = self.eng.weights.config().hidden_size;
        vec![Lane { send: self.bufs.part.ptr(), recv: self.bufs.back.ptr(), bytes: rows * h * 4 }]
    }

    /// Phase 3: every home token's partial sums added in rank order, then its shared expert, into
    /// `y` `[T, H]` (f32 or bf16). Ends the forward.
    pub fn enqueue_reduce(&mut self, y: &DeviceTensor, stream: StreamRef) -> Result<()> {
        let Inflight { t, rows, shared } = self.inflight.ok_or_else(|| {
            MegaError::Input(format!("device EP rank {}: enqueue_reduce before enqueue_dispatch", self.rank))
        })?;
        let h = self.eng.weights.config().hidden_size;
        y.check("y", t, h, &[DType::F32, DType::Bf16], 16)?;
        self.inflight = None;
        let ws = &self.eng.ws;
        if shared {
            launch::wait(stream, &ws.join)?;
        }
        let p = EpReduceParams {
            back: self.bufs.back.ptr(),
            dest_row: self.bufs.dest_row.ptr(),
            shared_out: if shared { ws.shared_out.ptr() } else { 0 },
            y: y.ptr,
            t: t as i32,
            h: h as i32,
            cap: rows as i32,
            world: self.world as i32,
            y_dtype: if y.dtype == DType::Bf16 { OUT_BF16 } else { OUT_F32 },
        };
        let col_blocks = h.div_ceil(4 * crate::backend::cuda::device::CORE_THREADS as usize) as u32;
        self.eng.device.bind()?;
        // SAFETY: y holds [t, H] (checked, 16-byte aligned), back and dest_row [world, cap(, H)].
        unsafe {
            self.eng.device.core.ep_reduce.launch(stream, &LaunchCfg::grid((t as u32, col_blocks, 1), 0), &p)
        }
    }

    /// One forward of this process's only local rank over `ex` (NCCL: a process per rank) from host
    /// slices: the home tokens `x` `[T, H]` (`input_ids` on hash layers) in, y `[T, H]` f32 and
    /// the routing out; messages of `rows` rows (every rank the same: the largest home batch).
    pub fn forward(
        &mut self,
        ex: &mut dyn super::DeviceExchange,
        x: &[half::bf16],
        input_ids: Option<&[i64]>,
        rows: usize,
        mode: Mode,
    ) -> Result<ForwardOutput> {
        self.prepare(mode)?;
        let t = self.upload(x, input_ids)?;
        let (x, input_ids, y) = self.io(t);
        let s = self.stream();
        super::enqueue_forward(
            std::slice::from_mut(self),
            ex,
            &[super::RankIo { x, input_ids, y }],
            rows,
            mode,
            &[s],
        )?;
        // The bounded wait first: a copy to pageable host memory would block on a dead peer.
        ex.wait(s, "the device EP forward")?;
        self.collect(t)
    }

    /// Copies `x` (and `input_ids`) of `t` home tokens into the engine's io buffers on the rank's
    /// stream (the host-slice entry of tests, the CLI and [`super::DeviceEpGroup`]).
    pub(super) fn upload(&mut self, x: &[half::bf16], input_ids: Option<&[i64]>) -> Result<usize> {
        self.eng.upload_input(&crate::forward::ForwardInput { x, input_ids })
    }

    /// The engine's io as the phases' tensors for `t` home tokens: x, input ids (hash layers), y.
    pub(super) fn io(&self, t: usize) -> (DeviceTensor, Option<DeviceTensor>, DeviceTensor) {
        let h = self.eng.weights.config().hidden_size;
        let io = &self.eng.io;
        let ids = self.eng.weights.is_hash().then(|| DeviceTensor::new(io.ids.ptr(), t, 1, DType::I32));
        (
            DeviceTensor::new(io.x.ptr(), t, h, DType::Bf16),
            ids,
            DeviceTensor::new(io.y.ptr(), t, h, DType::F32),
        )
    }

    /// `t` home tokens' outputs (y, routing) copied back once the rank's stream is done, its
    /// kernels' status checked.
    pub(super) fn collect(&self, t: usize) -> Result<ForwardOutput> {
        self.eng.collect(t).map_err(|e| err(format!("device EP rank {}: {e}", self.rank)))
    }

    /// Waits for the rank's stream (outside a forward).
    pub(super) fn sync(&self, what: &str) -> Result<()> {
        self.eng.sync(what)
    }

    /// Each destination's rows of the last dispatch of `rows` message rows, as home tokens
    /// (`[world][count]`): the host [`crate::parallel::dispatch::DispatchLayout`]'s `tokens`, for tests.
    #[doc(hidden)]
    pub fn dispatched_tokens(&self, rows: usize) -> Result<Vec<Vec<u32>>> {
        let rows = rows.clamp(1, self.cap);
        let src = self.eng.download::<i32>(&self.bufs.src_token, self.world * rows, "copying src_token")?;
        self.eng.sync("reading the dispatch rows")?;
        Ok(src.chunks(rows).map(|c| c.iter().take_while(|&&t| t >= 0).map(|&t| t as u32).collect()).collect())
    }

    /// Fills the engine's workspace and io and every exchange buffer but the expert ranges with
    /// `byte` (0xFF: NaN), so tests prove every element read was written in the same forward.
    #[doc(hidden)]
    pub fn poison(&mut self, byte: u8) -> Result<()> {
        self.eng.poison(byte)?;
        let b = &self.bufs;
        let st = self.eng.device.stream();
        for buf in [
            &b.dest_row,
            &b.src_token,
            &b.send_ids,
            &b.send_w,
            &b.recv_x,
            &b.recv_ids,
            &b.recv_w,
            &b.part,
            &b.back,
        ]
        .into_iter()
        .chain(b.rows.all())
        {
            // SAFETY: `buf` holds `buf.bytes()` bytes.
            unsafe { cudarc::driver::result::memset_d8_async(buf.ptr(), byte, buf.bytes(), st.cu_stream()) }
                .map_err(derr("poison"))?;
        }
        st.synchronize().map_err(derr("poison"))
    }
}

//! Device-resident expert parallelism: dispatch and combine on device buffers, with counts that
//! never leave the device and messages of a fixed worst-case size, so a rank's whole forward —
//! router, exchange, experts, exchange, reduce — is enqueue-only and graph-capturable.
//!
//! ```text
//! rank r, home tokens x [T <= rows, H]
//!   dispatch  route -> topk [T, k]; shared expert forked onto the side stream;
//!             moe_ep_pack / moe_ep_rows: for every rank d, the home tokens with a slot on d's
//!             experts in token order (once per destination, not per slot), their ids (-1 where
//!             not d's) and weights; rows past the count carry only -1 ids
//!   round 1   all-to-all of [rows, H] bf16 (or FP8: e4m3 + 128-block scales, act_quant) +
//!             [rows, k] ids + [rows, k] weights per rank pair (FP8: moe_ep_unpack back to bf16)
//!   experts   plan + experts + combine over the world * rows rows received: per row, the sum of
//!             its slots on r's experts in slot order (-1 rows plan nothing and sum to 0)
//!   round 2   all-to-all of [rows, H] f32 partial sums per rank pair
//!   reduce    moe_ep_reduce: y[t] = sum over ranks d in rank order of d's partial sum of t,
//!             then the shared expert (joined back)
//! ```
//!
//! **Reduction order.** A token's slots are summed per destination rank (slot order), then the
//! ranks' partial sums in rank order, then the shared expert: fixed, so the output is bitwise
//! reproducible, and equal to the single engine's slot-order sum up to that reassociation (a group
//! of one: bitwise where both run the same launches; at decode the rank takes the fused kernel
//! while the single engine, its shared expert beside, runs separate stages — last-bit
//! differences, measured). The
//! host-buffer path of [`crate::parallel::EpRank`] keeps the single engine's exact order by
//! sending every slot's row back; here one row per token and destination travels, as in the
//! dispatch). Tensor parallelism needs nothing more: a destination's partial sum covers its slice
//! of the intermediate dimension, and the TP ranks' sums are added in rank order like the others.
//!
//! **Sizes.** Messages are `rows` rows whatever the routing (a graph cannot change a transfer's
//! size): `rows` is the forward's largest home batch, the same on every rank (a server captures a
//! graph per batch size), at most the `cap` the buffers were allocated for. The receive side runs
//! its experts over `world * rows` rows (the plan skips the empty ones).
//!
//! | file | responsibility |
//! |---|---|
//! | `rank.rs` | [`DeviceEpRank`]: one rank's buffers and its three phases |
//! | `exchange.rs` | [`Lane`], [`DeviceExchange`], [`SharedGpuExchange`] (ranks sharing one GPU) |
//! | `group.rs` | [`enqueue_forward`] (the phases over any exchange), [`DeviceEpGroup`] (a whole group on one GPU, one thread, one graph) |
//!
//! The NCCL exchange (one rank per process) is `crate::parallel::nccl`'s `DeviceExchange` impl.

mod exchange;
mod group;
mod rank;

pub(crate) use exchange::check_round;
pub use exchange::{DeviceExchange, Lane, SharedGpuExchange};
pub use group::{enqueue_forward, message_rows, DeviceEpGroup, RankIo};
pub use rank::DeviceEpRank;

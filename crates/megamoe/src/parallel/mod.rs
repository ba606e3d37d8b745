//! Expert and tensor parallelism: sharding, the transport between ranks, dispatch and combine.
//!
//! | file | responsibility |
//! |---|---|
//! | `shard.rs` | [`ExpertShard`] (contiguous expert ranges), [`GlobalExpert`] / [`LocalExpert`] ids, [`HeldBytes`] |
//! | `topology.rs` | [`Topology`]: `ep x tp` ranks, each rank's experts, TP slice and home tokens |
//! | `tp.rs` | Tensor-parallel slices of the experts' intermediate dimension |
//! | `transport.rs` | [`Transport`]: the variable all-to-all every exchange goes through |
//! | `inproc.rs` | The in-process transport (ranks = threads) |
//! | `nccl.rs` | The NCCL transport (ranks = processes; `cuda` feature) and its unique-id bootstrap |
//! | `payload.rs` | Wire formats: bf16 / fp8 hidden states, f32 / bf16 results |
//! | `dispatch.rs` | Which tokens go where (once per destination rank) and their messages |
//! | `combine.rs` | Results back and the home rank's fixed-order sum |
//! | `engine.rs` | [`RankEngine`]: router, shared expert, per-slot experts; the CPU implementation |
//! | `rank.rs` | [`EpRank`]: one rank's forward (counts, dispatch, experts, combine) |
//! | `group.rs` | [`InProcGroup`]: a whole group as threads of this process |
//!
//! The reduction order (see `combine.rs`) makes an EP group's output bitwise equal to the single
//! engine's with `tp = 1` and the default payloads, and bitwise reproducible in every case.

pub mod combine;
pub mod dispatch;
pub mod engine;
pub mod group;
pub mod inproc;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod payload;
pub mod rank;
pub mod shard;
pub mod topology;
pub mod tp;
pub mod transport;

pub use engine::{CpuRankEngine, RankEngine};
pub use group::{cpu_engines, rank_layer, InProcGroup};
pub use payload::{CombinePayload, DispatchPayload};
pub use rank::{EpConfig, EpRank, ExchangeOptions, RankTimings};
pub use shard::{local_index, ExpertShard, GlobalExpert, HeldBytes, LocalExpert};
pub use topology::Topology;
pub use transport::Transport;

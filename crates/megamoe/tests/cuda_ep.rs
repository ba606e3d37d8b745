//! GPU tests of expert parallelism on one GPU (skipped with a printed reason when no GPU is
//! present; `MEGAMOE_REQUIRE_GPU=1` makes that a failure, as `scripts/device/run.sh` does):
//!
//! - the device-resident exchange (`backend::cuda::ep`): groups of 1..8 ranks (EP and EP x TP)
//!   against the single CUDA engine within rounding of the reassociated sum (a group of one:
//!   of the decode launch chosen), every buffer poisoned
//!   first, repeats and the whole group's CUDA-graph replay bitwise equal, each destination's
//!   rows equal to the host `DispatchLayout`, hot / empty / foreign experts and ranks without
//!   tokens; bad input refused by name;
//! - the NCCL exchange of the same phases on a one-rank communicator (skipped without NCCL);
//! - the host-buffer path's `CudaRankEngine` in an in-process group.
#![cfg(feature = "cuda")]

use megamoe::backend::cuda::ep::DeviceEpGroup;
use megamoe::backend::cuda::{CudaEngine, CudaRankEngine, DeviceEpRank};
use megamoe::backend::MoeEngine;
use megamoe::checkpoint::MoeLayer;
use megamoe::config::MoeConfig;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, ForwardOutput, Mode};
use megamoe::parallel::dispatch::DispatchLayout;
use megamoe::parallel::{
    rank_layer, DispatchPayload, EpConfig, ExchangeOptions, InProcGroup, RankEngine, Topology,
};
use megamoe::synthetic;
use std::sync::Arc;
use std::time::Duration;

fn gpu_or_skip(layer: &MoeLayer, max_t: usize) -> Option<CudaEngine> {
    match CudaEngine::new(Arc::new(layer.clone()), max_t) {
        Ok(e) => Some(e),
        Err(e) => {
            if std::env::var_os("MEGAMOE_REQUIRE_GPU").is_some() {
                panic!("MEGAMOE_REQUIRE_GPU is set but the CUDA engine failed: {e}");
            }
            eprintln!("SKIPPED: no usable GPU ({e})");
            None
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

fn mid_config() -> MoeConfig {
    MoeConfig {
        hidden_size: 512,
        moe_intermediate_size: 256,
        n_routed_experts: 24,
        num_experts_per_tok: 6,
        ..synthetic::tiny_config()
    }
}

fn device_group(layer: &MoeLayer, topo: Topology, max_t: usize) -> DeviceEpGroup {
    let layers = (0..topo.world()).map(|r| rank_layer(layer, &topo, r).unwrap()).collect();
    DeviceEpGroup::new(layers, topo, max_t, DispatchPayload::Bf16).unwrap()
}

/// Within rounding of the single engine: the ranks' partial sums reassociate the slot sum (and a
/// rank's batch may tile differently); a wrong row or a missed slot is O(1).
const EP_TOL: f64 = 1e-3;

#[test]
fn device_exchange_groups_match_the_single_engine() {
    let mut row = 0u64;
    for (cfg, format, hash, skew) in [
        (synthetic::tiny_config(), WeightFormat::Nvfp4, false, false),
        (synthetic::tiny_config(), WeightFormat::Mxfp4, true, true),
        (mid_config(), WeightFormat::Nvfp4, false, true),
        (mid_config(), WeightFormat::Mxfp4, false, true),
    ] {
        row += 1;
        let mut layer = synthetic::random_layer(&cfg, format, usize::from(!hash), hash, 300 + row);
        if skew {
            // 3 hot experts and the last E/4 empty: some ranks get most slots, some none.
            synthetic::skew_routing(&mut layer, 3, cfg.n_routed_experts / 4);
        }
        let max_t = 37;
        let Some(mut single) = gpu_or_skip(&layer, max_t) else { return };
        for (ep, tp) in [(1, 1), (2, 1), (3, 1), (8, 1), (2, 2)] {
            let topo = Topology::new(ep, tp).unwrap();
            let mut group = device_group(&layer, topo, max_t);
            for t in [1usize, 5, 37] {
                let x = synthetic::random_hidden(t, cfg.hidden_size, row * 10 + t as u64);
                let ids = synthetic::random_input_ids(t, cfg.vocab_size, row * 10 + 1 + t as u64);
                let modes: &[Mode] = if format == WeightFormat::Nvfp4 {
                    &[Mode::W4A16, Mode::W4A8, Mode::W4A4]
                } else {
                    &[Mode::W4A16, Mode::W4A8]
                };
                for &mode in modes {
                    if mode == Mode::W4A8 && !(cfg.moe_intermediate_size / tp).is_multiple_of(128) {
                        continue; // a TP slice of whole 128-blocks only (W4A8's activation blocks)
                    }
                    let what = format!("row {row} ep {ep} tp {tp} T {t} {}", mode.name());
                    let want =
                        single.forward(&ForwardInput { x: &x, input_ids: Some(&ids) }, mode, None).unwrap();
                    group.poison(0xFF).unwrap();
                    let got = group.forward(&x, Some(&ids), mode).unwrap();
                    assert_eq!(got.topk_ids, want.topk_ids, "{what}: routing");
                    assert_eq!(bits(&got.topk_weights), bits(&want.topk_weights), "{what}: routing weights");
                    assert!(got.y.iter().all(|v| v.is_finite()), "{what}: non-finite output");
                    // A group of one differs from the single engine only where their decode launches
                    // differ (fused vs separate stages): last bits.
                    let tol = if topo.world() == 1 { 1e-5 } else { EP_TOL };
                    let e = rel_l2(&got.y, &want.y);
                    assert!(e <= tol, "{what}: rel L2 {e:.3e} against the single engine");
                    let again = group.forward(&x, Some(&ids), mode).unwrap();
                    assert_eq!(bits(&again.y), bits(&got.y), "{what}: a repeat differs");
                    check_dispatch_rows(&group, &layer, &topo, &got, t, &what);
                    if t == 5 {
                        group.capture_graph(t, mode).unwrap();
                        let replay = group.replay(&x, Some(&ids)).unwrap();
                        assert_eq!(bits(&replay.y), bits(&got.y), "{what}: the graph replay differs");
                        let times = group.time_replays(&x, Some(&ids), 3).unwrap();
                        assert!(times.iter().all(|&ms| ms > 0.0), "{what}: replay times {times:?}");
                    }
                }
            }
        }
    }
}

/// Each destination's rows of the last forward are the host layout's tokens of each home share.
fn check_dispatch_rows(
    group: &DeviceEpGroup,
    layer: &MoeLayer,
    topo: &Topology,
    out: &ForwardOutput,
    t: usize,
    what: &str,
) {
    let k = layer.config.num_experts_per_tok;
    for (r, rank) in group.ranks().iter().enumerate() {
        let span = topo.tokens_of(t, r);
        let ids = &out.topk_ids[span.start * k..span.end * k];
        let want = DispatchLayout::build(ids, k, layer.config.n_routed_experts, topo).unwrap();
        assert_eq!(
            rank.dispatched_tokens(megamoe::backend::cuda::ep::message_rows(topo, t)).unwrap(),
            want.tokens,
            "{what}: rank {r}'s dispatch rows"
        );
    }
}

#[test]
fn device_exchange_refuses_bad_input_by_name() {
    let cfg = synthetic::tiny_config();
    let layer = synthetic::random_layer(&cfg, WeightFormat::Nvfp4, 1, false, 5);
    // Refused before any device is touched (the same error on a machine without a GPU).
    let whole = Arc::new(layer.clone());
    let e = DeviceEpRank::new(whole.clone(), 0, std::slice::from_ref(&(0..16)), 4, DispatchPayload::Nvfp4)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("bf16 or fp8 rows"), "{e}");
    let e = DeviceEpRank::new(whole, 0, std::slice::from_ref(&(0..16)), 0, DispatchPayload::Bf16)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("cap at least 1"), "{e}");
    if gpu_or_skip(&layer, 4).is_none() {
        return;
    }
    let topo = Topology::new(2, 1).unwrap();
    let mut group = device_group(&layer, topo, 8);
    let x = synthetic::random_hidden(9, cfg.hidden_size, 1);
    let e = group.forward(&x, None, Mode::W4A16).unwrap_err().to_string();
    assert!(e.contains("9 tokens exceed") && e.contains("4 per rank"), "{e}");
    let e = group.forward(&x[..100], None, Mode::W4A16).unwrap_err().to_string();
    assert!(e.contains("not a multiple of H"), "{e}");
    let e = group.replay(&x[..8 * cfg.hidden_size], None).unwrap_err().to_string();
    assert!(e.contains("no graph captured"), "{e}");
    // A rank whose layer is not the group's range for it.
    let whole = Arc::new(layer.clone());
    let e = DeviceEpRank::new(whole, 1, &[0..8, 8..16], 4, DispatchPayload::Bf16).err().unwrap().to_string();
    assert!(e.contains("holds experts 0..16") && e.contains("8..16"), "{e}");
    // The group still works after the refusals.
    let ok = group.forward(&x[..8 * cfg.hidden_size], None, Mode::W4A16).unwrap();
    assert!(ok.y.iter().all(|v| v.is_finite()));
}

#[test]
fn nccl_device_exchange_on_one_rank_equals_the_shared_gpu_group() {
    use megamoe::parallel::nccl::{NcclId, NcclTransport};
    let cfg = mid_config();
    let mut layer = synthetic::random_layer(&cfg, WeightFormat::Mxfp4, 1, false, 11);
    synthetic::skew_routing(&mut layer, 2, 3);
    if gpu_or_skip(&layer, 16).is_none() {
        return;
    }
    let id = match NcclId::new() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("SKIPPED: NCCL unavailable ({e})");
            return;
        }
    };
    let mut nccl = NcclTransport::new(0, 1, id, 0, Duration::from_secs(60)).unwrap();
    let mut rank = DeviceEpRank::new(
        Arc::new(layer.clone()),
        0,
        std::slice::from_ref(&(0..cfg.n_routed_experts)),
        16,
        DispatchPayload::Bf16,
    )
    .unwrap();
    megamoe::parallel::transport::agree(&mut nccl, &rank.fingerprint(), "device EP group").unwrap();
    let mut group = device_group(&layer, Topology::new(1, 1).unwrap(), 16);
    for (t, mode) in [(1usize, Mode::W4A16), (16, Mode::W4A8)] {
        let x = synthetic::random_hidden(t, cfg.hidden_size, 40 + t as u64);
        let a = rank.forward(&mut nccl, &x, None, t, mode).unwrap();
        let b = group.forward(&x, None, mode).unwrap();
        assert_eq!(bits(&a.y), bits(&b.y), "T {t} {}: NCCL vs shared-GPU exchange", mode.name());
    }
}

#[test]
fn cuda_rank_engines_in_an_inproc_group_match_the_single_engine() {
    let cfg = mid_config();
    let mut layer = synthetic::random_layer(&cfg, WeightFormat::Nvfp4, 1, false, 21);
    synthetic::skew_routing(&mut layer, 3, 4);
    let Some(mut single) = gpu_or_skip(&layer, 37) else { return };
    for (ep, tp) in [(2, 1), (3, 1), (2, 2)] {
        let topo = Topology::new(ep, tp).unwrap();
        let engines = (0..topo.world())
            .map(|r| {
                Ok(Box::new(CudaRankEngine::new(Arc::new(rank_layer(&layer, &topo, r)?), 37)?)
                    as Box<dyn RankEngine>)
            })
            .collect::<megamoe::error::Result<Vec<_>>>()
            .unwrap();
        let cfg_ep = EpConfig {
            layer: layer.index,
            config: layer.config.clone(),
            topo,
            exchange: ExchangeOptions::default(),
        };
        let mut group = InProcGroup::new(engines, cfg_ep, Duration::from_secs(120)).unwrap();
        for t in [1usize, 37] {
            let x = synthetic::random_hidden(t, cfg.hidden_size, 70 + t as u64);
            for mode in [Mode::W4A16, Mode::W4A4] {
                let want = single.forward(&ForwardInput { x: &x, input_ids: None }, mode, None).unwrap();
                let (got, _) = group.forward(&x, None, mode).unwrap();
                let (again, _) = group.forward(&x, None, mode).unwrap();
                let what = format!("ep {ep} tp {tp} T {t} {}", mode.name());
                assert_eq!(got.topk_ids, want.topk_ids, "{what}: routing");
                let e = rel_l2(&got.y, &want.y);
                assert!(e <= EP_TOL, "{what}: rel L2 {e:.3e} against the single engine");
                assert_eq!(bits(&again.y), bits(&got.y), "{what}: a repeat differs");
            }
        }
    }
}

#[test]
fn fp8_payload_is_exact_in_w4a8_and_close_elsewhere() {
    let cfg = mid_config();
    for (format, seed) in [(WeightFormat::Mxfp4, 61u64), (WeightFormat::Nvfp4, 62)] {
        let mut layer = synthetic::random_layer(&cfg, format, 1, false, seed);
        synthetic::skew_routing(&mut layer, 3, 4);
        if gpu_or_skip(&layer, 4).is_none() {
            return;
        }
        for ep in [2usize, 3] {
            let topo = Topology::new(ep, 1).unwrap();
            let layers = |p| {
                let l = (0..ep).map(|r| rank_layer(&layer, &topo, r).unwrap()).collect();
                DeviceEpGroup::new(l, topo, 37, p).unwrap()
            };
            let (mut bf, mut f8) = (layers(DispatchPayload::Bf16), layers(DispatchPayload::Fp8));
            f8.poison(0xFF).unwrap();
            for t in [1usize, 5, 37] {
                let mut x = synthetic::random_hidden(t, cfg.hidden_size, seed + t as u64);
                if t == 37 {
                    x[3 * cfg.hidden_size + 7] = half::bf16::NAN; // a NaN block travels as NaN
                }
                for mode in [Mode::W4A8, Mode::W4A16] {
                    let what = format!("{} ep {ep} T {t} {}", format.name(), mode.name());
                    let a = bf.forward(&x, None, mode).unwrap();
                    let b = f8.forward(&x, None, mode).unwrap();
                    assert_eq!(a.topk_ids, b.topk_ids, "{what}: routing");
                    if mode == Mode::W4A8 {
                        // Bitwise, a NaN matching a NaN (its payload bits may differ).
                        let same =
                            a.y.iter()
                                .zip(&b.y)
                                .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()));
                        assert!(same, "{what}: fp8 rows are exact in W4A8");
                    } else {
                        let finite = |v: &[f32]| {
                            v.iter().map(|x| if x.is_finite() { *x } else { 0.0 }).collect::<Vec<_>>()
                        };
                        let e = rel_l2(&finite(&b.y), &finite(&a.y));
                        assert!(e <= DispatchPayload::Fp8.expected_rel_l2(), "{what}: rel L2 {e:.3e}");
                        let nan = |v: &[f32]| v.iter().map(|x| x.is_nan()).collect::<Vec<_>>();
                        assert_eq!(nan(&b.y), nan(&a.y), "{what}: NaN positions");
                    }
                }
            }
            f8.capture_graph(5, Mode::W4A8).unwrap();
            let x = synthetic::random_hidden(5, cfg.hidden_size, 99);
            let eager = f8.forward(&x, None, Mode::W4A8).unwrap();
            let replay = f8.replay(&x, None).unwrap();
            assert_eq!(bits(&replay.y), bits(&eager.y), "fp8 ep {ep}: graph replay");
        }
    }
}

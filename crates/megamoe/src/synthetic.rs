//! Synthetic layers and inputs with realistic magnitudes, for the demo, the verify sweep, benches
//! and tests. FP4 codes and scales are drawn directly (no BF16 original, no quantization pass), so
//! even a whole V4-Pro layer (384 experts) is generated in seconds.

use crate::checkpoint::{DenseData, DenseProj, ExpertProj, MoeLayer, ProjData, RouterWeights, SharedExpert};
use crate::config::{MoeConfig, ScoringFunc};
use crate::formats::WeightFormat;
use half::bf16;
use rand::{Rng, RngCore, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;
use std::ops::Range;

type Rng64 = rand::rngs::StdRng;

/// DeepSeek-V4-Pro's MoE hyper-parameters.
pub fn v4_pro_config() -> MoeConfig {
    MoeConfig {
        hidden_size: 7168,
        moe_intermediate_size: 3072,
        n_routed_experts: 384,
        num_experts_per_tok: 6,
        n_shared_experts: 1,
        scoring_func: ScoringFunc::SqrtSoftplus,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        swiglu_limit: 10.0,
        num_hash_layers: 3,
        num_hidden_layers: 61,
        vocab_size: 129280,
    }
}

/// DeepSeek-V4-Flash's MoE hyper-parameters.
pub fn v4_flash_config() -> MoeConfig {
    MoeConfig {
        hidden_size: 4096,
        moe_intermediate_size: 2048,
        n_routed_experts: 256,
        routed_scaling_factor: 1.5,
        num_hidden_layers: 43,
        ..v4_pro_config()
    }
}

/// The golden fixtures' shapes (H 256, I 128, 16 experts, top-4).
pub fn tiny_config() -> MoeConfig {
    MoeConfig {
        hidden_size: 256,
        moe_intermediate_size: 128,
        n_routed_experts: 16,
        num_experts_per_tok: 4,
        num_hash_layers: 1,
        num_hidden_layers: 2,
        vocab_size: 1000,
        ..v4_pro_config()
    }
}

fn rng(seed: u64, stream: u64) -> Rng64 {
    // Distinct, reproducible streams per (seed, purpose, expert).
    Rng64::seed_from_u64(
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03),
    )
}

fn normal(r: &mut Rng64) -> f32 {
    StandardNormal.sample(r)
}

/// A random e4m3 block scale in [64, 448] (never NaN).
fn e4m3_scale_byte(r: &mut Rng64) -> u8 {
    let e: u8 = r.gen_range(13..=15);
    let m: u8 = if e == 15 { r.gen_range(0..=6) } else { r.gen_range(0..=7) };
    (e << 3) | m
}

/// One projection of the experts `range` (global ids) of a layer of `total` experts, `rows x cols`,
/// with `|w| ~ 1/sqrt(cols)`. Every expert has its own random stream (keyed by its global id), so
/// any range gives the same matrices as the matching slice of `0..total`.
fn random_proj(
    format: WeightFormat,
    range: Range<usize>,
    rows: usize,
    cols: usize,
    seed: u64,
    stream: u64,
) -> ExpertProj {
    let experts = range.len();
    let first = range.start as u64;
    let per = rows * cols;
    // Block scales per expert matrix (unused for BF16).
    let sc = per / format.block_size().unwrap_or(1);
    let data = match format {
        WeightFormat::Nvfp4 => {
            let mut packed = vec![0u8; experts * per / 2];
            let mut scales = vec![0u8; experts * sc];
            packed.par_chunks_mut(per / 2).zip(scales.par_chunks_mut(sc)).enumerate().for_each(
                |(e, (p, s))| {
                    let mut r = rng(seed, stream * 1_000_003 + first + e as u64);
                    r.fill_bytes(p);
                    s.iter_mut().for_each(|b| *b = e4m3_scale_byte(&mut r));
                },
            );
            // Mean |e2m1| of uniform codes is ~2.3 and the mean scale ~200: aim at |w| ~ 1/sqrt(cols).
            // One stream for all experts' global scales: draw up to the range's end, keep the range.
            let mut r = rng(seed, stream * 1_000_003 + 999_999);
            let global_scale = (0..range.end)
                .map(|_| r.gen_range(0.7f32..1.4) / (460.0 * (cols as f32).sqrt()))
                .skip(range.start)
                .take(experts)
                .collect();
            // Activation global scales: amax/(6*448) with headroom over the largest activations
            // these layers see (N(0,1) inputs reach ~5; clamped SwiGLU outputs times a routing
            // weight reach ~18), so W4A4 block scales do not saturate at 448.
            let amax = if stream == 2 { 24.0 } else { 6.0 };
            let input_scale = Some(vec![amax / 2688.0; experts]);
            ProjData::Nvfp4 { packed, scales, global_scale, input_scale }
        }
        WeightFormat::Mxfp4 => {
            let mut packed = vec![0u8; experts * per / 2];
            let mut scales = vec![0u8; experts * sc];
            let base = 127 - (2.3 * (cols as f32).sqrt()).log2().round() as i32;
            packed.par_chunks_mut(per / 2).zip(scales.par_chunks_mut(sc)).enumerate().for_each(
                |(e, (p, s))| {
                    let mut r = rng(seed, stream * 1_000_003 + first + e as u64);
                    r.fill_bytes(p);
                    s.iter_mut().for_each(|b| *b = (base + r.gen_range(-1..=1)) as u8);
                },
            );
            ProjData::Mxfp4 { packed, scales }
        }
        WeightFormat::Bf16 => {
            let mut weight = vec![bf16::ZERO; experts * per];
            let std = 1.0 / (cols as f32).sqrt();
            weight.par_chunks_mut(per).enumerate().for_each(|(e, w)| {
                let mut r = rng(seed, stream * 1_000_003 + first + e as u64);
                w.iter_mut().for_each(|v| *v = bf16::from_f32(normal(&mut r) * std));
            });
            ProjData::Bf16 { weight }
        }
    };
    ExpertProj { experts, rows, cols, data }
}

fn random_dense(rows: usize, cols: usize, seed: u64, stream: u64) -> DenseProj {
    let mut r = rng(seed, stream);
    let std = 0.5 / (cols as f32).sqrt();
    let w = (0..rows * cols).map(|_| bf16::from_f32(normal(&mut r) * std)).collect();
    DenseProj { rows, cols, data: DenseData::Bf16(w) }
}

/// A random layer of `cfg`'s shape in `format`. `hash` chooses a `tid2eid` table (over
/// `cfg.vocab_size` tokens) instead of a score bias. The same arguments give the same layer.
pub fn random_layer(
    cfg: &MoeConfig,
    format: WeightFormat,
    layer_index: usize,
    hash: bool,
    seed: u64,
) -> MoeLayer {
    random_layer_experts(cfg, format, layer_index, hash, seed, 0..cfg.n_routed_experts)
}

/// The routed experts `experts` (global ids, e.g. one expert-parallel rank's
/// [`crate::parallel::ExpertShard`]) of the layer [`random_layer`] gives for the same arguments:
/// the same router (all E experts) and shared expert, and the same matrices for those experts (each
/// expert has its own random stream), with `expert_range == experts`. Host memory and time are
/// proportional to the range, so one V4-Pro rank is generated without the other 336 experts.
///
/// # Panics
/// When `experts` is empty or ends beyond `cfg.n_routed_experts`.
pub fn random_layer_experts(
    cfg: &MoeConfig,
    format: WeightFormat,
    layer_index: usize,
    hash: bool,
    seed: u64,
    experts: Range<usize>,
) -> MoeLayer {
    assert!(
        !experts.is_empty() && experts.end <= cfg.n_routed_experts,
        "expert range {experts:?} must be a non-empty part of 0..{}",
        cfg.n_routed_experts
    );
    let (h, i, e, k) =
        (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok);
    let mut r = rng(seed, 7);
    let gstd = 1.0 / (h as f32).sqrt();
    let weight = (0..e * h).map(|_| bf16::from_f32(normal(&mut r) * gstd).to_f32()).collect();
    let (bias, tid2eid) = if hash {
        let mut t = Vec::with_capacity(cfg.vocab_size * k);
        let mut ids: Vec<i32> = (0..e as i32).collect();
        for _ in 0..cfg.vocab_size {
            // k distinct experts: a partial Fisher-Yates shuffle.
            for j in 0..k {
                let s = r.gen_range(j..e);
                ids.swap(j, s);
            }
            t.extend_from_slice(&ids[..k]);
        }
        (None, Some(t))
    } else {
        (Some((0..e).map(|_| normal(&mut r) * 0.05).collect()), None)
    };
    let shared = (cfg.n_shared_experts > 0).then(|| {
        let is = i * cfg.n_shared_experts;
        SharedExpert {
            w1: random_dense(is, h, seed, 11),
            w2: random_dense(h, is, seed, 12),
            w3: random_dense(is, h, seed, 13),
        }
    });
    MoeLayer {
        index: layer_index,
        expert_range: experts.clone(),
        config: cfg.clone(),
        router: RouterWeights { weight, bias, tid2eid },
        w1: random_proj(format, experts.clone(), i, h, seed, 1),
        w2: random_proj(format, experts.clone(), h, i, seed, 2),
        w3: random_proj(format, experts, i, h, seed, 3),
        shared,
    }
}

/// Skews routing: `hot` experts attract most tokens and the last `empty` experts get none
/// (through the score bias, or through `tid2eid` on hash layers).
pub fn skew_routing(layer: &mut MoeLayer, hot: usize, empty: usize) {
    let e = layer.config.n_routed_experts;
    let hot = hot.min(e);
    let empty = empty.min(e.saturating_sub(hot + layer.config.num_experts_per_tok));
    if let Some(bias) = layer.router.bias.as_mut() {
        bias.iter_mut().take(hot).for_each(|b| *b += 1.0);
        bias.iter_mut().skip(e - empty).for_each(|b| *b = -100.0);
    }
    if let Some(t) = layer.router.tid2eid.as_mut() {
        let k = layer.config.num_experts_per_tok;
        let usable = (e - empty) as i32;
        for (row, ids) in t.chunks_mut(k).enumerate() {
            // A hot expert first, then the row's own ids that stay usable, then the lowest unused
            // ids: still k distinct experts, none of them in the empty range.
            let mut new: Vec<i32> = Vec::with_capacity(k);
            if hot > 0 {
                new.push((row % hot) as i32);
            }
            for &id in ids.iter() {
                if new.len() < k && id < usable && !new.contains(&id) {
                    new.push(id);
                }
            }
            let mut c = 0;
            while new.len() < k {
                if !new.contains(&c) {
                    new.push(c);
                }
                c += 1;
            }
            ids.copy_from_slice(&new);
        }
    }
}

/// Random hidden states `[tokens, hidden]` ~ N(0, 1) in bf16.
pub fn random_hidden(tokens: usize, hidden: usize, seed: u64) -> Vec<bf16> {
    let mut r = rng(seed, 21);
    (0..tokens * hidden).map(|_| bf16::from_f32(normal(&mut r))).collect()
}

/// Random token ids in `0..vocab`.
pub fn random_input_ids(tokens: usize, vocab: usize, seed: u64) -> Vec<i64> {
    let mut r = rng(seed, 22);
    (0..tokens).map(|_| r.gen_range(0..vocab as i64)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn distinct_in_range(ids: &[i32], k: usize, lo: i32, hi: i32) {
        for row in ids.chunks(k) {
            for (a, &x) in row.iter().enumerate() {
                assert!((lo..hi).contains(&x), "{row:?}");
                assert!(!row[..a].contains(&x), "repeated id in {row:?}");
            }
        }
    }

    #[test]
    fn layers_are_reproducible_and_well_formed() {
        let cfg = tiny_config();
        for format in [WeightFormat::Nvfp4, WeightFormat::Mxfp4, WeightFormat::Bf16] {
            let a = random_layer(&cfg, format, 0, true, 5);
            let b = random_layer(&cfg, format, 0, true, 5);
            assert_eq!(format!("{:?}", a.w2.data), format!("{:?}", b.w2.data));
            assert_eq!(a.format(), format);
            distinct_in_range(a.router.tid2eid.as_ref().unwrap(), 4, 0, 16);
        }
        let l = random_layer(&cfg, WeightFormat::Nvfp4, 1, false, 5);
        if let ProjData::Nvfp4 { scales, .. } = &l.w1.data {
            assert!(scales.iter().all(|&s| s & 0x7F != 0x7F), "NaN scale drawn");
        }
    }

    #[test]
    fn expert_ranges_are_slices_of_the_whole_layer() {
        let cfg = tiny_config();
        for format in [WeightFormat::Nvfp4, WeightFormat::Mxfp4, WeightFormat::Bf16] {
            for hash in [false, true] {
                let whole = random_layer(&cfg, format, 0, hash, 11);
                assert_eq!(whole.expert_range, 0..16);
                for (world, rank) in [(4, 0), (4, 3), (3, 1), (16, 7), (1, 0)] {
                    let shard = crate::parallel::ExpertShard::new(16, world, rank).unwrap();
                    let want = shard.slice_layer(&whole).unwrap();
                    let got = random_layer_experts(&cfg, format, 0, hash, 11, shard.experts.clone());
                    assert_eq!(got.expert_range, shard.experts);
                    got.validate().unwrap();
                    assert_eq!(got.w1.experts, shard.experts.len());
                    for (a, b) in [(&got.w1, &want.w1), (&got.w2, &want.w2), (&got.w3, &want.w3)] {
                        assert_eq!((a.experts, a.rows, a.cols), (b.experts, b.rows, b.cols));
                        assert_eq!(format!("{:?}", a.data), format!("{:?}", b.data), "{format} {shard:?}");
                    }
                    assert_eq!(format!("{:?}", got.router), format!("{:?}", want.router));
                    assert_eq!(format!("{:?}", got.shared), format!("{:?}", want.shared));
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "expert range")]
    fn expert_range_beyond_the_layer_panics() {
        random_layer_experts(&tiny_config(), WeightFormat::Nvfp4, 0, false, 1, 8..17);
    }

    #[test]
    fn skew_keeps_hash_ids_distinct_and_empties_experts() {
        let cfg = tiny_config();
        let mut l = random_layer(&cfg, WeightFormat::Nvfp4, 0, true, 9);
        skew_routing(&mut l, 2, 3);
        distinct_in_range(l.router.tid2eid.as_ref().unwrap(), 4, 0, 13);
        let mut s = random_layer(&cfg, WeightFormat::Nvfp4, 1, false, 9);
        skew_routing(&mut s, 2, 3);
        assert!(s.router.bias.as_ref().unwrap()[13..].iter().all(|&b| b == -100.0));
    }
}

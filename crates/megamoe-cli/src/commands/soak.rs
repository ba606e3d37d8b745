//! `megamoe soak`: a long run of forwards of random shape, mode and routing through a few engines
//! (one per layer, built once, as a server keeps them), checking every output's invariants (shape,
//! finite values, expert ids in range and distinct per token, finite weights) and, every
//! `--check-every` forwards, the output against the CPU reference fed the engine's own routing. On
//! CUDA the device's free memory is sampled after a warm-up and at the end: a drop of more than
//! `--max-growth-mb` is an error (a leak per forward would show as one). Exits non-zero on any
//! failure, after printing the summary.

use super::run_model::tolerance;
use super::verify::rel_l2;
use megamoe::backend::{create_engine, BackendKind, MoeEngine};
use megamoe::checkpoint::MoeLayer;
use megamoe::config::MoeConfig;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::{reference, synthetic};
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `megamoe soak`.
#[derive(clap::Args)]
pub struct Args {
    /// Backend under test (cuda, auto or cpu).
    #[arg(long, default_value = "cuda")]
    pub backend: String,
    /// Forwards in all.
    #[arg(long, default_value_t = 10_000)]
    pub forwards: usize,
    /// Every this many forwards, check the output against the CPU reference.
    #[arg(long, default_value_t = 100)]
    pub check_every: usize,
    /// Largest batch (tokens per forward; batches are log-uniform in 1..=this, and some are 0).
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Random seed (shapes, modes, data).
    #[arg(long, default_value_t = 20261201)]
    pub seed: u64,
    /// CUDA: free device memory may drop by at most this much (MB) between the warm-up and the end.
    #[arg(long, default_value_t = 64.0)]
    pub max_growth_mb: f64,
    /// Only the tiny layers (a quick CPU run).
    #[arg(long)]
    pub tiny: bool,
}

/// The layers of the run: a tiny scored NVFP4 layer, a tiny hash-routed MXFP4 layer with skewed
/// routing, a tiny bf16 one and (unless `tiny_only`) a mid-size skewed NVFP4 layer (64 experts, k 6).
fn layers(seed: u64, tiny_only: bool) -> Vec<(&'static str, Arc<MoeLayer>)> {
    let tiny = synthetic::tiny_config();
    let mut hash = synthetic::random_layer(&tiny, WeightFormat::Mxfp4, 0, true, seed + 1);
    synthetic::skew_routing(&mut hash, 2, 2);
    let mut v = vec![
        ("tiny-nvfp4", Arc::new(synthetic::random_layer(&tiny, WeightFormat::Nvfp4, 1, false, seed))),
        ("tiny-mxfp4-hash", Arc::new(hash)),
        ("tiny-bf16", Arc::new(synthetic::random_layer(&tiny, WeightFormat::Bf16, 1, false, seed + 3))),
    ];
    if !tiny_only {
        let mid = MoeConfig {
            hidden_size: 1024,
            moe_intermediate_size: 512,
            n_routed_experts: 64,
            num_experts_per_tok: 6,
            ..synthetic::tiny_config()
        };
        let mut skew = synthetic::random_layer(&mid, WeightFormat::Nvfp4, 1, false, seed + 2);
        synthetic::skew_routing(&mut skew, 3, 8);
        v.push(("mid-nvfp4-skew", Arc::new(skew)));
    }
    v
}

/// A small deterministic generator (splitmix64): the run is reproducible from `--seed`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// A batch size: 0 one time in 64, else log-uniform in 1..=max.
    fn tokens(&mut self, max: usize) -> usize {
        if self.below(64) == 0 {
            return 0;
        }
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((max as f64).powf(u).floor() as usize).clamp(1, max)
    }
}

/// What one forward's output must satisfy whatever the data: `[T, H]` finite values, `[T, k]`
/// expert ids in `0..E` and distinct per token, finite routing weights.
fn invariants(out: &megamoe::forward::ForwardOutput, t: usize, c: &MoeConfig) -> Result<(), String> {
    let (h, k, e) = (c.hidden_size, c.num_experts_per_tok, c.n_routed_experts as i32);
    if out.y.len() != t * h || out.topk_ids.len() != t * k || out.topk_weights.len() != t * k {
        return Err(format!(
            "shapes: y {} (want {}), topk_ids {} / topk_weights {} (want {})",
            out.y.len(),
            t * h,
            out.topk_ids.len(),
            out.topk_weights.len(),
            t * k
        ));
    }
    if let Some(i) = out.y.iter().position(|v| !v.is_finite()) {
        return Err(format!("y[{i}] = {} (finite input)", out.y[i]));
    }
    for (tok, ids) in out.topk_ids.chunks(k).enumerate() {
        if let Some(&bad) = ids.iter().find(|&&id| !(0..e).contains(&id)) {
            return Err(format!("token {tok}: expert id {bad} outside 0..{e}"));
        }
        if (1..ids.len()).any(|j| ids[..j].contains(&ids[j])) {
            return Err(format!("token {tok}: expert ids {ids:?} repeat"));
        }
    }
    if let Some(i) = out.topk_weights.iter().position(|w| !w.is_finite()) {
        return Err(format!("topk_weights[{i}] = {}", out.topk_weights[i]));
    }
    Ok(())
}

/// The device's free memory (bytes) when the backend is CUDA.
#[cfg(feature = "cuda")]
fn free_device_bytes(kind: BackendKind) -> Option<usize> {
    (kind != BackendKind::Cpu)
        .then(|| super::gpu::open_device().ok()?.memory_info().ok().map(|(f, _)| f))
        .flatten()
}

#[cfg(not(feature = "cuda"))]
fn free_device_bytes(_kind: BackendKind) -> Option<usize> {
    None
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let kind: BackendKind = args.backend.parse()?;
    anyhow::ensure!(args.max_tokens >= 1, "--max-tokens must be at least 1");
    let layers = layers(args.seed, args.tiny);
    let mut engines: Vec<Box<dyn MoeEngine>> = layers
        .iter()
        .map(|(_, l)| create_engine(kind, l.clone(), args.max_tokens))
        .collect::<Result<_, _>>()?;
    println!(
        "soak: {} forwards on {}, reference check every {}",
        args.forwards,
        engines[0].describe(),
        args.check_every
    );
    let mut rng = Rng(args.seed);
    let warmup = (args.forwards / 20).clamp(1, 200);
    let (mut free_warm, mut checks, mut failures, mut tokens) = (None, 0usize, 0usize, 0usize);
    let mut worst = [0.0f64; 3];
    let t0 = Instant::now();
    for i in 0..args.forwards {
        let li = rng.below(layers.len());
        let (name, layer) = (&layers[li].0, &layers[li].1);
        let c = &layer.config;
        let modes: Vec<Mode> =
            Mode::ALL.into_iter().filter(|&m| reference::check_mode(layer, m).is_ok()).collect();
        let mode = modes[rng.below(modes.len())];
        let t = rng.tokens(args.max_tokens);
        let data_seed = rng.next();
        let x = synthetic::random_hidden(t, c.hidden_size, data_seed);
        let ids = synthetic::random_input_ids(t, c.vocab_size, data_seed ^ 1);
        let input = ForwardInput { x: &x, input_ids: layer.is_hash().then_some(&ids[..]) };
        tokens += t;
        let out = match engines[li].forward(&input, mode, None) {
            Ok(o) => o,
            Err(e) => {
                failures += 1;
                println!("forward {i} ({name}, {mode}, T={t}): error: {e}");
                continue;
            }
        };
        if let Err(why) = invariants(&out, t, c) {
            failures += 1;
            println!("forward {i} ({name}, {mode}, T={t}): {why}");
            continue;
        }
        if args.check_every > 0 && (i % args.check_every == 0 || i + 1 == args.forwards) && t > 0 {
            checks += 1;
            // The reference fed the engine's own routing (near-tie scores cannot pick other experts):
            // its routed sum plus the shared expert.
            let mut want = reference::forward_routed(layer, &x, &out.topk_ids, &out.topk_weights, mode)?;
            for (w, s) in want.iter_mut().zip(reference::shared_expert(layer, &x)) {
                *w += s;
            }
            let err = rel_l2(&out.y, &want);
            let m = Mode::ALL.iter().position(|&x| x == mode).unwrap_or(0);
            worst[m] = worst[m].max(err);
            if err > tolerance(mode) {
                failures += 1;
                println!(
                    "forward {i} ({name}, {mode}, T={t}): rel L2 {err:.3e} > {:.0e} against the reference",
                    tolerance(mode)
                );
            }
        }
        if i + 1 == warmup {
            free_warm = free_device_bytes(kind);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "soak: {} forwards ({tokens} tokens) in {secs:.1} s, {checks} reference checks; worst rel L2 {}",
        args.forwards,
        Mode::ALL.iter().zip(worst).map(|(m, w)| format!("{m} {w:.2e}")).collect::<Vec<_>>().join(", ")
    );
    if let (Some(a), Some(b)) = (free_warm, free_device_bytes(kind)) {
        let growth_mb = (a as f64 - b as f64) / 1e6;
        println!(
            "device memory: free {:.1} MB after the warm-up, {:.1} MB at the end (growth {growth_mb:.1} MB)",
            a as f64 / 1e6,
            b as f64 / 1e6
        );
        if growth_mb > args.max_growth_mb {
            failures += 1;
            println!("FAIL: device memory grew by {growth_mb:.1} MB (limit {} MB)", args.max_growth_mb);
        }
    }
    if failures > 0 {
        println!("soak: {failures} failure(s)");
        Ok(1)
    } else {
        println!("soak: PASS");
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_cover_zero_one_and_the_maximum() {
        let mut r = Rng(7);
        let v: Vec<usize> = (0..5000).map(|_| r.tokens(512)).collect();
        assert!(v.contains(&0) && v.contains(&1) && v.iter().any(|&t| t > 256));
        assert!(v.iter().all(|&t| t <= 512));
    }

    #[test]
    fn invariants_catch_bad_ids_and_non_finite_values() {
        let c = synthetic::tiny_config();
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        let good = megamoe::forward::ForwardOutput {
            y: vec![0.5; 2 * h],
            topk_ids: (0..2 * k as i32).collect(),
            topk_weights: vec![0.25; 2 * k],
        };
        assert!(invariants(&good, 2, &c).is_ok());
        let mut o = good.clone();
        o.topk_ids[1] = o.topk_ids[0];
        assert!(invariants(&o, 2, &c).unwrap_err().contains("repeat"));
        let mut o = good.clone();
        o.topk_ids[3] = c.n_routed_experts as i32;
        assert!(invariants(&o, 2, &c).unwrap_err().contains("outside"));
        let mut o = good.clone();
        o.y[5] = f32::NAN;
        assert!(invariants(&o, 2, &c).unwrap_err().contains("y[5]"));
        assert!(invariants(&good, 3, &c).unwrap_err().contains("shapes"));
    }
}

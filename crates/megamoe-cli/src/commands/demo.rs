//! `megamoe demo`: the README's main job. Builds (or reuses) a DeepSeek-V4-shaped NVFP4 checkpoint,
//! runs its MoE layers on the best backend, checks them against the reference and prints a summary.
//!
//! - Without a usable GPU: a checkpoint with V4-Pro's real hidden / intermediate sizes (H 7168,
//!   I 3072) and a scaled-down expert count, made by the real quantize path (random BF16 weights ->
//!   `formats::nvfp4::quantize` -> `checkpoint::writer`), cached under `target/megamoe-demo/` (or
//!   `$MEGAMOE_CACHE`); the CPU result is checked against the float64 forward.
//! - With a GPU: the full V4-Pro layer (384 experts), FP4 codes and scales drawn directly, run on
//!   CUDA and checked against the CPU reference.

use anyhow::Context;
use half::bf16;
use megamoe::backend::{create_engine, BackendKind, MoeEngine};
use megamoe::checkpoint::naming::Naming;
use megamoe::checkpoint::{Checkpoint, ExpertProj, MoeLayer, ProjData};
use megamoe::config::MoeConfig;
use megamoe::formats::nvfp4;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, ForwardOutput, Mode};
use megamoe::reference::{self, float64};
use megamoe::synthetic;
use megamoe::trace::{Stage, StageTrace};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Bumped whenever the demo checkpoint's recipe changes, so stale caches are rebuilt.
const RECIPE: u32 = 2;
/// The demo checkpoint's layers: the last hash-routed one and the first score-routed one of V4.
const CPU_LAYERS: [usize; 2] = [2, 3];

/// Arguments of `megamoe demo`.
#[derive(clap::Args)]
pub struct Args {
    /// Backend: auto (CUDA when usable, else the CPU), cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: BackendKind,
    #[arg(long, default_value = "w4a16", help = megamoe::forward::MODE_HELP)]
    pub mode: Mode,
    /// Tokens per forward (default: 4 on the CPU, 32 on a GPU).
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Routed experts of the CPU demo checkpoint (V4-Pro has 384; scaled down to finish quickly).
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    /// Cache directory for the demo checkpoint (default: `$MEGAMOE_CACHE` or `target/megamoe-demo`).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Rebuild the demo checkpoint even if a cached one exists.
    #[arg(long)]
    pub rebuild: bool,
}

/// Where the demo checkpoint lives.
fn cache_dir(args: &Args) -> PathBuf {
    if let Some(c) = &args.cache {
        return c.clone();
    }
    if let Some(c) = std::env::var_os("MEGAMOE_CACHE") {
        return PathBuf::from(c);
    }
    // Next to the binary when it runs from a cargo target directory, else ./target.
    let exe_target = std::env::current_exe().ok().and_then(|exe| {
        exe.ancestors().find(|p| p.file_name().is_some_and(|n| n == "target")).map(Path::to_path_buf)
    });
    exe_target.unwrap_or_else(|| PathBuf::from("target")).join("megamoe-demo")
}

/// V4-Pro's MoE config with `experts` routed experts.
fn demo_config(experts: usize) -> MoeConfig {
    let mut cfg = synthetic::v4_pro_config();
    cfg.n_routed_experts = experts;
    cfg
}

/// Random BF16 layer -> NVFP4 through the real quantizer, with calibrated `input_scale`s.
fn quantized_layer(cfg: &MoeConfig, index: usize, calib: &[bf16]) -> anyhow::Result<MoeLayer> {
    let t0 = Instant::now();
    let mut layer =
        synthetic::random_layer(cfg, WeightFormat::Bf16, index, cfg.is_hash_layer(index), 7 + index as u64);
    let t_gen = t0.elapsed().as_secs_f64();
    // Calibration (what ModelOpt does): activation amax on a few tokens of the BF16 layer.
    let ids = synthetic::random_input_ids(calib.len() / cfg.hidden_size, cfg.vocab_size, 99);
    let mut trace = StageTrace::default();
    reference::forward(
        &layer,
        &ForwardInput { x: calib, input_ids: Some(&ids) },
        Mode::W4A16,
        Some(&mut trace),
    )?;
    let amax = |s: Stage| trace.get(s).map_or(1.0, |t| t.data.iter().fold(0.0f32, |m, v| m.max(v.abs())));
    let t_cal = t0.elapsed().as_secs_f64() - t_gen;
    let x_scale = amax(Stage::InputQuant).max(1e-6) / (6.0 * 448.0);
    let a_scale = amax(Stage::Activation).max(1e-6) / (6.0 * 448.0);
    // ModelOpt's export gives W1 and W3 of one expert a common global scale (the larger amax),
    // so that they can be fused; W2 keeps its own.
    let take_bf16 =
        |p: &mut ExpertProj| match std::mem::replace(&mut p.data, ProjData::Bf16 { weight: Vec::new() }) {
            ProjData::Bf16 { weight } => Ok(weight),
            _ => Err(anyhow::anyhow!("random_layer(Bf16) gave a non-BF16 projection")),
        };
    let (w1, w3, w2) = (take_bf16(&mut layer.w1)?, take_bf16(&mut layer.w3)?, take_bf16(&mut layer.w2)?);
    let (i, h) = (cfg.moe_intermediate_size, cfg.hidden_size);
    let mut q = [Vec::new(), Vec::new(), Vec::new()];
    for e in 0..cfg.n_routed_experts {
        let (s1, s3) = (&w1[e * i * h..(e + 1) * i * h], &w3[e * i * h..(e + 1) * i * h]);
        let (a, b) = (nvfp4::quantize_bf16(s1, i, h)?, nvfp4::quantize_bf16(s3, i, h)?);
        let g = a.global_scale.max(b.global_scale);
        q[0].push(if a.global_scale == g { a } else { nvfp4::quantize_with_global_scale(s1, i, h, g)? });
        q[1].push(if b.global_scale == g { b } else { nvfp4::quantize_with_global_scale(s3, i, h, g)? });
        q[2].push(nvfp4::quantize_bf16(&w2[e * h * i..(e + 1) * h * i], h, i)?);
    }
    for ((proj, mats), in_scale) in
        [&mut layer.w1, &mut layer.w3, &mut layer.w2].into_iter().zip(q).zip([x_scale, x_scale, a_scale])
    {
        proj.data = ProjData::Nvfp4 {
            packed: mats.iter().flat_map(|m| m.packed.iter().copied()).collect(),
            scales: mats.iter().flat_map(|m| m.scales.iter().copied()).collect(),
            global_scale: mats.iter().map(|m| m.global_scale).collect(),
            input_scale: Some(vec![in_scale; proj.experts]),
        };
    }
    println!(
        "             layer {index}: random BF16 {t_gen:.1} s, calibration {t_cal:.1} s, quantize {:.1} s",
        t0.elapsed().as_secs_f64() - t_gen - t_cal
    );
    Ok(layer)
}

/// Builds the CPU demo checkpoint unless a complete one with the same recipe is cached.
fn ensure_checkpoint(dir: &Path, experts: usize, rebuild: bool) -> anyhow::Result<()> {
    let marker = dir.join("megamoe-demo.json");
    let want = serde_json::json!({ "recipe": RECIPE, "experts": experts, "layers": CPU_LAYERS });
    if !rebuild {
        if let Ok(s) = std::fs::read_to_string(&marker) {
            if serde_json::from_str::<serde_json::Value>(&s).ok().as_ref() == Some(&want) {
                println!("checkpoint   {} (cached)", dir.display());
                return Ok(());
            }
        }
    }
    let t0 = Instant::now();
    let _ = std::fs::remove_file(&marker);
    let cfg = demo_config(experts);
    let calib = synthetic::random_hidden(2, cfg.hidden_size, 1234);
    let mut layers = Vec::new();
    for &l in &CPU_LAYERS {
        println!(
            "building     layer {l}: {experts} experts of random BF16 weights -> NVFP4 (ModelOpt rules)..."
        );
        layers.push(quantized_layer(&cfg, l, &calib)?);
    }
    megamoe::checkpoint::writer::write_layers(dir, &layers, Naming::DeepSeekV4, 1)?;
    // The marker goes last: an interrupted build is never mistaken for a complete one.
    std::fs::write(&marker, serde_json::to_string_pretty(&want)?)
        .with_context(|| format!("writing {}", marker.display()))?;
    println!("checkpoint   {} (built in {:.1} s)", dir.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

/// Relative L2 error of `got` against `want`.
fn rel_l2(got: &[f32], want: impl Iterator<Item = f64>) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (a, b) in got.iter().zip(want) {
        num += (*a as f64 - b).powi(2);
        den += b * b;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// One layer's outcome.
struct Outcome {
    layer: usize,
    ms: f64,
    rel_err: f64,
    routing_agree: f64,
    tol: f64,
}

impl Outcome {
    fn pass(&self) -> bool {
        self.rel_err < self.tol && self.routing_agree >= 0.99
    }
}

fn agreement(a: &[i32], b: &[i32]) -> f64 {
    a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len().max(1) as f64
}

/// Times `engine` on `input`: one warm-up, then the median of up to 7 runs (fewer past ~0.5 s).
fn timed(
    engine: &mut dyn MoeEngine,
    input: &ForwardInput<'_>,
    mode: Mode,
) -> anyhow::Result<(ForwardOutput, f64)> {
    // Warm-up (kernel compilation, first-touch allocations), then one timed run, and more
    // when a run is short.
    let out = engine.forward(input, mode, None)?;
    let mut times = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        engine.forward(input, mode, None)?;
        times.push(t.elapsed().as_secs_f64());
        if times.iter().sum::<f64>() > 0.5 {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok((out, times[times.len() / 2] * 1e3))
}

fn cuda_usable() -> Result<(), String> {
    let probe =
        Arc::new(synthetic::random_layer(&synthetic::tiny_config(), WeightFormat::Nvfp4, 1, false, 1));
    create_engine(BackendKind::Cuda, probe, 1).map(|_| ()).map_err(|e| e.to_string())
}

fn print_header(kind: &str, cfg: &MoeConfig, tokens: usize, mode: Mode) {
    println!("megamoe demo — DeepSeek-V4-shaped NVFP4 MoE layer ({kind})");
    println!(
        "shape        H {} x I {}, {} routed experts, top-{}, {} shared expert, routed_scaling_factor {}",
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.n_shared_experts,
        cfg.routed_scaling_factor
    );
    println!("input        {tokens} tokens, mode {mode}");
}

fn cpu_demo(args: &Args, kind: BackendKind) -> anyhow::Result<Vec<Outcome>> {
    let tokens = args.tokens.unwrap_or(4);
    let cfg = demo_config(args.experts);
    print_header("V4-Pro sizes, experts scaled down for the CPU", &cfg, tokens, args.mode);
    let dir = cache_dir(args).join(format!("v4pro-nvfp4-e{}", args.experts));
    ensure_checkpoint(&dir, args.experts, args.rebuild)?;
    let ck = Checkpoint::open(&dir)?;
    let x = synthetic::random_hidden(tokens, cfg.hidden_size, 42);
    let ids = synthetic::random_input_ids(tokens, cfg.vocab_size, 43);
    let input = ForwardInput { x: &x, input_ids: Some(&ids) };
    let mut outcomes = Vec::new();
    for l in ck.moe_layers() {
        let layer = Arc::new(ck.load_layer_for(l, args.mode)?.layer);
        let mut engine = create_engine(kind, layer.clone(), tokens)?;
        let routing = if layer.is_hash() { "hash-routed" } else { "score-routed" };
        println!("layer {l}      {routing}, backend {}", engine.describe());
        let (out, ms) = timed(engine.as_mut(), &input, args.mode)?;
        // The oracle: the float64 forward (exact activations, so a looser bar for W4A8/W4A4,
        // whose activation rounding is part of their definition).
        let r64 = float64::forward_w4a16(&layer, &x, Some(&ids))?;
        // The float64 oracle keeps activations exact, so in W4A8/W4A4 the error is mostly the mode's
        // own activation rounding: the bar is the expected size of that noise, not 2e-3.
        let tol = match args.mode {
            Mode::W4A16 => 2e-3,
            Mode::W4A8 => 1e-1,
            Mode::W4A4 => 3e-1,
        };
        outcomes.push(Outcome {
            layer: l,
            ms,
            rel_err: rel_l2(&out.y, r64.y.iter().copied()),
            routing_agree: agreement(&out.topk_ids, &r64.topk_ids),
            tol,
        });
    }
    Ok(outcomes)
}

fn gpu_demo(args: &Args) -> anyhow::Result<Vec<Outcome>> {
    let tokens = args.tokens.unwrap_or(32);
    let cfg = synthetic::v4_pro_config();
    print_header("the full V4-Pro layer, FP4 codes and scales drawn directly", &cfg, tokens, args.mode);
    let l = cfg.num_hash_layers; // the first score-routed layer
    let t0 = Instant::now();
    let layer = Arc::new(synthetic::random_layer(&cfg, WeightFormat::Nvfp4, l, false, 2026));
    println!("layer {l}      generated in {:.1} s", t0.elapsed().as_secs_f64());
    let x = synthetic::random_hidden(tokens, cfg.hidden_size, 42);
    let input = ForwardInput { x: &x, input_ids: None };
    let mut engine = create_engine(BackendKind::Cuda, layer.clone(), tokens)?;
    println!("backend      {}", engine.describe());
    let (out, ms) = timed(engine.as_mut(), &input, args.mode)?;
    let t0 = Instant::now();
    let want = reference::forward(&layer, &input, args.mode, None)?;
    println!("reference    CPU, {:.1} s", t0.elapsed().as_secs_f64());
    let tol = super::run_model::tolerance(args.mode);
    Ok(vec![Outcome {
        layer: l,
        ms,
        rel_err: rel_l2(&out.y, want.y.iter().map(|&v| v as f64)),
        routing_agree: agreement(&out.topk_ids, &want.topk_ids),
        tol,
    }])
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(args.tokens != Some(0), "--tokens must be at least 1");
    anyhow::ensure!(args.experts >= 6, "--experts must be at least top-k (6)");
    let t0 = Instant::now();
    let gpu = match args.backend {
        BackendKind::Cpu => false,
        // Fail before generating a 14 GB layer when the GPU cannot be used.
        BackendKind::Cuda => {
            cuda_usable().map_err(|e| anyhow::anyhow!("--backend cuda: {e}"))?;
            true
        }
        BackendKind::Auto => match cuda_usable() {
            Ok(()) => true,
            Err(e) => {
                println!("note         no usable GPU ({e}); running the CPU demo");
                false
            }
        },
    };
    let outcomes = if gpu { gpu_demo(&args)? } else { cpu_demo(&args, BackendKind::Cpu)? };
    let oracle = if gpu { "CPU reference (fp32)" } else { "float64 w4a16 forward" };
    if !gpu && args.mode != Mode::W4A16 {
        println!(
            "note         {} rounds activations and the float64 oracle does not: the error below is \
             mostly that rounding (exactness of the mode itself is tested against the golden fixtures)",
            args.mode
        );
    }
    println!();
    println!("layer | time/forward | rel L2 error vs {oracle} | routing agreement | result");
    let mut all = true;
    for o in &outcomes {
        all &= o.pass();
        println!(
            "{:5} | {:9.2} ms | {:.2e} (tolerance {:.0e}) | {:.1}% | {}",
            o.layer,
            o.ms,
            o.rel_err,
            o.tol,
            o.routing_agree * 100.0,
            if o.pass() { "PASS" } else { "FAIL" }
        );
    }
    println!("\n{} in {:.1} s", if all { "PASS" } else { "FAIL" }, t0.elapsed().as_secs_f64());
    Ok(if all { 0 } else { 1 })
}

//! `megamoe run-model`: every MoE layer of a model (a checkpoint's, partial checkpoints included,
//! or a synthetic stack) loaded once onto one device and run in sequence on one batch of random
//! tokens, each layer's output fed to the next through the residual stream as the model does:
//! `h += y`, next input `x = bf16(h / rms(h))` (the pre-FFN norm without its weight; on the GPU
//! [`CudaModel::enqueue_residual_norm`], on the CPU the same math as
//! `crates/megamoe/tests/stacked_layers.rs`).
//!
//! Prints the per-layer times (CUDA events between layers of an eager run), the eager total, with
//! `--graph` the replay time of the whole model captured as one CUDA graph and whether its output
//! is bitwise the eager run's, the device memory, and the drift against the CPU reference on the
//! first and the last layer: that layer's actual input is run through `reference::forward` on the
//! regenerated (synthetic) or reloaded (checkpoint) host layer and the outputs are compared by
//! relative L2 (tokens whose expert set differs are excluded and counted). Exits with 1 when the
//! drift exceeds 2e-3 (W4A16) / 2e-2 (W4A8, W4A4) or an output is not finite.
//!
//! [`CudaModel::enqueue_residual_norm`]: megamoe::backend::cuda::CudaModel::enqueue_residual_norm

use super::bench::{row_progress, BenchShape, ForwardFormat, GemmFamily};
use anyhow::Context;
use half::bf16;
use megamoe::backend::BackendKind;
use megamoe::checkpoint::{Checkpoint, MoeLayer};
use megamoe::config::MoeConfig;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::{reference, synthetic};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `megamoe run-model`.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory: every MoE layer it holds is run, in index order.
    #[arg(long, conflicts_with = "synthetic", required_unless_present = "synthetic")]
    pub checkpoint: Option<PathBuf>,
    /// A synthetic model of this shape instead of a checkpoint (FP4 codes and scales drawn
    /// directly; hash-routed layers where the config says).
    #[arg(long, value_enum)]
    pub synthetic: Option<BenchShape>,
    /// Synthetic: MoE layers 0..N (default 2).
    #[arg(long, value_name = "N", requires = "synthetic", conflicts_with = "checkpoint")]
    pub layers: Option<usize>,
    /// Synthetic: routed experts per layer (default: the shape's own count).
    #[arg(long, requires = "synthetic", conflicts_with = "checkpoint")]
    pub experts: Option<usize>,
    /// Synthetic: expert format (default nvfp4).
    #[arg(long, value_enum, requires = "synthetic", conflicts_with = "checkpoint")]
    pub format: Option<ForwardFormat>,
    /// Tokens of the batch.
    #[arg(long, default_value_t = 8)]
    pub tokens: usize,
    /// Backend: cpu, cuda or auto (CUDA when usable, else the CPU).
    #[arg(long, default_value = "auto")]
    pub backend: BackendKind,
    #[arg(long, default_value = "w4a16", help = megamoe::forward::MODE_HELP)]
    pub mode: Mode,
    /// CUDA: also capture the whole model as one CUDA graph and time its replays.
    #[arg(long)]
    pub graph: bool,
    /// CUDA: timed graph replays with `--graph` (the median is reported).
    #[arg(long, default_value_t = 10)]
    pub replays: usize,
    /// CUDA: GEMM family of every layer (default: the runtime's choice).
    #[arg(long, value_enum)]
    pub family: Option<GemmFamily>,
    /// Seed of the tokens (and of the synthetic layers).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Where the layers come from.
enum Source {
    /// A checkpoint, and the load warnings counted so far (each is also logged when raised).
    Checkpoint(Box<Checkpoint>, std::cell::Cell<usize>),
    Synthetic {
        shape: BenchShape,
        cfg: MoeConfig,
        format: WeightFormat,
        layers: usize,
        seed: u64,
    },
}

impl Source {
    fn open(a: &Args) -> anyhow::Result<Source> {
        if let Some(dir) = &a.checkpoint {
            let ck = Checkpoint::open(dir).with_context(|| format!("--checkpoint {}", dir.display()))?;
            anyhow::ensure!(
                !ck.moe_layers().is_empty(),
                "{}: the checkpoint holds no MoE layer",
                dir.display()
            );
            return Ok(Source::Checkpoint(Box::new(ck), Default::default()));
        }
        let shape = a.synthetic.expect("clap: --checkpoint or --synthetic");
        let layers = a.layers.unwrap_or(2);
        anyhow::ensure!(layers > 0, "--layers must be at least 1");
        let mut cfg = shape.config();
        if let Some(e) = a.experts {
            anyhow::ensure!(e >= cfg.num_experts_per_tok, "--experts must be at least top-k");
            cfg.n_routed_experts = e;
        }
        cfg.num_hidden_layers = cfg.num_hidden_layers.max(layers);
        let format = a.format.unwrap_or(ForwardFormat::Nvfp4).weight_format();
        Ok(Source::Synthetic { shape, cfg, format, layers, seed: a.seed })
    }

    fn config(&self) -> &MoeConfig {
        match self {
            Source::Checkpoint(ck, _) => ck.config(),
            Source::Synthetic { cfg, .. } => cfg,
        }
    }

    /// The model's MoE layer indices, in order.
    fn layers(&self) -> Vec<usize> {
        match self {
            Source::Checkpoint(ck, _) => ck.moe_layers(),
            Source::Synthetic { layers, .. } => (0..*layers).collect(),
        }
    }

    /// Loads (checkpoint) or generates (synthetic, the same layer every time) layer `l`.
    fn load(&self, l: usize, mode: Mode) -> megamoe::Result<MoeLayer> {
        match self {
            Source::Checkpoint(ck, warnings) => {
                let loaded = ck.load_layer_for(l, mode)?;
                warnings.set(warnings.get() + loaded.warnings.len());
                Ok(loaded.layer)
            }
            Source::Synthetic { cfg, format, seed, .. } => Ok(synthetic::random_layer(
                cfg,
                *format,
                l,
                cfg.is_hash_layer(l),
                1000 + seed.wrapping_mul(1_000_003) + l as u64,
            )),
        }
    }

    /// [`Source::load`] again (the drift check), without counting warnings a second time.
    fn reload(&self, l: usize, mode: Mode) -> megamoe::Result<MoeLayer> {
        match self {
            Source::Checkpoint(ck, _) => Ok(ck.load_layer_for(l, mode)?.layer),
            Source::Synthetic { .. } => self.load(l, mode),
        }
    }

    /// Load warnings counted so far.
    fn warnings(&self) -> usize {
        match self {
            Source::Checkpoint(_, w) => w.get(),
            Source::Synthetic { .. } => 0,
        }
    }

    fn describe(&self) -> String {
        let c = self.config();
        let dims = format!(
            "H {}, I {}, {} experts, top-{}",
            c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok
        );
        match self {
            Source::Checkpoint(ck, _) => format!("checkpoint {} ({dims})", ck.dir().display()),
            Source::Synthetic { shape, format, .. } => {
                format!("synthetic {} ({dims}, {format})", shape.name())
            }
        }
    }
}

/// `bf16(v / rms(v))` per token row (f64 sums), as `tests/stacked_layers.rs` renormalises.
pub(crate) fn renorm(v: &[f32], h: usize) -> Vec<bf16> {
    v.chunks(h)
        .flat_map(|row| {
            let ss: f64 = row.iter().map(|&a| a as f64 * a as f64).sum();
            let rms = (ss / h as f64).sqrt().max(1e-30);
            row.iter().map(move |&a| bf16::from_f64(a as f64 / rms))
        })
        .collect()
}

/// The drift of one layer's backend output against the CPU reference on the same input.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Drift {
    /// Model layer index.
    pub layer: usize,
    /// Relative L2 error of y over the tokens compared (NaN when none is).
    pub rel_l2: f64,
    /// Tokens excluded because the backend chose another expert set than the reference.
    pub excluded: usize,
    /// Tokens.
    pub tokens: usize,
}

/// Compares `y` / `topk_ids` (a backend's output of `layer` on `x`) with `reference::forward`.
pub(crate) fn drift(
    layer: &MoeLayer,
    x: &[bf16],
    ids: &[i64],
    y: &[f32],
    topk_ids: &[i32],
    mode: Mode,
) -> anyhow::Result<Drift> {
    let (h, k) = (layer.config.hidden_size, layer.config.num_experts_per_tok);
    let input = ForwardInput { x, input_ids: layer.is_hash().then_some(ids) };
    let want = reference::forward(layer, &input, mode, None)?;
    let tokens = x.len() / h;
    let (mut num, mut den, mut excluded) = (0f64, 0f64, 0);
    for t in 0..tokens {
        let set = |v: &[i32]| {
            let mut s = v[t * k..(t + 1) * k].to_vec();
            s.sort_unstable();
            s
        };
        if set(topk_ids) != set(&want.topk_ids) {
            excluded += 1;
            continue;
        }
        for (a, b) in y[t * h..(t + 1) * h].iter().zip(&want.y[t * h..(t + 1) * h]) {
            num += (*a as f64 - *b as f64).powi(2);
            den += (*b as f64).powi(2);
        }
    }
    let rel_l2 = if excluded == tokens {
        f64::NAN
    } else if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    Ok(Drift { layer: layer.index, rel_l2, excluded, tokens })
}

/// The drift tolerance of `mode` (W4A16 is exact math; quantized modes round activations, and a
/// rounding boundary crossed by a last-bit difference moves a value by one quantization step).
pub(crate) fn tolerance(mode: Mode) -> f64 {
    megamoe::diagnostics::trace::threshold(megamoe::trace::Stage::Output, mode)
}

/// For a checked layer: its index, input x, output y, chosen experts, and the host layer when the
/// backend still holds it (the CPU run; the CUDA run dropped it after the upload, so it reloads).
type Checked = (usize, Vec<bf16>, Vec<f32>, Vec<i32>, Option<Arc<MoeLayer>>);

/// What a backend's run reports.
struct Outcome {
    /// `(layer index, hash-routed, milliseconds)` per layer of the eager run.
    times: Vec<(usize, bool, f64)>,
    /// The eager run's total, ms.
    total_ms: f64,
    /// For the first and the last layer: its input x, output y and chosen experts.
    checks: Vec<Checked>,
    /// Layers whose output had non-finite values.
    non_finite: Vec<usize>,
    /// The token ids of the batch (hash layers).
    ids: Vec<i64>,
}

/// Random token ids below the smallest hash table of the model (`vocab` when there is none).
fn token_ids(tokens: usize, vocab: usize, seed: u64) -> Vec<i64> {
    synthetic::random_input_ids(tokens, vocab.max(1), 43 + seed)
}

/// The batch's initial residual stream `[T, H]` ~ N(0, 1).
fn initial_h(tokens: usize, h: usize, seed: u64) -> Vec<f32> {
    synthetic::random_hidden(tokens, h, 42 + seed).iter().map(|v| v.to_f32()).collect()
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(a.tokens > 0, "--tokens must be at least 1");
    anyhow::ensure!(a.replays > 0, "--replays must be at least 1");
    let src = Source::open(&a)?;
    let layers = src.layers();
    println!(
        "run-model: {} MoE layer(s) {:?} of {}, T={} tokens, mode {}",
        layers.len(),
        layers,
        src.describe(),
        a.tokens,
        a.mode
    );
    let cuda = super::wants_cuda(a.backend);
    let out = if cuda {
        run_cuda(&a, &src)?
    } else {
        for (on, flag) in [(a.graph, "--graph"), (a.family.is_some(), "--family")] {
            if on {
                println!("note: {flag} needs the CUDA backend; ignored on the CPU");
            }
        }
        run_cpu(&a, &src)?
    };
    report(&a, &src, out)
}

/// Prints the per-layer table and the drift, and returns the exit code.
fn report(a: &Args, src: &Source, out: Outcome) -> anyhow::Result<i32> {
    if src.warnings() > 0 {
        // Logged when raised (tracing, default level `warn`); counted so a quieter log keeps them.
        eprintln!("{} load warning(s); see the log above or `megamoe inspect --validate`", src.warnings());
    }
    println!("\nlayer  routing  time_ms (eager; CUDA: forward + residual norm, events between layers)");
    for (l, hash, ms) in &out.times {
        println!("{l:5}  {:<7}  {ms:9.3}", if *hash { "hash" } else { "score" });
    }
    println!("total eager: {:.3} ms over {} layer(s)", out.total_ms, out.times.len());
    let tol = tolerance(a.mode);
    let mut pass = out.non_finite.is_empty();
    if !out.non_finite.is_empty() {
        println!("NON-FINITE outputs in layer(s) {:?}", out.non_finite);
    }
    println!(
        "\ndrift vs the CPU reference (relative L2 of y on the layer's actual input; tokens whose \
         expert set differs are excluded; tolerance {tol:.0e}):"
    );
    let first = out.checks.first().map(|c| c.0);
    for (l, x, y, topk, held) in &out.checks {
        let t0 = Instant::now();
        let layer = match held {
            Some(layer) => layer.clone(),
            // The reload raises the load's warnings again: already logged and counted, so not shown.
            None => Arc::new(tracing::subscriber::with_default(
                tracing::subscriber::NoSubscriber::default(),
                || src.reload(*l, a.mode),
            )?),
        };
        let d = drift(&layer, x, &out.ids, y, topk, a.mode)?;
        let ok = d.rel_l2 <= tol && y.iter().all(|v| v.is_finite());
        pass &= ok;
        let which = if Some(*l) == first && out.checks.len() > 1 { "first" } else { "last" };
        println!(
            "  layer {l} ({which}): drift {:.2e}, {} of {} tokens excluded (reference {:.1} s) {}",
            d.rel_l2,
            d.excluded,
            d.tokens,
            t0.elapsed().as_secs_f64(),
            if ok { "ok" } else { "FAIL" }
        );
    }
    println!("\n{}", if pass { "PASS" } else { "FAIL" });
    Ok(if pass { 0 } else { 1 })
}

/// The CPU backend: the same loop through the reference engine.
fn run_cpu(a: &Args, src: &Source) -> anyhow::Result<Outcome> {
    let c = src.config().clone();
    let (h, t) = (c.hidden_size, a.tokens);
    let indices = src.layers();
    let pb = row_progress(indices.len(), "loading layers");
    let mut engines = Vec::with_capacity(indices.len());
    let mut vocab = c.vocab_size;
    for &l in &indices {
        let layer = Arc::new(src.load(l, a.mode)?);
        if let Some(tid) = &layer.router.tid2eid {
            vocab = vocab.min(tid.len() / c.num_experts_per_tok);
        }
        let engine = megamoe::backend::create_engine(BackendKind::Cpu, layer.clone(), t)?;
        engines.push((layer, engine));
        pb.inc(1);
    }
    pb.finish_and_clear();
    if let Some((_, e)) = engines.first() {
        println!("backend: {}", e.describe());
    }
    let ids = token_ids(t, vocab, a.seed);
    let mut hs = initial_h(t, h, a.seed);
    let (mut times, mut checks, mut non_finite) = (Vec::new(), Vec::new(), Vec::new());
    let last = engines.len() - 1;
    let t_all = Instant::now();
    for (j, (layer, engine)) in engines.iter_mut().enumerate() {
        let x = renorm(&hs, h);
        let input = ForwardInput { x: &x, input_ids: layer.is_hash().then_some(&ids[..]) };
        let t0 = Instant::now();
        let out = engine.forward(&input, a.mode, None)?;
        times.push((layer.index, layer.is_hash(), t0.elapsed().as_secs_f64() * 1e3));
        if out.y.iter().any(|v| !v.is_finite()) {
            non_finite.push(layer.index);
        }
        hs.iter_mut().zip(&out.y).for_each(|(a, b)| *a += b);
        if j == 0 || j == last {
            checks.push((layer.index, x, out.y, out.topk_ids, Some(layer.clone())));
        }
    }
    let total_ms = t_all.elapsed().as_secs_f64() * 1e3;
    Ok(Outcome { times, total_ms, checks, non_finite, ids })
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_a: &Args, _src: &Source) -> anyhow::Result<Outcome> {
    anyhow::bail!("--backend cuda: this build has no CUDA support (built without the `cuda` feature)")
}

/// The CUDA backend: one [`CudaModel`], one stream, one workspace.
///
/// [`CudaModel`]: megamoe::backend::cuda::CudaModel
#[cfg(feature = "cuda")]
fn run_cuda(a: &Args, src: &Source) -> anyhow::Result<Outcome> {
    use super::gpu;
    use megamoe::backend::cuda::params::{STATUS_BAD_EXPERT_ID, STATUS_BAD_TOKEN_ID};
    use megamoe::backend::cuda::{CudaModel, DType, DeviceTensor, ForwardIo, LayerWeights, Routing};
    let c = src.config().clone();
    let (h, k, t) = (c.hidden_size, c.num_experts_per_tok, a.tokens);
    let device = gpu::open_device()?;
    let (free0, total) = device.memory_info()?;
    let indices = src.layers();
    let pb = row_progress(indices.len(), "loading layers");
    let t_load = Instant::now();
    let mut model = CudaModel::load(
        &device,
        indices.iter().map(|&l| src.load(l, a.mode)),
        t,
        a.family.map(GemmFamily::name),
        |w| {
            pb.set_message(format!("layer {} uploaded", w.index()));
            pb.inc(1);
        },
    )?;
    pb.finish_and_clear();
    model.workspace_mut().prepare(a.mode, false)?;
    let fams: Vec<String> = model.layers().iter().map(LayerWeights::family_label).collect();
    println!(
        "backend: cuda {} {} (gemm {}), {} layer(s) loaded in {:.1} s",
        device.arch(),
        device.name(),
        fams.first().map_or("?", String::as_str),
        model.layers().len(),
        t_load.elapsed().as_secs_f64()
    );
    if fams.iter().any(|f| Some(f) != fams.first()) {
        println!("  gemm families per layer: {fams:?}");
    }
    let stream = device.new_stream()?;
    let vocab =
        model.layers().iter().filter(|w| w.is_hash()).map(|w| w.vocab()).min().unwrap_or(c.vocab_size);
    let ids = token_ids(t, vocab, a.seed);
    let h0 = initial_h(t, h, a.seed);
    let x0 = renorm(&h0, h);
    let ids32: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
    let buf = |bytes: usize, what: &str| device.alloc(bytes, what);
    let (h0_d, hs_d) = (device.upload(&h0, "h0")?, buf(t * h * 4, "residual stream")?);
    let (x0_d, x_d) = (device.upload(&x0, "x0")?, buf(t * h * 2, "x")?);
    let y_d = buf(t * h * 4, "y")?;
    let ids_d = device.upload(&ids32, "input_ids")?;
    let (topk_d, topw_d) = (buf(t * k * 4, "topk_ids")?, buf(t * k * 4, "topk_weights")?);
    let (free1, _) = device.memory_info()?;
    println!(
        "device memory: weights {:.1} MB, workspace {:.1} MB; free {:.2} of {:.2} GB before the load, {:.2} GB after",
        model.weights_bytes() as f64 / 1e6,
        model.workspace().device_bytes() as f64 / 1e6,
        free0 as f64 / 1e9,
        total as f64 / 1e9,
        free1 as f64 / 1e9
    );
    let reset = || -> anyhow::Result<()> {
        // SAFETY: h0/hs hold T*H f32 and x0/x T*H bf16; all live until the stream is synchronised.
        unsafe {
            gpu::copy(&stream, hs_d.ptr(), h0_d.ptr(), t * h * 4)?;
            gpu::copy(&stream, x_d.ptr(), x0_d.ptr(), t * h * 2)?;
        }
        Ok(())
    };
    let io = |hash: bool| ForwardIo {
        tokens: t,
        x: DeviceTensor::new(x_d.ptr(), t, h, DType::Bf16),
        input_ids: hash.then(|| DeviceTensor::new(ids_d.ptr(), t, 1, DType::I32)),
        y: DeviceTensor::new(y_d.ptr(), t, h, DType::F32),
        topk_ids: Some(DeviceTensor::new(topk_d.ptr(), t, k, DType::I32)),
        topk_weights: Some(DeviceTensor::new(topw_d.ptr(), t, k, DType::F32)),
        routing: Routing::Internal,
    };
    let model = &model;
    let ws = model.workspace();
    let step = |j: usize, s| -> anyhow::Result<()> {
        let w = &model.layers()[j];
        w.enqueue_forward(ws, &io(w.is_hash()), a.mode, s)?;
        // SAFETY: hs, y and x hold T*H elements of their types (allocated above).
        unsafe { model.enqueue_residual_norm(hs_d.ptr(), y_d.ptr(), x_d.ptr(), t, h, s)? };
        Ok(())
    };
    let sref = gpu::stream_ref(&stream);
    let n = model.layers().len();

    // Run 1 (also the warm-up): synchronised per layer, the first and last layer's x, y and
    // experts downloaded, every layer's y checked.
    reset()?;
    let (mut checks, mut non_finite) = (Vec::new(), Vec::new());
    for j in 0..n {
        let idx = model.layers()[j].index();
        let x = if j == 0 || j == n - 1 {
            gpu::sync(&stream, "before a layer")?;
            Some(x_d.read::<bf16>(&stream, 0, t * h)?)
        } else {
            None
        };
        // The residual norm only reads y (and the ids it leaves alone): y and the experts are still
        // this layer's after the step.
        step(j, sref)?;
        gpu::sync(&stream, &format!("layer {idx}"))?;
        let y = y_d.read::<f32>(&stream, 0, t * h)?;
        if y.iter().any(|v| !v.is_finite()) {
            non_finite.push(idx);
        }
        if let Some(x) = x {
            checks.push((idx, x, y, topk_d.read::<i32>(&stream, 0, t * k)?, None));
        }
    }
    gpu::sync(&stream, "run 1")?;
    let h_check = hs_d.read::<f32>(&stream, 0, t * h)?;
    let status = ws.take_status()?;
    if status & (STATUS_BAD_EXPERT_ID | STATUS_BAD_TOKEN_ID) as u32 != 0 {
        println!("warning: the forwards reported malformed ids (status 0x{status:x})");
    }

    // Run 2, timed: eager, events between layers.
    reset()?;
    let mut marks = vec![gpu::event(&stream)?];
    for j in 0..n {
        step(j, sref)?;
        marks.push(gpu::event(&stream)?);
    }
    gpu::sync(&stream, "eager run")?;
    let mut times = Vec::with_capacity(n);
    for j in 0..n {
        let w = &model.layers()[j];
        times.push((w.index(), w.is_hash(), gpu::elapsed_ms(&marks[j], &marks[j + 1])?));
    }
    let total_ms = gpu::elapsed_ms(&marks[0], &marks[n])?;
    let h_eager = hs_d.read::<f32>(&stream, 0, t * h)?;
    let y_eager = y_d.read::<f32>(&stream, 0, t * h)?;
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    println!(
        "eager runs bitwise repeatable: {}",
        if same(&h_check, &h_eager) { "yes" } else { "NO (the two eager runs differ)" }
    );

    if a.graph {
        let graph = gpu::capture(&stream, |s| (0..n).try_for_each(|j| step(j, s)))?;
        reset()?;
        graph.launch().context("graph launch")?; // warm-up
        let mut ms = Vec::with_capacity(a.replays);
        for _ in 0..a.replays {
            reset()?;
            let e0 = gpu::event(&stream)?;
            graph.launch().context("graph launch")?;
            let e1 = gpu::event(&stream)?;
            ms.push(gpu::elapsed_ms(&e0, &e1)?);
        }
        gpu::sync(&stream, "graph replays")?;
        let (med, min) = super::median_min(&ms);
        let equal = same(&hs_d.read::<f32>(&stream, 0, t * h)?, &h_eager)
            && same(&y_d.read::<f32>(&stream, 0, t * h)?, &y_eager);
        println!(
            "graph replay (whole model, {n} layer(s)): median {med:.3} ms of {} (min {min:.3}); output bitwise \
             equal to the eager run: {}",
            a.replays,
            if equal { "yes" } else { "NO" }
        );
    }
    gpu::sync(&stream, "end")?;
    Ok(Outcome { times, total_ms, checks, non_finite, ids })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renorm_gives_unit_rms_rows() {
        let v: Vec<f32> = (0..512).map(|i| (i as f32 - 200.0) * 0.37).collect();
        let x = renorm(&v, 256);
        for row in x.chunks(256) {
            let ms: f64 = row.iter().map(|a| a.to_f64().powi(2)).sum::<f64>() / 256.0;
            assert!((ms.sqrt() - 1.0).abs() < 1e-2, "{ms}");
        }
        assert!(renorm(&[0.0; 4], 4).iter().all(|v| v.to_f32() == 0.0));
    }

    #[test]
    fn drift_is_zero_on_the_reference_itself_and_sees_changes() {
        let cfg = synthetic::tiny_config();
        let layer = synthetic::random_layer(&cfg, WeightFormat::Nvfp4, 0, true, 3);
        let x = synthetic::random_hidden(5, cfg.hidden_size, 4);
        let ids = synthetic::random_input_ids(5, cfg.vocab_size, 5);
        let out =
            reference::forward(&layer, &ForwardInput { x: &x, input_ids: Some(&ids) }, Mode::W4A16, None)
                .unwrap();
        let d = drift(&layer, &x, &ids, &out.y, &out.topk_ids, Mode::W4A16).unwrap();
        assert_eq!((d.rel_l2, d.excluded, d.tokens, d.layer), (0.0, 0, 5, 0));
        // Another expert set on token 1 excludes it; a scaled output is measured.
        let mut topk = out.topk_ids.clone();
        topk[4] = (0..16).find(|e| !out.topk_ids[4..8].contains(e)).unwrap();
        let y: Vec<f32> = out.y.iter().map(|v| v * 1.01).collect();
        let d = drift(&layer, &x, &ids, &y, &topk, Mode::W4A16).unwrap();
        assert_eq!(d.excluded, 1);
        assert!((d.rel_l2 - 0.01).abs() < 1e-6, "{}", d.rel_l2);
        assert_eq!(tolerance(Mode::W4A16), 2e-3);
        assert_eq!(tolerance(Mode::W4A4), 2e-2);
    }
}

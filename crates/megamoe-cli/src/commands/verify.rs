//! `megamoe verify`: a sweep of shapes, formats, modes and routings on a backend (the GPU by
//! default) against the CPU reference, with fresh random data each time; prints a table and exits
//! non-zero on any failure. `--timings` adds graph-replay timings of one V4-Pro rank.

use super::run_model::tolerance;
use megamoe::backend::{create_engine, BackendKind, MoeEngine};
use megamoe::checkpoint::MoeLayer;
use megamoe::config::MoeConfig;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, ForwardOutput, Mode};
use megamoe::synthetic;
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `megamoe verify`.
#[derive(clap::Args)]
pub struct Args {
    /// Backend to check against the CPU reference (cuda, auto or cpu).
    #[arg(long, default_value = "cuda")]
    pub backend: String,
    /// A short sweep (tiny shapes and one mid-size skewed layer).
    #[arg(long)]
    pub quick: bool,
    /// Also time graph replays of one V4-Pro rank (48 experts) at T = 1, 64, 512 (CUDA only).
    #[arg(long)]
    pub timings: bool,
    /// Only the timings, no sweep.
    #[arg(long)]
    pub timings_only: bool,
    /// Base random seed (each row derives its own).
    #[arg(long, default_value_t = 20261117)]
    pub seed: u64,
    /// Only these cases of the sweep (comma-separated names, e.g. `mid-skew,pro-dims`), each row
    /// with the seed it has in the whole sweep: a part of the sweep under a slow tool.
    #[arg(long, value_delimiter = ',')]
    pub cases: Vec<String>,
    /// Only rows of these weight formats (e.g. `mxfp4`), seeds as in the whole sweep.
    #[arg(long, value_delimiter = ',')]
    pub formats: Vec<String>,
    /// Only rows of these modes (e.g. `w4a8`), seeds as in the whole sweep.
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Only rows of these token counts (e.g. `17`), seeds as in the whole sweep.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<usize>,
    /// Expert / tensor parallelism: with `--ep N` every row runs as an EP group and is checked
    /// against the single engine of the same backend (EP = 1) and the CPU reference.
    #[command(flatten)]
    pub par: super::parallel::EpArgs,
}

struct Case {
    name: &'static str,
    cfg: MoeConfig,
    tokens: Vec<usize>,
    formats: Vec<WeightFormat>,
    hash: bool,
    skew: bool,
}

fn cfg(h: usize, i: usize, e: usize, k: usize) -> MoeConfig {
    MoeConfig {
        hidden_size: h,
        moe_intermediate_size: i,
        n_routed_experts: e,
        num_experts_per_tok: k,
        ..synthetic::tiny_config()
    }
}

/// Every case of the sweep (rows `--cases` leaves out are skipped as they come, so that the kept
/// ones keep their whole-sweep seeds), or an error naming the names `--cases` has that the sweep
/// does not.
fn sweep_cases(args: &Args) -> anyhow::Result<Vec<Case>> {
    let all = cases(args.quick);
    let unknown: Vec<&String> =
        args.cases.iter().filter(|w| !all.iter().any(|c| c.name == w.as_str())).collect();
    if !unknown.is_empty() {
        let names: Vec<&str> = all.iter().map(|c| c.name).collect();
        anyhow::bail!(
            "--cases: no case named {} in the{} sweep (its cases: {})",
            unknown.iter().map(|u| format!("{u:?}")).collect::<Vec<_>>().join(", "),
            if args.quick { " quick" } else { "" },
            names.join(", ")
        );
    }
    Ok(all)
}

/// Whether `--formats` keeps rows of `format` (all when empty).
fn format_wanted(args: &Args, format: WeightFormat) -> bool {
    args.formats.is_empty() || args.formats.iter().any(|f| f.eq_ignore_ascii_case(format.name()))
}

/// Whether `--modes` keeps rows of `mode` (all when empty).
fn mode_wanted(args: &Args, mode: Mode) -> bool {
    args.modes.is_empty() || args.modes.iter().any(|m| m.eq_ignore_ascii_case(mode.name()))
}

/// Whether `--cases` keeps `case` (all when empty).
fn wanted(args: &Args, case: &Case) -> bool {
    args.cases.is_empty() || args.cases.iter().any(|w| w == case.name)
}

fn cases(quick: bool) -> Vec<Case> {
    use WeightFormat::*;
    let all = WeightFormat::ALL.to_vec();
    if quick {
        return vec![
            Case {
                name: "tiny",
                cfg: synthetic::tiny_config(),
                tokens: vec![1, 17, 129],
                formats: all,
                hash: false,
                skew: false,
            },
            Case {
                name: "tiny-hash",
                cfg: synthetic::tiny_config(),
                tokens: vec![33],
                formats: vec![Nvfp4],
                hash: true,
                skew: true,
            },
            Case {
                name: "mid-skew",
                cfg: cfg(1024, 512, 64, 6),
                tokens: vec![200],
                formats: vec![Nvfp4, Mxfp4],
                hash: false,
                skew: true,
            },
        ];
    }
    let pro = synthetic::v4_pro_config();
    let flash = synthetic::v4_flash_config();
    vec![
        Case {
            name: "tiny",
            cfg: synthetic::tiny_config(),
            tokens: vec![1, 3, 17, 64, 129, 512, 1000, 4096],
            formats: all.clone(),
            hash: false,
            skew: false,
        },
        Case {
            name: "tiny-hash",
            cfg: synthetic::tiny_config(),
            tokens: vec![129],
            formats: vec![Nvfp4, Mxfp4],
            hash: true,
            skew: true,
        },
        Case {
            name: "mid-skew",
            cfg: cfg(1024, 512, 64, 6),
            tokens: vec![64, 1000],
            formats: all.clone(),
            hash: false,
            skew: true,
        },
        Case {
            name: "E384-k6",
            cfg: cfg(512, 256, 384, 6),
            tokens: vec![512, 4096],
            formats: vec![Nvfp4, Mxfp4],
            hash: false,
            skew: true,
        },
        Case {
            name: "flash-dims",
            cfg: MoeConfig { n_routed_experts: 32, ..flash },
            tokens: vec![1, 17, 64],
            formats: vec![Nvfp4, Mxfp4],
            hash: false,
            skew: false,
        },
        Case {
            name: "pro-dims",
            cfg: MoeConfig { n_routed_experts: 24, ..pro },
            tokens: vec![1, 17],
            formats: vec![Nvfp4, Mxfp4],
            hash: false,
            skew: true,
        },
    ]
}

/// Relative L2 distance of `a` from `b` (the absolute one when `b` is all zeros).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Fraction of (token, choice) pairs whose expert sets agree.
fn routing_agreement(a: &[i32], b: &[i32], k: usize) -> f64 {
    let (mut same, mut total) = (0usize, 0usize);
    for (x, y) in a.chunks(k).zip(b.chunks(k)) {
        total += k;
        same += x.iter().filter(|v| y.contains(v)).count();
    }
    if total == 0 {
        1.0
    } else {
        same as f64 / total as f64
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let kind: BackendKind = args.backend.parse()?;
    if args.timings || args.timings_only {
        // Fail before the sweep and before generating a 48-expert V4-Pro layer (tens of seconds)
        // when no GPU can run the timings.
        let probe =
            Arc::new(synthetic::random_layer(&synthetic::tiny_config(), WeightFormat::Nvfp4, 1, false, 1));
        create_engine(BackendKind::Cuda, probe, 1)
            .map_err(|e| anyhow::anyhow!("--timings needs a usable CUDA GPU: {e}"))?;
    }
    let mut failures = 0usize;
    if let Some(topo) = args.par.topology()? {
        anyhow::ensure!(!(args.timings || args.timings_only), "--timings does not combine with --ep");
        failures += sweep_ep(kind, &args, topo)?;
    } else if !args.timings_only {
        failures += sweep(kind, &args)?;
    }
    if args.timings || args.timings_only {
        timings(args.seed)?;
    }
    if failures > 0 {
        println!("verify: {failures} row(s) FAILED");
        Ok(1)
    } else {
        if !args.timings_only {
            println!("verify: all rows PASS");
        }
        Ok(0)
    }
}

fn sweep(kind: BackendKind, args: &Args) -> anyhow::Result<usize> {
    let all = sweep_cases(args)?;
    println!(
        "{:<11} {:>5} {:>5} {:>5} {:>4} {:>3} {:>5} {:<6} {:<6} {:>10} {:>8} {:>7} {:>8} {:>8} result",
        "case",
        "T",
        "H",
        "I",
        "E",
        "k",
        "mode",
        "format",
        "route",
        "rel_l2",
        "routing",
        "repeat",
        "gpu_ms",
        "ref_ms"
    );
    let mut failures = 0;
    for (n, SweepRow { case, format, seed, layer, max_t }) in kept_rows(args, &all).enumerate() {
        let mut dut = create_engine(kind, layer.clone(), max_t)?;
        let mut cpu = create_engine(BackendKind::Cpu, layer.clone(), max_t)?;
        if n == 0 {
            println!("backend under test: {}", dut.describe());
        }
        for &t in case.tokens.iter().filter(|&&t| args.tokens.is_empty() || args.tokens.contains(&t)) {
            let x = synthetic::random_hidden(t, case.cfg.hidden_size, seed + t as u64);
            let ids = synthetic::random_input_ids(t, case.cfg.vocab_size, seed + 1 + t as u64);
            let input = ForwardInput { x: &x, input_ids: Some(&ids) };
            for mode in Mode::ALL {
                if (mode == Mode::W4A4 && format != WeightFormat::Nvfp4) || !mode_wanted(args, mode) {
                    continue;
                }
                failures += check_row(case, &layer, format, t, mode, &input, dut.as_mut(), cpu.as_mut());
            }
        }
    }
    Ok(failures)
}

/// One kept row of the sweep: a case in one format, its whole-sweep seed, its random layer and
/// the most tokens it runs.
struct SweepRow<'a> {
    case: &'a Case,
    format: WeightFormat,
    seed: u64,
    layer: Arc<MoeLayer>,
    max_t: usize,
}

/// The rows of `all` that `args` keeps, in sweep order. The seed counts every (case, format) row,
/// kept or not, so a filtered run reuses the whole sweep's seed for each row it keeps.
fn kept_rows<'a>(args: &'a Args, all: &'a [Case]) -> impl Iterator<Item = SweepRow<'a>> + 'a {
    all.iter()
        .flat_map(|case| case.formats.iter().map(move |&format| (case, format)))
        .zip(1u64..)
        .filter(|&((case, format), _)| wanted(args, case) && format_wanted(args, format))
        .map(|((case, format), row)| {
            let seed = args.seed.wrapping_add(row * 1000);
            let layer = case_layer(case, format, seed);
            let max_t = *case.tokens.iter().max().expect("every sweep case has token counts");
            SweepRow { case, format, seed, layer, max_t }
        })
}

/// The random layer of a sweep row: `case`'s shape in `format`, hash-routed (layer 0) or scored
/// (layer 1), skewed routing when the case asks for it.
fn case_layer(case: &Case, format: WeightFormat, seed: u64) -> Arc<MoeLayer> {
    let mut layer =
        synthetic::random_layer(&case.cfg, format, if case.hash { 0 } else { 1 }, case.hash, seed);
    if case.skew {
        synthetic::skew_routing(&mut layer, 3, case.cfg.n_routed_experts / 8);
    }
    Arc::new(layer)
}

/// The sweep with every row run as an EP group (`--ep N [--tp M]`): each row's output against
/// the single engine of the same backend (bitwise where the payloads are exact and tp = 1 on the
/// CPU; within the mode's tolerance on a GPU, whose kernels may tile a rank's smaller batches
/// differently) and against the CPU reference, and a repeat run bitwise.
fn sweep_ep(kind: BackendKind, args: &Args, topo: megamoe::parallel::Topology) -> anyhow::Result<usize> {
    let all = sweep_cases(args)?;
    use super::parallel::{EpGroup, LayerSource, Run};
    let cuda = super::wants_cuda(kind);
    let dut_kind = if cuda { BackendKind::Cuda } else { BackendKind::Cpu };
    println!("expert parallelism: {}", args.par.label(&topo));
    println!(
        "{:<11} {:>5} {:>5} {:>5} {:>4} {:>3} {:>5} {:<6} {:>10} {:>7} {:>10} {:>7} {:>8} {:>8} result",
        "case",
        "T",
        "H",
        "I",
        "E",
        "k",
        "mode",
        "format",
        "vs_ep1",
        "bitwise",
        "vs_ref",
        "repeat",
        "ep_ms",
        "ep1_ms"
    );
    let exact_payload = |mode: Mode| {
        let x = args.par.exchange();
        x.combine == megamoe::parallel::CombinePayload::F32 && x.dispatch.exact_in(mode)
    };
    // A lossy exchange: ten times the mode's tolerance (a bf16 combine, fp8 rows outside W4A8), or
    // the dispatch format's own bound where that is larger (nvfp4 rows).
    let lossy_tol = |mode: Mode| {
        let d = args.par.exchange().dispatch;
        let own = if d.exact_in(mode) { 0.0 } else { d.expected_rel_l2() };
        (10.0 * tolerance(mode)).max(own)
    };
    let mut failures = 0;
    for (n, SweepRow { case, format, seed, layer, max_t }) in kept_rows(args, &all).enumerate() {
        let mut group = match EpGroup::new(&args.par, topo, &LayerSource::Whole(&layer), cuda, max_t) {
            Ok(g) => g,
            Err(e) => {
                println!("{:<11} FAIL (building the EP group: {e:#})", case.name);
                failures += 1;
                continue;
            }
        };
        if n == 0 {
            for d in group.describe() {
                println!("  {d}");
            }
        }
        let mut single = create_engine(dut_kind, layer.clone(), max_t)?;
        let mut cpu = create_engine(BackendKind::Cpu, layer.clone(), max_t)?;
        let c = &layer.config;
        for &t in case.tokens.iter().filter(|&&t| args.tokens.is_empty() || args.tokens.contains(&t)) {
            let x = synthetic::random_hidden(t, c.hidden_size, seed + t as u64);
            let ids = synthetic::random_input_ids(t, c.vocab_size, seed + 1 + t as u64);
            let input = ForwardInput { x: &x, input_ids: Some(&ids) };
            let span = group.home_tokens(&topo, t);
            let (h, k) = (c.hidden_size, c.num_experts_per_tok);
            for mode in Mode::ALL {
                if (mode == Mode::W4A4 && format != WeightFormat::Nvfp4) || !mode_wanted(args, mode) {
                    continue;
                }
                print!(
                    "{:<11} {:>5} {:>5} {:>5} {:>4} {:>3} {:>5} {:<6} ",
                    case.name,
                    t,
                    h,
                    c.moe_intermediate_size,
                    c.n_routed_experts,
                    k,
                    mode.name(),
                    format.name()
                );
                if mode == Mode::W4A8 && !(c.moe_intermediate_size / topo.tp).is_multiple_of(128) {
                    println!(
                        "skip (--tp {} slices I into {}: not whole 128-blocks for w4a8)",
                        topo.tp,
                        c.moe_intermediate_size / topo.tp
                    );
                    continue;
                }
                let t0 = Instant::now();
                let a = group.forward(Run::Eager, &topo, h, &x, Some(&ids), mode);
                let ep_ms = t0.elapsed().as_secs_f64() * 1e3;
                // The device exchange's repeat is a CUDA-graph replay of the whole group.
                let b = group.forward(Run::GraphReplay, &topo, h, &x, Some(&ids), mode);
                let t1 = Instant::now();
                let s = single.forward(&input, mode, None);
                let ep1_ms = t1.elapsed().as_secs_f64() * 1e3;
                let r = cpu.forward(&input, mode, None);
                match (a, b, s, r) {
                    (Ok((a, _)), Ok((b, _)), Ok(s), Ok(r)) => {
                        let ys = &s.y[span.start * h..span.end * h];
                        let yr = &r.y[span.start * h..span.end * h];
                        let vs_ep1 = rel_l2(&a.y, ys);
                        let vs_ref = rel_l2(&a.y, yr);
                        let bitwise = bits(&a.y) == bits(ys);
                        let repeat = bits(&a.y) == bits(&b.y);
                        let routing_same = a.topk_ids == s.topk_ids[span.start * k..span.end * k];
                        let must_be_bitwise = !cuda && topo.tp == 1 && exact_payload(mode);
                        let ep_tol = if exact_payload(mode) { tolerance(mode) } else { lossy_tol(mode) };
                        let pass = repeat
                            && routing_same
                            && vs_ref <= ep_tol
                            && vs_ep1 <= ep_tol
                            && (bitwise || !must_be_bitwise)
                            && a.y.iter().all(|v| v.is_finite());
                        println!(
                            "{:>10.3e} {:>7} {:>10.3e} {:>7} {:>8.2} {:>8.2} {}{}",
                            vs_ep1,
                            if bitwise { "yes" } else { "no" },
                            vs_ref,
                            if repeat { "yes" } else { "NO" },
                            ep_ms,
                            ep1_ms,
                            if pass { "PASS" } else { "FAIL" },
                            if routing_same { "" } else { " (routing differs)" }
                        );
                        failures += usize::from(!pass);
                    }
                    (a, b, s, r) => {
                        let msg = [
                            a.err().map(|e| format!("ep: {e:#}")),
                            b.err().map(|e| format!("ep repeat: {e:#}")),
                            s.err().map(|e| format!("ep=1: {e}")),
                            r.err().map(|e| format!("reference: {e}")),
                        ]
                        .into_iter()
                        .flatten()
                        .collect::<Vec<_>>()
                        .join("; ");
                        println!("FAIL ({msg})");
                        failures += 1;
                    }
                }
            }
        }
    }
    Ok(failures)
}

#[allow(clippy::too_many_arguments)]
fn check_row(
    case: &Case,
    layer: &MoeLayer,
    format: WeightFormat,
    t: usize,
    mode: Mode,
    input: &ForwardInput<'_>,
    dut: &mut dyn MoeEngine,
    cpu: &mut dyn MoeEngine,
) -> usize {
    let c = &layer.config;
    let route = if case.hash {
        "hash"
    } else if case.skew {
        "skew"
    } else {
        "random"
    };
    print!(
        "{:<11} {:>5} {:>5} {:>5} {:>4} {:>3} {:>5} {:<6} {:<6} ",
        case.name,
        t,
        c.hidden_size,
        c.moe_intermediate_size,
        c.n_routed_experts,
        c.num_experts_per_tok,
        mode.name(),
        format.name(),
        route
    );
    let t0 = Instant::now();
    let a: megamoe::Result<ForwardOutput> = dut.forward(input, mode, None);
    let gpu_ms = t0.elapsed().as_secs_f64() * 1e3;
    let b = dut.forward(input, mode, None);
    let t1 = Instant::now();
    let r = cpu.forward(input, mode, None);
    let ref_ms = t1.elapsed().as_secs_f64() * 1e3;
    match (a, b, r) {
        (Ok(a), Ok(b), Ok(r)) => {
            let err = rel_l2(&a.y, &r.y);
            let agree = routing_agreement(&a.topk_ids, &r.topk_ids, c.num_experts_per_tok);
            let repeat = bits(&a.y) == bits(&b.y) && a.topk_ids == b.topk_ids;
            let finite = a.y.iter().all(|v| v.is_finite());
            let pass = err <= tolerance(mode) && agree >= 0.99 && repeat && finite;
            println!(
                "{:>10.3e} {:>8.4} {:>7} {:>8.2} {:>8.1} {} (<= {:.0e})",
                err,
                agree,
                if repeat { "yes" } else { "NO" },
                gpu_ms,
                ref_ms,
                if pass { "PASS" } else { "FAIL" },
                tolerance(mode)
            );
            usize::from(!pass)
        }
        (a, _, r) => {
            let msg = match (a, r) {
                (Err(e), _) => format!("backend error: {e}"),
                (_, Err(e)) => format!("reference error: {e}"),
                _ => "repeat run failed".to_string(),
            };
            println!("FAIL ({msg})");
            1
        }
    }
}

#[cfg(feature = "cuda")]
fn timings(seed: u64) -> anyhow::Result<()> {
    use megamoe::backend::cuda::CudaEngine;
    let cfg = MoeConfig { n_routed_experts: 48, ..synthetic::v4_pro_config() };
    println!("\nTimings: one V4-Pro rank as a 48-expert layer (H 7168, I 3072, k 6 over the 48), NVFP4,");
    println!("CUDA-graph replays timed with CUDA events (median of 20 after a warm-up):");
    println!(
        "{:>6} {:>6} {:>10} {:>10} {:>12} {:>12}",
        "T", "mode", "median_ms", "min_ms", "weights_GB/s", "TFLOP/s"
    );
    let t0 = Instant::now();
    let layer = Arc::new(synthetic::random_layer(&cfg, WeightFormat::Nvfp4, 5, false, seed));
    eprintln!("(layer generated in {:.1} s)", t0.elapsed().as_secs_f64());
    let mut eng = CudaEngine::new(layer.clone(), 512)?;
    println!("engine: {}", megamoe::backend::MoeEngine::describe(&eng));
    let (h, i, e, k) =
        (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok);
    for t in [1usize, 64, 512] {
        let x: Vec<half::bf16> = synthetic::random_hidden(t, h, seed + t as u64);
        let input = ForwardInput { x: &x, input_ids: None };
        for mode in [Mode::W4A16, Mode::W4A8] {
            let out = eng.forward(&input, mode, None)?;
            let mut used = vec![false; e];
            out.topk_ids.iter().for_each(|&id| used[id as usize] = true);
            let active = used.iter().filter(|&&u| u).count();
            // Bytes of the routed experts that received tokens (FP4 + e4m3 scales) + the bf16 shared expert.
            let wbytes = active as f64 * 3.0 * layer.format().matrix_bytes(i, h) as f64
                + 3.0 * WeightFormat::Bf16.matrix_bytes(i, h) as f64;
            let flops = 2.0 * (t * k + t) as f64 * 3.0 * (h * i) as f64;
            eng.capture_graph(t, mode)?;
            let mut v = eng.time_replays(&input, 20)?;
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let med = v[v.len() / 2] as f64;
            println!(
                "{:>6} {:>6} {:>10.3} {:>10.3} {:>12.0} {:>12.2}",
                t,
                mode.name(),
                med,
                v[0],
                wbytes / (med * 1e-3) / 1e9,
                flops / (med * 1e-3) / 1e12
            );
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn timings(_seed: u64) -> anyhow::Result<()> {
    anyhow::bail!("timings need the CUDA backend (built without the `cuda` feature)")
}

//! `megamoe inspect`: a checkpoint's config, detected naming and formats, quantization
//! description, and a per-layer summary read from tensor headers and scalars (cheap even for a
//! full V4-Pro checkpoint). `--validate` also loads every layer with all checks.

use megamoe::checkpoint::{Checkpoint, LoadOptions, Naming, Proj};
use safetensors::Dtype;
use std::path::PathBuf;

/// Arguments of `megamoe inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + model.safetensors or sharded index).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Only these layers (comma-separated); default: every MoE layer present.
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<usize>,
    /// Also load each layer with every load-time check (reads all expert bytes).
    #[arg(long)]
    pub validate: bool,
    /// With --validate: require valid `input_scale`s (W4A4).
    #[arg(long)]
    pub w4a4: bool,
}

/// min / max of a list, as text.
fn range(v: &[f32]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    let (lo, hi) = v.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    format!("[{lo:.4e}, {hi:.4e}]")
}

/// A scalar tensor's value, when present and readable.
fn scalar(ck: &Checkpoint, name: &str) -> Option<f32> {
    let v = ck.tensor(name).ok()?;
    megamoe::tensor_io::to_f32(name, &v).ok()?.1.first().copied()
}

fn shared_format(ck: &Checkpoint, layer: usize) -> String {
    let w = format!("{}.weight", ck.naming().shared_module(layer, Proj::W1));
    match ck.store().info(&w) {
        None => "none".into(),
        Some((Dtype::BF16, s)) => format!("BF16 {s:?}"),
        Some((Dtype::F8_E4M3, s)) => format!("FP8 e4m3 128x128-block {s:?}"),
        Some((d, s)) => format!("{d:?} {s:?} (unsupported)"),
    }
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let ck = Checkpoint::open(&args.checkpoint)?;
    let c = ck.config();
    println!("checkpoint  {}", ck.dir().display());
    println!("files       {} safetensors file(s), {} tensors", ck.store().files().len(), ck.names().len());
    println!("naming      {}", ck.naming().name());
    println!(
        "config      hidden {}  intermediate {}  experts {}  top-k {}  shared {}  scoring {:?}",
        c.hidden_size,
        c.moe_intermediate_size,
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.n_shared_experts,
        c.scoring_func
    );
    println!(
        "            routed_scaling_factor {}  norm_topk_prob {}  swiglu_limit {}{}  hash layers {}  layers {}  vocab {}",
        c.routed_scaling_factor,
        c.norm_topk_prob,
        c.swiglu_limit,
        if c.swiglu_limit == 0.0 { " (no clamp)" } else { "" },
        c.num_hash_layers,
        c.num_hidden_layers,
        c.vocab_size
    );
    let q = ck.quant();
    println!(
        "quant       source {:?}  method `{}`  algo `{}`  experts {:?}  dense {:?}  group {}",
        q.source,
        q.method,
        q.algo,
        q.experts,
        q.dense,
        q.group_size.map_or("-".into(), |g| g.to_string())
    );
    if !q.exclude_modules.is_empty() {
        println!("exclude     {}", q.exclude_modules.join("  "));
    }
    let present = ck.moe_layers();
    println!("moe layers  {} present: {present:?}", present.len());
    let layers: Vec<usize> = if args.layers.is_empty() { present.clone() } else { args.layers.clone() };
    let mut errors = 0usize;
    let naming: Naming = ck.naming();
    for l in layers {
        if !present.contains(&l) {
            println!("layer {l:>3}  ERROR: not in the checkpoint");
            errors += 1;
            continue;
        }
        let routing = if c.is_hash_layer(l) { "hash" } else { "scored" };
        let fmt = match ck.expert_format(l) {
            Ok(f) => format!("{f:?}"),
            Err(e) => {
                errors += 1;
                format!("ERROR: {e}")
            }
        };
        let experts = ck.experts_present(l).len();
        println!(
            "layer {l:>3}  {routing:<6} experts {fmt} ({experts}/{} present)  shared {}",
            c.n_routed_experts,
            shared_format(&ck, l)
        );
        // Global scales (NVFP4): ranges per projection, W1/W3 mismatches, input_scale coverage.
        let gs = |p: Proj, t: &str| -> Vec<f32> {
            (0..c.n_routed_experts)
                .filter_map(|e| scalar(&ck, &format!("{}.{t}", naming.expert_module(l, e, p))))
                .collect()
        };
        let (g1, g2, g3) =
            (gs(Proj::W1, "weight_scale_2"), gs(Proj::W2, "weight_scale_2"), gs(Proj::W3, "weight_scale_2"));
        if !(g1.is_empty() && g2.is_empty() && g3.is_empty()) {
            println!("           weight_scale_2  w1 {}  w2 {}  w3 {}", range(&g1), range(&g2), range(&g3));
            let mism = g1.iter().zip(&g3).filter(|(a, b)| a != b).count();
            if mism > 0 {
                println!("           note: {mism} expert(s) have W1 and W3 weight_scale_2 that differ (kept separate)");
            }
            let bad = g1.iter().chain(&g2).chain(&g3).filter(|x| !(x.is_finite() && **x > 0.0)).count();
            if bad > 0 {
                errors += 1;
                println!("           ERROR: {bad} weight_scale_2 value(s) zero, negative or non-finite");
            }
            let inp: Vec<f32> =
                [Proj::W1, Proj::W2, Proj::W3].iter().flat_map(|&p| gs(p, "input_scale")).collect();
            let usable = inp.iter().filter(|x| x.is_finite() && **x > 0.0).count();
            println!(
                "           input_scale     {} ({usable}/{} usable{})",
                range(&inp),
                3 * c.n_routed_experts,
                if usable < 3 * c.n_routed_experts { "; W4A4 unavailable" } else { "" }
            );
        }
        if args.validate {
            let opts = LoadOptions { require_input_scale: args.w4a4, progress: None };
            match ck.load_layer_with(l, &opts) {
                Ok(loaded) => {
                    println!("           validate: ok ({} warning(s))", loaded.warnings.len());
                    for w in &loaded.warnings {
                        println!("           warning: {w}");
                    }
                }
                Err(e) => {
                    errors += 1;
                    println!("           validate: ERROR: {e}");
                }
            }
        }
    }
    Ok(if errors == 0 { 0 } else { 1 })
}

//! `megamoe trace`: run a backend and the CPU reference on the same input, stage by stage, and
//! name the first stage where they diverge.
//!
//! Exit code: 0 when no stage diverges (and `--expect`, if given, matches the reference within
//! the output tolerance), 1 otherwise. `MEGAMOE_FAULT=<name>` injects a test fault into the
//! backend (see `megamoe::diagnostics::fault`).

use megamoe::backend::cpu::CpuEngine;
use megamoe::backend::BackendKind;
use megamoe::checkpoint::Checkpoint;
use megamoe::diagnostics::{fault, trace};
use megamoe::forward::{ForwardInput, Mode};
use megamoe::trace::Stage;
use safetensors::Dtype;
use std::path::PathBuf;
use std::sync::Arc;

/// Arguments of `megamoe trace`.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint, layer and activations.
    #[command(flatten)]
    pub at: super::LayerInput,
    /// Backend to check: cpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Mode: w4a16, w4a8 or w4a4.
    #[arg(long, default_value = "w4a16")]
    pub mode: String,
    /// A captured output to compare with (`y`, `out`, `L.out_<mode>`, or the only F32/BF16
    /// tensor of the file).
    #[arg(long)]
    pub expect: Option<PathBuf>,
    /// Write every stage of both sides to `DIR/backend.safetensors` and `DIR/reference.safetensors`.
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Picks a float tensor: the first present of `names`, else the only float tensor matching
/// `shape_ok`.
fn pick_float(
    st: &safetensors::SafeTensors<'_>,
    names: &[String],
    shape_ok: impl Fn(&[usize]) -> bool,
    what: &str,
    path: &std::path::Path,
) -> anyhow::Result<String> {
    if let Some(n) = names.iter().find(|n| st.names().iter().any(|m| m == n)) {
        return Ok(n.clone());
    }
    let floats: Vec<String> = st
        .tensors()
        .into_iter()
        .filter(|(_, v)| matches!(v.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16) && shape_ok(v.shape()))
        .map(|(n, _)| n)
        .collect();
    match floats.as_slice() {
        [one] => Ok(one.clone()),
        [] => anyhow::bail!(
            "{}: no {what} tensor (tried {names:?} and any float tensor of the right shape)",
            path.display()
        ),
        many => anyhow::bail!(
            "{}: several candidate {what} tensors {many:?}; name it one of {names:?}",
            path.display()
        ),
    }
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let mode: Mode = args.mode.parse()?;
    let kind: BackendKind = args.backend.parse()?;
    let ck = Checkpoint::open(&args.at.checkpoint)?;
    let loaded = ck.load_layer_for(args.at.layer, mode)?;
    let layer = Arc::new(loaded.layer);
    let (h, k) = (layer.config.hidden_size, layer.config.num_experts_per_tok);

    let bytes = megamoe::tensor_io::read_file(&args.at.input)?;
    let st = megamoe::tensor_io::parse(&args.at.input, &bytes)?;
    let xnames = ["x".to_string(), "hidden_states".to_string(), format!("{}.x", args.at.layer)];
    let xname = pick_float(&st, &xnames, |s| s.len() == 2 && s[1] == h, "hidden-state", &args.at.input)?;
    let (tokens, x) = megamoe::tensor_io::read_hidden_states(&xname, &st.tensor(&xname)?, h)?;
    let ids: Option<Vec<i64>> = match st.tensor("input_ids") {
        Ok(v) => Some(megamoe::tensor_io::to_i64("input_ids", &v)?.1),
        Err(_) => None,
    };
    if let Some(ids) = &ids {
        anyhow::ensure!(ids.len() == tokens, "input_ids has {} ids for {tokens} tokens", ids.len());
    }
    tracing::info!("trace: layer {} ({tokens} tokens from `{xname}`), mode {mode}", args.at.layer);
    let input = ForwardInput { x: &x, input_ids: ids.as_deref() };

    let mut backend = fault::engine(kind, layer.clone(), tokens)?;
    let mut reference = CpuEngine::new(layer.clone());
    eprintln!("backend   {}\nreference cpu reference\n", backend.describe());
    let mut result = trace::run(backend.as_mut(), &mut reference, &input, mode, k)?;

    if let Some(path) = &args.expect {
        let eb = megamoe::tensor_io::read_file(path)?;
        let es = megamoe::tensor_io::parse(path, &eb)?;
        let names = ["y".to_string(), "out".to_string(), format!("{}.out_{}", args.at.layer, mode.name())];
        let name = pick_float(&es, &names, |s| s.iter().product::<usize>() == tokens * h, "output", path)?;
        let (_, expected) = megamoe::tensor_io::to_f32(&name, &es.tensor(&name)?)?;
        result.report.expect =
            Some(trace::compare_expect(&name, &expected, &result.backend_out.y, &result.reference_out.y)?);
    }
    if let Some(dir) = &args.dump {
        trace::dump(dir, &result.backend_trace, &result.reference_trace)?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result.report)?);
    } else {
        print!("{}", result.report.render_table());
        if let Some(dir) = &args.dump {
            println!("stages written to {}", dir.display());
        }
    }
    let expect_ok = result
        .report
        .expect
        .as_ref()
        .is_none_or(|e| e.reference_rel_error <= trace::threshold(Stage::Output, mode));
    Ok(if result.report.first_divergence.is_none() && expect_ok { 0 } else { 1 })
}

//! File-level forward, as `megamoe forward` runs it: a checkpoint layer, activations from a
//! safetensors file, results to another. Lives in the library so tests need no binary.

use crate::backend::{create_engine, BackendKind};
use crate::checkpoint::Checkpoint;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::tensor_io::{self, OwnedTensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What to run.
#[derive(Clone, Debug)]
pub struct ForwardFileOptions {
    /// Checkpoint directory.
    pub checkpoint: PathBuf,
    /// MoE layer index.
    pub layer: usize,
    /// Input safetensors: `x` BF16/F32/F16 `[T, H]`, and `input_ids` I64/I32 `[T]` for hash layers.
    pub input: PathBuf,
    /// Output safetensors: `y` F32 `[T, H]`, `topk_ids` I32 `[T, k]`, `topk_weights` F32 `[T, k]`.
    pub output: PathBuf,
    /// Execution mode.
    pub mode: Mode,
    /// Backend.
    pub backend: BackendKind,
}

/// What happened.
#[derive(Clone, Debug)]
pub struct ForwardFileReport {
    /// Tokens T.
    pub tokens: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// The engine's description.
    pub backend: String,
    /// Warnings raised while loading the layer.
    pub warnings: Vec<String>,
    /// Seconds spent in the forward itself (not loading).
    pub forward_seconds: f64,
    /// The results (as written).
    pub output: ForwardOutput,
}

/// `path` made absolute with its parent resolved (the file itself need not exist).
fn resolved(path: &Path) -> PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match (parent.canonicalize(), path.file_name()) {
        (Ok(p), Some(name)) => p.join(name),
        _ => path.to_path_buf(),
    }
}

/// Reads `x` (and `input_ids` when present) from an activation file.
pub fn read_input(path: &Path, hidden: usize) -> Result<(Vec<half::bf16>, Option<Vec<i64>>)> {
    let bytes = tensor_io::read_file(path)?;
    let st = tensor_io::parse(path, &bytes)?;
    let view = st
        .tensor("x")
        .map_err(|_| MegaError::file(path, format!("no tensor `x` (the hidden states [T, {hidden}])")))?;
    let (tokens, x) = tensor_io::read_hidden_states("x", &view, hidden)?;
    let ids = match st.tensor("input_ids") {
        Ok(v) => {
            let (shape, ids) = tensor_io::to_i64("input_ids", &v)?;
            if shape.len() != 1 || shape[0] != tokens {
                return Err(MegaError::tensor(
                    "input_ids",
                    format!("shape {shape:?}, expected [T={tokens}]"),
                ));
            }
            Some(ids)
        }
        Err(_) => None,
    };
    Ok((x, ids))
}

/// Runs one layer of a checkpoint on an activation file and writes the results.
pub fn forward_file(opts: &ForwardFileOptions) -> Result<ForwardFileReport> {
    let out = resolved(&opts.output);
    if out == resolved(&opts.input) {
        return Err(MegaError::Input(format!(
            "refusing to overwrite the input file {} with the output",
            opts.output.display()
        )));
    }
    let ck = Checkpoint::open(&opts.checkpoint)?;
    let protected = ck.store().files().into_iter().map(Path::to_path_buf).chain(
        ["config.json", crate::checkpoint::HF_QUANT_FILE, "model.safetensors.index.json"]
            .map(|f| ck.dir().join(f)),
    );
    for p in protected {
        if resolved(&p) == out {
            return Err(MegaError::Input(format!(
                "refusing to overwrite checkpoint file {} with the output",
                p.display()
            )));
        }
    }
    let layers = ck.moe_layers();
    if !layers.contains(&opts.layer) {
        return Err(MegaError::Input(format!(
            "layer {} is not an MoE layer of {} (present: {layers:?})",
            opts.layer,
            opts.checkpoint.display()
        )));
    }
    let loaded = ck.load_layer_for(opts.layer, opts.mode)?;
    let layer = loaded.layer;
    let (h, k) = (layer.config.hidden_size, layer.config.num_experts_per_tok);
    let (x, ids) = read_input(&opts.input, h)?;
    if layer.is_hash() && ids.is_none() {
        return Err(MegaError::Input(format!(
            "layer {} is hash-routed: {} needs an `input_ids` I64 [T] tensor",
            opts.layer,
            opts.input.display()
        )));
    }
    let tokens = x.len() / h;
    let mut engine = create_engine(opts.backend, Arc::new(layer), tokens.max(1))?;
    let t0 = std::time::Instant::now();
    let output = engine.forward(&ForwardInput { x: &x, input_ids: ids.as_deref() }, opts.mode, None)?;
    let forward_seconds = t0.elapsed().as_secs_f64();

    let mut tensors = BTreeMap::new();
    tensors.insert("y".to_string(), OwnedTensor::f32(&[tokens, h], &output.y));
    tensors.insert("topk_ids".to_string(), OwnedTensor::i32(&[tokens, k], &output.topk_ids));
    tensors.insert("topk_weights".to_string(), OwnedTensor::f32(&[tokens, k], &output.topk_weights));
    tensor_io::write_safetensors(&opts.output, &tensors)?;
    Ok(ForwardFileReport {
        tokens,
        hidden: h,
        backend: engine.describe(),
        warnings: loaded.warnings,
        forward_seconds,
        output,
    })
}

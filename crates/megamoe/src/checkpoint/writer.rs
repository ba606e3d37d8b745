//! Writing checkpoint directories from tensors (tests, the demo, the doctor's broken copies), and
//! reading a checkpoint's tensors back into memory so they can be edited.

use super::store::{TensorStore, INDEX_FILE, SINGLE_FILE};
use super::HF_QUANT_FILE;
use crate::error::{MegaError, Result};
use crate::tensor_io::{write_safetensors, OwnedTensor};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| MegaError::file(path, e))?;
    std::fs::write(path, text).map_err(|e| MegaError::file(path, e))
}

/// Writes a checkpoint directory: `config.json`, optionally `hf_quant_config.json`, and the tensors
/// as `model.safetensors` (`shards <= 1`) or as `shards` files
/// `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
///
/// Tensors are split into shards in name order, balanced by bytes. Creates `dir` if needed;
/// stale single-file / index files from an earlier write are removed so the result is unambiguous.
pub fn write_checkpoint(
    dir: &Path,
    config_json: &Value,
    quant_json: Option<&Value>,
    tensors: &BTreeMap<String, OwnedTensor>,
    shards: usize,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| MegaError::file(dir, e))?;
    write_json(&dir.join("config.json"), config_json)?;
    let hq = dir.join(HF_QUANT_FILE);
    match quant_json {
        Some(q) => write_json(&hq, q)?,
        None if hq.exists() => std::fs::remove_file(&hq).map_err(|e| MegaError::file(&hq, e))?,
        None => {}
    }
    for stale in [SINGLE_FILE, INDEX_FILE] {
        let p = dir.join(stale);
        if p.exists() {
            std::fs::remove_file(&p).map_err(|e| MegaError::file(&p, e))?;
        }
    }
    if shards <= 1 {
        return write_safetensors(&dir.join(SINGLE_FILE), tensors);
    }
    let total: usize = tensors.values().map(|t| t.bytes.len()).sum();
    let per = total.div_ceil(shards).max(1);
    let mut parts: Vec<BTreeMap<String, OwnedTensor>> = vec![BTreeMap::new(); shards];
    let mut acc = 0usize;
    for (name, t) in tensors {
        // Shard index by the running byte offset: balanced, name-ordered, never past the last shard.
        let i = (acc / per).min(shards - 1);
        acc += t.bytes.len();
        parts[i].insert(name.clone(), t.clone());
    }
    let mut weight_map = serde_json::Map::new();
    for (i, part) in parts.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
        write_safetensors(&dir.join(&file), part)?;
        for name in part.keys() {
            weight_map.insert(name.clone(), Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": Value::Object(weight_map),
    });
    write_json(&dir.join(INDEX_FILE), &index)
}

/// Reads every tensor of checkpoint directory `dir` (single file or shards) into memory.
/// Only the safetensors files are read, so this works even when `config.json` is broken.
pub fn read_tensors(dir: &Path) -> Result<BTreeMap<String, OwnedTensor>> {
    let store = TensorStore::open_dir(dir)?;
    let mut out = BTreeMap::new();
    for name in store.names() {
        let v = store.tensor(name)?;
        out.insert(
            name.to_string(),
            OwnedTensor { dtype: v.dtype(), shape: v.shape().to_vec(), bytes: v.data().to_vec() },
        );
    }
    Ok(out)
}

/// Reads a checkpoint directory's `config.json`, optional `hf_quant_config.json` and all tensors,
/// ready to be edited and written with [`write_checkpoint`].
pub fn read_checkpoint_dir(dir: &Path) -> Result<(Value, Option<Value>, BTreeMap<String, OwnedTensor>)> {
    let config = crate::config::read_json(&dir.join("config.json"))?;
    let hq = dir.join(HF_QUANT_FILE);
    let quant = if hq.exists() { Some(crate::config::read_json(&hq)?) } else { None };
    Ok((config, quant, read_tensors(dir)?))
}

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

use super::layer::{DenseData, DenseProj, ExpertProj, MoeLayer, ProjData};
use super::naming::{Naming, Proj};
use crate::config::{MoeConfig, ScoringFunc};
use crate::formats::{nvfp4, WeightFormat};
use safetensors::Dtype;

/// A `config.json` (HF names) describing `cfg`, with the quantization block for `format`
/// (ModelOpt NVFP4, or the official V4 `fp8` + `expert_dtype: fp4` for MXFP4).
pub fn config_json(cfg: &MoeConfig, format: WeightFormat) -> Value {
    let scoring = match cfg.scoring_func {
        ScoringFunc::SqrtSoftplus => "sqrtsoftplus",
        ScoringFunc::Sigmoid => "sigmoid",
        ScoringFunc::Softmax => "softmax",
    };
    let mut v = serde_json::json!({
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": cfg.hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "scoring_func": scoring,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "num_hash_layers": cfg.num_hash_layers,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
    });
    match format {
        WeightFormat::Nvfp4 => {
            v["quantization_config"] = serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": nvfp4::BLOCK});
        }
        WeightFormat::Mxfp4 => {
            v["quantization_config"] = serde_json::json!({
                "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]
            });
            v["expert_dtype"] = "fp4".into();
        }
        WeightFormat::Bf16 => {}
    }
    v
}

/// The `hf_quant_config.json` ModelOpt writes for `format` (NVFP4 only; `None` otherwise): the
/// router and shared experts are excluded (they stay BF16).
pub fn hf_quant_json(format: WeightFormat) -> Option<Value> {
    (format == WeightFormat::Nvfp4).then(|| {
        serde_json::json!({
            "producer": {"name": "megamoe", "version": env!("CARGO_PKG_VERSION")},
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": null,
                "group_size": nvfp4::BLOCK,
                "exclude_modules": ["*.attn.*", "*.shared_experts.*", "*.ffn.gate*", "*.mlp.gate"]
            }
        })
    })
}

fn u8_tensor(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> OwnedTensor {
    OwnedTensor { dtype, shape: shape.to_vec(), bytes: bytes.to_vec() }
}

fn put_experts(
    out: &mut BTreeMap<String, OwnedTensor>,
    l: usize,
    p: Proj,
    proj: &ExpertProj,
    naming: Naming,
) {
    let (r, c) = (proj.rows, proj.cols);
    let block = proj.format().block_size().unwrap_or(1);
    for e in 0..proj.experts {
        let m = naming.expert_module(l, e, p);
        match &proj.data {
            ProjData::Nvfp4 { packed, scales, global_scale, input_scale } => {
                let (pk, sc) = (r * c / 2, r * c / block);
                out.insert(
                    format!("{m}.weight"),
                    u8_tensor(Dtype::U8, &[r, c / 2], &packed[e * pk..(e + 1) * pk]),
                );
                out.insert(
                    format!("{m}.weight_scale"),
                    u8_tensor(Dtype::F8_E4M3, &[r, c / block], &scales[e * sc..(e + 1) * sc]),
                );
                out.insert(format!("{m}.weight_scale_2"), OwnedTensor::f32(&[], &[global_scale[e]]));
                if let Some(is) = input_scale {
                    out.insert(format!("{m}.input_scale"), OwnedTensor::f32(&[], &[is[e]]));
                }
            }
            ProjData::Mxfp4 { packed, scales } => {
                let (pk, sc) = (r * c / 2, r * c / block);
                out.insert(
                    format!("{m}.weight"),
                    u8_tensor(Dtype::I8, &[r, c / 2], &packed[e * pk..(e + 1) * pk]),
                );
                out.insert(
                    format!("{m}.scale"),
                    u8_tensor(Dtype::F8_E8M0, &[r, c / block], &scales[e * sc..(e + 1) * sc]),
                );
            }
            ProjData::Bf16 { weight } => {
                out.insert(
                    format!("{m}.weight"),
                    OwnedTensor::bf16(&[r, c], &weight[e * r * c..(e + 1) * r * c]),
                );
            }
        }
    }
}

fn put_dense(out: &mut BTreeMap<String, OwnedTensor>, m: &str, d: &DenseProj, naming: Naming) {
    let (r, c) = (d.rows, d.cols);
    match &d.data {
        DenseData::Bf16(w) => {
            out.insert(format!("{m}.weight"), OwnedTensor::bf16(&[r, c], w));
        }
        DenseData::Fp8Block { weight, scale } => {
            out.insert(format!("{m}.weight"), u8_tensor(Dtype::F8_E4M3, &[r, c], weight));
            let shape = super::fp8_scale_grid(r, c);
            // Powers of two in e8m0 range are stored as the official e8m0 `scale`; others as f32.
            let e8m0: Option<Vec<u8>> = scale
                .iter()
                .map(|&s| {
                    let b = s.to_bits();
                    (s.is_normal() && s > 0.0 && b & 0x007F_FFFF == 0).then_some((b >> 23) as u8)
                })
                .collect();
            match (naming, e8m0) {
                (Naming::DeepSeekV4, Some(bytes)) => {
                    out.insert(format!("{m}.scale"), u8_tensor(Dtype::F8_E8M0, &shape, &bytes));
                }
                (Naming::DeepSeekV4, None) => {
                    out.insert(format!("{m}.scale"), OwnedTensor::f32(&shape, scale));
                }
                (Naming::Hf, _) => {
                    out.insert(format!("{m}.weight_scale_inv"), OwnedTensor::f32(&shape, scale));
                }
            }
        }
    }
}

/// The checkpoint tensors of one loaded (or synthetic) layer under `naming` — the inverse of
/// [`super::Checkpoint::load_layer`]. The router weight is stored as BF16 when every value is a
/// bf16 (as in real checkpoints), else F32.
pub fn layer_tensors(layer: &MoeLayer, naming: Naming) -> BTreeMap<String, OwnedTensor> {
    let l = layer.index;
    let cfg = &layer.config;
    let mut out = BTreeMap::new();
    let (e, h) = (cfg.n_routed_experts, cfg.hidden_size);
    let w = &layer.router.weight;
    let as_bf16: Vec<half::bf16> = w.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let exact = as_bf16.iter().zip(w).all(|(b, x)| b.to_f32().to_bits() == x.to_bits());
    let gw = if exact { OwnedTensor::bf16(&[e, h], &as_bf16) } else { OwnedTensor::f32(&[e, h], w) };
    out.insert(naming.router_weight(l), gw);
    if let Some(b) = &layer.router.bias {
        out.insert(naming.router_bias(l), OwnedTensor::f32(&[e], b));
    }
    if let Some(t) = &layer.router.tid2eid {
        let ids: Vec<i64> = t.iter().map(|&x| x as i64).collect();
        out.insert(
            naming.tid2eid(l),
            OwnedTensor::i64(&[t.len() / cfg.num_experts_per_tok.max(1), cfg.num_experts_per_tok], &ids),
        );
    }
    put_experts(&mut out, l, Proj::W1, &layer.w1, naming);
    put_experts(&mut out, l, Proj::W2, &layer.w2, naming);
    put_experts(&mut out, l, Proj::W3, &layer.w3, naming);
    if let Some(s) = &layer.shared {
        put_dense(&mut out, &naming.shared_module(l, Proj::W1), &s.w1, naming);
        put_dense(&mut out, &naming.shared_module(l, Proj::W2), &s.w2, naming);
        put_dense(&mut out, &naming.shared_module(l, Proj::W3), &s.w3, naming);
    }
    out
}

/// Writes `layers` (same config and expert format) as a checkpoint directory: `config.json`
/// from the first layer's config, `hf_quant_config.json` for NVFP4, tensors under `naming`.
pub fn write_layers(dir: &Path, layers: &[MoeLayer], naming: Naming, shards: usize) -> Result<()> {
    let first = layers.first().ok_or_else(|| MegaError::Input("write_layers: no layers given".into()))?;
    let format = first.format();
    let mut tensors = BTreeMap::new();
    for l in layers {
        if l.config != first.config || l.format() != format {
            return Err(MegaError::Input(format!(
                "write_layers: layer {} differs from layer {} in config or expert format",
                l.index, first.index
            )));
        }
        tensors.append(&mut layer_tensors(l, naming));
    }
    write_checkpoint(
        dir,
        &config_json(&first.config, format),
        hf_quant_json(format).as_ref(),
        &tensors,
        shards,
    )
}

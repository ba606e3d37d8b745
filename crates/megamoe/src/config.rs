//! The MoE block's hyper-parameters, read from a checkpoint's `config.json`.

use crate::error::{MegaError, Result};
use crate::formats::{nvfp4, WeightFormat};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// How router logits become scores (the official `Gate.score_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScoringFunc {
    /// `sqrt(softplus(logits))` (DeepSeek-V4).
    SqrtSoftplus,
    /// `sigmoid(logits)` (DeepSeek-V3).
    Sigmoid,
    /// `softmax(logits)` over experts; weights are not renormalised.
    Softmax,
}

/// Hyper-parameters of one MoE block, shared by every layer of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Hidden size H.
    pub hidden_size: usize,
    /// Expert intermediate size I.
    pub moe_intermediate_size: usize,
    /// Routed experts E.
    pub n_routed_experts: usize,
    /// Experts chosen per token k.
    pub num_experts_per_tok: usize,
    /// Shared experts (0 or 1; several are fused into one of width n*I).
    pub n_shared_experts: usize,
    /// Score function of the router.
    pub scoring_func: ScoringFunc,
    /// Factor applied to the routing weights after normalisation.
    pub routed_scaling_factor: f32,
    /// Whether the chosen weights are divided by their sum (ignored for softmax).
    pub norm_topk_prob: bool,
    /// SwiGLU clamp limit L (0 disables the clamp).
    pub swiglu_limit: f32,
    /// Layers `< num_hash_layers` route by `tid2eid[input_ids]`.
    pub num_hash_layers: usize,
    /// Number of layers in the model (not all need be present in the checkpoint).
    pub num_hidden_layers: usize,
    /// Vocabulary size (rows of `tid2eid`).
    pub vocab_size: usize,
}

impl MoeConfig {
    /// Whether layer `layer` is hash-routed.
    pub fn is_hash_layer(&self, layer: usize) -> bool {
        layer < self.num_hash_layers
    }
}

/// Reads the first present (non-null) key of `keys` from a JSON object, with the key found.
fn field<'a, 'k>(v: &'a Value, keys: &[&'k str]) -> Option<(&'k str, &'a Value)> {
    keys.iter().find_map(|k| v.get(*k).filter(|x| !x.is_null()).map(|x| (*k, x)))
}

fn req_usize(v: &Value, keys: &[&str]) -> Result<usize> {
    match field(v, keys) {
        None => Err(MegaError::Config(format!(
            "config.json lacks the required field `{}`{}",
            keys[0],
            if keys.len() > 1 { format!(" (or {})", keys[1..].join(", ")) } else { String::new() }
        ))),
        Some((k, x)) => as_usize(k, x),
    }
}

fn opt_usize(v: &Value, keys: &[&str], default: usize) -> Result<usize> {
    field(v, keys).map_or(Ok(default), |(k, x)| as_usize(k, x))
}

fn as_usize(k: &str, x: &Value) -> Result<usize> {
    // Accept integral floats (`16.0`) that some exporters write.
    if let Some(u) = x.as_u64() {
        return Ok(u as usize);
    }
    match x.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 1e15 => Ok(f as usize),
        _ => Err(MegaError::Config(format!("field `{k}` is {x}, expected a non-negative integer"))),
    }
}

fn as_f32(k: &str, x: &Value) -> Result<f32> {
    match x.as_f64() {
        Some(f) if f.is_finite() => Ok(f as f32),
        _ => Err(MegaError::Config(format!("field `{k}` is {x}, expected a finite number"))),
    }
}

impl ScoringFunc {
    /// Parses `sqrtsoftplus` / `sigmoid` / `softmax` (case-insensitive; `sqrt_softplus` too).
    pub fn parse(s: &str) -> Result<ScoringFunc> {
        match s.to_ascii_lowercase().replace(['_', '-'], "").as_str() {
            "sqrtsoftplus" => Ok(ScoringFunc::SqrtSoftplus),
            "sigmoid" => Ok(ScoringFunc::Sigmoid),
            "softmax" => Ok(ScoringFunc::Softmax),
            _ => Err(MegaError::Config(format!(
                "scoring_func `{s}` is not supported (expected sqrtsoftplus, sigmoid or softmax)"
            ))),
        }
    }
}

impl MoeConfig {
    /// Parses a model `config.json` (HF names, or the official DeepSeek-V4 inference names
    /// `dim`, `moe_inter_dim`, `n_activated_experts`, `score_func`, `route_scale`, `n_hash_layers`,
    /// `n_layers`). Missing required fields and inconsistent values are [`MegaError::Config`].
    ///
    /// Defaults: `n_shared_experts` 0, `norm_topk_prob` true, `swiglu_limit` 0 (no clamp),
    /// `num_hash_layers` 0.
    pub fn from_json(v: &Value) -> Result<MoeConfig> {
        if !v.is_object() {
            return Err(MegaError::Config("config.json is not a JSON object".into()));
        }
        // Multimodal / nested exports keep the language model's config under `text_config`.
        if v.get("hidden_size").is_none() && v.get("dim").is_none() {
            if let Some(t) = v.get("text_config").filter(|t| t.is_object()) {
                return MoeConfig::from_json(t);
            }
        }
        let scoring_func = match field(v, &["scoring_func", "score_func"]) {
            None => {
                return Err(MegaError::Config(
                    "config.json lacks the required field `scoring_func` (or score_func)".into(),
                ))
            }
            Some((k, x)) => ScoringFunc::parse(
                x.as_str()
                    .ok_or_else(|| MegaError::Config(format!("field `{k}` is {x}, expected a string")))?,
            )?,
        };
        let routed_scaling_factor = match field(v, &["routed_scaling_factor", "route_scale"]) {
            None => {
                return Err(MegaError::Config(
                    "config.json lacks the required field `routed_scaling_factor` (or route_scale)".into(),
                ))
            }
            Some((k, x)) => as_f32(k, x)?,
        };
        let norm_topk_prob = match field(v, &["norm_topk_prob"]) {
            None => true,
            Some((k, x)) => x
                .as_bool()
                .ok_or_else(|| MegaError::Config(format!("field `{k}` is {x}, expected true or false")))?,
        };
        let swiglu_limit = field(v, &["swiglu_limit"]).map_or(Ok(0.0), |(k, x)| as_f32(k, x))?;
        let cfg = MoeConfig {
            hidden_size: req_usize(v, &["hidden_size", "dim"])?,
            moe_intermediate_size: req_usize(v, &["moe_intermediate_size", "moe_inter_dim"])?,
            n_routed_experts: req_usize(v, &["n_routed_experts", "num_experts"])?,
            num_experts_per_tok: req_usize(v, &["num_experts_per_tok", "n_activated_experts"])?,
            n_shared_experts: opt_usize(v, &["n_shared_experts"], 0)?,
            scoring_func,
            routed_scaling_factor,
            norm_topk_prob,
            swiglu_limit,
            num_hash_layers: opt_usize(v, &["num_hash_layers", "n_hash_layers"], 0)?,
            num_hidden_layers: req_usize(v, &["num_hidden_layers", "n_layers"])?,
            vocab_size: req_usize(v, &["vocab_size"])?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a `config.json` file (see [`MoeConfig::from_json`]).
    pub fn from_file(path: impl AsRef<Path>) -> Result<MoeConfig> {
        let v = read_json(path.as_ref())?;
        MoeConfig::from_json(&v).map_err(|e| match e {
            MegaError::Config(m) => MegaError::Config(format!("{}: {m}", path.as_ref().display())),
            e => e,
        })
    }

    /// Checks the values are usable (positive sizes, `k <= E`, finite non-negative limit, ...).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(MegaError::Config(m));
        for (name, val) in [
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("num_hidden_layers", self.num_hidden_layers),
        ] {
            if val == 0 {
                return bad(format!("`{name}` is 0, expected a positive integer"));
            }
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return bad(format!(
                "num_experts_per_tok = {} exceeds n_routed_experts = {}",
                self.num_experts_per_tok, self.n_routed_experts
            ));
        }
        if !(self.swiglu_limit.is_finite() && self.swiglu_limit >= 0.0) {
            return bad(format!("swiglu_limit = {}, expected a finite value >= 0", self.swiglu_limit));
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return bad(format!(
                "routed_scaling_factor = {}, expected a finite value > 0",
                self.routed_scaling_factor
            ));
        }
        if self.num_hash_layers > self.num_hidden_layers {
            return bad(format!(
                "num_hash_layers = {} exceeds num_hidden_layers = {}",
                self.num_hash_layers, self.num_hidden_layers
            ));
        }
        if self.num_hash_layers > 0 && self.vocab_size == 0 {
            return bad("vocab_size is 0 but the model has hash-routed layers".into());
        }
        Ok(())
    }
}

/// Reads a JSON file.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| MegaError::file(path, e))?;
    serde_json::from_str(&text).map_err(|e| MegaError::file(path, format!("invalid JSON: {e}")))
}

/// How a family of weights is stored, as the quantization description declares it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum WeightQuant {
    /// Unquantized (bf16).
    Bf16,
    /// ModelOpt NVFP4 (e4m3 scales per 16 + f32 global scale).
    Nvfp4,
    /// OCP MXFP4 (e8m0 scales per 32).
    Mxfp4,
    /// FP8 e4m3 with one scale per 128x128 block.
    Fp8Block,
    /// An algorithm megamoe does not know (kept verbatim for messages).
    Other(String),
}

impl WeightQuant {
    /// The routed-expert format this corresponds to, if any.
    pub fn expert_format(&self) -> Option<WeightFormat> {
        match self {
            WeightQuant::Bf16 => Some(WeightFormat::Bf16),
            WeightQuant::Nvfp4 => Some(WeightFormat::Nvfp4),
            WeightQuant::Mxfp4 => Some(WeightFormat::Mxfp4),
            _ => None,
        }
    }
}

/// Where the quantization description came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum QuantSource {
    /// No description: every weight's format is taken from its tensors.
    None,
    /// `hf_quant_config.json` (ModelOpt export).
    HfQuantConfig,
    /// `quantization_config` inside `config.json`.
    ConfigJson,
}

/// The checkpoint's quantization description (`hf_quant_config.json` or
/// `config.json:quantization_config`).
#[derive(Clone, Debug)]
pub struct QuantConfig {
    /// Where it came from.
    pub source: QuantSource,
    /// `quant_method` (`modelopt`, `fp8`, ...) or empty.
    pub method: String,
    /// `quant_algo` (`NVFP4`, ...) or empty.
    pub algo: String,
    /// What the routed experts are declared to be (unless excluded).
    pub experts: WeightQuant,
    /// What the other linear layers (shared expert, ...) are declared to be (unless excluded).
    pub dense: WeightQuant,
    /// Quantization group size along K, when declared.
    pub group_size: Option<usize>,
    /// fnmatch patterns of modules left unquantized (`exclude_modules` / `ignore`).
    pub exclude_modules: Vec<String>,
    excluder: globset::GlobSet,
}

impl QuantConfig {
    /// No quantization description: formats come from the tensors.
    pub fn none() -> QuantConfig {
        QuantConfig {
            source: QuantSource::None,
            method: String::new(),
            algo: String::new(),
            experts: WeightQuant::Bf16,
            dense: WeightQuant::Bf16,
            group_size: None,
            exclude_modules: Vec::new(),
            excluder: globset::GlobSet::empty(),
        }
    }

    /// Parses the description from `config.json` and, when present (it wins), `hf_quant_config.json`.
    pub fn from_json(config_json: &Value, hf_quant: Option<&Value>) -> Result<QuantConfig> {
        if let Some(h) = hf_quant {
            // ModelOpt nests everything under `quantization`.
            let q = h.get("quantization").unwrap_or(h);
            return QuantConfig::from_desc(
                q,
                Some(config_json),
                QuantSource::HfQuantConfig,
                "hf_quant_config.json",
            );
        }
        match config_json.get("quantization_config").filter(|q| !q.is_null()) {
            None => Ok(QuantConfig::none()),
            Some(q) => QuantConfig::from_desc(q, Some(config_json), QuantSource::ConfigJson, "config.json"),
        }
    }

    fn from_desc(q: &Value, top: Option<&Value>, source: QuantSource, file: &str) -> Result<QuantConfig> {
        let q = q.get("quantization").filter(|x| x.is_object()).unwrap_or(q);
        let s = |k: &str| q.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
        let method = s("quant_method");
        let algo = s("quant_algo");
        let group_size = match q.get("group_size").filter(|x| !x.is_null()) {
            None => None,
            Some(x) => Some(as_usize("group_size", x)?),
        };
        // `expert_dtype` sits at the top of the official V4 config.json (or inside the quant block).
        let expert_dtype = q
            .get("expert_dtype")
            .or_else(|| top.and_then(|t| t.get("expert_dtype")))
            .and_then(|x| x.as_str())
            .map(|x| x.to_ascii_lowercase());
        let from_algo = |a: &str| match a.to_ascii_uppercase().as_str() {
            "NVFP4" => WeightQuant::Nvfp4,
            "MXFP4" => WeightQuant::Mxfp4,
            "" | "NONE" => WeightQuant::Bf16,
            "FP8_PB" | "FP8_BLOCK" => WeightQuant::Fp8Block,
            other => WeightQuant::Other(other.to_string()),
        };
        let (experts, dense) = match method.to_ascii_lowercase().as_str() {
            "fp8" => {
                let dense = WeightQuant::Fp8Block;
                let experts = match expert_dtype.as_deref() {
                    Some("fp4") | Some("mxfp4") => WeightQuant::Mxfp4,
                    Some("fp8") | None => WeightQuant::Fp8Block,
                    Some("bf16") => WeightQuant::Bf16,
                    Some(o) => WeightQuant::Other(format!("expert_dtype {o}")),
                };
                (experts, dense)
            }
            "modelopt" | "" => {
                let w = from_algo(&algo);
                (w.clone(), w)
            }
            "mxfp4" => (WeightQuant::Mxfp4, WeightQuant::Bf16),
            other => {
                let w = WeightQuant::Other(format!("quant_method {other}"));
                (w.clone(), w)
            }
        };
        if experts == WeightQuant::Nvfp4 && group_size.is_some_and(|g| g != nvfp4::BLOCK) {
            return Err(MegaError::Config(format!(
                "{file}: NVFP4 with group_size {}, expected {}",
                group_size.unwrap_or(0),
                nvfp4::BLOCK
            )));
        }
        let mut exclude_modules = Vec::new();
        for key in ["exclude_modules", "ignore", "modules_to_not_convert"] {
            if let Some(list) = q.get(key).filter(|x| !x.is_null()) {
                let arr = list.as_array().ok_or_else(|| {
                    MegaError::Config(format!("{file}: `{key}` is {list}, expected a list of patterns"))
                })?;
                for p in arr {
                    let p = p.as_str().ok_or_else(|| {
                        MegaError::Config(format!("{file}: `{key}` entry {p} is not a string"))
                    })?;
                    exclude_modules.push(p.to_string());
                }
            }
        }
        let mut b = globset::GlobSetBuilder::new();
        for p in &exclude_modules {
            // fnmatch semantics: `*` crosses dots (globset's default: no literal separator).
            let g = globset::GlobBuilder::new(p)
                .literal_separator(false)
                .backslash_escape(true)
                .build()
                .map_err(|e| MegaError::Config(format!("{file}: bad exclude pattern `{p}`: {e}")))?;
            b.add(g);
        }
        let excluder =
            b.build().map_err(|e| MegaError::Config(format!("{file}: bad exclude patterns: {e}")))?;
        Ok(QuantConfig { source, method, algo, experts, dense, group_size, exclude_modules, excluder })
    }

    /// Whether `module` (a tensor name without its last component, e.g.
    /// `layers.3.ffn.experts.7.w1`) matches an exclude pattern (so it stays unquantized).
    /// Patterns are tried against the name and against it with a leading `model.` removed or added.
    pub fn is_excluded(&self, module: &str) -> bool {
        if self.exclude_modules.is_empty() {
            return false;
        }
        if self.excluder.is_match(module) {
            return true;
        }
        match module.strip_prefix("model.") {
            Some(rest) => self.excluder.is_match(rest),
            None => self.excluder.is_match(format!("model.{module}")),
        }
    }

    /// The declared format of a routed-expert module (`Bf16` when excluded).
    pub fn expert_quant(&self, module: &str) -> WeightQuant {
        if self.is_excluded(module) {
            WeightQuant::Bf16
        } else {
            self.experts.clone()
        }
    }

    /// The declared format of a dense module such as the shared expert (`Bf16` when excluded).
    pub fn dense_quant(&self, module: &str) -> WeightQuant {
        if self.is_excluded(module) {
            WeightQuant::Bf16
        } else {
            self.dense.clone()
        }
    }
}

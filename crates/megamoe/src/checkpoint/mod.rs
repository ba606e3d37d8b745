//! Checkpoints: `config.json`, safetensors (single or sharded, memory-mapped), naming schemes,
//! validation at load, and the [`MoeLayer`] struct.
//!
//! ```no_run
//! # fn main() -> megamoe::Result<()> {
//! let ck = megamoe::checkpoint::Checkpoint::open("path/to/checkpoint")?;
//! for l in ck.moe_layers() {
//!     let loaded = ck.load_layer(l)?;
//!     println!("layer {l}: {:?}, {} warnings", loaded.layer.format(), loaded.warnings.len());
//! }
//! # Ok(()) }
//! ```

pub mod layer;
mod load;
pub mod naming;
pub mod store;
mod validate;
pub mod writer;

pub use layer::{
    fp8_scale_grid, fp8_scale_index, DenseData, DenseProj, ExpertProj, MoeLayer, ProjData, RouterWeights,
    SharedExpert, FP8_WEIGHT_BLOCK,
};
pub use load::{LoadOptions, LoadedLayer};
pub use naming::{Naming, Proj};
pub use safetensors::tensor::TensorView;
pub use store::TensorStore;
pub(crate) use validate::check_expert_range;

use crate::config::{read_json, MoeConfig, QuantConfig};
use crate::error::{MegaError, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Name of the ModelOpt quantization description.
pub const HF_QUANT_FILE: &str = "hf_quant_config.json";

/// An opened checkpoint directory: parsed config, quantization description, detected naming and
/// memory-mapped tensors. Opening reads only headers; layers are read by [`Checkpoint::load_layer`]
/// (whole) or [`Checkpoint::load_layer_experts`] (one rank's expert range).
pub struct Checkpoint {
    dir: PathBuf,
    config_json: serde_json::Value,
    hf_quant_json: Option<serde_json::Value>,
    config: MoeConfig,
    quant: QuantConfig,
    naming: Naming,
    store: TensorStore,
    layers: Vec<usize>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("naming", &self.naming)
            .field("layers", &self.layers)
            .finish_non_exhaustive()
    }
}

impl Checkpoint {
    /// Opens `dir`: `config.json`, optional `hf_quant_config.json`, and `model.safetensors` or the
    /// shards of `model.safetensors.index.json`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(MegaError::file(&dir, "not a directory"));
        }
        let cfg_path = dir.join("config.json");
        if !cfg_path.exists() {
            return Err(MegaError::file(&cfg_path, "missing: a checkpoint needs config.json"));
        }
        let config_json = read_json(&cfg_path)?;
        let config = MoeConfig::from_json(&config_json)
            .map_err(|e| MegaError::Config(format!("{}: {}", cfg_path.display(), strip_config(e))))?;
        let hq_path = dir.join(HF_QUANT_FILE);
        let hf_quant_json = if hq_path.exists() { Some(read_json(&hq_path)?) } else { None };
        let quant = QuantConfig::from_json(&config_json, hf_quant_json.as_ref())?;
        let store = TensorStore::open_dir(&dir)?;
        let naming = Naming::detect(store.names())?;
        let layers: BTreeSet<usize> = store.names().filter_map(|n| naming.parse_moe_layer(n)).collect();
        let layers: Vec<usize> = layers.into_iter().collect();
        if let Some(&bad) = layers.iter().find(|&&l| l >= config.num_hidden_layers) {
            return Err(MegaError::Config(format!(
                "the checkpoint has MoE tensors for layer {bad} but config.json says num_hidden_layers = {}",
                config.num_hidden_layers
            )));
        }
        Ok(Checkpoint { dir, config_json, hf_quant_json, config, quant, naming, store, layers })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The MoE hyper-parameters from `config.json`.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }
    /// `config.json` as parsed JSON.
    pub fn config_json(&self) -> &serde_json::Value {
        &self.config_json
    }
    /// `hf_quant_config.json`, when present.
    pub fn hf_quant_json(&self) -> Option<&serde_json::Value> {
        self.hf_quant_json.as_ref()
    }
    /// The quantization description.
    pub fn quant(&self) -> &QuantConfig {
        &self.quant
    }
    /// The detected naming scheme.
    pub fn naming(&self) -> Naming {
        self.naming
    }
    /// The memory-mapped tensors.
    pub fn store(&self) -> &TensorStore {
        &self.store
    }
    /// Raw view of one tensor (borrowed from the map, no copy).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.store.tensor(name)
    }
    /// Whether the checkpoint holds tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.store.has(name)
    }
    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.store.names().collect()
    }
    /// The MoE layers present in the files (router or expert tensors), ascending.
    pub fn moe_layers(&self) -> Vec<usize> {
        self.layers.clone()
    }
    /// Routed experts of `layer` that have at least one tensor, ascending.
    pub fn experts_present(&self, layer: usize) -> Vec<usize> {
        let prefix = self.naming.experts_prefix(layer);
        let set: BTreeSet<usize> = self
            .store
            .names_with_prefix(&prefix)
            .filter_map(|n| n[prefix.len()..].split('.').next()?.parse().ok())
            .collect();
        set.into_iter().collect()
    }
}

/// Removes the `config: ` prefix of a config error so it can be re-wrapped with the file name.
fn strip_config(e: MegaError) -> String {
    match e {
        MegaError::Config(m) => m,
        e => e.to_string(),
    }
}

//! Checkpoints: `config.json`, safetensors (single or sharded, memory-mapped), naming schemes,
//! validation at load, and the [`MoeLayer`] struct.

pub mod layer;

pub use layer::{
    DenseData, DenseProj, ExpertFormat, ExpertProj, MoeLayer, ProjData, RouterWeights, SharedExpert,
};

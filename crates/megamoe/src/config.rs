//! The MoE block's hyper-parameters, read from a checkpoint's `config.json`.

use serde::{Deserialize, Serialize};

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

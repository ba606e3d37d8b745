//! Per-stage tensors of one forward, for comparing a backend with the reference stage by stage.
//!
//! Every stage has one canonical layout, independent of how a backend orders its work:
//! per-slot tensors are indexed by `slot = t*k + j` (token-major), never by plan row.
//!
//! On a layer that holds only a range of experts (expert parallelism), the reference records
//! zeros in the per-slot stages for slots routed outside the range, keeps [`Stage::PlanCounts`]
//! `[E]` by global id (zero outside the range) and shows in [`Stage::InputQuant`] the input of
//! each token's first slot inside the range (zeros for a token with none); see
//! [`crate::reference::forward_detailed`].

/// The stages of a forward, in pipeline order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Stage {
    /// Router scores `[T, E]` (after the score function, before bias).
    RouterScores,
    /// Chosen experts `[T, k]` (as f32).
    TopkIds,
    /// Routing weights `[T, k]`.
    TopkWeights,
    /// Tokens per expert `[E]` (as f32).
    PlanCounts,
    /// Expert input after the mode's activation quantization, `[T, H]` (dequantized values;
    /// W4A16: the bf16 input itself). Per token, since every slot of a token sees the same input.
    InputQuant,
    /// `x W1^T` per slot `[T*k, I]`, before the clamp.
    L1Gate,
    /// `x W3^T` per slot `[T*k, I]`, before the clamp.
    L1Up,
    /// `bf16(silu(min(gate,L)) * clamp(up,-L,L) * w)` per slot `[T*k, I]`.
    Activation,
    /// The activation after the mode's quantization `[T*k, I]` (dequantized values).
    ActivationQuant,
    /// `a W2^T` per slot `[T*k, H]`.
    L2Out,
    /// Shared expert output `[T, H]`.
    SharedOut,
    /// Final output `[T, H]`.
    Output,
}

impl Stage {
    /// Every stage, in pipeline order.
    pub const ALL: [Stage; 12] = [
        Stage::RouterScores,
        Stage::TopkIds,
        Stage::TopkWeights,
        Stage::PlanCounts,
        Stage::InputQuant,
        Stage::L1Gate,
        Stage::L1Up,
        Stage::Activation,
        Stage::ActivationQuant,
        Stage::L2Out,
        Stage::SharedOut,
        Stage::Output,
    ];

    /// snake_case name (used in tables and dump files).
    pub fn name(self) -> &'static str {
        match self {
            Stage::RouterScores => "router_scores",
            Stage::TopkIds => "topk_ids",
            Stage::TopkWeights => "topk_weights",
            Stage::PlanCounts => "plan_counts",
            Stage::InputQuant => "input_quant",
            Stage::L1Gate => "l1_gate",
            Stage::L1Up => "l1_up",
            Stage::Activation => "activation",
            Stage::ActivationQuant => "activation_quant",
            Stage::L2Out => "l2_out",
            Stage::SharedOut => "shared_out",
            Stage::Output => "output",
        }
    }
}

/// One stage's tensor.
#[derive(Clone, Debug)]
pub struct StageTensor {
    /// Which stage.
    pub stage: Stage,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Values.
    pub data: Vec<f32>,
}

/// The stages a backend recorded during one forward.
#[derive(Clone, Debug, Default)]
pub struct StageTrace {
    /// Recorded stages, in the order recorded.
    pub stages: Vec<StageTensor>,
}

impl StageTrace {
    /// Records a stage (replacing an earlier record of the same stage).
    pub fn record(&mut self, stage: Stage, shape: &[usize], data: Vec<f32>) {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        self.stages.retain(|s| s.stage != stage);
        self.stages.push(StageTensor { stage, shape: shape.to_vec(), data });
    }

    /// The recorded tensor of `stage`, if any.
    pub fn get(&self, stage: Stage) -> Option<&StageTensor> {
        self.stages.iter().find(|s| s.stage == stage)
    }
}

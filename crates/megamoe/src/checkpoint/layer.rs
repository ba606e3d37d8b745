//! One loaded MoE layer: a plain struct of expert-stacked host tensors that every backend consumes.
//!
//! Layouts are the checkpoint's own (row-major, out x in), stacked along a leading expert axis:
//! backends transform them into whatever their kernels want, in tested functions of their own.

use crate::config::MoeConfig;
use half::bf16;
use std::ops::Range;

use crate::formats::WeightFormat;

/// The weights of one projection (W1, W2 or W3) of every routed expert.
#[derive(Clone, Debug)]
pub enum ProjData {
    /// NVFP4 (ModelOpt).
    Nvfp4 {
        /// E2M1 codes `[E, rows, cols/2]`, element 2j in the low nibble, 2j+1 in the high.
        packed: Vec<u8>,
        /// e4m3 block scales, row-major `[E, rows, cols/16]`.
        scales: Vec<u8>,
        /// `weight_scale_2` per expert `[E]`: value = e2m1 * scale * global_scale.
        global_scale: Vec<f32>,
        /// `input_scale` per expert `[E]` (static activation global scale, W4A4), when present.
        input_scale: Option<Vec<f32>>,
    },
    /// MXFP4 (official DeepSeek-V4 release).
    Mxfp4 {
        /// E2M1 codes `[E, rows, cols/2]`, element 2j in the low nibble.
        packed: Vec<u8>,
        /// e8m0 block scales `[E, rows, cols/32]`: value = e2m1 * 2^(scale-127).
        scales: Vec<u8>,
    },
    /// bf16 weights `[E, rows, cols]`.
    Bf16 {
        /// The weights.
        weight: Vec<bf16>,
    },
}

/// One projection of all routed experts: `experts` matrices of `rows x cols` (out x in).
#[derive(Clone, Debug)]
pub struct ExpertProj {
    /// Number of experts E.
    pub experts: usize,
    /// Output features (rows of each matrix).
    pub rows: usize,
    /// Input features (columns of each matrix).
    pub cols: usize,
    /// The data.
    pub data: ProjData,
}

impl ExpertProj {
    /// The storage format.
    pub fn format(&self) -> WeightFormat {
        match self.data {
            ProjData::Nvfp4 { .. } => WeightFormat::Nvfp4,
            ProjData::Mxfp4 { .. } => WeightFormat::Mxfp4,
            ProjData::Bf16 { .. } => WeightFormat::Bf16,
        }
    }
}

/// A dense (non-routed) projection, e.g. of the shared expert.
#[derive(Clone, Debug)]
pub enum DenseData {
    /// bf16 weights `[rows, cols]`.
    Bf16(Vec<bf16>),
    /// FP8 e4m3 weights `[rows, cols]` with one f32 dequantization multiplier per 128x128 block,
    /// `scale` `[ceil(rows/128), ceil(cols/128)]` (value = fp8 * scale).
    Fp8Block {
        /// e4m3 bytes.
        weight: Vec<u8>,
        /// Block multipliers (DeepSeek's `scale` / HF's `weight_scale_inv`, as f32).
        scale: Vec<f32>,
    },
}

/// A dense projection `rows x cols` (out x in).
#[derive(Clone, Debug)]
pub struct DenseProj {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The data.
    pub data: DenseData,
}

/// Rows and columns of one FP8 weight-scale block: a dense FP8 projection has one multiplier per
/// `FP8_WEIGHT_BLOCK x FP8_WEIGHT_BLOCK` block (DeepSeek's `scale`, HF's `weight_scale_inv`).
pub const FP8_WEIGHT_BLOCK: usize = 128;

/// The `[block rows, block cols]` grid of `FP8_WEIGHT_BLOCK` blocks over a `[rows, cols]` weight.
pub fn fp8_scale_grid(rows: usize, cols: usize) -> [usize; 2] {
    [rows.div_ceil(FP8_WEIGHT_BLOCK), cols.div_ceil(FP8_WEIGHT_BLOCK)]
}

/// The index into the `[block rows, block cols]` scales of weight element (`r`, `c`) of a
/// `cols`-wide weight.
pub fn fp8_scale_index(r: usize, c: usize, cols: usize) -> usize {
    (r / FP8_WEIGHT_BLOCK) * cols.div_ceil(FP8_WEIGHT_BLOCK) + c / FP8_WEIGHT_BLOCK
}

/// The shared expert (always applied, routing weight 1).
#[derive(Clone, Debug)]
pub struct SharedExpert {
    /// Gate projection `[I_s, H]`.
    pub w1: DenseProj,
    /// Down projection `[H, I_s]`.
    pub w2: DenseProj,
    /// Up projection `[I_s, H]`.
    pub w3: DenseProj,
}

/// The router's tensors.
#[derive(Clone, Debug)]
pub struct RouterWeights {
    /// `gate.weight` `[E, H]`, as f32 (exact for bf16 checkpoints).
    pub weight: Vec<f32>,
    /// `gate.bias` / `e_score_correction_bias` `[E]`, used only for choosing experts.
    pub bias: Option<Vec<f32>>,
    /// `gate.tid2eid` `[vocab, k]` for hash layers, validated to lie in `0..E`.
    pub tid2eid: Option<Vec<i32>>,
}

/// One MoE layer, loaded and validated.
#[derive(Clone, Debug)]
pub struct MoeLayer {
    /// Layer index in the model.
    pub index: usize,
    /// Global ids of the routed experts this layer holds: `0..E` for a whole layer, a rank's
    /// contiguous range when loaded or sliced for expert parallelism. The expert tensors hold
    /// `expert_range.len()` experts; the router always covers all `E`.
    pub expert_range: Range<usize>,
    /// The model's MoE hyper-parameters.
    pub config: MoeConfig,
    /// Router.
    pub router: RouterWeights,
    /// Gate projections of all experts `[E, I, H]`.
    pub w1: ExpertProj,
    /// Down projections `[E, H, I]`.
    pub w2: ExpertProj,
    /// Up projections `[E, I, H]`.
    pub w3: ExpertProj,
    /// Shared expert, when the model has one.
    pub shared: Option<SharedExpert>,
}

impl MoeLayer {
    /// Whether this layer routes by `tid2eid[input_ids]`.
    pub fn is_hash(&self) -> bool {
        self.router.tid2eid.is_some()
    }
    /// The routed experts' storage format.
    pub fn format(&self) -> WeightFormat {
        self.w1.format()
    }
    /// Routed experts held (`expert_range.len()`).
    pub fn local_experts(&self) -> usize {
        self.expert_range.len()
    }
    /// The local index of global expert `id`, if this layer holds it (`None` for -1 and for
    /// experts of other ranks).
    pub fn local_expert(&self, id: i32) -> Option<usize> {
        crate::parallel::local_index(&self.expert_range, id)
    }
}

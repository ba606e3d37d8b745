//! What a forward takes and returns, independent of the backend.

use crate::error::{MegaError, Result};
use half::bf16;

/// How activations enter the expert GEMMs (DESIGN.md, "Execution modes").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Mode {
    /// bf16 activations, exactly dequantized FP4 weights, fp32 accumulation.
    W4A16,
    /// Activations through DeepSeek-V4's FP8 `act_quant` (128-blocks, power-of-two scales), on the
    /// exact bf16 path (the W4A16 kernels on quantize-dequantized activations). On Hopper, with
    /// `MEGAMOE_W4A8_FP8=1`, prefill batches of MXFP4 experts run both GEMMs on FP8 tensor cores
    /// instead (the weights converted to e4m3 exactly; 3-11% faster, with the FP8 MMA's
    /// accumulation), with `=l2` the L2 only; NVFP4 experts always stay on the bf16 path (e4m3
    /// block scales times E2M1 are not FP8 values).
    W4A8,
    /// Activations quantized to NVFP4 under the checkpoint's `input_scale` (Blackwell semantics).
    W4A4,
}

/// The command-line help of a `--mode` option.
pub const MODE_HELP: &str = "Execution mode: w4a16 (bf16 activations, exact), w4a8 (DeepSeek's FP8 \
act_quant activations, on the exact bf16 path; on Hopper MEGAMOE_W4A8_FP8=1 runs MXFP4 experts' \
prefill on FP8 tensor cores with the weights converted to e4m3 exactly, 3-11% faster but with the FP8 \
MMA's accumulation, 2.4-3.0e-3 from the reference, and MEGAMOE_W4A8_FP8=l2 only their L2; NVFP4 experts \
always take the bf16 path, since e4m3 block scales times E2M1 are not FP8 values), w4a4 (NVFP4 \
activations, NVFP4 checkpoints)";

impl Mode {
    /// Every mode, in order.
    pub const ALL: [Mode; 3] = [Mode::W4A16, Mode::W4A8, Mode::W4A4];

    /// Lower-case name as used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mode::W4A16 => "w4a16",
            Mode::W4A8 => "w4a8",
            Mode::W4A4 => "w4a4",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = MegaError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "w4a16" => Ok(Mode::W4A16),
            "w4a8" => Ok(Mode::W4A8),
            "w4a4" => Ok(Mode::W4A4),
            _ => Err(MegaError::Input(format!("unknown mode `{s}` (expected w4a16, w4a8 or w4a4)"))),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The input of one forward: `tokens` rows of hidden states and, for hash layers, token ids.
#[derive(Clone, Copy, Debug)]
pub struct ForwardInput<'a> {
    /// Hidden states `[T, H]` in bf16 (the model's activation dtype).
    pub x: &'a [bf16],
    /// Token ids `[T]` (required on hash-routed layers).
    pub input_ids: Option<&'a [i64]>,
}

/// The result of one forward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ForwardOutput {
    /// Output `[T, H]`: routed sum plus shared expert.
    pub y: Vec<f32>,
    /// Chosen experts `[T, k]`.
    pub topk_ids: Vec<i32>,
    /// Routing weights `[T, k]` (normalised, times `routed_scaling_factor`).
    pub topk_weights: Vec<f32>,
}

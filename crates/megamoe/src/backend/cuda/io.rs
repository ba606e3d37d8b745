//! The caller's device buffers of one forward: [`DeviceTensor`] (pointer, shape, dtype of a
//! contiguous row-major tensor) and [`ForwardIo`]. Nothing is copied: kernels read the inputs and
//! write the outputs where they are (offsets inside larger allocations included). Every tensor is
//! checked against the layer before anything is enqueued, with errors that name it.

use super::weights::LayerWeights;
use crate::error::{MegaError, Result};

/// Element types of the io tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// float32.
    F32,
    /// int32.
    I32,
    /// int64 (torch's default for token ids).
    I64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }
}

/// A contiguous row-major `[rows, cols]` tensor in device memory (a vector is `[n, 1]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceTensor {
    /// Device address of element 0.
    pub ptr: u64,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Element type.
    pub dtype: DType,
}

impl DeviceTensor {
    /// A `[rows, cols]` tensor of `dtype` at `ptr`.
    pub fn new(ptr: u64, rows: usize, cols: usize, dtype: DType) -> Self {
        DeviceTensor { ptr, rows, cols, dtype }
    }

    /// Checks shape, dtype (one of `dtypes`) and alignment (`align` bytes), naming the tensor.
    pub(crate) fn check(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        dtypes: &[DType],
        align: u64,
    ) -> Result<()> {
        if self.rows != rows || self.cols != cols || !dtypes.contains(&self.dtype) {
            return Err(MegaError::Input(format!(
                "{name}: expected [{rows}, {cols}] {}, got [{}, {}] {:?}",
                dtypes.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(" or "),
                self.rows,
                self.cols,
                self.dtype
            )));
        }
        if self.ptr == 0 && rows * cols > 0 {
            return Err(MegaError::Input(format!("{name}: null device pointer")));
        }
        if !self.ptr.is_multiple_of(align) {
            return Err(MegaError::Input(format!(
                "{name}: device address 0x{:x} is not {align}-byte aligned (the kernels use {align}-byte loads)",
                self.ptr
            )));
        }
        Ok(())
    }
}

/// Who routes the tokens of a forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// The layer's own router; `topk_ids` / `topk_weights`, when given, receive its choice.
    Internal,
    /// The caller's router (vLLM's convention): `topk_ids` (global ids, -1 = not here) and
    /// `topk_weights` are inputs and required; ids outside the layer's expert range are skipped.
    External,
}

/// The device buffers of one forward of `tokens` tokens.
#[derive(Clone, Copy, Debug)]
pub struct ForwardIo {
    /// Tokens T.
    pub tokens: usize,
    /// Hidden states `[T, H]` bf16.
    pub x: DeviceTensor,
    /// Token ids `[T, 1]` i32 or i64 (hash-routed layers with internal routing).
    pub input_ids: Option<DeviceTensor>,
    /// Output `[T, H]` f32 or bf16.
    pub y: DeviceTensor,
    /// `[T, k]` i32 global expert ids (output of internal routing, input of external).
    pub topk_ids: Option<DeviceTensor>,
    /// `[T, k]` f32 routing weights (as `topk_ids`).
    pub topk_weights: Option<DeviceTensor>,
    /// Who routes.
    pub routing: Routing,
}

impl ForwardIo {
    /// A forward of `x` `[T, H]` into `y` on the caller's routing (`topk_ids` `[T, k]` global ids,
    /// `topk_weights` `[T, k]`): plan, experts, shared expert and combine, no router.
    pub fn external(
        x: DeviceTensor,
        y: DeviceTensor,
        topk_ids: DeviceTensor,
        topk_weights: DeviceTensor,
    ) -> Self {
        ForwardIo {
            tokens: x.rows,
            x,
            input_ids: None,
            y,
            topk_ids: Some(topk_ids),
            topk_weights: Some(topk_weights),
            routing: Routing::External,
        }
    }

    /// Checks every tensor against layer `w`.
    pub fn check(&self, w: &LayerWeights) -> Result<()> {
        let c = w.config();
        let (t, h, k) = (self.tokens, c.hidden_size, c.num_experts_per_tok);
        X.check(&self.x, t, h)?;
        Y.check(&self.y, t, h)?;
        for (spec, v) in [(TOPK_IDS, &self.topk_ids), (TOPK_WEIGHTS, &self.topk_weights)] {
            match v {
                Some(v) => spec.check(v, t, k)?,
                None if self.routing == Routing::External => {
                    return Err(MegaError::Input(format!("{} is required with external routing", spec.name)))
                }
                None => {}
            }
        }
        if self.routing == Routing::Internal {
            check_input_ids(w, self.input_ids.as_ref(), t)?;
        }
        Ok(())
    }
}

/// What the entry points accept for one of the layer's tensors: its name in errors, its element
/// types and the byte alignment its kernels' vector accesses need. Every entry point checks a
/// tensor through its spec here (one place for the rules).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorSpec {
    /// The name errors give it.
    pub name: &'static str,
    dtypes: &'static [DType],
    align: u64,
}

impl TensorSpec {
    /// Checks `v` as a `[rows, cols]` tensor of this spec.
    pub fn check(&self, v: &DeviceTensor, rows: usize, cols: usize) -> Result<()> {
        v.check(self.name, rows, cols, self.dtypes, self.align)
    }
}

/// The layer input `[T, H]` bf16 (16-byte row loads and TMA boxes).
pub(crate) const X: TensorSpec = TensorSpec { name: "x", dtypes: &[DType::Bf16], align: 16 };
/// The layer output `[T, H]` f32 or bf16: 4-byte aligned (the L2 epilogues' f32 stores); the
/// combines store 4 columns at once where the base allows (common.cuh `store_out4`).
pub(crate) const Y: TensorSpec = TensorSpec { name: "y", dtypes: &[DType::F32, DType::Bf16], align: 4 };
/// Global expert ids `[T, k]` i32.
pub(crate) const TOPK_IDS: TensorSpec = TensorSpec { name: "topk_ids", dtypes: &[DType::I32], align: 4 };
/// Routing weights `[T, k]` f32.
pub(crate) const TOPK_WEIGHTS: TensorSpec =
    TensorSpec { name: "topk_weights", dtypes: &[DType::F32], align: 4 };

/// A hash-routed layer's token ids `[T, 1]` i32 / i64, required there (other layers ignore them).
pub(crate) fn check_input_ids(w: &LayerWeights, ids: Option<&DeviceTensor>, t: usize) -> Result<()> {
    if !w.is_hash() {
        return Ok(());
    }
    let ids = ids.ok_or_else(|| {
        MegaError::Input(format!("layer {} is hash-routed: input_ids are required", w.index()))
    })?;
    ids.check("input_ids", t, 1, &[DType::I32, DType::I64], ids.dtype.size() as u64)
}

//! What one rank's engine does for expert parallelism: the home-rank stages (router, shared
//! expert) and the expert stage on the tokens other ranks sent (per-slot results, not summed, so
//! the home rank can sum every token's slots in the single-engine order).
//!
//! [`CpuRankEngine`] runs the reference; `backend::cuda::CudaRankEngine` runs the CUDA runtime's
//! enqueue stages on one GPU (several ranks may share one, a stream each).

use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::Mode;
use crate::reference;
use crate::router;
use half::bf16;
use std::sync::Arc;
use std::thread::JoinHandle;

/// One rank's engine: a layer holding this rank's experts (and TP slice) plus the whole router
/// and shared expert.
pub trait RankEngine: Send {
    /// One line: backend, experts, slice.
    fn describe(&self) -> String;

    /// Bytes of weights this engine holds (host bytes on the CPU, device bytes on a GPU).
    fn held_bytes(&self) -> usize;

    /// Routes the home tokens `x` `[T, H]`: `(topk_ids, topk_weights)`, both `[T, k]`, global ids.
    fn route(&mut self, x: &[bf16], input_ids: Option<&[i64]>) -> Result<(Vec<i32>, Vec<f32>)>;

    /// Starts the shared expert on the home tokens `x` `[T, H]` (runs beside the exchange).
    fn shared_begin(&mut self, x: &[bf16]) -> Result<()>;

    /// Waits for the shared expert started last: its output `[T, H]` (zeros without one).
    fn shared_end(&mut self) -> Result<Vec<f32>>;

    /// The routed experts on received tokens: `x` `[R, H]`, `ids` `[R, k]` global ids (`-1` and
    /// other ranks' experts are not computed here), `weights` `[R, k]`. Returns one `[H]` f32 row
    /// per slot this engine holds, in slot order (`r*k + j` ascending): `[P, H]`. Each row is
    /// bitwise the slot's contribution in a single-engine forward of the same backend.
    fn expert_slots(&mut self, x: &[bf16], ids: &[i32], weights: &[f32], mode: Mode) -> Result<Vec<f32>>;
}

/// The CPU reference as a rank engine.
pub struct CpuRankEngine {
    layer: Arc<MoeLayer>,
    shared: Option<JoinHandle<Vec<f32>>>,
    shared_tokens: usize,
}

impl CpuRankEngine {
    /// An engine for `layer` (already sliced to the rank's experts and TP slice).
    pub fn new(layer: Arc<MoeLayer>) -> Result<Self> {
        layer.validate()?;
        Ok(CpuRankEngine { layer, shared: None, shared_tokens: 0 })
    }

    /// The held layer.
    pub fn layer(&self) -> &MoeLayer {
        &self.layer
    }
}

/// Checks `ids` / `weights` of `rows` received tokens against `[R, k]`.
pub(crate) fn check_slots(x_len: usize, h: usize, k: usize, ids: &[i32], weights: &[f32]) -> Result<usize> {
    if !x_len.is_multiple_of(h) {
        return Err(MegaError::Input(format!("x has {x_len} elements, not a multiple of H={h}")));
    }
    let r = x_len / h;
    for (name, len) in [("topk_ids", ids.len()), ("topk_weights", weights.len())] {
        if len != r * k {
            return Err(MegaError::Input(format!("{name} has {len} elements, expected [R={r}, k={k}]")));
        }
    }
    Ok(r)
}

impl RankEngine for CpuRankEngine {
    fn describe(&self) -> String {
        let l = &self.layer;
        format!(
            "cpu, experts {:?}, I {} ({} threads)",
            l.expert_range,
            l.config.moe_intermediate_size,
            rayon::current_num_threads()
        )
    }

    fn held_bytes(&self) -> usize {
        super::HeldBytes::of(&self.layer).total()
    }

    fn route(&mut self, x: &[bf16], input_ids: Option<&[i64]>) -> Result<(Vec<i32>, Vec<f32>)> {
        let r = router::route(&self.layer, x, input_ids)?;
        Ok((r.topk_ids, r.topk_weights))
    }

    fn shared_begin(&mut self, x: &[bf16]) -> Result<()> {
        if self.shared.is_some() {
            return Err(MegaError::Input("shared_begin called twice without shared_end".into()));
        }
        let h = self.layer.config.hidden_size;
        if !x.len().is_multiple_of(h) {
            return Err(MegaError::Input(format!("x has {} elements, not a multiple of H={h}", x.len())));
        }
        self.shared_tokens = x.len() / h;
        let (layer, x) = (self.layer.clone(), x.to_vec());
        self.shared = Some(std::thread::spawn(move || reference::shared_expert(&layer, &x)));
        Ok(())
    }

    fn shared_end(&mut self) -> Result<Vec<f32>> {
        let h =
            self.shared.take().ok_or_else(|| MegaError::Input("shared_end without shared_begin".into()))?;
        h.join().map_err(|_| MegaError::backend("cpu", "the shared expert's thread panicked"))
    }

    fn expert_slots(&mut self, x: &[bf16], ids: &[i32], weights: &[f32], mode: Mode) -> Result<Vec<f32>> {
        let l = &self.layer;
        let (h, k) = (l.config.hidden_size, l.config.num_experts_per_tok);
        check_slots(x.len(), h, k, ids, weights)?;
        // One row per held slot, that slot alone in its row (the other k-1 slots -1): the
        // reference computes each slot's contribution independently of the rows around it, so
        // row i of the result is bitwise the slot's term of a single-engine forward (0 + v == v
        // up to the sign of a zero, which the home rank's sum, starting at +0, cannot see).
        let held: Vec<usize> = (0..ids.len()).filter(|&s| l.local_expert(ids[s]).is_some()).collect();
        let p = held.len();
        let mut xe = Vec::with_capacity(p * h);
        let mut ie = vec![-1i32; p * k];
        let mut we = vec![0.0f32; p * k];
        for (i, &s) in held.iter().enumerate() {
            let t = s / k;
            xe.extend_from_slice(&x[t * h..(t + 1) * h]);
            ie[i * k] = ids[s];
            we[i * k] = weights[s];
        }
        reference::forward_routed(l, &xe, &ie, &we, mode)
    }
}

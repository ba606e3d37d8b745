//! The exact CPU reference forward: the oracle every other backend is tested against.
//!
//! Per chosen (token, expert) slot, with `L = swiglu_limit` (no clamp when 0):
//! `gate = x W1^T`, `up = x W3^T`, `up = clamp(up, -L, L)`, `gate = min(gate, L)`,
//! `a = bf16(silu(gate) * up * w)` (routing weight before W2), `out = a W2^T`;
//! `y = sum of the k slots in slot order (fp32) + shared expert` (same math, `w = 1`, activations
//! never quantized). The mode decides what enters each routed GEMM: bf16 values (W4A16), DeepSeek's
//! FP8 `act_quant` (W4A8) or NVFP4 under the expert's `input_scale` (W4A4).
//!
//! Weights are dequantized exactly, one row at a time (`e2m1 * block scale`), multiplied with every
//! token of the expert in fp32; the NVFP4 global scale is an fp32 alpha applied after accumulation,
//! one per projection per expert. Work is spread with rayon over (expert, row block) tasks; experts
//! without tokens cost nothing. Results do not depend on the thread count.
//!
//! Expert parallelism: a layer holding only a range of experts (`MoeLayer::expert_range`, loaded
//! with `Checkpoint::load_layer_experts` or sliced with `ExpertShard::slice_layer`) computes only
//! the slots routed to its own experts, planned over local ids; slots routed elsewhere (and `-1`
//! in an external routing, [`forward_routed`]) contribute nothing. Every entry point checks the
//! layer with [`MoeLayer::validate`] first.

pub mod file;
pub mod float64;
mod weights;

use crate::checkpoint::{MoeLayer, ProjData};
use crate::error::{MegaError, Result};
use crate::formats as fmt;
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::plan::{ForwardShape, RoutingPlan};
use crate::router;
use crate::trace::{Stage, StageTrace};
use half::bf16;
use rayon::prelude::*;
use weights::MatView;

/// Tokens processed together when no trace is requested (bounds the scratch memory; weights are
/// re-read once per chunk, which is cheap next to the arithmetic of 256 tokens).
const TOKEN_CHUNK: usize = 256;
/// Weight rows per task.
const ROW_BLOCK: usize = 32;

/// The reference's result with the parts the golden fixtures check separately.
#[derive(Clone, Debug, Default)]
pub struct ReferenceOutput {
    /// `y`, `topk_ids`, `topk_weights`.
    pub output: ForwardOutput,
    /// Router scores `[T, E]`.
    pub scores: Vec<f32>,
    /// Sum of the routed experts' contributions `[T, H]` (`y = routed + shared`); on a layer holding
    /// a range of experts, of those experts only.
    pub routed: Vec<f32>,
    /// Shared expert output `[T, H]` (zeros when the layer has none).
    pub shared: Vec<f32>,
}

/// Checks that `layer` can run in `mode`: W4A8 needs H and I multiples of 128; W4A4 needs NVFP4
/// experts with a positive finite `input_scale` on every expert's W1 and W2.
pub fn check_mode(layer: &MoeLayer, mode: Mode) -> Result<()> {
    let c = &layer.config;
    match mode {
        Mode::W4A16 => Ok(()),
        Mode::W4A8 => {
            if !c.hidden_size.is_multiple_of(128) || !c.moe_intermediate_size.is_multiple_of(128) {
                return Err(MegaError::Input(format!(
                    "mode w4a8 quantizes activations in 128-element blocks: hidden_size={} and \
                     moe_intermediate_size={} must both be multiples of 128",
                    c.hidden_size, c.moe_intermediate_size
                )));
            }
            Ok(())
        }
        Mode::W4A4 => {
            for (proj, p, needs_input_scale) in
                [("w1", &layer.w1, true), ("w3", &layer.w3, false), ("w2", &layer.w2, true)]
            {
                let ProjData::Nvfp4 { input_scale, .. } = &p.data else {
                    return Err(MegaError::Input(format!(
                        "mode w4a4 needs NVFP4 experts; layer {} `{proj}` is {:?}",
                        layer.index,
                        p.format()
                    )));
                };
                if !needs_input_scale {
                    continue;
                }
                let Some(s) = input_scale else {
                    return Err(MegaError::tensor(
                        format!("layers.{}.ffn.experts.*.{proj}.input_scale", layer.index),
                        "missing: mode w4a4 quantizes activations under the checkpoint's input_scale",
                    ));
                };
                if let Some((e, v)) = s.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v > 0.0)) {
                    return Err(MegaError::tensor(
                        format!(
                            "layers.{}.ffn.experts.{}.{proj}.input_scale",
                            layer.index,
                            layer.expert_range.start + e
                        ),
                        format!("is {v}; mode w4a4 needs a positive finite activation global scale"),
                    ));
                }
            }
            Ok(())
        }
    }
}

/// Runs the reference forward: router, the routed experts the layer holds, shared expert (see
/// [`forward_detailed`]). When `trace` is given, records every [`Stage`].
pub fn forward(
    layer: &MoeLayer,
    input: &ForwardInput<'_>,
    mode: Mode,
    trace: Option<&mut StageTrace>,
) -> Result<ForwardOutput> {
    forward_detailed(layer, input, mode, trace).map(|o| o.output)
}

/// One expert's worth of rows: a weight triple, its input rows and per-row routing weights.
struct Job<'a> {
    w1: MatView<'a>,
    w3: MatView<'a>,
    w2: MatView<'a>,
    /// Input rows `[n, H]` (already through the mode's input quantization).
    input: &'a [f32],
    n: usize,
    /// Routing weight per row (`None`: the shared expert, weight 1).
    row_weight: Option<Vec<f32>>,
    /// How the activation is quantized before W2.
    act_quant: ActQuant,
}

#[derive(Clone, Copy)]
enum ActQuant {
    None,
    Fp8,
    Nvfp4(f32),
}

impl ActQuant {
    fn apply(self, row: &mut [f32], scratch: &mut Vec<f32>) {
        match self {
            ActQuant::None => {}
            ActQuant::Fp8 => {
                scratch.clear();
                scratch.extend_from_slice(row);
                fmt::act_quant::fp8_block128_ue8m0(scratch, row);
            }
            ActQuant::Nvfp4(g) => {
                scratch.clear();
                scratch.extend_from_slice(row);
                fmt::act_quant::nvfp4_block16(scratch, g, row);
            }
        }
    }
}

/// fp32 dot product with 8 independent partial sums (vectorizes; fixed order, so deterministic).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `out[i*(r1-r0) + (r-r0)] = alpha * W[r] . inp[i]` for rows `r0..r1` and all `n` input rows.
fn gemm_rows(w: &MatView<'_>, r0: usize, r1: usize, inp: &[f32], n: usize, out: &mut [f32]) {
    let mut row = vec![0.0f32; w.cols];
    let width = r1 - r0;
    for r in r0..r1 {
        w.row(r, &mut row);
        for i in 0..n {
            out[i * width + (r - r0)] = w.alpha * dot(&row, &inp[i * w.cols..(i + 1) * w.cols]);
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The clamped SwiGLU inputs: `gate = min(gate, L)`, `up = clamp(up, -L, L)`, no clamp when
/// `L == 0`. NaN stays NaN (as torch's `clamp` keeps it; `f32::min` alone would turn it into L).
fn swiglu_clamp(g: f32, u: f32, limit: f32) -> (f32, f32) {
    if limit > 0.0 {
        (if g.is_nan() { g } else { g.min(limit) }, u.clamp(-limit, limit))
    } else {
        (g, u)
    }
}

/// Per-job results of the L1 phase `[n, I]`: activations and, when tracing, gate, up and the
/// quantized activation.
struct L1Out {
    act: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act_q: Vec<f32>,
}

/// Runs L1 (+ SwiGLU, routing weight, bf16 rounding, activation quantization) and L2 for `jobs`.
/// Returns per job the L2 output `[n, H]` and the L1 results.
fn run_jobs(jobs: &[Job<'_>], inter: usize, hidden: usize, limit: f32, keep: bool) -> Vec<(Vec<f32>, L1Out)> {
    // L1: (job, block of I rows).
    let tasks: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, _)| (0..inter).step_by(ROW_BLOCK).map(move |r0| (j, r0)))
        .collect();
    let blocks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = tasks
        .par_iter()
        .map(|&(j, r0)| {
            let job = &jobs[j];
            let r1 = (r0 + ROW_BLOCK).min(inter);
            let width = r1 - r0;
            let mut gate = vec![0.0f32; job.n * width];
            let mut up = vec![0.0f32; job.n * width];
            gemm_rows(&job.w1, r0, r1, job.input, job.n, &mut gate);
            gemm_rows(&job.w3, r0, r1, job.input, job.n, &mut up);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .enumerate()
                .map(|(idx, (&g, &u))| {
                    let (g, u) = swiglu_clamp(g, u, limit);
                    let w = job.row_weight.as_ref().map_or(1.0, |rw| rw[idx / width]);
                    bf16::from_f32(silu(g) * u * w).to_f32()
                })
                .collect();
            if keep {
                (act, gate, up)
            } else {
                (act, Vec::new(), Vec::new())
            }
        })
        .collect();
    // Scatter the blocks into per-job row-major [n, I] buffers.
    let mut l1: Vec<L1Out> = jobs
        .iter()
        .map(|job| {
            let len = job.n * inter;
            let traced = if keep { len } else { 0 };
            L1Out { act: vec![0.0; len], gate: vec![0.0; traced], up: vec![0.0; traced], act_q: Vec::new() }
        })
        .collect();
    for (&(j, r0), (act, gate, up)) in tasks.iter().zip(blocks) {
        let width = (r0 + ROW_BLOCK).min(inter) - r0;
        let o = &mut l1[j];
        for i in 0..jobs[j].n {
            let dst = i * inter + r0..i * inter + r0 + width;
            o.act[dst.clone()].copy_from_slice(&act[i * width..(i + 1) * width]);
            if keep {
                o.gate[dst.clone()].copy_from_slice(&gate[i * width..(i + 1) * width]);
                o.up[dst].copy_from_slice(&up[i * width..(i + 1) * width]);
            }
        }
    }
    // Activation quantization, per row (keeps the pre-quantization values when tracing).
    let quant: Vec<Vec<f32>> = l1
        .par_iter()
        .zip(jobs)
        .map(|(o, job)| {
            let mut q = o.act.clone();
            let mut scratch = Vec::new();
            for row in q.chunks_mut(inter) {
                job.act_quant.apply(row, &mut scratch);
            }
            q
        })
        .collect();
    // L2: (job, block of H rows).
    let tasks: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, _)| (0..hidden).step_by(ROW_BLOCK).map(move |r0| (j, r0)))
        .collect();
    let blocks: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(j, r0)| {
            let r1 = (r0 + ROW_BLOCK).min(hidden);
            let mut out = vec![0.0f32; jobs[j].n * (r1 - r0)];
            gemm_rows(&jobs[j].w2, r0, r1, &quant[j], jobs[j].n, &mut out);
            out
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = jobs.iter().map(|job| vec![0.0; job.n * hidden]).collect();
    for (&(j, r0), blk) in tasks.iter().zip(blocks) {
        let width = (r0 + ROW_BLOCK).min(hidden) - r0;
        for i in 0..jobs[j].n {
            outs[j][i * hidden + r0..i * hidden + r0 + width]
                .copy_from_slice(&blk[i * width..(i + 1) * width]);
        }
    }
    outs.into_iter()
        .zip(l1)
        .zip(quant)
        .map(|((out, mut o), q)| {
            if keep {
                o.act_q = q;
            }
            (out, o)
        })
        .collect()
}

/// Runs the reference forward and returns the routed and shared parts separately as well.
///
/// The router always covers all `E` experts; the routed sum covers only the experts the layer
/// holds (`layer.expert_range`): on a layer loaded or sliced for one rank, slots routed to other
/// ranks' experts contribute nothing (those ranks compute them), and the shared expert is still
/// added, so `y = shared + this rank's routed contributions`. A whole layer holds every expert.
///
/// Tracing runs all tokens as one chunk (full-size per-slot buffers). In W4A4 the expert input
/// depends on the expert's own `input_scale`; [`Stage::InputQuant`] then shows each token's input
/// as quantized for its first chosen expert (slot `j = 0`). On a layer that holds only a range of
/// experts, the per-slot stages ([`Stage::L1Gate`] .. [`Stage::L2Out`]) are zeros for slots routed
/// outside the range, [`Stage::InputQuant`] shows the input of the token's first slot inside the
/// range (zeros for a token with none) and [`Stage::PlanCounts`] stays `[E]` by global id, zero
/// outside the range.
pub fn forward_detailed(
    layer: &MoeLayer,
    input: &ForwardInput<'_>,
    mode: Mode,
    trace: Option<&mut StageTrace>,
) -> Result<ReferenceOutput> {
    layer.validate()?;
    check_mode(layer, mode)?;
    let tokens = input.x.len() / layer.config.hidden_size.max(1);
    let shape = ForwardShape::of(layer, tokens);
    shape.check_x(input.x.len())?;
    shape.check_host_memory(crate::plan::available_host_memory)?;
    let (h, inter, e_count, k) = (shape.hidden, shape.inter, shape.experts, shape.top_k);

    let routing = router::route(layer, input.x, input.input_ids)?;
    let tracing = trace.is_some();
    let routed = routed_experts(layer, input.x, &routing.topk_ids, &routing.topk_weights, mode, tracing)?;
    let shared = shared_expert(layer, input.x);
    let y: Vec<f32> = routed.sum.iter().zip(&shared).map(|(r, s)| r + s).collect();

    if let (Some(t), Some(tb)) = (trace, routed.trace) {
        let slots = tokens * k;
        let mut counts = vec![0.0f32; e_count];
        for (c, &n) in counts[layer.expert_range.clone()].iter_mut().zip(&routed.counts) {
            *c = n as f32;
        }
        t.record(Stage::RouterScores, &[tokens, e_count], routing.scores.clone());
        t.record(Stage::TopkIds, &[tokens, k], routing.topk_ids.iter().map(|&v| v as f32).collect());
        t.record(Stage::TopkWeights, &[tokens, k], routing.topk_weights.clone());
        t.record(Stage::PlanCounts, &[e_count], counts);
        t.record(Stage::InputQuant, &[tokens, h], tb.input_q);
        t.record(Stage::L1Gate, &[slots, inter], tb.gate);
        t.record(Stage::L1Up, &[slots, inter], tb.up);
        t.record(Stage::Activation, &[slots, inter], tb.act);
        t.record(Stage::ActivationQuant, &[slots, inter], tb.act_q);
        t.record(Stage::L2Out, &[slots, h], tb.l2);
        t.record(Stage::SharedOut, &[tokens, h], shared.clone());
        t.record(Stage::Output, &[tokens, h], y.clone());
    }

    Ok(ReferenceOutput {
        output: ForwardOutput { y, topk_ids: routing.topk_ids, topk_weights: routing.topk_weights },
        scores: routing.scores,
        routed: routed.sum,
        shared,
    })
}

/// The routed experts' sum `[T, H]` for an external routing, in vLLM's convention: `topk_ids`
/// `[T, k]` are global expert ids, `-1` means "not routed here" and is skipped, and slots routed
/// to experts outside `layer.expert_range` contribute nothing (another rank computes them);
/// `topk_weights` `[T, k]` multiply each slot's activation before W2, as the router's weights do
/// (non-finite weights are allowed and propagate as the math says). No router, no shared expert:
/// this is what one expert-parallel rank adds to the combine. Same per-slot math and slot order as
/// [`forward_detailed`]'s `routed` (fed its own routing, the results are equal).
///
/// Errors: `x` not `[T, H]`, `topk_ids` or `topk_weights` not `[T, k]`, an id `>= E` or `< -1`
/// (the message names `topk_ids[i]`), a batch whose outputs do not fit the host's available
/// memory ([`ForwardShape::check_host_memory`]), a layer that fails [`MoeLayer::validate`] or a mode the
/// layer cannot run ([`check_mode`]).
pub fn forward_routed(
    layer: &MoeLayer,
    x: &[bf16],
    topk_ids: &[i32],
    topk_weights: &[f32],
    mode: Mode,
) -> Result<Vec<f32>> {
    layer.validate()?;
    check_mode(layer, mode)?;
    let (h, k) = (layer.config.hidden_size, layer.config.num_experts_per_tok);
    if !x.len().is_multiple_of(h) {
        return Err(MegaError::Input(format!(
            "x has {} elements, not a multiple of H={h} (expected [T, H])",
            x.len()
        )));
    }
    let tokens = x.len() / h;
    ForwardShape::of(layer, tokens).check_host_memory(crate::plan::available_host_memory)?;
    for (name, len) in [("topk_ids", topk_ids.len()), ("topk_weights", topk_weights.len())] {
        if len != tokens * k {
            return Err(MegaError::Input(format!(
                "{name} has {len} elements, expected [T={tokens}, k={k}] = {} (T from x)",
                tokens * k
            )));
        }
    }
    Ok(routed_experts(layer, x, topk_ids, topk_weights, mode, false)?.sum)
}

/// What [`routed_experts`] computes.
struct Routed {
    /// Sum of the local slots' contributions `[T, H]`, per token in slot order.
    sum: Vec<f32>,
    /// Slots routed to each local expert `[E_local]`.
    counts: Vec<u32>,
    /// Full-size per-slot buffers (non-local slots zero), when tracing.
    trace: Option<TraceBufs>,
}

/// The one routed-experts path of the reference: `ids` `[T, k]` global ids (`-1`: skipped),
/// `wts` `[T, k]`; only the layer's own experts are computed, planned over local ids. The caller
/// has validated the layer, the mode and the shapes of `x`, `ids` and `wts`.
fn routed_experts(
    layer: &MoeLayer,
    x: &[bf16],
    ids: &[i32],
    wts: &[f32],
    mode: Mode,
    tracing: bool,
) -> Result<Routed> {
    let c = &layer.config;
    let (h, inter, e_count, k) =
        (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
    let limit = c.swiglu_limit;
    let tokens = x.len() / h;
    if let Some((i, &v)) = ids.iter().enumerate().find(|(_, &v)| v < -1 || v >= e_count as i32) {
        return Err(MegaError::Input(format!(
            "topk_ids[{i}] = {v} is outside the router's experts: expected a global id in 0..{e_count} \
             or -1 (not routed here)"
        )));
    }
    let n_local = layer.local_experts();
    let shape = ForwardShape::of(layer, tokens);
    let mut sum = vec![0.0f32; tokens * h];
    let mut counts = vec![0u32; n_local];
    let mut tr = if tracing { Some(TraceBufs::new(tokens, &shape)) } else { None };
    let chunk = if tracing { tokens.max(1) } else { TOKEN_CHUNK };

    let input_scale = |p: &ProjData, e: usize| match p {
        ProjData::Nvfp4 { input_scale: Some(s), .. } => s[e],
        _ => 1.0, // unreachable after check_mode for W4A4
    };

    for t0 in (0..tokens).step_by(chunk) {
        let t1 = (t0 + chunk).min(tokens);
        let tc = t1 - t0;
        let ids = &ids[t0 * k..t1 * k];
        let wts = &wts[t0 * k..t1 * k];
        // The slots this layer computes: the plan over its expert range (-1 and other ranks'
        // experts are not planned, exactly as on the device).
        let plan = RoutingPlan::build_range(ids, &layer.expert_range);
        let local_of = |slot: usize| layer.local_expert(ids[slot]).expect("a planned slot is held");
        for (total, n) in counts.iter_mut().zip(&plan.counts) {
            *total += n;
        }
        let x_f32: Vec<f32> = x[t0 * h..t1 * h].iter().map(|v| v.to_f32()).collect();

        // Expert inputs in plan-row order, through the mode's input quantization.
        let row_token = |row: usize| plan.perm[row] as usize / k;
        let mut xin = vec![0.0f32; plan.perm.len() * h];
        match mode {
            Mode::W4A16 => xin.par_chunks_mut(h).enumerate().for_each(|(row, dst)| {
                let t = row_token(row);
                dst.copy_from_slice(&x_f32[t * h..(t + 1) * h]);
            }),
            Mode::W4A8 => {
                let mut xq = vec![0.0f32; tc * h];
                xq.par_chunks_mut(h).zip(x_f32.par_chunks(h)).for_each(|(q, x)| {
                    fmt::act_quant::fp8_block128_ue8m0(x, q);
                });
                xin.par_chunks_mut(h).enumerate().for_each(|(row, dst)| {
                    let t = row_token(row);
                    dst.copy_from_slice(&xq[t * h..(t + 1) * h]);
                });
            }
            Mode::W4A4 => xin.par_chunks_mut(h).enumerate().for_each(|(row, dst)| {
                let (t, e) = (row_token(row), local_of(plan.perm[row] as usize));
                fmt::act_quant::nvfp4_block16(
                    &x_f32[t * h..(t + 1) * h],
                    input_scale(&layer.w1.data, e),
                    dst,
                );
            }),
        }

        let mut jobs: Vec<Job<'_>> = Vec::new();
        let mut job_of_expert = vec![usize::MAX; n_local];
        for e in plan.active_experts() {
            let (r0, r1) = (plan.offsets[e] as usize, plan.offsets[e + 1] as usize);
            job_of_expert[e] = jobs.len();
            jobs.push(Job {
                w1: MatView::expert(&layer.w1, e),
                w3: MatView::expert(&layer.w3, e),
                w2: MatView::expert(&layer.w2, e),
                input: &xin[r0 * h..r1 * h],
                n: r1 - r0,
                row_weight: Some(plan.perm[r0..r1].iter().map(|&slot| wts[slot as usize]).collect()),
                act_quant: match mode {
                    Mode::W4A16 => ActQuant::None,
                    Mode::W4A8 => ActQuant::Fp8,
                    Mode::W4A4 => ActQuant::Nvfp4(input_scale(&layer.w2.data, e)),
                },
            });
        }
        let results = run_jobs(&jobs, inter, h, limit, tracing);
        // `(job, row within the job)` of planned slot `slot`.
        let place = |slot: usize| {
            let e = local_of(slot);
            (job_of_expert[e], plan.row_of_slot[slot] as usize - plan.offsets[e] as usize)
        };
        let planned =
            |t: usize| (t * k..(t + 1) * k).filter(|&s| plan.row_of_slot[s] != RoutingPlan::NOT_PLANNED);

        // Combine: per token, its planned slots in slot order.
        for t in 0..tc {
            let dst = &mut sum[(t0 + t) * h..(t0 + t + 1) * h];
            for slot in planned(t) {
                let (j, i) = place(slot);
                for (d, v) in dst.iter_mut().zip(&results[j].0[i * h..(i + 1) * h]) {
                    *d += v;
                }
            }
        }

        if let Some(tb) = tr.as_mut() {
            // Canonical per-slot layouts (slot = t*k + j); this chunk is the whole forward.
            for slot in (0..tc).flat_map(planned) {
                let (j, i) = place(slot);
                let (out, l1) = &results[j];
                let s = slot * inter..(slot + 1) * inter;
                let src = i * inter..(i + 1) * inter;
                tb.gate[s.clone()].copy_from_slice(&l1.gate[src.clone()]);
                tb.up[s.clone()].copy_from_slice(&l1.up[src.clone()]);
                tb.act[s.clone()].copy_from_slice(&l1.act[src.clone()]);
                tb.act_q[s].copy_from_slice(&l1.act_q[src]);
                tb.l2[slot * h..(slot + 1) * h].copy_from_slice(&out[i * h..(i + 1) * h]);
            }
            for t in 0..tc {
                if let Some(slot) = planned(t).next() {
                    let row = plan.row_of_slot[slot] as usize;
                    tb.input_q[t * h..(t + 1) * h].copy_from_slice(&xin[row * h..(row + 1) * h]);
                }
            }
        }
    }
    Ok(Routed { sum, counts, trace: tr })
}

/// The shared expert's output `[T, H]` (zeros when the layer has none): weight 1, activations
/// never quantized, in chunks of `TOKEN_CHUNK` tokens. `x` is `[T, H]` (the caller checks it;
/// expert parallelism runs it on the home rank, beside the exchange).
pub fn shared_expert(layer: &MoeLayer, x: &[bf16]) -> Vec<f32> {
    let h = layer.config.hidden_size;
    let tokens = x.len() / h;
    let mut out = vec![0.0f32; tokens * h];
    let Some(s) = &layer.shared else { return out };
    for t0 in (0..tokens).step_by(TOKEN_CHUNK) {
        let t1 = (t0 + TOKEN_CHUNK).min(tokens);
        let x_f32: Vec<f32> = x[t0 * h..t1 * h].iter().map(|v| v.to_f32()).collect();
        let job = Job {
            w1: MatView::dense(&s.w1),
            w3: MatView::dense(&s.w3),
            w2: MatView::dense(&s.w2),
            input: &x_f32,
            n: t1 - t0,
            row_weight: None,
            act_quant: ActQuant::None,
        };
        // The shared expert may be wider than I (several fused): its own intermediate size.
        let (y, _) = run_jobs(std::slice::from_ref(&job), s.w1.rows, h, layer.config.swiglu_limit, false)
            .pop()
            .expect("one job, one result");
        out[t0 * h..t1 * h].copy_from_slice(&y);
    }
    out
}

/// Full-size trace buffers in canonical layouts.
struct TraceBufs {
    input_q: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    act_q: Vec<f32>,
    l2: Vec<f32>,
}

impl TraceBufs {
    fn new(tokens: usize, s: &ForwardShape) -> Self {
        let slots = tokens * s.top_k;
        TraceBufs {
            input_q: vec![0.0; tokens * s.hidden],
            gate: vec![0.0; slots * s.inter],
            up: vec![0.0; slots * s.inter],
            act: vec![0.0; slots * s.inter],
            act_q: vec![0.0; slots * s.inter],
            l2: vec![0.0; slots * s.hidden],
        }
    }
}

//! The CPU path: the exact reference forward on host tensors borrowed through DLPack. Inputs are
//! read in place (bf16 `x`, i64 ids) or converted once when their dtype differs; results are
//! written into the caller's output tensors.

use crate::calls::{ExpertsCall, ForwardCall, RouteCall};
use crate::capsule::Borrowed;
use crate::dlpack::Elem;
use crate::errors::to_py;
use half::bf16;
use megamoe::checkpoint::MoeLayer;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::{reference, router};
use pyo3::prelude::*;
use std::borrow::Cow;
use std::sync::Arc;

/// A model's layers held on the host for the reference forward.
pub struct CpuBackend {
    /// The layers, in load order.
    pub layers: Vec<Arc<MoeLayer>>,
}

/// A `Send` wrapper of the caller's borrowed host tensors, so that the GIL can be released while
/// the reference runs (the Python objects stay alive in the caller's frame).
struct Unguarded<T>(T);
// SAFETY: only raw host addresses of tensors kept alive by the calling frame cross threads, and
// the calling thread waits for the closure.
unsafe impl<T> Send for Unguarded<T> {}

impl CpuBackend {
    /// The reference forward of layer `pos`.
    pub fn forward(&self, py: Python<'_>, pos: usize, c: &ForwardCall<'_>, mode: Mode) -> PyResult<()> {
        let layer = self.layers[pos].clone();
        // SAFETY: the tensors were checked (CPU, contiguous, dtype, shape) and live in `c`.
        let x = unsafe { x_bf16(c.x)? };
        let ids = c.input_ids.map(|b| unsafe { ids_i64(b) }).transpose()?;
        let job = Unguarded((x.as_ref().as_ptr(), x.len(), ids.as_ref().map(|v| (v.as_ptr(), v.len()))));
        let out = py
            .detach(move || {
                let job = job;
                let (xp, xn, ids) = job.0;
                // SAFETY: the slices above outlive this closure (the caller waits for it).
                let x = unsafe { std::slice::from_raw_parts(xp, xn) };
                let ids = ids.map(|(p, n)| unsafe { std::slice::from_raw_parts(p, n) });
                reference::forward(&layer, &ForwardInput { x, input_ids: ids }, mode, None)
            })
            .map_err(to_py)?;
        unsafe {
            write_floats(c.y, &out.y)?;
            if let Some(t) = c.topk_ids {
                write_ids(t, &out.topk_ids)?;
            }
            if let Some(w) = c.topk_weights {
                w.host_slice_mut::<f32>()?.copy_from_slice(&out.topk_weights);
            }
        }
        Ok(())
    }

    /// The router of layer `pos`.
    pub fn route(&self, py: Python<'_>, pos: usize, c: &RouteCall<'_>) -> PyResult<()> {
        let layer = self.layers[pos].clone();
        let x = unsafe { x_bf16(c.x)? };
        let ids = c.input_ids.map(|b| unsafe { ids_i64(b) }).transpose()?;
        let job = Unguarded((x.as_ref().as_ptr(), x.len(), ids.as_ref().map(|v| (v.as_ptr(), v.len()))));
        let r = py
            .detach(move || {
                let job = job;
                let (xp, xn, ids) = job.0;
                // SAFETY: as in `forward`.
                let x = unsafe { std::slice::from_raw_parts(xp, xn) };
                let ids = ids.map(|(p, n)| unsafe { std::slice::from_raw_parts(p, n) });
                router::route(&layer, x, ids)
            })
            .map_err(to_py)?;
        unsafe {
            write_ids(c.topk_ids, &r.topk_ids)?;
            c.topk_weights.host_slice_mut::<f32>()?.copy_from_slice(&r.topk_weights);
        }
        Ok(())
    }

    /// The routed experts of layer `pos` under the caller's routing (no shared expert).
    pub fn experts(&self, py: Python<'_>, pos: usize, c: &ExpertsCall<'_>, mode: Mode) -> PyResult<()> {
        let layer = self.layers[pos].clone();
        let x = unsafe { x_bf16(c.x)? };
        let ids: Cow<'_, [i32]> = unsafe {
            match c.topk_ids_elem {
                Elem::I32 => Cow::Borrowed(c.topk_ids.host_slice::<i32>()?),
                _ => Cow::Owned(ids32(c.topk_ids)?),
            }
        };
        let w = unsafe { c.topk_weights.host_slice::<f32>()? };
        let job = Unguarded((x.as_ptr(), x.len(), ids.as_ptr(), ids.len(), w.as_ptr(), w.len()));
        let y = py
            .detach(move || {
                let job = job;
                let (xp, xn, ip, n, wp, wn) = job.0;
                // SAFETY: as in `forward`.
                let (x, ids, w) = unsafe {
                    (
                        std::slice::from_raw_parts(xp, xn),
                        std::slice::from_raw_parts(ip, n),
                        std::slice::from_raw_parts(wp, wn),
                    )
                };
                reference::forward_routed(&layer, x, ids, w, mode)
            })
            .map_err(to_py)?;
        unsafe { write_floats(c.y, &y) }
    }
}

/// `x` as bf16: borrowed when it is bf16, rounded to nearest-even bf16 when float32.
///
/// # Safety
/// `x` was checked as a CPU, contiguous bf16 or f32 tensor.
unsafe fn x_bf16(x: &Borrowed) -> PyResult<Cow<'_, [bf16]>> {
    Ok(match x.desc.elem {
        Some(Elem::Bf16) => Cow::Borrowed(x.host_slice::<bf16>()?),
        _ => Cow::Owned(x.host_slice::<f32>()?.iter().map(|&v| bf16::from_f32(v)).collect()),
    })
}

/// Token ids as i64 (copied when i32).
///
/// # Safety
/// `ids` was checked as a CPU, contiguous i32 or i64 tensor.
unsafe fn ids_i64(ids: &Borrowed) -> PyResult<Cow<'_, [i64]>> {
    Ok(match ids.desc.elem {
        Some(Elem::I64) => Cow::Borrowed(ids.host_slice::<i64>()?),
        _ => Cow::Owned(ids.host_slice::<i32>()?.iter().map(|&v| v as i64).collect()),
    })
}

/// i64 expert ids narrowed to i32, naming an id that does not fit.
///
/// # Safety
/// `ids` was checked as a CPU, contiguous i64 tensor.
unsafe fn ids32(ids: &Borrowed) -> PyResult<Vec<i32>> {
    ids.host_slice::<i64>()?
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            i32::try_from(v).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "{}[{i}] = {v} is not an expert id",
                    ids.name
                ))
            })
        })
        .collect()
}

/// Writes f32 results into a checked f32 or bf16 output.
///
/// # Safety
/// `out` was checked as a writable CPU, contiguous f32 or bf16 tensor of `v.len()` elements.
unsafe fn write_floats(out: &Borrowed, v: &[f32]) -> PyResult<()> {
    match out.desc.elem {
        Some(Elem::Bf16) => {
            for (o, &x) in out.host_slice_mut::<bf16>()?.iter_mut().zip(v) {
                *o = bf16::from_f32(x);
            }
        }
        _ => out.host_slice_mut::<f32>()?.copy_from_slice(v),
    }
    Ok(())
}

/// Writes expert ids into a checked i32 or i64 output.
///
/// # Safety
/// `out` was checked as a writable CPU, contiguous i32 or i64 tensor of `v.len()` elements.
unsafe fn write_ids(out: &Borrowed, v: &[i32]) -> PyResult<()> {
    match out.desc.elem {
        Some(Elem::I64) => {
            for (o, &x) in out.host_slice_mut::<i64>()?.iter_mut().zip(v) {
                *o = x as i64;
            }
        }
        _ => out.host_slice_mut::<i32>()?.copy_from_slice(v),
    }
    Ok(())
}

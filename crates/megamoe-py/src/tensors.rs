//! A layer from host tensors instead of a checkpoint: ModelOpt NVFP4 or MXFP4 experts stacked
//! along a leading expert axis, in vLLM's FusedMoE names (`w13_*` = gate rows then up rows) or with
//! W1 and W3 apart (`w1_*`, `w3_*`), plus the router and the shared expert. MXFP4 is recognised by
//! the absence of every `*_weight_scale_2`: its `*_weight_scale` are e8m0 bytes `[E_l, rows,
//! cols/32]`, row-major (the official release's `.scale`), and it has no input scales. bf16
//! experts by their dtype: `*_weight` bfloat16 / float32 `[E_l, rows, cols]`, no scales.
//!
//! | name | shape | dtype |
//! |---|---|---|
//! | `gate.weight` | `[E, H]` | float32 / bfloat16 |
//! | `gate.bias` (score-routed) | `[E]` | float32 / bfloat16 |
//! | `gate.tid2eid` (hash-routed) | `[vocab, k]` | int32 / int64 |
//! | `w13_weight` or `w1_weight`, `w3_weight` | `[E_l, 2I or I, H/2]` | uint8 (E2M1, even element low) |
//! | `w13_weight_scale` or `w1_…`, `w3_…` | `[E_l, 2I or I, H/16]` (or the chosen layout) | uint8 / float8_e4m3fn |
//! | `w13_weight_scale_2` or `w1_…`, `w3_…` | `[E_l]` or `[E_l, 2]` | float32 |
//! | `w13_input_scale` or `w1_…` (optional; W4A4) | `[E_l]` or `[E_l, 2]` (max taken) | float32 |
//! | `w2_weight`, `w2_weight_scale`, `w2_weight_scale_2`, `w2_input_scale` | `[E_l, H, I/2]`, `[E_l, H, I/16]`, `[E_l]`, `[E_l]` | as above |
//! | MXFP4: `w13_weight` / `w1_`, `w3_`, `w2_weight` | as NVFP4 | uint8 / int8 |
//! | MXFP4: `w13_weight_scale` / `w1_`, `w3_`, `w2_weight_scale` | `[E_l, rows, cols/32]` | uint8 / float8_e8m0fnu |
//! | bf16 experts: `w13_weight` / `w1_`, `w3_`, `w2_weight` (no scales) | `[E_l, 2I or I, H]`, `[E_l, H, I]` | bfloat16 / float32 |
//! | `shared.w{1,2,3}.weight` (optional) | `[I_s, H]`, `[H, I_s]`, `[I_s, H]` | bfloat16 / float32, or uint8 (FP8 e4m3) |
//! | `shared.w{1,2,3}.weight_scale_inv` (FP8 shared expert) | `[ceil(rows/128), ceil(cols/128)]` | float32 |
//!
//! Scale bytes are reinterpreted, never cast; a non-row-major layout (128x4-swizzled, four per
//! u32) is converted per expert matrix with `megamoe::formats::scale_layout`.

use crate::args::Dim;
use crate::capsule::Borrowed;
use crate::dlpack::{Device, Elem};
use crate::errors::to_py;
use half::bf16;
use megamoe::checkpoint::{
    DenseData, DenseProj, ExpertProj, MoeLayer, ProjData, RouterWeights, SharedExpert,
};
use megamoe::config::MoeConfig;
use megamoe::formats::scale_layout::{self, ScaleLayout};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;

/// The caller's tensors by name, borrowed from the host.
struct Tensors {
    map: HashMap<String, Borrowed>,
}

impl Tensors {
    fn new(dict: &Bound<'_, PyDict>) -> PyResult<Tensors> {
        let mut map = HashMap::new();
        for (k, v) in dict.iter() {
            let name: String = k.extract()?;
            let b = crate::capsule::borrow(&v, &format!("tensors[{name:?}]"), 0)?;
            b.device(Device::Cpu)?;
            b.contiguous()?;
            map.insert(name, b);
        }
        Ok(Tensors { map })
    }

    fn get(&self, name: &str) -> Option<&Borrowed> {
        self.map.get(name)
    }

    fn req(&self, name: &str) -> PyResult<&Borrowed> {
        self.get(name).ok_or_else(|| PyKeyError::new_err(format!("tensors: {name:?} is required")))
    }

    /// The first of `names` present.
    fn first<'a>(&'a self, names: &[&'a str]) -> Option<(&'a str, &'a Borrowed)> {
        names.iter().find_map(|n| self.get(n).map(|b| (*n, b)))
    }
}

/// Values of a float tensor as f32 (f32 read, bf16 widened).
fn floats(b: &Borrowed, dims: &[Dim]) -> PyResult<Vec<f32>> {
    let e = b.dtype(&[Elem::F32, Elem::Bf16])?;
    b.shape(dims)?;
    // SAFETY: checked host, contiguous, dtype.
    unsafe {
        Ok(match e {
            Elem::F32 => b.host_slice::<f32>()?.to_vec(),
            _ => b.host_slice::<bf16>()?.iter().map(|v| v.to_f32()).collect(),
        })
    }
}

/// The raw bytes of a host tensor of any accepted dtype.
fn bytes(b: &Borrowed) -> PyResult<&[u8]> {
    let size = b.desc.elem.map_or(1, Elem::size);
    // SAFETY: a host, contiguous tensor of numel elements of `size` bytes.
    unsafe {
        let n = b.desc.numel() * size;
        if n == 0 {
            return Ok(&[]);
        }
        Ok(std::slice::from_raw_parts(b.desc.ptr as *const u8, n))
    }
}

/// Per-expert f32 scalars of `[E_l]` or `[E_l, 2]` (the max of the pair when `pair_max`, else the
/// column `col`).
fn per_expert(b: &Borrowed, el: usize, col: usize, pair_max: bool) -> PyResult<Vec<f32>> {
    b.dtype(&[Elem::F32])?;
    // SAFETY: checked host, contiguous, f32.
    let v = unsafe { b.host_slice::<f32>()? };
    match b.desc.shape.as_slice() {
        [n] if *n == el => Ok(v.to_vec()),
        [] if el == 1 => Ok(v.to_vec()),
        [n, 2] if *n == el => {
            Ok((0..el).map(|e| if pair_max { v[2 * e].max(v[2 * e + 1]) } else { v[2 * e + col] }).collect())
        }
        s => Err(PyValueError::new_err(format!("{}: shape {s:?}, expected [E={el}] or [E={el}, 2]", b.name))),
    }
}

/// Row-major scale bytes `[E_l, rows, cols/16]` from a scale tensor in `layout`.
fn scales_row_major(
    b: &Borrowed,
    el: usize,
    rows: usize,
    cols: usize,
    layout: ScaleLayout,
) -> PyResult<Vec<u8>> {
    b.dtype(&[Elem::U8, Elem::I32, Elem::U32])?;
    let sc = cols / 16;
    let src = bytes(b)?;
    let per = match layout {
        ScaleLayout::RowMajor => rows * sc,
        ScaleLayout::Swizzled128x4 => scale_layout::swizzled_len(rows, sc),
        ScaleLayout::PackedU32 => rows * scale_layout::u32_words_per_row(sc) * 4,
    };
    if src.len() != el * per {
        return Err(PyValueError::new_err(format!(
            "{}: {} bytes, expected {el} experts x {per} bytes ({rows} x {sc} e4m3 scales, {layout:?} layout)",
            b.name,
            src.len()
        )));
    }
    let mut out = Vec::with_capacity(el * rows * sc);
    for e in 0..el {
        let m = scale_layout::convert(&src[e * per..(e + 1) * per], layout, ScaleLayout::RowMajor, rows, sc)
            .map_err(to_py)?;
        out.extend_from_slice(&m);
    }
    Ok(out)
}

/// Splits row-major `[E_l, 2R, C]` elements into its first and second `R` rows per expert.
fn split_rows<T: Copy>(v: &[T], el: usize, rows: usize, width: usize) -> (Vec<T>, Vec<T>) {
    let (mut a, mut b) = (Vec::with_capacity(v.len() / 2), Vec::with_capacity(v.len() / 2));
    for e in 0..el {
        let m = &v[e * 2 * rows * width..(e + 1) * 2 * rows * width];
        a.extend_from_slice(&m[..rows * width]);
        b.extend_from_slice(&m[rows * width..]);
    }
    (a, b)
}

/// One NVFP4 projection of every held expert.
fn proj(
    el: usize,
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
    gs: Vec<f32>,
    is: Option<Vec<f32>>,
) -> ExpertProj {
    ExpertProj {
        experts: el,
        rows,
        cols,
        data: ProjData::Nvfp4 { packed, scales, global_scale: gs, input_scale: is },
    }
}

/// Whether the experts are MXFP4 (no `*_weight_scale_2` anywhere) rather than NVFP4.
fn is_mxfp4(t: &Tensors) -> bool {
    ["w13_weight_scale_2", "w1_weight_scale_2", "w3_weight_scale_2", "w2_weight_scale_2"]
        .iter()
        .all(|n| t.get(n).is_none())
}

/// One MXFP4 projection of every held expert from `{w}_weight` and its e8m0 `{w}_weight_scale`.
fn mx_proj(t: &Tensors, w: &str, el: usize, rows: usize, cols: usize) -> PyResult<ExpertProj> {
    let packed = packed(t.req(&format!("{w}_weight"))?, el, rows, cols)?;
    let s = t.req(&format!("{w}_weight_scale"))?;
    s.dtype(&[Elem::U8])?;
    s.shape(&[Dim("E", el), Dim("rows", rows), Dim("cols/32", cols / 32)])?;
    if let Some(b) = t.get(&format!("{w}_input_scale")) {
        return Err(PyValueError::new_err(format!(
            "{}: MXFP4 experts (no weight_scale_2) take no input scales",
            b.name
        )));
    }
    Ok(ExpertProj { experts: el, rows, cols, data: ProjData::Mxfp4 { packed, scales: bytes(s)?.to_vec() } })
}

/// The MXFP4 W1, W3 (from `w13_*` or `w1_*` + `w3_*`) and W2.
fn mx_experts(t: &Tensors, el: usize, i: usize, h: usize) -> PyResult<(ExpertProj, ExpertProj, ExpertProj)> {
    let w2 = mx_proj(t, "w2", el, h, i)?;
    if t.get("w13_weight").is_none() {
        return Ok((mx_proj(t, "w1", el, i, h)?, mx_proj(t, "w3", el, i, h)?, w2));
    }
    let both = mx_proj(t, "w13", el, 2 * i, h)?;
    let ProjData::Mxfp4 { packed, scales } = both.data else { unreachable!("built as MXFP4") };
    let (p1, p3) = split_rows(&packed, el, i, h / 2);
    let (s1, s3) = split_rows(&scales, el, i, h / 32);
    let mk = |packed, scales| ExpertProj {
        experts: el,
        rows: i,
        cols: h,
        data: ProjData::Mxfp4 { packed, scales },
    };
    Ok((mk(p1, s1), mk(p3, s3), w2))
}

/// Whether the experts are dense (`*_weight` bfloat16 / float32: bf16 experts, no scales).
fn is_dense(first: &Borrowed) -> bool {
    matches!(first.desc.elem, Some(Elem::Bf16 | Elem::F32))
}

/// One dense projection of every held expert, `{w}_weight` `[E_l, rows, cols]` bfloat16 (or
/// float32, rounded to bf16).
fn dense_proj(t: &Tensors, w: &str, el: usize, rows: usize, cols: usize) -> PyResult<Vec<bf16>> {
    let b = t.req(&format!("{w}_weight"))?;
    b.shape(&[Dim("E", el), Dim("rows", rows), Dim("cols", cols)])?;
    if let Some(s) = t.get(&format!("{w}_weight_scale")) {
        return Err(PyValueError::new_err(format!("{}: bf16 experts take no weight scales", s.name)));
    }
    // SAFETY: checked host, contiguous, dtype.
    Ok(match b.dtype(&[Elem::Bf16, Elem::F32])? {
        Elem::Bf16 => unsafe { b.host_slice::<bf16>()? }.to_vec(),
        _ => unsafe { b.host_slice::<f32>()? }.iter().map(|&v| bf16::from_f32(v)).collect(),
    })
}

/// The bf16 W1, W3 (from `w13_*` or `w1_*` + `w3_*`) and W2.
fn dense_experts(
    t: &Tensors,
    el: usize,
    i: usize,
    h: usize,
) -> PyResult<(ExpertProj, ExpertProj, ExpertProj)> {
    let mk = |rows, cols, weight| ExpertProj { experts: el, rows, cols, data: ProjData::Bf16 { weight } };
    let w2 = mk(h, i, dense_proj(t, "w2", el, h, i)?);
    if t.get("w13_weight").is_none() {
        return Ok((mk(i, h, dense_proj(t, "w1", el, i, h)?), mk(i, h, dense_proj(t, "w3", el, i, h)?), w2));
    }
    let (w1, w3) = split_rows(&dense_proj(t, "w13", el, 2 * i, h)?, el, i, h);
    Ok((mk(i, h, w1), mk(i, h, w3), w2))
}

/// Packed E2M1 bytes `[E_l, rows, cols/2]` (uint8, or int8 as the official release stores them).
fn packed(b: &Borrowed, el: usize, rows: usize, cols: usize) -> PyResult<Vec<u8>> {
    b.dtype(&[Elem::U8, Elem::I8])?;
    b.shape(&[Dim("E", el), Dim("rows", rows), Dim("cols/2", cols / 2)])?;
    Ok(bytes(b)?.to_vec())
}

/// W1, W3 from `w13_*` or `w1_*` + `w3_*`.
fn gate_up(
    t: &Tensors,
    el: usize,
    i: usize,
    h: usize,
    layout: ScaleLayout,
) -> PyResult<(ExpertProj, ExpertProj)> {
    if let Some(w13) = t.get("w13_weight") {
        let p = packed(w13, el, 2 * i, h)?;
        let s = scales_row_major(t.req("w13_weight_scale")?, el, 2 * i, h, layout)?;
        let gs = t.req("w13_weight_scale_2")?;
        let (g1, g3) = (per_expert(gs, el, 0, false)?, per_expert(gs, el, 1, false)?);
        let is = t.get("w13_input_scale").map(|b| per_expert(b, el, 0, true)).transpose()?;
        let (p1, p3) = split_rows(&p, el, i, h / 2);
        let (s1, s3) = split_rows(&s, el, i, h / 16);
        return Ok((proj(el, i, h, p1, s1, g1, is.clone()), proj(el, i, h, p3, s3, g3, is)));
    }
    let one = |w: &str| -> PyResult<ExpertProj> {
        let p = packed(t.req(&format!("{w}_weight"))?, el, i, h)?;
        let s = scales_row_major(t.req(&format!("{w}_weight_scale"))?, el, i, h, layout)?;
        let gs = per_expert(t.req(&format!("{w}_weight_scale_2"))?, el, 0, false)?;
        let is = t.get(&format!("{w}_input_scale")).map(|b| per_expert(b, el, 0, true)).transpose()?;
        Ok(proj(el, i, h, p, s, gs, is))
    };
    Ok((one("w1")?, one("w3")?))
}

/// One dense projection of the shared expert, bf16 / f32 (rounded to bf16) or FP8 128-block.
fn dense(t: &Tensors, w: &str, rows: usize, cols: usize) -> PyResult<DenseProj> {
    let name = format!("shared.{w}.weight");
    let b = t.req(&name)?;
    b.shape(&[Dim("rows", rows), Dim("cols", cols)])?;
    let data = match b.dtype(&[Elem::Bf16, Elem::F32, Elem::U8])? {
        // SAFETY: checked host, contiguous, dtype.
        Elem::Bf16 => DenseData::Bf16(unsafe { b.host_slice::<bf16>()? }.to_vec()),
        Elem::F32 => {
            DenseData::Bf16(unsafe { b.host_slice::<f32>()? }.iter().map(|&v| bf16::from_f32(v)).collect())
        }
        _ => {
            let s = t.req(&format!("shared.{w}.weight_scale_inv"))?;
            let scale = floats(
                s,
                &[Dim("ceil(rows/128)", rows.div_ceil(128)), Dim("ceil(cols/128)", cols.div_ceil(128))],
            )?;
            DenseData::Fp8Block { weight: bytes(b)?.to_vec(), scale }
        }
    };
    Ok(DenseProj { rows, cols, data })
}

/// Parses a scale layout name.
pub fn parse_layout(s: &str) -> PyResult<ScaleLayout> {
    match s.to_ascii_lowercase().replace(['-', ' '], "_").as_str() {
        "row_major" | "linear" => Ok(ScaleLayout::RowMajor),
        "swizzled" | "swizzled_128x4" | "128x4" => Ok(ScaleLayout::Swizzled128x4),
        "u32" | "packed_u32" => Ok(ScaleLayout::PackedU32),
        _ => Err(PyValueError::new_err(format!(
            "scale_layout: {s:?}, expected \"row_major\", \"swizzled_128x4\" or \"packed_u32\""
        ))),
    }
}

/// Builds and validates layer `index` from `config` (a `config.json` as text) and `tensors`
/// (see the module docs), holding experts `expert_start..expert_start + E_l`.
pub fn layer_from_tensors(
    config: &str,
    index: usize,
    dict: &Bound<'_, PyDict>,
    expert_start: usize,
    layout: ScaleLayout,
) -> PyResult<MoeLayer> {
    let json: serde_json::Value =
        serde_json::from_str(config).map_err(|e| PyValueError::new_err(format!("config: not JSON: {e}")))?;
    let config = MoeConfig::from_json(&json).map_err(to_py)?;
    let t = Tensors::new(dict)?;
    let (h, i, e, k) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
    );
    let weight = floats(t.req("gate.weight")?, &[Dim("E", e), Dim("H", h)])?;
    let bias = t.get("gate.bias").map(|b| floats(b, &[Dim("E", e)])).transpose()?;
    let tid2eid = match t.get("gate.tid2eid") {
        None => None,
        Some(b) => {
            let el = b.dtype(&[Elem::I32, Elem::I64])?;
            let rows = b.rows(2, &format!("[vocab, k={k}]"))?;
            b.shape(&[Dim("vocab", rows), Dim("k", k)])?;
            // SAFETY: checked host, contiguous, dtype.
            Some(unsafe {
                match el {
                    Elem::I32 => b.host_slice::<i32>()?.to_vec(),
                    _ => b
                        .host_slice::<i64>()?
                        .iter()
                        .map(|&v| v.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
                        .collect(),
                }
            })
        }
    };
    let (_, first) = t.first(&["w13_weight", "w1_weight"]).ok_or_else(|| {
        PyKeyError::new_err("tensors: \"w13_weight\" (or \"w1_weight\" and \"w3_weight\") is required")
    })?;
    let el = first.rows(3, "[E_local, rows, cols/2] (FP4) or [E_local, rows, cols] (bf16)")?;
    let (w1, w3, w2) = if is_dense(first) {
        dense_experts(&t, el, i, h)?
    } else if is_mxfp4(&t) {
        if layout != ScaleLayout::RowMajor {
            return Err(PyValueError::new_err(format!(
                "scale_layout {layout:?} applies to NVFP4's e4m3 scales; MXFP4 scales are row-major \
                 [E, rows, cols/32]"
            )));
        }
        mx_experts(&t, el, i, h)?
    } else {
        let (w1, w3) = gate_up(&t, el, i, h, layout)?;
        let w2 = proj(
            el,
            h,
            i,
            packed(t.req("w2_weight")?, el, h, i)?,
            scales_row_major(t.req("w2_weight_scale")?, el, h, i, layout)?,
            per_expert(t.req("w2_weight_scale_2")?, el, 0, false)?,
            t.get("w2_input_scale").map(|b| per_expert(b, el, 0, true)).transpose()?,
        );
        (w1, w3, w2)
    };
    let shared = match t.get("shared.w1.weight") {
        None => None,
        Some(b) => {
            let is = b.rows(2, &format!("[I_s, H={h}]"))?;
            Some(SharedExpert {
                w1: dense(&t, "w1", is, h)?,
                w2: dense(&t, "w2", h, is)?,
                w3: dense(&t, "w3", is, h)?,
            })
        }
    };
    let layer = MoeLayer {
        index,
        expert_range: expert_start..expert_start + el,
        config,
        router: RouterWeights { weight, bias, tid2eid },
        w1,
        w2,
        w3,
        shared,
    };
    layer.validate().map_err(to_py)?;
    Ok(layer)
}

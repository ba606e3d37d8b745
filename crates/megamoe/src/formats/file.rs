//! File-level quantize / dequantize: the logic behind `megamoe quantize` and `megamoe dequantize`,
//! kept in the library so it can be tested without the binary.
//!
//! Quantize: every 2-D floating (BF16 / F16 / F32) tensor whose name ends in `.weight` (and
//! matches no `exclude` pattern) is quantized; every other tensor is copied unchanged. Output
//! names follow the checkpoint conventions:
//! - NVFP4 (ModelOpt): `X.weight` U8 `[out, in/2]`, `X.weight_scale` F8_E4M3 `[out, in/16]`,
//!   `X.weight_scale_2` F32 `[]`;
//! - MXFP4 (DeepSeek-V4 release): `X.weight` I8 `[out, in/2]`, `X.scale` F8_E8M0 `[out, in/32]`.
//!
//! Dequantize recognises both namings, writes `X.weight` as BF16 or F32, drops the scale tensors
//! (and an NVFP4 weight's `input_scale`) and copies everything else.

use super::{mxfp4, nvfp4, WeightFormat};
use crate::error::{MegaError, Result};
use crate::tensor_io::{write_safetensors, OwnedTensor};
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The FP4 checkpoint formats `quantize` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp4Format {
    /// ModelOpt NVFP4 (16-element blocks, e4m3 scales, f32 global scale).
    Nvfp4,
    /// DeepSeek-V4 MXFP4 (32-element blocks, UE8M0 scales).
    Mxfp4,
}

impl std::str::FromStr for Fp4Format {
    type Err = MegaError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "nvfp4" => Ok(Fp4Format::Nvfp4),
            "mxfp4" => Ok(Fp4Format::Mxfp4),
            _ => Err(MegaError::Input(format!("unknown format `{s}`, expected nvfp4 or mxfp4"))),
        }
    }
}

impl Fp4Format {
    /// The storage format it writes (block size, name).
    pub fn weight_format(self) -> WeightFormat {
        match self {
            Fp4Format::Nvfp4 => WeightFormat::Nvfp4,
            Fp4Format::Mxfp4 => WeightFormat::Mxfp4,
        }
    }
}

impl std::fmt::Display for Fp4Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.weight_format().name())
    }
}

/// The floating dtypes `dequantize` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputDtype {
    /// bfloat16 (rounded to nearest even from the exact f32 values).
    Bf16,
    /// float32 (the exact dequantized values).
    F32,
}

/// Options of [`quantize_file_with`].
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// Target format.
    pub format: Fp4Format,
    /// Glob patterns (fnmatch style, `*` crosses dots) of tensor names to copy unquantized.
    pub exclude: Vec<String>,
}

/// What a file conversion did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileSummary {
    /// Names of the tensors converted (quantized or dequantized), as named in the input.
    pub converted: Vec<String>,
    /// Names of the tensors copied unchanged.
    pub copied: Vec<String>,
    /// Names of input tensors not written (scale tensors of dequantized weights).
    pub dropped: Vec<String>,
}

/// Progress callback: `(tensors done, tensors total, name of the tensor just handled)`.
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize, &str);

/// Quantizes `input` into `output` (see the module docs). Refuses to write over the input.
pub fn quantize_file(input: &Path, output: &Path, format: Fp4Format) -> Result<FileSummary> {
    quantize_file_with(input, output, &QuantizeOptions { format, exclude: Vec::new() }, &mut |_, _, _| {})
}

/// [`quantize_file`] with exclude patterns and a progress callback.
pub fn quantize_file_with(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    progress: Progress<'_>,
) -> Result<FileSummary> {
    transform_file(input, output, |st| quantize_tensors(st, opts, progress))
}

/// Maps `input`, converts its tensors with `convert` and writes them to `output` (never over the
/// input; written atomically).
fn transform_file(
    input: &Path,
    output: &Path,
    convert: impl FnOnce(&SafeTensors<'_>) -> Result<(BTreeMap<String, OwnedTensor>, FileSummary)>,
) -> Result<FileSummary> {
    refuse_same_file(input, output)?;
    let map = map_file(input)?;
    let st = SafeTensors::deserialize(&map)
        .map_err(|e| MegaError::file(input, format!("not a valid safetensors file: {e}")))?;
    let (tensors, summary) = convert(&st)?;
    write_safetensors(output, &tensors)?;
    Ok(summary)
}

/// Quantizes the tensors of a parsed safetensors file, returning the output tensors by name.
pub fn quantize_tensors(
    st: &SafeTensors<'_>,
    opts: &QuantizeOptions,
    progress: Progress<'_>,
) -> Result<(BTreeMap<String, OwnedTensor>, FileSummary)> {
    let exclude = build_globs(&opts.exclude)?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let mut out = BTreeMap::new();
    let mut summary = FileSummary::default();
    for (i, name) in names.iter().enumerate() {
        let view = st.tensor(name).map_err(|e| MegaError::tensor(name.as_str(), e.to_string()))?;
        if name.ends_with(".weight") && !exclude.is_match(name) {
            for (n, t) in quantize_one(name, &view, opts.format)? {
                if st.names().iter().any(|m| *m == n && n != *name) {
                    return Err(MegaError::tensor(
                        n.as_str(),
                        format!("already in the input; quantizing `{name}` would write it again"),
                    ));
                }
                out.insert(n, t);
            }
            summary.converted.push(name.clone());
        } else {
            out.insert(name.clone(), copy_tensor(&view));
            summary.copied.push(name.clone());
        }
        progress(i + 1, names.len(), name);
    }
    Ok((out, summary))
}

/// Quantizes one `.weight` tensor, returning the output tensors.
fn quantize_one(name: &str, view: &TensorView<'_>, format: Fp4Format) -> Result<Vec<(String, OwnedTensor)>> {
    let shape = view.shape();
    let hint = "(use --exclude to copy it unquantized)";
    if !matches!(view.dtype(), Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return Err(MegaError::tensor(
            name,
            format!("dtype {:?} cannot be quantized, expected BF16, F16 or F32 {hint}", view.dtype()),
        ));
    }
    if shape.len() != 2 {
        return Err(MegaError::tensor(
            name,
            format!("shape {shape:?} is not a 2-D [out, in] matrix and cannot be quantized {hint}"),
        ));
    }
    let (rows, cols) = (shape[0], shape[1]);
    let block = format.weight_format().block_size().expect("FP4 formats are block-scaled");
    if cols % block != 0 {
        return Err(MegaError::tensor(
            name,
            format!(
                "shape {shape:?}: {format} needs the input dimension ({cols}) to be a multiple of {block}"
            ),
        ));
    }
    let tag = |e: MegaError| match e {
        MegaError::Input(m) => MegaError::tensor(name, m),
        other => other,
    };
    let stem = name.strip_suffix(".weight").unwrap_or(name);
    let bytes = view.data();
    macro_rules! run {
        ($f:path) => {
            match view.dtype() {
                Dtype::BF16 => $f(&pod_vec::<half::bf16>(bytes), rows, cols),
                Dtype::F16 => $f(&pod_vec::<half::f16>(bytes), rows, cols),
                _ => $f(&pod_vec::<f32>(bytes), rows, cols),
            }
            .map_err(tag)?
        };
    }
    Ok(match format {
        Fp4Format::Nvfp4 => {
            let q = run!(nvfp4::quantize_generic);
            vec![
                (name.to_string(), raw(Dtype::U8, &[rows, cols / 2], q.packed)),
                (format!("{stem}.weight_scale"), raw(Dtype::F8_E4M3, &[rows, cols / block], q.scales)),
                (format!("{stem}.weight_scale_2"), OwnedTensor::f32(&[], &[q.global_scale])),
            ]
        }
        Fp4Format::Mxfp4 => {
            let q = run!(mxfp4::quantize_generic);
            vec![
                (name.to_string(), raw(Dtype::I8, &[rows, cols / 2], q.packed)),
                (format!("{stem}.scale"), raw(Dtype::F8_E8M0, &[rows, cols / block], q.scales)),
            ]
        }
    })
}

/// Dequantizes `input` into `output` (see the module docs). Refuses to write over the input.
pub fn dequantize_file(input: &Path, output: &Path, dtype: OutputDtype) -> Result<FileSummary> {
    dequantize_file_with(input, output, dtype, &mut |_, _, _| {})
}

/// [`dequantize_file`] with a progress callback.
pub fn dequantize_file_with(
    input: &Path,
    output: &Path,
    dtype: OutputDtype,
    progress: Progress<'_>,
) -> Result<FileSummary> {
    transform_file(input, output, |st| dequantize_tensors(st, dtype, progress))
}

/// Dequantizes the NVFP4 / MXFP4 weights of a parsed safetensors file.
pub fn dequantize_tensors(
    st: &SafeTensors<'_>,
    dtype: OutputDtype,
    progress: Progress<'_>,
) -> Result<(BTreeMap<String, OwnedTensor>, FileSummary)> {
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let get = |n: &str| st.tensor(n).ok();
    // First pass: find the quantized weights and the scale tensors they own.
    let mut quantized: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    let mut shapes: BTreeMap<String, [usize; 2]> = BTreeMap::new();
    let mut owned_scales: Vec<String> = Vec::new();
    for name in &names {
        let Some(stem) = name.strip_suffix(".weight") else { continue };
        let w = st.tensor(name).map_err(|e| MegaError::tensor(name.as_str(), e.to_string()))?;
        let (ws, s2, sc) = (
            get(&format!("{stem}.weight_scale")),
            get(&format!("{stem}.weight_scale_2")),
            get(&format!("{stem}.scale")),
        );
        let values = match (&ws, &sc) {
            (Some(ws), _) if w.dtype() == Dtype::U8 && matches!(ws.dtype(), Dtype::F8_E4M3 | Dtype::U8) => {
                let g = s2.ok_or_else(|| {
                    MegaError::tensor(format!("{stem}.weight_scale_2"), "missing (NVFP4 global scale)")
                })?;
                owned_scales.extend([
                    format!("{stem}.weight_scale"),
                    format!("{stem}.weight_scale_2"),
                    format!("{stem}.input_scale"),
                ]);
                dequant_nvfp4(stem, &w, ws, &g)?
            }
            (_, Some(sc)) if matches!(w.dtype(), Dtype::I8 | Dtype::U8) => {
                owned_scales.push(format!("{stem}.scale"));
                dequant_mxfp4(stem, &w, sc)?
            }
            _ => continue,
        };
        let rows = w.shape()[0];
        shapes.insert(name.clone(), [rows, values.len() / rows.max(1)]);
        quantized.insert(name.clone(), values);
    }
    let mut out = BTreeMap::new();
    let mut summary = FileSummary::default();
    for (i, name) in names.iter().enumerate() {
        if let Some(values) = quantized.remove(name) {
            let shape = shapes[name];
            let t = match dtype {
                OutputDtype::F32 => OwnedTensor::f32(&shape, &values),
                OutputDtype::Bf16 => {
                    let v: Vec<half::bf16> = values.par_iter().map(|&x| half::bf16::from_f32(x)).collect();
                    OwnedTensor::bf16(&shape, &v)
                }
            };
            out.insert(name.clone(), t);
            summary.converted.push(name.clone());
        } else if owned_scales.contains(name) {
            summary.dropped.push(name.clone());
        } else {
            let view = st.tensor(name).map_err(|e| MegaError::tensor(name.as_str(), e.to_string()))?;
            out.insert(name.clone(), copy_tensor(&view));
            summary.copied.push(name.clone());
        }
        progress(i + 1, names.len(), name);
    }
    Ok((out, summary))
}

fn dequant_nvfp4(
    stem: &str,
    w: &TensorView<'_>,
    ws: &TensorView<'_>,
    g: &TensorView<'_>,
) -> Result<Vec<f32>> {
    let (wn, sn, gn) =
        (format!("{stem}.weight"), format!("{stem}.weight_scale"), format!("{stem}.weight_scale_2"));
    let (rows, cols) = packed_shape(&wn, w)?;
    let want = [rows, cols / nvfp4::BLOCK];
    if cols % nvfp4::BLOCK != 0 || ws.shape() != want {
        return Err(MegaError::tensor(
            sn,
            format!(
                "shape {:?}, expected {want:?} for weight {:?} ({}-element blocks)",
                ws.shape(),
                w.shape(),
                nvfp4::BLOCK
            ),
        ));
    }
    if g.dtype() != Dtype::F32 || g.data().len() != 4 {
        return Err(MegaError::tensor(
            gn,
            format!("dtype {:?} shape {:?}, expected one F32 value", g.dtype(), g.shape()),
        ));
    }
    let gs = f32::from_le_bytes(g.data().try_into().expect("4 bytes"));
    nvfp4::check_global_scale(&gn, gs)?;
    if let Some(i) = ws.data().iter().position(|&b| super::e4m3::is_nan(b)) {
        return Err(MegaError::tensor(
            sn,
            format!("block scale {i} (row {}, block {}) is NaN (0x7F/0xFF)", i / want[1], i % want[1]),
        ));
    }
    let m = nvfp4::Nvfp4Matrix::from_parts(rows, cols, w.data().to_vec(), ws.data().to_vec(), gs)
        .map_err(|e| MegaError::tensor(wn, e.to_string()))?;
    Ok(m.dequantize())
}

fn dequant_mxfp4(stem: &str, w: &TensorView<'_>, sc: &TensorView<'_>) -> Result<Vec<f32>> {
    let (wn, sn) = (format!("{stem}.weight"), format!("{stem}.scale"));
    let (rows, cols) = packed_shape(&wn, w)?;
    let want = [rows, cols / mxfp4::BLOCK];
    if !matches!(sc.dtype(), Dtype::F8_E8M0 | Dtype::U8) {
        return Err(MegaError::tensor(sn, format!("dtype {:?}, expected F8_E8M0 (or U8)", sc.dtype())));
    }
    if cols % mxfp4::BLOCK != 0 || sc.shape() != want {
        return Err(MegaError::tensor(
            sn,
            format!(
                "shape {:?}, expected {want:?} for weight {:?} ({}-element blocks)",
                sc.shape(),
                w.shape(),
                mxfp4::BLOCK
            ),
        ));
    }
    if let Some(i) = sc.data().iter().position(|&b| super::e8m0::is_nan(b)) {
        return Err(MegaError::tensor(
            sn,
            format!("block scale {i} (row {}, block {}) is 0xFF (NaN)", i / want[1], i % want[1]),
        ));
    }
    let m = mxfp4::Mxfp4Matrix::from_parts(rows, cols, w.data().to_vec(), sc.data().to_vec())
        .map_err(|e| MegaError::tensor(wn, e.to_string()))?;
    Ok(m.dequantize())
}

/// `(rows, unpacked cols)` of a packed `[rows, cols/2]` weight.
fn packed_shape(name: &str, w: &TensorView<'_>) -> Result<(usize, usize)> {
    match w.shape() {
        [r, c] => Ok((*r, 2 * *c)),
        s => Err(MegaError::tensor(name, format!("shape {s:?}, expected a 2-D packed [out, in/2] weight"))),
    }
}

fn raw(dtype: Dtype, shape: &[usize], bytes: Vec<u8>) -> OwnedTensor {
    OwnedTensor { dtype, shape: shape.to_vec(), bytes }
}

fn copy_tensor(view: &TensorView<'_>) -> OwnedTensor {
    raw(view.dtype(), view.shape(), view.data().to_vec())
}

/// Little-endian bytes to values; borrows nothing so unaligned tensor data is fine.
fn pod_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
    v
}

fn build_globs(patterns: &[String]) -> Result<globset::GlobSet> {
    let mut b = globset::GlobSetBuilder::new();
    for p in patterns {
        let g = globset::GlobBuilder::new(p)
            .literal_separator(false)
            .build()
            .map_err(|e| MegaError::Input(format!("bad exclude pattern `{p}`: {e}")))?;
        b.add(g);
    }
    b.build().map_err(|e| MegaError::Input(format!("bad exclude patterns: {e}")))
}

fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(path).map_err(|e| MegaError::file(path, e))?;
    // SAFETY: the map is read-only and lives only for this conversion; like every safetensors
    // reader we assume nobody truncates the file meanwhile.
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| MegaError::file(path, e))
}

/// Refuses `output` when it names the same file as `input` (also through links or `..`).
fn refuse_same_file(input: &Path, output: &Path) -> Result<()> {
    let inp = input.canonicalize().map_err(|e| MegaError::file(input, e))?;
    let out: PathBuf = match output.canonicalize() {
        Ok(p) => p,
        Err(_) => {
            let parent = match output.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            let parent = parent.canonicalize().map_err(|e| MegaError::file(output, e))?;
            parent.join(output.file_name().ok_or_else(|| MegaError::file(output, "not a file name"))?)
        }
    };
    if inp == out {
        return Err(MegaError::file(output, "is the input file; refusing to overwrite the input"));
    }
    Ok(())
}

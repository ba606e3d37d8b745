//! The three layouts of 8-bit block scales (DESIGN.md, "Weight formats").
//!
//! - **Row-major** `[rows, cols]` bytes (cols = K / block): how checkpoints store them.
//! - **Swizzled 128x4** (CUTLASS / TensorRT-LLM / FlashInfer): rows padded to 128, scale columns
//!   padded to 4, byte of `(m, k)` at
//!   `(m/128)*(Kt*512) + (k/4)*512 + (m%32)*16 + ((m%128)/32)*4 + k%4` with `Kt` = padded cols / 4.
//!   Padding is written as zero (an uninitialised 0x7F would be an e4m3 NaN).
//! - **Packed u32**: four scale bytes per `u32`, byte `i` (little-endian) = column `4j + i`; each row
//!   has `ceil(cols / 4)` words, the missing columns of the last word are zero.
//!
//! Every conversion moves bytes; none of them interprets or casts a scale numerically.

use crate::error::{MegaError, Result};

/// A scale layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// `[rows, cols]` bytes.
    RowMajor,
    /// The 128x4 swizzled layout, padded to 128 rows and a multiple of 4 columns.
    Swizzled128x4,
    /// Four bytes per little-endian `u32`, `ceil(cols / 4)` words per row.
    PackedU32,
}

/// Rows after padding to the swizzled layout's 128-row tiles.
pub fn padded_rows(rows: usize) -> usize {
    rows.div_ceil(128) * 128
}

/// Scale columns after padding to the swizzled layout's 4-column tiles.
pub fn padded_cols(cols: usize) -> usize {
    cols.div_ceil(4) * 4
}

/// Bytes of a swizzled buffer for `rows x cols` scales (padding included).
pub fn swizzled_len(rows: usize, cols: usize) -> usize {
    padded_rows(rows) * padded_cols(cols)
}

/// Byte offset of scale `(m, k)` in the swizzled layout of a matrix with `cols` scale columns.
#[inline]
pub fn swizzled_offset(m: usize, k: usize, cols: usize) -> usize {
    let kt = padded_cols(cols) / 4;
    (m / 128) * (kt * 512) + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + k % 4
}

fn check_len(what: &str, got: usize, want: usize, rows: usize, cols: usize) -> Result<()> {
    if got != want {
        return Err(MegaError::Input(format!(
            "{what} scale buffer has {got} elements, expected {want} for {rows} x {cols} scales"
        )));
    }
    Ok(())
}

/// Row-major `[rows, cols]` to swizzled 128x4 (padding zero).
pub fn to_swizzled(row_major: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    check_len("row-major", row_major.len(), rows * cols, rows, cols)?;
    let mut out = vec![0u8; swizzled_len(rows, cols)];
    for m in 0..rows {
        for k in 0..cols {
            out[swizzled_offset(m, k, cols)] = row_major[m * cols + k];
        }
    }
    Ok(out)
}

/// Swizzled 128x4 back to row-major `[rows, cols]` (the padding is dropped).
pub fn from_swizzled(swizzled: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    check_len("swizzled", swizzled.len(), swizzled_len(rows, cols), rows, cols)?;
    let mut out = vec![0u8; rows * cols];
    for m in 0..rows {
        for k in 0..cols {
            out[m * cols + k] = swizzled[swizzled_offset(m, k, cols)];
        }
    }
    Ok(out)
}

/// Words per row of the packed-u32 layout.
pub fn u32_words_per_row(cols: usize) -> usize {
    cols.div_ceil(4)
}

/// Row-major `[rows, cols]` bytes to four-per-`u32` words (`[rows, ceil(cols/4)]`, zero-filled).
pub fn to_u32(row_major: &[u8], rows: usize, cols: usize) -> Result<Vec<u32>> {
    check_len("row-major", row_major.len(), rows * cols, rows, cols)?;
    let wpr = u32_words_per_row(cols);
    let mut out = Vec::with_capacity(rows * wpr);
    for row in row_major.chunks_exact(cols.max(1)).take(rows) {
        for quad in row.chunks(4) {
            let mut b = [0u8; 4];
            b[..quad.len()].copy_from_slice(quad);
            out.push(u32::from_le_bytes(b));
        }
    }
    Ok(out)
}

/// Four-per-`u32` words back to row-major `[rows, cols]` bytes.
pub fn from_u32(words: &[u32], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let wpr = u32_words_per_row(cols);
    check_len("packed-u32", words.len(), rows * wpr, rows, cols)?;
    let mut out = Vec::with_capacity(rows * cols);
    for row in words.chunks_exact(wpr.max(1)).take(rows) {
        let bytes: Vec<u8> = row.iter().flat_map(|w| w.to_le_bytes()).collect();
        out.extend_from_slice(&bytes[..cols]);
    }
    Ok(out)
}

/// Converts a scale buffer between any two layouts; packed-u32 words are taken and returned as
/// their little-endian bytes (see [`to_u32`] / [`from_u32`] for typed words).
pub fn convert(src: &[u8], from: ScaleLayout, to: ScaleLayout, rows: usize, cols: usize) -> Result<Vec<u8>> {
    use ScaleLayout::*;
    let row_major = match from {
        RowMajor => {
            check_len("row-major", src.len(), rows * cols, rows, cols)?;
            src.to_vec()
        }
        Swizzled128x4 => from_swizzled(src, rows, cols)?,
        PackedU32 => {
            if !src.len().is_multiple_of(4) {
                return Err(MegaError::Input(format!("packed-u32 scale buffer has {} bytes", src.len())));
            }
            let words: Vec<u32> =
                src.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            from_u32(&words, rows, cols)?
        }
    };
    Ok(match to {
        RowMajor => row_major,
        Swizzled128x4 => to_swizzled(&row_major, rows, cols)?,
        PackedU32 => to_u32(&row_major, rows, cols)?.iter().flat_map(|w| w.to_le_bytes()).collect(),
    })
}

//! [`WeightFormat`]: the one description of a weight storage format — block size, bytes per
//! matrix and per weight — used by the formats, the checkpoint loader, the reference, the CUDA runtime
//! and the command line.

use super::{mxfp4, nvfp4};

/// The storage format of a weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum WeightFormat {
    /// ModelOpt NVFP4: E2M1 codes, e4m3 scales per 16, one f32 global scale per projection.
    Nvfp4,
    /// Official DeepSeek-V4 MXFP4: E2M1 codes, e8m0 scales per 32.
    Mxfp4,
    /// Unquantized bf16.
    Bf16,
}

impl WeightFormat {
    /// Every format, in order.
    pub const ALL: [WeightFormat; 3] = [WeightFormat::Nvfp4, WeightFormat::Mxfp4, WeightFormat::Bf16];

    /// Lower-case name as used on the command line and in messages.
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Nvfp4 => "nvfp4",
            WeightFormat::Mxfp4 => "mxfp4",
            WeightFormat::Bf16 => "bf16",
        }
    }

    /// Elements per block scale (`None`: unscaled).
    pub fn block_size(self) -> Option<usize> {
        match self {
            WeightFormat::Nvfp4 => Some(nvfp4::BLOCK),
            WeightFormat::Mxfp4 => Some(mxfp4::BLOCK),
            WeightFormat::Bf16 => None,
        }
    }

    /// Bytes of one `rows x cols` matrix: codes plus one byte per block scale.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> usize {
        let n = rows * cols;
        match self.block_size() {
            Some(b) => n / 2 + n / b,
            None => 2 * n,
        }
    }

    /// Bytes per weight, scales included (NVFP4 0.5625, MXFP4 0.53125, BF16 2).
    pub fn bytes_per_weight(self) -> f64 {
        match self.block_size() {
            Some(b) => 0.5 + 1.0 / b as f64,
            None => 2.0,
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = crate::error::MegaError;
    fn from_str(s: &str) -> crate::error::Result<Self> {
        WeightFormat::ALL.into_iter().find(|f| f.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
            crate::error::MegaError::Input(format!(
                "unknown weight format `{s}` (expected nvfp4, mxfp4 or bf16)"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(WeightFormat::Nvfp4.bytes_per_weight(), 0.5625);
        assert_eq!(WeightFormat::Mxfp4.matrix_bytes(2, 64), 64 + 4);
        assert_eq!(WeightFormat::Bf16.matrix_bytes(2, 64), 256);
        assert_eq!("MXFP4".parse::<WeightFormat>().unwrap(), WeightFormat::Mxfp4);
        assert!("fp8".parse::<WeightFormat>().is_err());
    }
}

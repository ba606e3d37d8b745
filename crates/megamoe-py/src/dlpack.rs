//! The DLPack ABI (v1.x, `dlpack.h`): the C structs a producer hands over in a capsule, and
//! [`TensorDesc`], the checked description (address, shape, dtype, device) read from one.
//!
//! Pure Rust with no Python: the capsule side is in `capsule.rs`. Both the legacy
//! `DLManagedTensor` (capsule name `dltensor`) and `DLManagedTensorVersioned`
//! (`dltensor_versioned`, DLPack >= 1.0) are read; the tensor is borrowed, never owned.

use std::ffi::c_void;

/// `DLDeviceType` values megamoe accepts.
pub mod device_type {
    /// Host memory.
    pub const CPU: i32 = 1;
    /// CUDA device memory.
    pub const CUDA: i32 = 2;
    /// Pinned host memory (readable by the host).
    pub const CUDA_HOST: i32 = 3;
    /// CUDA managed memory (readable by both).
    pub const CUDA_MANAGED: i32 = 13;
}

/// `DLDataTypeCode` values megamoe reads.
pub mod type_code {
    /// Signed integer.
    pub const INT: u8 = 0;
    /// Unsigned integer.
    pub const UINT: u8 = 1;
    /// IEEE float.
    pub const FLOAT: u8 = 2;
    /// bfloat16.
    pub const BFLOAT: u8 = 4;
    /// Boolean.
    pub const BOOL: u8 = 6;
    /// FP8 e4m3 (finite, "fn"): torch.float8_e4m3fn.
    pub const FLOAT8_E4M3FN: u8 = 10;
    /// FP8 e8m0 (exponent only): torch.float8_e8m0fnu.
    pub const FLOAT8_E8M0FNU: u8 = 14;
}

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// `DLDeviceType`.
    pub device_type: i32,
    /// Device ordinal.
    pub device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// `DLDataTypeCode`.
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes (1 for scalars).
    pub lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// Base address (add `byte_offset`).
    pub data: *mut c_void,
    /// Where the memory lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `[ndim]` sizes.
    pub shape: *mut i64,
    /// `[ndim]` strides in elements, or null for a compact row-major tensor.
    pub strides: *mut i64,
    /// Offset of element 0 from `data`, in bytes.
    pub byte_offset: u64,
}

/// `DLManagedTensor` (capsule name `dltensor`).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Frees the tensor (called by the capsule's destructor while we only borrow it).
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLPackVersion {
    /// Major version (1 for this ABI).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (capsule name `dltensor_versioned`).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The producer's DLPack version.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Frees the tensor.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*`.
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the producer forbids writes.
pub const FLAG_READ_ONLY: u64 = 1;

/// The DLPack major version this layer reads.
pub const MAJOR_VERSION: u32 = 1;

/// Element types a megamoe argument can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    /// bfloat16.
    Bf16,
    /// float16.
    F16,
    /// float32.
    F32,
    /// float64.
    F64,
    /// int32.
    I32,
    /// int64.
    I64,
    /// uint32 (four e4m3 scales per word).
    U32,
    /// uint8, and the 8-bit float formats that cross as bytes (FP8 e4m3fn, e8m0).
    U8,
    /// int8 (the official MXFP4 release's packed codes; read as bytes).
    I8,
}

impl Elem {
    /// The DLPack dtype as megamoe sees it, or `None` for one it never accepts.
    pub fn from_dl(dt: DLDataType) -> Option<Elem> {
        use type_code::*;
        if dt.lanes != 1 {
            return None;
        }
        Some(match (dt.code, dt.bits) {
            (BFLOAT, 16) => Elem::Bf16,
            (FLOAT, 16) => Elem::F16,
            (FLOAT, 32) => Elem::F32,
            (FLOAT, 64) => Elem::F64,
            (INT, 32) => Elem::I32,
            (INT, 64) => Elem::I64,
            (UINT, 32) => Elem::U32,
            (UINT, 8) | (FLOAT8_E4M3FN, 8) | (FLOAT8_E8M0FNU, 8) => Elem::U8,
            (INT, 8) => Elem::I8,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::U8 | Elem::I8 => 1,
            Elem::Bf16 | Elem::F16 => 2,
            Elem::F32 | Elem::I32 | Elem::U32 => 4,
            Elem::F64 | Elem::I64 => 8,
        }
    }

    /// The name users know (numpy / torch spelling).
    pub fn name(self) -> &'static str {
        match self {
            Elem::Bf16 => "bfloat16",
            Elem::F16 => "float16",
            Elem::F32 => "float32",
            Elem::F64 => "float64",
            Elem::I32 => "int32",
            Elem::I64 => "int64",
            Elem::U32 => "uint32",
            Elem::U8 => "uint8",
            Elem::I8 => "int8",
        }
    }
}

/// Human-readable name of a DLPack dtype (also for those megamoe rejects).
pub fn dtype_name(dt: DLDataType) -> String {
    match Elem::from_dl(dt) {
        Some(e) if dt.code == type_code::FLOAT8_E4M3FN => format!("float8_e4m3fn (read as {})", e.name()),
        Some(e) if dt.code == type_code::FLOAT8_E8M0FNU => format!("float8_e8m0fnu (read as {})", e.name()),
        Some(e) => e.name().to_string(),
        None => {
            let kind = match dt.code {
                type_code::INT => "int",
                type_code::UINT => "uint",
                type_code::FLOAT => "float",
                type_code::BFLOAT => "bfloat",
                type_code::BOOL => "bool",
                _ => "dlpack-code-",
            };
            let lanes = if dt.lanes != 1 { format!("x{}", dt.lanes) } else { String::new() };
            if kind == "dlpack-code-" {
                format!("dlpack-code-{}:{}{lanes}", dt.code, dt.bits)
            } else {
                format!("{kind}{}{lanes}", dt.bits)
            }
        }
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host-readable memory (CPU, pinned host).
    Cpu,
    /// CUDA device memory (or managed memory) of one ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A checked description of a borrowed DLPack tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// Address of element 0 (`data + byte_offset`).
    pub ptr: u64,
    /// Sizes.
    pub shape: Vec<usize>,
    /// The element type as read (`None`: a dtype megamoe never accepts; see `raw_dtype`).
    pub elem: Option<Elem>,
    /// The producer's dtype.
    pub raw_dtype: DLDataType,
    /// Where the memory lives.
    pub device: Device,
    /// Whether the strides are those of a compact row-major tensor (size-1 dims ignored).
    pub contiguous: bool,
    /// Whether the producer marked the tensor read-only.
    pub read_only: bool,
}

/// Why a DLPack tensor cannot be described at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DescError {
    /// Negative `ndim` or size, or a null shape with `ndim > 0`.
    Malformed(String),
    /// A device type megamoe cannot read (e.g. ROCm, Metal).
    UnsupportedDevice(i32),
}

impl TensorDesc {
    /// Reads `t` (flags from a versioned tensor, 0 otherwise).
    ///
    /// # Safety
    /// `t` must point to a live `DLTensor` whose `shape` (and `strides`, when non-null) hold
    /// `ndim` values.
    pub unsafe fn read(t: *const DLTensor, flags: u64) -> Result<TensorDesc, DescError> {
        let t = &*t;
        if t.ndim < 0 {
            return Err(DescError::Malformed(format!("ndim = {}", t.ndim)));
        }
        let nd = t.ndim as usize;
        if nd > 0 && t.shape.is_null() {
            return Err(DescError::Malformed("null shape".into()));
        }
        let shape_i = if nd == 0 { &[][..] } else { std::slice::from_raw_parts(t.shape, nd) };
        let strides = if nd == 0 || t.strides.is_null() {
            None
        } else {
            Some(std::slice::from_raw_parts(t.strides, nd))
        };
        if let Some(&s) = shape_i.iter().find(|&&s| s < 0) {
            return Err(DescError::Malformed(format!("negative size {s} in shape {shape_i:?}")));
        }
        let shape: Vec<usize> = shape_i.iter().map(|&s| s as usize).collect();
        let device = match t.device.device_type {
            device_type::CPU | device_type::CUDA_HOST => Device::Cpu,
            device_type::CUDA | device_type::CUDA_MANAGED => Device::Cuda(t.device.device_id.max(0) as usize),
            other => return Err(DescError::UnsupportedDevice(other)),
        };
        Ok(TensorDesc {
            ptr: (t.data as u64).wrapping_add(t.byte_offset),
            contiguous: strides.is_none_or(|s| is_row_major(&shape, s)),
            shape,
            elem: Elem::from_dl(t.dtype),
            raw_dtype: t.dtype,
            device,
            read_only: flags & FLAG_READ_ONLY != 0,
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Whether `strides` (elements) are the compact row-major strides of `shape`; dimensions of size 1
/// may have any stride (torch reports arbitrary ones there), and an empty tensor is contiguous.
pub fn is_row_major(shape: &[usize], strides: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expect: i64 = 1;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != expect {
            return false;
        }
        expect = expect.saturating_mul(n as i64);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(shape: &mut [i64], strides: Option<&mut [i64]>, dtype: DLDataType, dev: DLDevice) -> DLTensor {
        DLTensor {
            data: 0x1000 as *mut c_void,
            device: dev,
            ndim: shape.len() as i32,
            dtype,
            shape: shape.as_mut_ptr(),
            strides: strides.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
            byte_offset: 64,
        }
    }

    const CPU: DLDevice = DLDevice { device_type: device_type::CPU, device_id: 0 };
    const BF16: DLDataType = DLDataType { code: type_code::BFLOAT, bits: 16, lanes: 1 };

    #[test]
    fn struct_layouts_match_dlpack_h() {
        // Sizes and offsets of the C ABI on 64-bit targets.
        assert_eq!(std::mem::size_of::<DLDevice>(), 8);
        assert_eq!(std::mem::size_of::<DLDataType>(), 4);
        assert_eq!(std::mem::size_of::<DLTensor>(), 48);
        assert_eq!(std::mem::size_of::<DLManagedTensor>(), 64);
        assert_eq!(std::mem::size_of::<DLManagedTensorVersioned>(), 80);
        assert_eq!(std::mem::offset_of!(DLTensor, ndim), 16);
        assert_eq!(std::mem::offset_of!(DLTensor, dtype), 20);
        assert_eq!(std::mem::offset_of!(DLTensor, byte_offset), 40);
        assert_eq!(std::mem::offset_of!(DLManagedTensorVersioned, flags), 24);
        assert_eq!(std::mem::offset_of!(DLManagedTensorVersioned, dl_tensor), 32);
    }

    #[test]
    fn reads_shape_dtype_device_and_offset() {
        let mut shape = [3, 256];
        let t = tensor(&mut shape, None, BF16, CPU);
        let d = unsafe { TensorDesc::read(&t, 0) }.unwrap();
        assert_eq!(d.ptr, 0x1000 + 64);
        assert_eq!(d.shape, vec![3, 256]);
        assert_eq!(d.elem, Some(Elem::Bf16));
        assert_eq!(d.device, Device::Cpu);
        assert!(d.contiguous && !d.read_only);
        assert_eq!(d.numel(), 768);
    }

    #[test]
    fn strides_decide_contiguity() {
        let mut shape = [4, 8];
        let mut row_major = [8, 1];
        let t = tensor(&mut shape, Some(&mut row_major), BF16, CPU);
        assert!(unsafe { TensorDesc::read(&t, 0) }.unwrap().contiguous);
        let mut transposed = [1, 4];
        let t = tensor(&mut shape, Some(&mut transposed), BF16, CPU);
        assert!(!unsafe { TensorDesc::read(&t, 0) }.unwrap().contiguous);
        // A size-1 dimension may carry any stride; an empty tensor is contiguous.
        assert!(is_row_major(&[1, 8], &[123, 1]));
        assert!(is_row_major(&[0, 8], &[1, 1]));
        assert!(!is_row_major(&[2, 8], &[16, 1]));
    }

    #[test]
    fn cuda_device_and_flags() {
        let mut shape = [2];
        let dev = DLDevice { device_type: device_type::CUDA, device_id: 3 };
        let f32t = DLDataType { code: type_code::FLOAT, bits: 32, lanes: 1 };
        let t = tensor(&mut shape, None, f32t, dev);
        let d = unsafe { TensorDesc::read(&t, FLAG_READ_ONLY) }.unwrap();
        assert_eq!(d.device, Device::Cuda(3));
        assert!(d.read_only);
        assert_eq!(d.device.to_string(), "cuda:3");
    }

    #[test]
    fn rejects_malformed_and_unknown_devices() {
        let mut shape = [-1, 4];
        let t = tensor(&mut shape, None, BF16, CPU);
        assert!(matches!(unsafe { TensorDesc::read(&t, 0) }, Err(DescError::Malformed(_))));
        let mut shape = [4];
        let rocm = DLDevice { device_type: 10, device_id: 0 };
        let t = tensor(&mut shape, None, BF16, rocm);
        assert_eq!(unsafe { TensorDesc::read(&t, 0) }, Err(DescError::UnsupportedDevice(10)));
    }

    #[test]
    fn dtypes_and_their_names() {
        let fp8 = DLDataType { code: type_code::FLOAT8_E4M3FN, bits: 8, lanes: 1 };
        assert_eq!(Elem::from_dl(fp8), Some(Elem::U8));
        assert_eq!(dtype_name(fp8), "float8_e4m3fn (read as uint8)");
        let vec2 = DLDataType { code: type_code::FLOAT, bits: 32, lanes: 2 };
        assert_eq!(Elem::from_dl(vec2), None);
        assert_eq!(dtype_name(vec2), "float32x2");
        let f8 = DLDataType { code: type_code::INT, bits: 8, lanes: 1 };
        assert_eq!(dtype_name(f8), "int8");
        assert_eq!(Elem::from_dl(DLDataType { code: type_code::INT, bits: 64, lanes: 1 }), Some(Elem::I64));
        assert_eq!(Elem::I64.size(), 8);
    }
}

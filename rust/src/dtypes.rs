//! Element types of buffers.

use std::fmt;

/// Element type of an [`crate::MlxBuffer`]. The discriminants are the C ABI codes.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    U8 = 3,
    U16 = 4,
    U32 = 5,
    I32 = 6,
    /// FP8 E4M3 (`float8_e4m3fn`: no infinity, NaN 0x7f / 0xff): quantised K/V (SPEC 11).
    F8E4M3 = 7,
    /// FP8 E5M2 (`float8_e5m2`, IEEE-like): quantised K/V (SPEC 11).
    F8E5M2 = 8,
    /// ggml's Q8_0 blocks, as bytes: per 32 values one F16 scale then 32 int8 (34 bytes).
    /// Quantised K/V (SPEC 11); its element is the byte, its strides are in bytes.
    Q8_0 = 9,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::I32,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::Q8_0,
    ];

    /// The quantised K/V formats (SPEC 11): read by the CPU kernels only, dequantised as
    /// each step of K/V is loaded.
    pub fn is_quantised_kv(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2 | DType::Q8_0)
    }

    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::U16 => 2,
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 | DType::Q8_0 => 1,
        }
    }

    /// Lower-case name, as numpy spells it where it can (`bfloat16` for BF16).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::I32 => "int32",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
            DType::Q8_0 => "q8_0",
        }
    }

    /// The dtype of a C ABI code, if it is one.
    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::U8 => "U8",
            DType::U16 => "U16",
            DType::U32 => "U32",
            DType::I32 => "I32",
            DType::F8E4M3 => "F8E4M3",
            DType::F8E5M2 => "F8E5M2",
            DType::Q8_0 => "Q8_0",
        };
        f.write_str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d as u32), Some(d));
        }
        assert_eq!(DType::from_code(10), None);
        assert_eq!(DType::Q8_0.size_of(), 1);
        assert_eq!(DType::F16.size_of(), 2);
        assert_eq!(DType::F32.size_of(), 4);
        assert_eq!(DType::U8.size_of(), 1);
        assert_eq!(DType::BF16.to_string(), "BF16");
    }
}

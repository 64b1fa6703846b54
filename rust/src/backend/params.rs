//! The params blocks the ops bind at index 0, as the Rust backends read them back (the
//! device sources declare the same structs: `shaders/*.metal`, `shaders/*.cu`). One
//! definition for every Rust backend; the ops keep their own private mirrors, as they do
//! for the device sources.

/// `flash_attn_prefill_tensor_f16_*`: twelve 32-bit words, strides in elements.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttentionParams {
    pub rows: i32,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub kv_pad: i32,
    pub q_row_stride: i32,
    pub q_head_stride: i32,
    pub k_row_stride: i32,
    pub k_head_stride: i32,
    pub v_row_stride: i32,
    pub v_head_stride: i32,
    pub mask_row_stride: i32,
    pub scale: f32,
}

/// `flash_attn_prefill_blk`: four 32-bit words.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlkParams {
    pub rows: i32,
    pub kv_pad: i32,
    pub bq: i32,
    pub bk: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_blocks_have_the_ops_sizes() {
        assert_eq!(std::mem::size_of::<AttentionParams>(), 48);
        assert_eq!(std::mem::size_of::<BlkParams>(), 16);
    }
}

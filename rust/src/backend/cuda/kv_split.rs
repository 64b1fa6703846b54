//! Split-KV for the CUDA attention: when a prefill's CTAs (query tiles x head groups x
//! sequences) leave most of the GPU idle, as a chunk of a few hundred rows against a long
//! cache does, each CTA's walk over the cache is cut into parts run by CTAs of their own
//! (grid z = batch x parts; a power of two, so the kernel finds its part with a mask and a
//! shift). Part i writes F32 O over its own row sum and its lse, without
//! the sinks, into a workspace; a second kernel (`split_merge.cuh`) merges the parts (SPEC
//! 8, with the sinks) into O in its dtype and lse.
//!
//! The workspace comes from the op's plan ([`workspace_bytes`], bound at dispatch index
//! 11), so a launch on another library's stream never allocates; without it (or with a
//! smaller one) nothing is split.

use super::attention_geometry::attention_geometry;
use crate::interface::RunOptions;
use crate::params::{FlashAttnPrefillParamsGpu, PREFILL_LSE, PREFILL_OFFSET, PREFILL_SINKS, PREFILL_VARLEN};

/// Most parts a walk is cut into (the merge reads each part's lse per row).
pub const MAX_PARTS: u32 = crate::options::MAX_KV_SPLITS;
/// Fewest cache steps (of 64 rows) a part should walk: below this the merge and the
/// partial epilogues cost more than the parallelism gives.
pub const MIN_PART_STEPS: u32 = 16;

/// The parts a dispatch with `options` is forced to: its plan's `kv_splits`, else
/// `MLX_NATIVE_CUDA_KV_SPLITS` (`settings`, read once per process: a plan's workspace and
/// its runs must agree). `N` (a power of two up to [`MAX_PARTS`]) cuts every walk into N
/// parts whatever the shape, `0` or `1` never splits; `None`: the shape decides.
pub fn forced_parts(options: &RunOptions) -> Option<u32> {
    options.kv_splits.or(crate::settings::get().cuda_kv_splits)
}

/// How one launch splits: `parts` (a power of two from 2 to [`MAX_PARTS`]) and the
/// workspace layout (F32 elements of one part's O and of its lse; every part's O first,
/// then every part's lse).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSplit {
    pub parts: u32,
    pub o_elems: u64,
    pub lse_elems: u64,
}

impl KvSplit {
    /// log2 of `parts` (the kernel's `Launch::kv_split_log2`).
    pub fn log2(&self) -> u32 {
        self.parts.trailing_zeros()
    }

    /// Bytes of the workspace.
    pub fn bytes(&self) -> u64 {
        self.parts as u64 * (self.o_elems + self.lse_elems) * 4
    }

    /// Byte offset of the lse parts in the workspace.
    pub fn lse_offset(&self) -> u64 {
        self.parts as u64 * self.o_elems * 4
    }

    /// The params block of the attention's parts: O in F32 over its own row sum, contiguous
    /// `[rows, heads, dv]` per sequence (the query rows' order of the call, one block per
    /// part), lse always, `[heads, rows]` per sequence (`[heads, total rows]` for variable
    /// length), no sinks (the merge adds them).
    pub fn part_params(&self, p: &FlashAttnPrefillParamsGpu) -> FlashAttnPrefillParamsGpu {
        let (h, dv, rows) = (p.n_heads as i64, p.head_dim_v as i64, p.rows as i64);
        let varlen = p.flags & PREFILL_VARLEN != 0;
        let mut w = *p;
        w.o_dtype = 0;
        w.o_batch_stride = if varlen { 0 } else { rows * h * dv };
        w.o_row_stride = h * dv;
        w.o_head_stride = dv;
        w.lse_batch_stride = if varlen { 0 } else { h * rows };
        w.lse_head_stride = rows;
        w.flags = (p.flags | PREFILL_LSE) & !PREFILL_SINKS;
        w
    }
}

/// CTAs of the attention that one SM holds at once: two in the Hopper form at head dims up
/// to 128 (its `HCfg::MINB`), else one.
fn ctas_per_sm(head_dim: u32, hopper: bool) -> u32 {
    if hopper && head_dim <= 128 {
        2
    } else {
        1
    }
}

/// Steps (of 64 cache rows) the longest CTA walks: the longer of the first and the last
/// query tile's of the longest sequence by the description (the last one's, where a right
/// bound (causal) is; the first one's can be longer under a window without one), a
/// variable-length batch's at its mean cache.
fn longest_walk(p: &FlashAttnPrefillParamsGpu, tile_rows: u32) -> u32 {
    let step = 64i64;
    let (rows, kv) = if p.flags & PREFILL_VARLEN != 0 {
        (p.max_rows as i64, (p.kv_len as i64) / (p.batch.max(1) as i64))
    } else {
        (p.rows as i64, p.kv_len as i64)
    };
    if kv <= 0 || rows <= 0 {
        return 0;
    }
    let off = if p.flags & PREFILL_OFFSET != 0 { p.offset as i64 } else { kv - rows };
    // The right bound: causal's (0) or a two-sided window's.
    let right = if p.flags & crate::params::PREFILL_CAUSAL != 0 {
        Some(0)
    } else if p.flags & crate::params::PREFILL_WINDOW_RIGHT != 0 {
        Some(p.window_right.max(0) as i64)
    } else {
        None
    };
    // The steps of query rows [a, b).
    let walk = |a: i64, b: i64| -> u32 {
        let hi = match right {
            Some(r) => (kv - 1).min(b - 1 + off + r),
            None => kv - 1,
        };
        let lo = if p.window > 0 { (a + off - p.window as i64 + 1).max(0) } else { 0 };
        if hi < lo {
            return 0;
        }
        (hi / step - lo / step + 1) as u32
    };
    let tile = (tile_rows as i64).max(1);
    walk((rows - tile).max(0), rows).max(walk(0, tile.min(rows)))
}

/// The split of a launch of `p` at head dims `dims` on a GPU of `multiprocessors` SMs in
/// the Hopper form or not, `None` for none. `forced` ([`forced_parts`]): that many parts
/// where the launch can take them. Unforced: when the CTAs fill at most half the
/// GPU's CTA slots, the most parts (a power of two) that fit in them once, each of at
/// least [`MIN_PART_STEPS`] steps of the longest walk, at most [`MAX_PARTS`].
pub fn kv_split(
    p: &FlashAttnPrefillParamsGpu,
    dims: (u32, u32),
    multiprocessors: u32,
    hopper: bool,
    forced: Option<u32>,
) -> Option<KvSplit> {
    let (rows, heads, kv_heads) = (p.max_rows.max(1) as u32, p.n_heads as u32, p.n_kv_heads as u32);
    let geo = attention_geometry(dims, rows, heads, kv_heads, hopper).ok()?;
    let parts = match forced {
        Some(n) => n.min(MAX_PARTS),
        None => {
            let ctas = geo.q_tiles as u64 * geo.head_groups as u64 * p.batch.max(1) as u64;
            let slots = multiprocessors as u64 * ctas_per_sm(dims.0, hopper) as u64;
            let by_slots = (slots / ctas.max(1)).min(MAX_PARTS as u64) as u32;
            by_slots.min(longest_walk(p, geo.queries_per_cta) / MIN_PART_STEPS)
        }
    };
    if parts < 2 {
        return None;
    }
    let parts = 1u32 << (31 - parts.leading_zeros()); // the power of two at or below
    if p.batch as u64 * parts as u64 > 65_535 {
        return None;
    }
    let total_rows = if p.flags & PREFILL_VARLEN != 0 { p.rows as u64 } else { p.batch as u64 * p.rows as u64 };
    let lse_elems = total_rows * p.n_heads as u64;
    let o_elems = lse_elems * p.head_dim_v as u64;
    // The kernel's part strides are 32-bit.
    if o_elems * parts as u64 > i32::MAX as u64 {
        return None;
    }
    Some(KvSplit { parts, o_elems, lse_elems })
}

/// Bytes of workspace a launch of the params block `params` at head dims `dims` can use
/// (0: it is not split), for [`super::launch::CudaKernel::workspace_bytes`].
pub fn workspace_bytes(
    dims: (u32, u32),
    hopper: bool,
    multiprocessors: u32,
    params: &[u8],
    forced: Option<u32>,
) -> u64 {
    split_of(dims, hopper, multiprocessors, params, forced).map_or(0, |s| s.bytes())
}

/// The split of a launch of the params block `params` (as [`workspace_bytes`] reads it),
/// for [`super::launch::CudaKernel::split`]; `None` for a block of another size or one no
/// op makes.
pub fn split_of(
    dims: (u32, u32),
    hopper: bool,
    multiprocessors: u32,
    params: &[u8],
    forced: Option<u32>,
) -> Option<KvSplit> {
    if params.len() != std::mem::size_of::<FlashAttnPrefillParamsGpu>() {
        return None;
    }
    let p: FlashAttnPrefillParamsGpu = bytemuck::pod_read_unaligned(params);
    p.extents()?;
    kv_split(&p, dims, multiprocessors, hopper, forced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{PREFILL_CAUSAL, PREFILL_MASK};

    /// A fixed-length params block: `batch` sequences of `rows` queries against `kv` cache
    /// rows, `heads` / `kv_heads`, head dim `d`, contiguous O and lse.
    fn block(
        batch: i32,
        rows: i32,
        kv: i32,
        heads: i32,
        kv_heads: i32,
        d: i32,
        flags: i32,
    ) -> FlashAttnPrefillParamsGpu {
        let (h, d64) = (heads as i64, d as i64);
        FlashAttnPrefillParamsGpu {
            q_batch_stride: rows as i64 * h * d64,
            q_row_stride: h * d64,
            q_head_stride: d64,
            k_batch_stride: kv as i64 * kv_heads as i64 * d64,
            k_row_stride: kv_heads as i64 * d64,
            k_head_stride: d64,
            v_batch_stride: kv as i64 * kv_heads as i64 * d64,
            v_row_stride: kv_heads as i64 * d64,
            v_head_stride: d64,
            o_batch_stride: rows as i64 * h * d64,
            o_row_stride: h * d64,
            o_head_stride: d64,
            lse_batch_stride: h * rows as i64,
            lse_head_stride: rows as i64,
            batch,
            rows,
            kv_len: kv,
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim: d,
            head_dim_v: d,
            max_rows: rows,
            flags,
            q_dtype: 0,
            o_dtype: 1,
            kv_dtype: 1,
            scale: 1.0,
            ..bytemuck::Zeroable::zeroed()
        }
    }

    #[test]
    fn a_chunk_against_a_long_cache_splits_to_fill_the_gpu_once() {
        // 512 rows x 8/8 heads at 256 against 64k (causal): 4 tiles x 8 heads = 32 CTAs on
        // 132 SMs -> 4 parts (128 CTAs); the walk of 1024 steps allows 16.
        let p = block(1, 512, 65_536, 8, 8, 256, PREFILL_CAUSAL);
        let s = kv_split(&p, (256, 256), 132, true, None).unwrap();
        assert_eq!(s.parts, 4);
        assert_eq!(s.log2(), 2);
        assert_eq!((s.o_elems, s.lse_elems), (512 * 8 * 256, 512 * 8));
        assert_eq!(s.bytes(), 4 * (512 * 8 * 256 + 512 * 8) * 4);
        assert_eq!(s.lse_offset(), 4 * 512 * 8 * 256 * 4);
        // Two CTAs per SM at head dim 128 (the Hopper form): 40 rows x 32/8 heads -> 8 CTAs,
        // 264 slots -> 16 parts, at most MAX_PARTS; the portable form holds one -> 16 too.
        let p = block(1, 40, 65_536, 32, 8, 128, PREFILL_CAUSAL);
        assert_eq!(kv_split(&p, (128, 128), 132, true, None).unwrap().parts, MAX_PARTS);
        // 3 parts fit: the power of two below, 2.
        let p = block(1, 5 * 128, 65_536, 8, 8, 256, PREFILL_CAUSAL);
        let geo = attention_geometry((256, 256), 640, 8, 8, true).unwrap();
        assert_eq!(geo.q_tiles * geo.head_groups, 40);
        assert_eq!(kv_split(&p, (256, 256), 132, true, None).unwrap().parts, 2);
    }

    #[test]
    fn full_grids_and_short_walks_do_not_split() {
        // 16k rows fill the GPU many times over.
        assert_eq!(kv_split(&block(1, 16_384, 16_384, 8, 8, 256, PREFILL_CAUSAL), (256, 256), 132, true, None), None);
        // A cache of 1024 rows: 16 steps, one part's worth.
        assert_eq!(kv_split(&block(1, 64, 1024, 8, 8, 256, 0), (256, 256), 132, true, None), None);
        // A window of 1024 against a 64k cache: the walk is the window's 17 steps.
        let mut p = block(1, 64, 65_536, 8, 8, 256, PREFILL_CAUSAL);
        p.window = 1024;
        assert_eq!(kv_split(&p, (256, 256), 132, true, None), None);
        // The same window of 4096: 65 steps -> 4 parts by the walk, 16 by the slots.
        p.window = 4096;
        assert_eq!(kv_split(&p, (256, 256), 132, true, None).unwrap().parts, 4);
        // A batch of 64 such chunks fills it too.
        assert_eq!(kv_split(&block(64, 512, 65_536, 8, 8, 256, PREFILL_CAUSAL), (256, 256), 132, true, None), None);
        // Causal with an offset that puts the chunk at the cache's start: a short walk.
        let mut p = block(1, 64, 65_536, 8, 8, 256, PREFILL_CAUSAL | PREFILL_OFFSET);
        p.offset = 100;
        assert_eq!(kv_split(&p, (256, 256), 132, true, None), None);
        p.offset = 40_000;
        assert_eq!(kv_split(&p, (256, 256), 132, true, None).unwrap().parts, 16);
    }

    #[test]
    fn two_sided_windows_split_by_their_walk() {
        use crate::params::PREFILL_WINDOW_RIGHT;
        // 64 rows at the end of a 64k cache, a right side of 4096 and no left side: every
        // step (1024) -> 16 parts, as the slots allow.
        let mut p = block(1, 64, 65_536, 8, 8, 256, PREFILL_WINDOW_RIGHT);
        p.window_right = 4096;
        assert_eq!(kv_split(&p, (256, 256), 132, true, None).unwrap().parts, 16);
        // The chunk at the cache's start (offset 0), left 1024, right 3071: steps 0..=48 -> 3
        // parts by the walk, the power of two below: 2.
        let mut p = block(1, 64, 65_536, 8, 8, 256, PREFILL_WINDOW_RIGHT | PREFILL_OFFSET);
        (p.window, p.window_right, p.offset) = (1025, 3071, 0);
        assert_eq!(kv_split(&p, (256, 256), 132, true, None).unwrap().parts, 2);
        // A window without a right side: the first query tile walks the most (to the cache's
        // end from 1599 rows before its first row: 33 steps -> 2 parts; the last tile's 27
        // would not split).
        let mut p = block(1, 512, 65_536, 8, 8, 256, 0);
        p.window = 1600;
        assert_eq!(kv_split(&p, (256, 256), 132, true, None).unwrap().parts, 2);
    }

    #[test]
    fn the_parts_write_f32_o_and_lse_without_sinks_to_the_workspace() {
        let p = block(2, 40, 4096, 8, 2, 128, PREFILL_CAUSAL | PREFILL_SINKS | PREFILL_MASK);
        let s = kv_split(&p, (128, 128), 132, true, None).unwrap();
        assert_eq!((s.o_elems, s.lse_elems), (2 * 40 * 8 * 128, 2 * 40 * 8));
        let w = s.part_params(&p);
        assert_eq!(w.o_dtype, 0);
        assert_eq!((w.o_batch_stride, w.o_row_stride, w.o_head_stride), (40 * 8 * 128, 8 * 128, 128));
        assert_eq!((w.lse_batch_stride, w.lse_head_stride), (8 * 40, 40));
        assert_eq!(w.flags, PREFILL_CAUSAL | PREFILL_MASK | PREFILL_LSE);
        // Everything else is the call's.
        let same = FlashAttnPrefillParamsGpu {
            o_dtype: p.o_dtype,
            o_batch_stride: p.o_batch_stride,
            o_row_stride: p.o_row_stride,
            o_head_stride: p.o_head_stride,
            lse_batch_stride: p.lse_batch_stride,
            lse_head_stride: p.lse_head_stride,
            flags: p.flags,
            ..w
        };
        assert_eq!(bytemuck::bytes_of(&same), bytemuck::bytes_of(&p));
        // Variable length: rows are the total, the batch strides 0, lse [heads, total].
        let mut v = block(3, 100, 9000, 8, 2, 256, PREFILL_CAUSAL | PREFILL_VARLEN);
        v.max_rows = 50;
        let s = kv_split(&v, (256, 256), 132, true, None).unwrap();
        assert_eq!((s.o_elems, s.lse_elems), (100 * 8 * 256, 100 * 8));
        let w = s.part_params(&v);
        assert_eq!((w.o_batch_stride, w.lse_batch_stride, w.lse_head_stride), (0, 0, 100));
    }

    #[test]
    fn the_workspace_is_asked_of_a_params_block_by_its_bytes() {
        let p = block(1, 512, 65_536, 8, 8, 256, PREFILL_CAUSAL);
        let bytes = workspace_bytes((256, 256), true, 132, bytemuck::bytes_of(&p), None);
        assert_eq!(bytes, kv_split(&p, (256, 256), 132, true, None).unwrap().bytes());
        assert_eq!(
            workspace_bytes((256, 256), true, 132, &bytemuck::bytes_of(&p)[1..], None),
            0,
            "a block of another size"
        );
        let mut bad = p;
        bad.rows = -1;
        assert_eq!(workspace_bytes((256, 256), true, 132, bytemuck::bytes_of(&bad), None), 0, "a block no op makes");
        let big = block(1, 16_384, 16_384, 8, 8, 256, PREFILL_CAUSAL);
        assert_eq!(workspace_bytes((256, 256), true, 132, bytemuck::bytes_of(&big), None), 0);
    }

    /// A plan's `kv_splits` forces the parts whatever the shape (where the launch can take
    /// them), `0` or `1` never splits a shape that would; it beats the variable.
    #[test]
    fn forced_parts_override_the_shape() {
        let full = block(1, 16_384, 16_384, 8, 8, 256, PREFILL_CAUSAL); // fills the GPU: unsplit
        assert_eq!(kv_split(&full, (256, 256), 132, true, None), None);
        for n in [2, 4, 16] {
            assert_eq!(kv_split(&full, (256, 256), 132, true, Some(n)).unwrap().parts, n);
        }
        let chunk = block(1, 512, 65_536, 8, 8, 256, PREFILL_CAUSAL); // a chunk: split by itself
        assert!(kv_split(&chunk, (256, 256), 132, true, None).is_some());
        for n in [0, 1] {
            assert_eq!(kv_split(&chunk, (256, 256), 132, true, Some(n)), None);
        }
        let o = RunOptions { kv_splits: Some(8), ..RunOptions::default() };
        assert_eq!(forced_parts(&o), Some(8));
        assert_eq!(forced_parts(&RunOptions::default()), crate::settings::get().cuda_kv_splits);
    }
}

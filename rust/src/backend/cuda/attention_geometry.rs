//! The CTA shapes of the CUDA attention: how many (query, head) rows a CTA holds in each
//! form, how they split into heads of one KV group and queries, the CTA-pair forms' shape,
//! and the dynamic shared memory each form needs. The launch (`flash_attn_prefill.rs`) and
//! the split-KV plan (`kv_split.rs`) both stand on it.

use crate::error::{MlxError, Result};

/// Query rows of one warp's row group (the mma.sync form).
const ROWS_PER_GROUP: u32 = 32;

/// The portable form's CTA at head dims (dk, dv), as the kernel's `Cfg<DK, DV>` has it:
/// warps per row group of 32 query rows, and V's columns padded to whole warp widths.
const fn portable_cfg(dv: u32) -> (u32, u32) {
    let g = if dv <= 64 {
        1
    } else if dv <= 256 {
        2
    } else {
        4
    };
    let dvp = if dv <= 64 {
        64
    } else if dv <= 96 {
        96
    } else if dv <= 128 {
        128
    } else {
        dv
    };
    (g, dvp)
}

/// (Query, head) rows of one CTA: the portable form's `Cfg::ROWS`, the wgmma form's
/// `HCfg::ROWS` (`hopper`).
pub fn attention_cta_rows(dk: u32, dv: u32, hopper: bool) -> u32 {
    if hopper {
        return if dk == 512 { 64 } else { 128 };
    }
    let _ = dk;
    (8 / portable_cfg(dv).0) * ROWS_PER_GROUP
}

/// Shared memory the host reserves for a CTA of the tiled pipeline (the Hopper pair forms at
/// head dims 64 and 128, `pipeline_sm90.cuh`): the kernel's `PIPE_SMEM_RESERVED`, at least
/// what any row of its tile table (`tiles_sm90.cuh`) lays out, or a variant of it (each
/// instantiation checks its own at compile time, and the kernel stops where a launch gives
/// it less). Such a CTA is alone on its SM (its 384 threads hold the registers), so
/// reserving more costs nothing; 1 KiB under the H100's and H200's 227 KiB a block.
pub const WS_SHARED_BYTES: u32 = 231_424;

/// Whether the Hopper CTA-pair form at `head_dim` is warp-specialised (a producer
/// warpgroup beside the consumers; the kernel's `Tiles<D>::PIPE`).
pub fn ws_form(head_dim: u32) -> bool {
    matches!(head_dim, 64 | 128 | 256)
}

/// Whether the paged module has the Hopper CTA-pair forms at `head_dim` (SPEC 11;
/// `shaders/flash_attn_prefill/paged_tma.cuh`): the warp-specialised ones, whose consumers
/// zero V's rows past a paged cache's end before a product reads them. Head dim 512's pair
/// form has no paged twin: a paged launch there runs the one-CTA form.
pub const fn paged_pair_form(head_dim: u32) -> bool {
    matches!(head_dim, 64 | 128 | 256)
}

/// Whether the host launches the paged module's pair forms ([`paged_pair_form`]) for paged
/// K/V with fixed-length queries on Hopper: on an H100 (2026-12-08, docs/benchmarks.md)
/// `scripts/gpu_paged_pairs.sh`'s tests passed (each sequence's contiguous result in the same
/// pair form, bit for bit) and they ran at 0.53x-0.84x of contiguous K/V where the one-CTA
/// forms run at 0.32x-0.42x. false: a paged launch runs the one-CTA forms.
pub const PAGED_PAIRS_LAUNCHED: bool = true;

/// Whether the quant module has the Hopper CTA-pair forms at `head_dim` (SPEC 11, FP8 K/V;
/// `shaders/flash_attn_prefill/quant_pipe.cuh`): the pipeline's, whose producer widens each
/// tile's FP8 bytes to F16 in shared memory after the TMA copies them; the head dims of the
/// paged twins. Q8_0 (blocks of 34 bytes, which the TMA's 16-byte strides cannot address in
/// general) and head dim 512 run the one-CTA forms.
pub const fn quant_pair_form(head_dim: u32) -> bool {
    paged_pair_form(head_dim)
}

/// Whether the host launches the quant module's pair forms ([`quant_pair_form`]) for FP8 K/V
/// with fixed-length queries and no explicit mask (the forms keep no room for mask tiles) on
/// Hopper: on an H100 (2026-12-08, docs/benchmarks.md) `scripts/gpu_quant_pairs.sh`'s tests
/// passed (with descale 1 the F16 pair forms' bits at head dims 64 and 128) and they ran at
/// 0.44x-0.55x of 16-bit K/V where the one-CTA forms run at 0.32x-0.42x. false: a quantised
/// launch runs the one-CTA forms.
pub const QUANT_PAIRS_LAUNCHED: bool = true;

/// Whether the pair forms at `head_dim` launch the pipeline's shape without the explicit
/// mask's tiles (`_wide` entry points, `tiles_sm90.cuh`'s `WideTiles`: 192-row tiles at head
/// dim 128) where no explicit mask is given. Same threads and shared memory reserve as the
/// other pair forms. Off: the shape lost to the 128-row forms on an H100 (docs/benchmarks.md,
/// "Tiles of 192 cache rows at head dim 128": dense 1.01x, causal 0.98x).
pub fn wide_form(head_dim: u32) -> bool {
    WIDE_LAUNCHED && head_dim == 128
}

/// Whether [`wide_form`] launches the wide shape at all (see there). It also decides whether
/// the kernels have its entry points: the NVRTC options pass `-DMLXN_WS_WIDE_ENTRIES=1` where
/// it is true (`nvrtc::options`), so a build that times the shape sets it and nothing else.
pub const WIDE_LAUNCHED: bool = false;

/// The head dims whose kernels have the wide pair forms' entry points
/// (`MLXN_PAIR_WIDE_ENTRIES`): 128 where [`WIDE_LAUNCHED`], else none.
pub fn has_wide_entries(head_dim: u32) -> bool {
    WIDE_LAUNCHED && head_dim == 128
}

/// Consumer warpgroups of the tiled pipeline at head dim 64 (the kernel's
/// `MLXN_WS_CONSUMERS_D64` default, `tiles_sm90.cuh`; a test reads it): three, 192 query rows
/// a CTA, as FlashAttention-3 has it at this head dim. Head dims 128 and 256 have two.
pub const WS_CONSUMERS_D64: u32 = 3;

/// Consumer warpgroups of the warp-specialised pair form at `head_dim`.
pub fn ws_consumers(head_dim: u32) -> u32 {
    if head_dim == 64 {
        WS_CONSUMERS_D64
    } else {
        2
    }
}

/// Threads of the warp-specialised pair form at `head_dim`: its consumer warpgroups and the
/// producer's (the kernel's `MLXN_PAIR_THREADS`).
pub fn ws_threads(head_dim: u32) -> u32 {
    128 * (ws_consumers(head_dim) + 1)
}

/// (Query, head) rows of one CTA of the Hopper CTA-pair form: 64 a consumer warpgroup in the
/// warp-specialised forms, the one-CTA form's rows at 512.
pub fn pair_cta_rows(head_dim: u32) -> u32 {
    if ws_form(head_dim) {
        64 * ws_consumers(head_dim)
    } else {
        attention_cta_rows(head_dim, head_dim, true)
    }
}

/// Whether a pair form's walk can carry the explicit mask's table bytes of its rows: its
/// CTA's rows (a query pair: both CTAs') span at most 4 (8) of the table's 32-row tile rows
/// (the kernel's `PairWalk` CAP). Without a table the walk reads none.
pub fn pair_walk_fits(queries_per_cta: u32, query_pair: bool, masked: bool) -> bool {
    let rows = queries_per_cta * if query_pair { 2 } else { 1 };
    let span = rows.div_ceil(32) + u32::from(!rows.is_multiple_of(32));
    !masked || span <= if query_pair { 8 } else { 4 }
}

/// Dynamic shared memory of one attention CTA of the plain forms: the kernel's
/// `Cfg<DK, DV>::SMEM`, or `hopper::HCfg<D>::SMEM` for the wgmma form (the kernel checks each
/// against these numbers at compile time, and a test reads its checks).
pub fn plain_shared_bytes(dk: u32, dv: u32, hopper: bool) -> Option<u32> {
    match (dk, dv, hopper) {
        (64, 64, true) => Some(83_008),
        (128, 128, true) => Some(83_008),
        (256, 256, true) => Some(230_528),
        (512, 512, true) => Some(214_592),
        (_, _, true) => None,
        _ => {
            let (g, dvp) = portable_cfg(dv);
            let rows = (8 / g) * ROWS_PER_GROUP;
            let (sw_k, sw_v) = (dk.div_ceil(64) * 64, dvp.div_ceil(64) * 64);
            let kl = 64 / g / 16;
            Some(
                rows * sw_k * 2
                    + 64 * sw_k * 2
                    + 64 * sw_v * 2
                    + rows * 64 * 2
                    + 8 * 2 * kl * 32 * 16
                    + 8 * 32 * 4
                    + 32,
            )
        }
    }
}

/// Dynamic shared memory of one CTA of the Hopper CTA-pair form at `head_dim`: the
/// warp-specialised pipelines' reserve at 64, 128 and 256 (at 256 either loop of
/// `tiles_sm90.cuh`'s PIPE fits in it: 230 528 bytes for mainloop_sm90_ws.cuh's, 230 560 for
/// pipeline_sm90.cuh's), else the one-CTA form's bytes (the same layout at 512).
pub fn pair_shared_bytes(head_dim: u32) -> Option<u32> {
    if ws_form(head_dim) {
        Some(WS_SHARED_BYTES)
    } else {
        plain_shared_bytes(head_dim, head_dim, true)
    }
}

/// The most dynamic shared memory any form of the kernel at (dk, dv) launches with (the
/// limit the backend raises for each of its entry points): the pair forms' where it has them.
pub fn attention_shared_bytes(dk: u32, dv: u32, hopper: bool) -> Option<u32> {
    let plain = plain_shared_bytes(dk, dv, hopper)?;
    if hopper && dk == dv {
        if let Some(pair) = pair_shared_bytes(dk) {
            return Some(plain.max(pair));
        }
    }
    Some(plain)
}

/// Geometry of one attention launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionGeometry {
    /// Query heads of one CTA (they share one KV head).
    pub heads_per_cta: u32,
    /// Query rows of one CTA.
    pub queries_per_cta: u32,
    /// CTAs along the query rows.
    pub q_tiles: u32,
    /// CTAs along the heads.
    pub head_groups: u32,
}

/// The CTA shape for a problem. A CTA holds 128 (query, head) rows at head dim 256 and 64
/// at 512, in blocks of 32 consecutive queries of one head (the mma.sync form: a warp
/// pair's rows) or of 16 (the wgmma form, `hopper`: a warp's rows). It takes as many
/// heads of one KV group as divide both the group and the number of blocks (a power of
/// two), so those heads share each K/V tile and the query tiles stay short.
pub fn attention_geometry(
    dims: (u32, u32),
    rows: u32,
    n_heads: u32,
    n_kv_heads: u32,
    hopper: bool,
) -> Result<AttentionGeometry> {
    let cta_rows = attention_cta_rows(dims.0, dims.1, hopper);
    geometry_of(cta_rows, if hopper { 16 } else { ROWS_PER_GROUP }, rows, n_heads, n_kv_heads)
}

/// The shape of CTAs of `cta_rows` (query, head) rows in blocks of `block` queries of one
/// head: as many heads of one KV group as divide both the group and the number of blocks
/// (their greatest common divisor; a power of two where the blocks are).
fn geometry_of(cta_rows: u32, block: u32, rows: u32, n_heads: u32, n_kv_heads: u32) -> Result<AttentionGeometry> {
    let row_groups = cta_rows / block;
    if rows == 0 || n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(MlxError::Internal(format!(
            "attention shape {rows} x {n_heads}/{n_kv_heads} breaks the op's contract"
        )));
    }
    let group = n_heads / n_kv_heads;
    let (mut a, mut b) = (row_groups, group);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    let hpc = a;
    let qpc = cta_rows / hpc;
    Ok(AttentionGeometry {
        heads_per_cta: hpc,
        queries_per_cta: qpc,
        q_tiles: rows.div_ceil(qpc),
        head_groups: n_heads / hpc,
    })
}

/// The CTA shape of the head-pair form (Hopper): the wgmma form's shape for groups of half
/// the query heads per KV head, so that the two CTAs of a cluster (y = 2j, 2j + 1) split
/// one KV head's heads. `None` when that group is odd.
pub fn pair_geometry(head_dim: u32, rows: u32, n_heads: u32, n_kv_heads: u32) -> Option<AttentionGeometry> {
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) || !(n_heads / n_kv_heads).is_multiple_of(2) {
        return None;
    }
    geometry_of(pair_cta_rows(head_dim), 16, rows, n_heads, n_kv_heads * 2).ok()
}

/// The CTA shape of the query-pair form (Hopper): the pair form's rows over the whole
/// group of query heads per KV head.
pub fn pair_queries_geometry(head_dim: u32, rows: u32, n_heads: u32, n_kv_heads: u32) -> Option<AttentionGeometry> {
    geometry_of(pair_cta_rows(head_dim), 16, rows, n_heads, n_kv_heads).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctas_take_the_heads_of_one_kv_group() {
        // Gemma 4 26B global: 16 heads over 2 KV heads, head dim 512 -> 2 heads x 32 queries
        // (mma.sync), 4 heads x 16 queries (wgmma).
        let g = attention_geometry((512, 512), 8192, 16, 2, false).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (2, 32, 256, 8));
        let g = attention_geometry((512, 512), 8192, 16, 2, true).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (4, 16, 512, 4));
        // Sliding: 16 over 8 at 256 -> 2 heads x 64 queries.
        let g = attention_geometry((256, 256), 8192, 16, 8, false).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (2, 64, 128, 8));
        assert_eq!(attention_geometry((256, 256), 8192, 16, 8, true).unwrap(), g);
        // Group of 8 at 256 -> 4 heads x 32 queries (8 x 16 with wgmma); none -> 1 x 128.
        assert_eq!(attention_geometry((256, 256), 100, 8, 1, false).unwrap().heads_per_cta, 4);
        assert_eq!(attention_geometry((256, 256), 100, 8, 1, true).unwrap().heads_per_cta, 8);
        let g = attention_geometry((256, 256), 129, 8, 8, true).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles), (1, 128, 2));
        // A group of 3 shares nothing; of 6, two heads.
        assert_eq!(attention_geometry((256, 256), 10, 6, 2, true).unwrap().heads_per_cta, 1);
        assert_eq!(attention_geometry((512, 512), 10, 6, 1, false).unwrap().heads_per_cta, 2);
        // The portable form at head dim 64 holds 256 rows (one warp per row group).
        assert_eq!(attention_geometry((64, 64), 10, 8, 1, false).unwrap().heads_per_cta, 8);
    }

    #[test]
    fn cta_pairs_split_each_kv_group_in_two() {
        // Global layer: 16 / 2 -> 4 heads x 16 queries; the pair (y = 2j, 2j + 1) is the 8.
        let g = pair_geometry(512, 8192, 16, 2).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (4, 16, 512, 4));
        // Groups of 4 and 2: 2 heads x 32 queries, 1 head x 64; groups of 16: 4 x 16.
        let g = pair_geometry(512, 100, 8, 2).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (2, 32, 4, 4));
        let g = pair_geometry(512, 100, 4, 2).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (1, 64, 2, 4));
        assert_eq!(pair_geometry(512, 100, 32, 2).unwrap().heads_per_cta, 4);
        // Head dim 256 (128 rows): sliding 16 / 8 -> 1 head x 128 queries; 16 / 1 -> 8 x 16.
        let g = pair_geometry(256, 8192, 16, 8).unwrap();
        assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (1, 128, 64, 16));
        assert_eq!(pair_geometry(256, 100, 16, 1).unwrap().heads_per_cta, 8);
        // Every pair stays inside one KV group.
        for (hd, nh, nkv) in [
            (512, 16, 2),
            (512, 8, 2),
            (512, 4, 2),
            (512, 32, 2),
            (512, 24, 2),
            (512, 12, 1),
            (256, 2, 1),
            (256, 24, 1),
            (256, 16, 8),
        ] {
            let g = pair_geometry(hd, 10, nh, nkv).unwrap();
            let group = nh / nkv;
            assert_eq!(g.head_groups % 2, 0);
            for j in 0..g.head_groups / 2 {
                assert_eq!((2 * j * g.heads_per_cta) / group, ((2 * j + 1) * g.heads_per_cta) / group);
            }
        }
        // Head dim 64 with three consumer warpgroups (192 rows): 32 / 8 -> head pairs of 2
        // heads x 96 queries, query pairs of 4 x 48; no sharing -> 1 x 192, whose walk cannot
        // carry a table's bytes in a query pair.
        if WS_CONSUMERS_D64 == 3 {
            let g = pair_geometry(64, 16384, 32, 8).unwrap();
            assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (2, 96, 171, 16));
            let g = pair_queries_geometry(64, 16384, 32, 8).unwrap();
            assert_eq!((g.heads_per_cta, g.queries_per_cta, g.q_tiles, g.head_groups), (4, 48, 342, 8));
            let g = pair_queries_geometry(64, 100, 8, 8).unwrap();
            assert_eq!((g.heads_per_cta, g.queries_per_cta), (1, 192));
            assert!(pair_walk_fits(96, false, true) && pair_walk_fits(96, true, true));
            assert!(pair_walk_fits(48, false, true) && pair_walk_fits(48, true, true));
            assert!(!pair_walk_fits(192, false, true) && !pair_walk_fits(192, true, true));
            assert!(pair_walk_fits(192, true, false));
        }
        for hd in [128, 256, 512] {
            assert_eq!(pair_queries_geometry(hd, 1000, 32, 8), attention_geometry((hd, hd), 1000, 32, 8, true).ok());
        }
        // Odd groups (and no sharing) have no pairs.
        assert!(pair_geometry(512, 10, 3, 1).is_none());
        assert!(pair_geometry(256, 10, 4, 4).is_none());
    }
}

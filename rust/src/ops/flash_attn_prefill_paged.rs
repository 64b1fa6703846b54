//! Paged K/V for the prefill (SPEC 11): `k_cache`, `v_cache` `[num_blocks, block_size,
//! n_kv_heads, head_dim]`, a block table `[batch, max_blocks]` and each sequence's cache
//! length (`seqused_k`, FlashAttention's name). Sequence b's cache row j is row
//! `j % block_size` of block `block_table[b, j / block_size]`; everything else is the
//! contiguous prefill's ([`super::flash_attn_prefill`]).
//!
//! [`validate_paged`] checks the table and the lengths on the host, before anything runs
//! (each failure an `InvalidArgument` naming the argument and the fix), so that no kernel
//! can read outside the caches; it then describes the prefill to the contiguous op's
//! validation as one whose K/V strides are 0 (they describe no tensor) and whose cache is
//! the longest sequence's (fixed-length queries) or the sum of them (variable length, with
//! `cu_seqlens_k` made from the lengths), and the paged block [`PagedKvParamsGpu`] carries
//! the caches' strides. The kernels read it beside the prefill's block.

use crate::error::{MlxError, Result};
use crate::params::PagedKvParamsGpu;

use super::flash_attn_prefill::FlashAttnPrefillParams;

/// The block sizes taken: multiples of 16 from 16 (vLLM's, FlashInfer's) to 256 (FA3's).
pub const BLOCK_SIZES: std::ops::RangeInclusive<u32> = 16..=256;

/// The paged K/V of a prefill, as host values (the table and the lengths belong to the
/// plan, as `cu_seqlens` do: a plan is made per block table, as FlashInfer's is).
#[derive(Debug, Clone, Copy)]
pub struct PagedKv<'a> {
    /// `[batch, max_blocks]` row-major.
    pub block_table: &'a [i32],
    pub max_blocks: u32,
    /// `[batch]`: each sequence's cache length.
    pub seqused_k: &'a [i32],
    /// Blocks of `k_cache` and `v_cache` (their first axis).
    pub num_blocks: u32,
    /// Rows of one block (their second axis).
    pub block_size: u32,
}

/// What [`validate_paged`] makes of a paged prefill for the contiguous op's validation.
#[derive(Debug, Clone)]
pub struct PagedPrefill {
    /// The params the contiguous validation checks: K/V strides 0, `kv_len` as above.
    pub params: FlashAttnPrefillParams,
    /// Variable length: `cu_seqlens_k` from the lengths (prefix sums).
    pub cu_seqlens_k: Option<Vec<i32>>,
    /// The caches' block, bound beside the prefill's.
    pub gpu: PagedKvParamsGpu,
}

fn invalid(msg: String) -> MlxError {
    MlxError::InvalidArgument(format!("flash_attn_prefill (paged K/V): {msg}"))
}

/// Check paged K/V against `p` (whose `k_strides` / `v_strides` are the caches' block, row
/// and head strides) and the queries (`cu_seqlens_q` for variable length, else `p.rows`
/// rows per sequence); see the module's comment.
pub fn validate_paged(
    p: &FlashAttnPrefillParams,
    cu_seqlens_q: Option<&[i32]>,
    pg: &PagedKv<'_>,
) -> Result<PagedPrefill> {
    let batch = p.batch as usize;
    let (bs, max_blocks) = (pg.block_size, pg.max_blocks);
    if !BLOCK_SIZES.contains(&bs) || !bs.is_multiple_of(16) {
        return Err(invalid(format!(
            "block_size (the caches' second axis) is {bs}; it must be a multiple of 16 from 16 to 256: allocate the \
             cache in blocks of 16, 32, 64, ... or 256 rows"
        )));
    }
    if pg.seqused_k.len() != batch {
        return Err(invalid(format!(
            "seqused_k has {} entries for a batch of {batch}: give one cache length per sequence",
            pg.seqused_k.len()
        )));
    }
    if pg.block_table.len() != batch * max_blocks as usize {
        return Err(invalid(format!(
            "block_table has {} entries; a batch of {batch} with {max_blocks} blocks per sequence needs {}",
            pg.block_table.len(),
            batch * max_blocks as usize
        )));
    }
    if pg.num_blocks > i32::MAX as u32 || max_blocks > i32::MAX as u32 {
        return Err(invalid(format!("num_blocks {} or max_blocks {max_blocks} exceeds i32", pg.num_blocks)));
    }
    let strides = [p.k_strides, p.v_strides];
    if strides.iter().flatten().any(|&s| s > i64::MAX as u64) {
        return Err(invalid(format!("a cache stride exceeds i64: k {:?}, v {:?}", p.k_strides, p.v_strides)));
    }
    // Each sequence's query rows, where the queries are well formed (the contiguous
    // validation names what is wrong with cu_seqlens_q otherwise).
    let lq = |b: usize| -> Option<i64> {
        match cu_seqlens_q {
            Some(cq) if cq.len() == batch + 1 => Some(cq[b + 1] as i64 - cq[b] as i64),
            Some(_) => None,
            None => Some(p.rows as i64),
        }
    };
    let (mut longest, mut total) = (0u64, 0u64);
    for (b, &lk) in pg.seqused_k.iter().enumerate() {
        if lk < 0 {
            return Err(invalid(format!("seqused_k[{b}] is {lk}: a cache length is at least 0")));
        }
        let blocks = (lk as u32).div_ceil(bs);
        if blocks > max_blocks {
            return Err(invalid(format!(
                "seqused_k[{b}] is {lk}, which needs {blocks} blocks of {bs} rows; block_table has {max_blocks} per \
                 sequence: widen the table (or shorten the sequence)"
            )));
        }
        let row = &pg.block_table[b * max_blocks as usize..][..blocks as usize];
        if let Some(i) = row.iter().position(|&e| e < 0 || e as u32 >= pg.num_blocks) {
            return Err(invalid(format!(
                "block_table[{b}, {i}] is {}, not a block of the caches (0 to {}): sequence {b}'s first {blocks} \
                 entries must name blocks of k_cache / v_cache",
                row[i],
                pg.num_blocks as i64 - 1
            )));
        }
        if p.causal != 0 && p.has_offset == 0 {
            if let Some(rows) = lq(b).filter(|&rows| (lk as i64) < rows) {
                return Err(invalid(format!(
                    "causal with {rows} query rows and seqused_k[{b}] = {lk}: the prompt is the end of its cache, \
                     which cannot be shorter (give the whole cache's length, or an offset)"
                )));
            }
        }
        longest = longest.max(lk as u64);
        total += lk as u64;
    }
    let kv_len = if cu_seqlens_q.is_some() { total } else { longest };
    if kv_len > i32::MAX as u64 {
        return Err(invalid(format!("the sequences' cache lengths sum to {kv_len}, more than i32 holds")));
    }
    let cu_seqlens_k = cu_seqlens_q.map(|_| {
        std::iter::once(0)
            .chain(pg.seqused_k.iter().scan(0i32, |acc, &lk| {
                *acc += lk;
                Some(*acc)
            }))
            .collect()
    });
    let i = |x: u64| x as i64;
    let gpu = PagedKvParamsGpu {
        k_block_stride: i(p.k_strides[0]),
        k_row_stride: i(p.k_strides[1]),
        k_head_stride: i(p.k_strides[2]),
        v_block_stride: i(p.v_strides[0]),
        v_row_stride: i(p.v_strides[1]),
        v_head_stride: i(p.v_strides[2]),
        num_blocks: pg.num_blocks as i32,
        block_size: bs as i32,
        max_blocks: max_blocks as i32,
        batch: p.batch as i32,
    };
    let params = FlashAttnPrefillParams { k_strides: [0; 3], v_strides: [0; 3], kv_len: kv_len as u32, ..*p };
    Ok(PagedPrefill { params, cu_seqlens_k, gpu })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(batch: u32, rows: u32, causal: u32) -> FlashAttnPrefillParams {
        FlashAttnPrefillParams {
            batch,
            rows,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64,
            causal,
            k_strides: [16 * 64, 64, 64],
            v_strides: [16 * 64, 64, 64],
            ..Default::default()
        }
    }

    fn paged<'a>(table: &'a [i32], max_blocks: u32, used: &'a [i32], bs: u32) -> PagedKv<'a> {
        PagedKv { block_table: table, max_blocks, seqused_k: used, num_blocks: 4, block_size: bs }
    }

    fn message(r: Result<PagedPrefill>) -> String {
        match r {
            Err(MlxError::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn a_good_table_becomes_the_contiguous_validations_params() {
        // Entries past a sequence's last block (99, -7) are never read, so never checked.
        let table = [3, 0, 99, 1, -7, -7];
        let v = validate_paged(&params(2, 4, 1), None, &paged(&table, 3, &[20, 16], 16)).unwrap();
        assert_eq!(v.params.kv_len, 20);
        assert_eq!((v.params.k_strides, v.params.v_strides), ([0; 3], [0; 3]));
        assert_eq!((v.gpu.k_block_stride, v.gpu.k_row_stride, v.gpu.num_blocks, v.gpu.max_blocks), (1024, 64, 4, 3));
        assert!(v.cu_seqlens_k.is_none());
        let v = validate_paged(&params(2, 3, 1), Some(&[0, 1, 3]), &paged(&table, 3, &[20, 16], 16)).unwrap();
        assert_eq!((v.params.kv_len, v.cu_seqlens_k), (36, Some(vec![0, 20, 36])));
    }

    #[test]
    fn every_bad_table_is_refused_by_name() {
        let p = params(2, 4, 0);
        let table = [0, 1, 2, 3];
        let cases: [(PagedKv<'_>, &str); 6] = [
            (paged(&table, 2, &[20, 4], 24), "block_size"),
            (paged(&table, 2, &[20, 4], 512), "block_size"),
            (paged(&table, 2, &[-1, 4], 16), "seqused_k[0] is -1"),
            (paged(&table, 2, &[20, 33], 16), "seqused_k[1] is 33"),
            (paged(&[0, 1, 4, 3], 2, &[20, 4], 16), "block_table[1, 0] is 4"),
            (paged(&[0, -2, 2, 3], 2, &[20, 4], 16), "block_table[0, 1] is -2"),
        ];
        for (pg, want) in cases {
            let m = message(validate_paged(&p, None, &pg));
            assert!(m.contains(want), "{m:?} should name {want:?}");
        }
        let m = message(validate_paged(&p, None, &paged(&table[..3], 2, &[20, 4], 16)));
        assert!(m.contains("block_table has 3 entries"), "{m}");
        let m = message(validate_paged(&p, None, &paged(&table, 2, &[20], 16)));
        assert!(m.contains("seqused_k has 1 entries"), "{m}");
        // Causal: a cache shorter than the prompt, unless an offset places the queries.
        let m = message(validate_paged(&params(2, 8, 1), None, &paged(&table, 2, &[20, 4], 16)));
        assert!(m.contains("seqused_k[1] = 4"), "{m}");
        let placed = FlashAttnPrefillParams { has_offset: 1, ..params(2, 8, 1) };
        assert!(validate_paged(&placed, None, &paged(&table, 2, &[20, 4], 16)).is_ok());
    }
}

//! CPU form of `flash_attn_prefill_d*` (SPEC sections 2 and 6-10: every head dim of the op's
//! table, F16 and BF16 K/V) and of `flash_attn_prefill_mask_blk` (SPEC 1 over a batch).
//!
//! The attention: one work item is one sequence, one KV head and up to four consecutive
//! query tiles (`prefill_tile`), with every query head that shares that KV head. Items run
//! in parallel on all cores, each thread taking the next item from a shared counter, in
//! sequence-major order and within a sequence longest first where the items' work differs
//! (causal), else KV-head-major (`run`). The origin's kernels (`flash_attn_prefill_tensor`)
//! are this one with a fixed layout.
//!
//! Tiles per head dim: `bq` query rows (the op's `mask_tile_rows`: 32 up to 256, 16 at 512
//! and 576) by 64 cache rows, `tiles_per_item` query tiles per work item. One function per
//! (Q/K, V) head dim pair serves both K/V dtypes: the dtype only changes how a tile is
//! widened to f32, so the kernel name's dtype is checked against the block's and the load
//! picks the conversion.

use std::sync::atomic::{AtomicBool, Ordering};

use super::flash_attn_prefill_blk::{classify_rows, MIXED, SKIP, ZERO};
use super::prefill_tile::{self, Elem, Kv, Pages, Problem, Quant, QuantFormat, Seq, C, NO_RIGHT, SCRATCH};
use super::{host_ptr, pool, CpuKernelFn, SendPtr};
use crate::error::{MlxError, Result};
use crate::interface::Dispatch;
use crate::params::{PREFILL_CAUSAL, PREFILL_LSE, PREFILL_MASK, PREFILL_OFFSET, PREFILL_WINDOW_RIGHT};
use crate::recorded::{Broken, RecordedMaskBlk, RecordedPaged, RecordedPrefill};

/// `DType` codes of K and V.
const KV_F32: i32 = 0;
const KV_F16: i32 = 1;
const KV_BF16: i32 = 2;
/// Any quantised K/V code (F8E4M3 7, F8E5M2 8, Q8_0 9): the `_kvq` kernels take all three.
const KV_QUANT: i32 = -1;

/// This op's kernels, by name: every (Q/K, V) head dim with F16 and BF16 K/V.
pub const KERNELS: &[(&str, CpuKernelFn)] = &[
    ("flash_attn_prefill_d16", entry::<16, 16, KV_F16>),
    ("flash_attn_prefill_d16_bf16", entry::<16, 16, KV_BF16>),
    ("flash_attn_prefill_d32", entry::<32, 32, KV_F16>),
    ("flash_attn_prefill_d32_bf16", entry::<32, 32, KV_BF16>),
    ("flash_attn_prefill_d48", entry::<48, 48, KV_F16>),
    ("flash_attn_prefill_d48_bf16", entry::<48, 48, KV_BF16>),
    ("flash_attn_prefill_d64", entry::<64, 64, KV_F16>),
    ("flash_attn_prefill_d64_bf16", entry::<64, 64, KV_BF16>),
    ("flash_attn_prefill_d80", entry::<80, 80, KV_F16>),
    ("flash_attn_prefill_d80_bf16", entry::<80, 80, KV_BF16>),
    ("flash_attn_prefill_d96", entry::<96, 96, KV_F16>),
    ("flash_attn_prefill_d96_bf16", entry::<96, 96, KV_BF16>),
    ("flash_attn_prefill_d112", entry::<112, 112, KV_F16>),
    ("flash_attn_prefill_d112_bf16", entry::<112, 112, KV_BF16>),
    ("flash_attn_prefill_d128", entry::<128, 128, KV_F16>),
    ("flash_attn_prefill_d128_bf16", entry::<128, 128, KV_BF16>),
    ("flash_attn_prefill_d160", entry::<160, 160, KV_F16>),
    ("flash_attn_prefill_d160_bf16", entry::<160, 160, KV_BF16>),
    ("flash_attn_prefill_d192", entry::<192, 192, KV_F16>),
    ("flash_attn_prefill_d192_bf16", entry::<192, 192, KV_BF16>),
    ("flash_attn_prefill_d224", entry::<224, 224, KV_F16>),
    ("flash_attn_prefill_d224_bf16", entry::<224, 224, KV_BF16>),
    ("flash_attn_prefill_d256", entry::<256, 256, KV_F16>),
    ("flash_attn_prefill_d256_bf16", entry::<256, 256, KV_BF16>),
    ("flash_attn_prefill_d512", entry::<512, 512, KV_F16>),
    ("flash_attn_prefill_d512_bf16", entry::<512, 512, KV_BF16>),
    ("flash_attn_prefill_d576_512", entry::<576, 512, KV_F16>),
    ("flash_attn_prefill_d576_512_bf16", entry::<576, 512, KV_BF16>),
    ("flash_attn_prefill_d16_f32", entry::<16, 16, KV_F32>),
    ("flash_attn_prefill_d32_f32", entry::<32, 32, KV_F32>),
    ("flash_attn_prefill_d48_f32", entry::<48, 48, KV_F32>),
    ("flash_attn_prefill_d64_f32", entry::<64, 64, KV_F32>),
    ("flash_attn_prefill_d80_f32", entry::<80, 80, KV_F32>),
    ("flash_attn_prefill_d96_f32", entry::<96, 96, KV_F32>),
    ("flash_attn_prefill_d112_f32", entry::<112, 112, KV_F32>),
    ("flash_attn_prefill_d128_f32", entry::<128, 128, KV_F32>),
    ("flash_attn_prefill_d160_f32", entry::<160, 160, KV_F32>),
    ("flash_attn_prefill_d192_f32", entry::<192, 192, KV_F32>),
    ("flash_attn_prefill_d224_f32", entry::<224, 224, KV_F32>),
    ("flash_attn_prefill_d256_f32", entry::<256, 256, KV_F32>),
    ("flash_attn_prefill_d512_f32", entry::<512, 512, KV_F32>),
    ("flash_attn_prefill_d576_512_f32", entry::<576, 512, KV_F32>),
    ("flash_attn_prefill_d16_kvq", entry::<16, 16, KV_QUANT>),
    ("flash_attn_prefill_d32_kvq", entry::<32, 32, KV_QUANT>),
    ("flash_attn_prefill_d48_kvq", entry::<48, 48, KV_QUANT>),
    ("flash_attn_prefill_d64_kvq", entry::<64, 64, KV_QUANT>),
    ("flash_attn_prefill_d80_kvq", entry::<80, 80, KV_QUANT>),
    ("flash_attn_prefill_d96_kvq", entry::<96, 96, KV_QUANT>),
    ("flash_attn_prefill_d112_kvq", entry::<112, 112, KV_QUANT>),
    ("flash_attn_prefill_d128_kvq", entry::<128, 128, KV_QUANT>),
    ("flash_attn_prefill_d160_kvq", entry::<160, 160, KV_QUANT>),
    ("flash_attn_prefill_d192_kvq", entry::<192, 192, KV_QUANT>),
    ("flash_attn_prefill_d224_kvq", entry::<224, 224, KV_QUANT>),
    ("flash_attn_prefill_d256_kvq", entry::<256, 256, KV_QUANT>),
    ("flash_attn_prefill_d512_kvq", entry::<512, 512, KV_QUANT>),
    ("flash_attn_prefill_d576_512_kvq", entry::<576, 512, KV_QUANT>),
    ("flash_attn_prefill_mask_blk", run_mask_blk),
];

static COLUMN_SKIP: AtomicBool = AtomicBool::new(true);

/// Whether a step of a partly visible tile leaves out the cache rows that no row of the
/// tile sees (on by default). Off computes them; the output is the same to the bit, which
/// the tests check with this switch.
pub fn set_column_skipping(on: bool) {
    COLUMN_SKIP.store(on, Ordering::Relaxed);
}

/// The switch [`set_column_skipping`] sets (a test comparing the two ways checks that the
/// second run really took the other one).
pub fn column_skipping() -> bool {
    COLUMN_SKIP.load(Ordering::Relaxed)
}

/// Query rows of one tile at Q/K head dim `d`: the op's table tiles (`mask_tile_rows`).
pub(super) const fn bq_of(d: usize) -> usize {
    if d <= 256 {
        32
    } else {
        16
    }
}

/// Entry point of `flash_attn_prefill_d<DK>[_<DV>][_bf16]`: K/V of dtype code `KV`.
fn entry<const DK: usize, const DV: usize, const KV: i32>(d: &Dispatch) -> Result<()> {
    let r = RecordedPrefill::decode(d)?.map_err(|Broken(what)| bad(what))?;
    if r.params.kv_dtype != KV && !(KV == KV_QUANT && (7..=9).contains(&r.params.kv_dtype)) {
        return Err(bad("the block's K/V dtype is not the kernel's"));
    }
    run::<DK, DV>(&r, super::isa_of(&d.options))
}

fn bad(what: &str) -> MlxError {
    MlxError::Internal(format!("flash_attn_prefill (cpu): {what}"))
}

/// Read and check `cu_seqlens` (`batch + 1` int32 at `ptr`): non-decreasing, from 0 up to at
/// most `total`, so every sequence lies inside its tensor.
unsafe fn read_cu(ptr: *const u8, batch: usize, total: usize) -> Result<Vec<usize>> {
    let cu: Vec<i32> = (0..=batch).map(|i| std::ptr::read_unaligned((ptr as *const i32).add(i))).collect();
    if cu[0] != 0 || cu.windows(2).any(|w| w[1] < w[0]) || cu[batch] as i64 > total as i64 {
        return Err(bad("cu_seqlens not non-decreasing from 0 up to the tensor's rows"));
    }
    Ok(cu.into_iter().map(|x| x as usize).collect())
}

/// Read and check paged K/V (SPEC 11; the op checked the same before recording): each
/// sequence's cache length `0 <= Lk_b <= max_blocks * block_size`, and each of the first
/// `ceil(Lk_b / block_size)` entries of its table row a block of the caches, so no row a kernel
/// reads lies outside them. Strides in u16 units (`kvu` per element). Returns the pages, the
/// lengths and K's and V's (row, head) strides.
unsafe fn read_pages(pg: &RecordedPaged<'_>, kvu: usize) -> Result<(Pages, Vec<usize>, [usize; 4])> {
    let pk = &pg.params;
    let (batch, bs, max_blocks) = (pk.batch as usize, pk.block_size as usize, pk.max_blocks as usize);
    let table = host_ptr(pg.block_table)? as *const i32;
    let used_ptr = host_ptr(pg.seqused_k)? as *const i32;
    let mut used = Vec::with_capacity(batch);
    for b in 0..batch {
        let lk = std::ptr::read_unaligned(used_ptr.add(b));
        if lk < 0 || lk as usize > max_blocks * bs {
            return Err(bad("a sequence's cache length outside its block table"));
        }
        let row = table.add(b * max_blocks);
        if (0..(lk as usize).div_ceil(bs)).any(|i| !(0..pk.num_blocks).contains(&std::ptr::read_unaligned(row.add(i))))
        {
            return Err(bad("a block table entry outside the caches"));
        }
        used.push(lk as usize);
    }
    if !table.is_aligned() {
        return Err(bad("a block table that is not aligned to its int32 entries"));
    }
    let z = |x: i64| x as usize * kvu;
    let pages = Pages { table, block_size: bs, k_bs: z(pk.k_block_stride), v_bs: z(pk.v_block_stride) };
    Ok((pages, used, [z(pk.k_row_stride), z(pk.k_head_stride), z(pk.v_row_stride), z(pk.v_head_stride)]))
}

/// Run one prefill at head dims (`DK`, `DV`): a recorded dispatch (the op's, or the
/// origin's as a prefill), its block checked against the op's contract and every buffer
/// against its extents (`RecordedPrefill`).
/// `isa`: the instruction set of its inner loops (the dispatch's, `isa_of`).
pub(super) fn run<const DK: usize, const DV: usize>(r: &RecordedPrefill<'_>, isa: &'static str) -> Result<()> {
    let p = &r.params;
    let has = |f: i32| p.flags & f != 0;
    let (Some(q_dtype), Some(o_dtype)) = (Elem::from_code(p.q_dtype), Elem::from_code(p.o_dtype)) else {
        return Err(bad("a Q or O dtype code that is not F32, F16 or BF16"));
    };
    if p.head_dim as usize != DK || p.head_dim_v as usize != DV {
        return Err(bad("a head dim is not the kernel's"));
    }
    // Quantised K/V: bytes, widened to f32 by the loaders as they read them (`Kv`, `Problem::quant`).
    let quant_format = match p.kv_dtype {
        7 => Some(QuantFormat::E4M3),
        8 => Some(QuantFormat::E5M2),
        9 => Some(QuantFormat::Q8_0),
        _ => None,
    };
    let kv = match p.kv_dtype {
        KV_F16 => Kv::F16,
        KV_BF16 => Kv::BF16,
        KV_F32 => Kv::F32,
        7 => Kv::E4M3(1.0),
        8 => Kv::E5M2(1.0),
        9 => Kv::Q8_0,
        _ => return Err(bad("a K/V dtype code that is not F16, BF16, F32 or a quantised format")),
    };
    let descale = r.descale.map(host_ptr).transpose()?.map_or(std::ptr::null(), |s| s as *const f32);
    let quant = quant_format.map(|format| Quant { format, descale, n_kv_heads: p.n_kv_heads as usize });
    // F32 K/V are addressed in u16 units: every stride and offset of K and V doubles
    // (quantised K/V in bytes, their own units).
    let kvu = if kv == Kv::F32 { 2 } else { 1 };
    let u = |x: i32| x as usize;
    let z = |x: i64| x as usize;
    let (batch, rows, kv_len) = (u(p.batch), u(p.rows), u(p.kv_len));
    let (q, k, v, out) = (host_ptr(r.q)?, host_ptr(r.k)?, host_ptr(r.v)?, host_ptr(r.out)?);
    let (mask, blk) = match r.mask {
        Some((m, t)) => (host_ptr(m)?, host_ptr(t)?),
        None => (q, q),
    };
    let lse = r.lse.map(host_ptr).transpose()?.unwrap_or(q);
    let sinks = r.sinks.map(host_ptr).transpose()?.map_or(std::ptr::null(), |s| s as *const f32);
    // Each query head's ALiBi slope (1 without ALiBi), read by the items through `slopes`.
    let slopes: Vec<f32> = (0..p.n_heads).map(|h| p.alibi_slope(h)).collect();
    // ALiBi on the positions: the slopes given as data, or max_bias's without an explicit mask.
    let given_slopes = r.alibi_slopes.is_some();
    let dist_slopes = match r.alibi_slopes {
        Some(b) => host_ptr(b)? as *const f32,
        None => slopes.as_ptr(),
    };
    let alibi_stride = if given_slopes { u(p.alibi_batch_stride) } else { 0 };
    let right = if has(PREFILL_CAUSAL) {
        0
    } else if has(PREFILL_WINDOW_RIGHT) {
        p.window_right as i64
    } else {
        NO_RIGHT
    };
    let cu = match r.cu_seqlens {
        // SAFETY: both hold batch + 1 int32 (checked by `RecordedPrefill`).
        Some((cq, ck)) => unsafe {
            Some((read_cu(host_ptr(cq)?, batch, rows)?, read_cu(host_ptr(ck)?, batch, kv_len)?))
        },
        None => None,
    };
    // Paged K/V: the caches' strides replace the block's (which are 0, describing no tensor).
    let paged = match &r.paged {
        // SAFETY: the table and the lengths hold what the block says (checked by `RecordedPrefill`).
        Some(pg) => Some(unsafe { read_pages(pg, kvu)? }),
        None => None,
    };
    let kv_strides = match &paged {
        Some((_, _, s)) => *s,
        None => [z(p.k_row_stride) * kvu, z(p.k_head_stride) * kvu, z(p.v_row_stride) * kvu, z(p.v_head_stride) * kvu],
    };
    let max_blocks = r.paged.as_ref().map_or(0, |pg| pg.params.max_blocks as usize);
    let (nh, nkv, bq) = (u(p.n_heads), u(p.n_kv_heads), bq_of(DK));
    let group = nh / nkv;
    let mut pb = Problem {
        group,
        bq,
        nt: prefill_tile::tiles_per_item(bq * group, DK),
        q_rs: z(p.q_row_stride),
        q_hs: z(p.q_head_stride),
        k_rs: kv_strides[0],
        k_hs: kv_strides[1],
        v_rs: kv_strides[2],
        v_hs: kv_strides[3],
        o_rs: z(p.o_row_stride),
        o_hs: z(p.o_head_stride),
        mask_rs: z(p.mask_row_stride),
        lse_hs: z(p.lse_head_stride),
        scale: p.scale,
        column_skip: column_skipping(),
        right,
        window: u(p.window),
        has_mask: has(PREFILL_MASK),
        has_lse: has(PREFILL_LSE),
        kv,
        softcap: p.softcap,
        alibi_distance: given_slopes || (p.max_bias > 0.0 && !has(PREFILL_MASK)),
        slopes: slopes.as_ptr(),
        dist_slopes,
        sinks,
        q_dtype,
        o_dtype,
        blk_steps: u(p.blk_steps),
        blk_bq: u(p.blk_bq.max(1)),
        q,
        k: k as *const u16,
        v: v as *const u16,
        mask: mask as *const u16,
        blk,
        out: SendPtr(out),
        lse: SendPtr(lse as *mut f32),
        amx: super::amx::products(kv == Kv::BF16),
        packed: std::ptr::null(),
        pages: paged.as_ref().map(|(pages, _, _)| *pages),
        quant,
    };
    // A paged sequence's cache length is its `seqused_k`, its rows found through its table row.
    let used = |b: usize, lk: usize| paged.as_ref().map_or(lk, |(_, used, _)| used[b]);
    // K/V packed once for every work item where the item can read them so (the AMX item,
    // BF16 K/V): each sequence's part at `packed_at[b]`, every KV head's in turn (nothing for a
    // sequence without query rows).
    let lens = |b: usize| match &cu {
        Some((cq, ck)) => (cq[b + 1] - cq[b], used(b, ck[b + 1] - ck[b])),
        None => (rows, used(b, kv_len)),
    };
    let pack = prefill_tile::pick_pack::<DK, DV>(kv, isa);
    let mut packed_at = vec![0usize; batch + 1];
    let mut pack_starts = vec![0usize; batch + 1];
    for b in 0..batch {
        let (lq, lk) = lens(b);
        let need = lq > 0 && lk > 0;
        packed_at[b + 1] = packed_at[b] + if need { nkv * prefill_tile::packed_len::<DK, DV>(lk) } else { 0 };
        pack_starts[b + 1] = pack_starts[b] + if need { nkv * lk.div_ceil(C) } else { 0 };
    }
    let mut packed_buf = Vec::new();
    let pack = pack.filter(|_| packed_at[batch] > 0 && packed_at[batch] * 2 <= PACKED_MAX_BYTES);
    if pack.is_some() {
        packed_buf = PACKED.with(|c| std::mem::take(&mut *c.borrow_mut()));
        pb.packed = prefill_tile::aligned(&mut packed_buf, packed_at[batch]);
    }
    // Where query row r of a sequence sits in its cache: r + off.
    let place = |lq: usize, lk: usize| {
        if has(PREFILL_OFFSET) {
            p.offset as i64
        } else {
            lk as i64 - lq as i64
        }
    };
    // Sequence b: its lengths and offsets (SPEC 7).
    let contiguous_seq = |b: usize| -> Seq {
        match &cu {
            Some((cq, ck)) => {
                let (q0, k0) = (cq[b], ck[b]);
                let (lq, lk) = (cq[b + 1] - q0, ck[b + 1] - k0);
                Seq {
                    lq,
                    lk,
                    off: place(lq, lk),
                    q: q0 * pb.q_rs,
                    k: k0 * pb.k_rs,
                    v: k0 * pb.v_rs,
                    o: q0 * pb.o_rs,
                    lse: q0,
                    mask: 0,
                    blk: 0,
                    alibi: b * alibi_stride,
                    packed: packed_at[b],
                    table: 0,
                }
            }
            None => Seq {
                lq: rows,
                lk: kv_len,
                off: place(rows, kv_len),
                q: b * z(p.q_batch_stride),
                k: b * z(p.k_batch_stride) * kvu,
                v: b * z(p.v_batch_stride) * kvu,
                o: b * z(p.o_batch_stride),
                lse: b * z(p.lse_batch_stride),
                mask: b * z(p.mask_batch_stride),
                blk: b * z(p.blk_batch_stride),
                alibi: b * alibi_stride,
                packed: packed_at[b],
                table: 0,
            },
        }
    };
    let seq = |b: usize| -> Seq {
        let s = contiguous_seq(b);
        match &paged {
            Some((_, used, _)) => {
                let lk = used[b];
                Seq { lk, off: place(s.lq, lk), k: 0, v: 0, table: b * max_blocks, ..s }
            }
            None => s,
        }
    };
    let groups = |lq: usize| lq.div_ceil(bq).div_ceil(pb.nt);
    let item: prefill_tile::ItemFn = prefill_tile::pick::<DK, DV>(isa);
    // The order of a sequence's items, which the threads take one at a time from a shared
    // counter (`pool::for_each`). With a right bound (causal) a query group sees more of the
    // cache the later it sits in the prompt, up to `groups` times the first's work: those go
    // first, every KV head's in turn, so that the last items taken are the shortest and no
    // thread is left alone with a long one at the end. Otherwise (equal items) KV-head-major,
    // so that the items running at once share their KV head's K/V rows in the caches.
    let longest_first = pb.right != NO_RIGHT;
    let run_item = |w: usize, s: &Seq| {
        let gs = groups(s.lq);
        let (grp, kvh) = if longest_first { (gs - 1 - w / nkv, w % nkv) } else { (w % gs, w / gs) };
        SCRATCH.with(|sc| {
            let mut sc = sc.borrow_mut();
            // SAFETY: `pick` chose an instruction set this CPU has; every sequence lies inside
            // the buffers, whose sizes were checked above; items write disjoint rows.
            unsafe { item(&pb, s, grp, kvh, &mut sc) };
        });
    };
    if let Some(pack) = pack {
        // Every step of every KV head of every sequence with query rows, before any item.
        let total = pack_starts[batch];
        let bytes = (packed_at[batch] * 2) as u64;
        pool::for_each(total, bytes, |w| {
            let b = pack_starts.partition_point(|&s| s <= w) - 1;
            let s = seq(b);
            let steps = s.lk.div_ceil(C);
            let (g, step) = ((w - pack_starts[b]) / steps, (w - pack_starts[b]) % steps);
            // SAFETY: as the items below; each step writes its own part of the buffer, which
            // holds `packed_at[batch]` elements from `pb.packed`.
            unsafe { pack(&pb, &s, g, step) };
        })?;
    }
    // The job's work for `pool::for_each`: the products' FLOP, were every pair visible.
    let flop = |lq: usize, lk: usize| (lq as u64) * (lk as u64) * (pb.group * nkv) as u64 * 2 * (DK + DV) as u64;
    match &cu {
        None => {
            let per_seq = groups(rows) * nkv;
            pool::for_each(batch * per_seq, batch as u64 * flop(rows, kv_len), |w| {
                let b = w / per_seq;
                run_item(w % per_seq, &seq(b));
            })?;
        }
        Some((cq, ck)) => {
            // First item of each sequence; sequences without query rows have none.
            let mut starts = Vec::with_capacity(batch + 1);
            let mut total = 0usize;
            for b in 0..batch {
                starts.push(total);
                total += groups(cq[b + 1] - cq[b]) * nkv;
            }
            starts.push(total);
            let work = (0..batch).map(|b| flop(cq[b + 1] - cq[b], ck[b + 1] - ck[b])).sum();
            pool::for_each(total, work, |w| {
                let b = starts.partition_point(|&s| s <= w) - 1;
                run_item(w - starts[b], &seq(b));
            })?;
        }
    }
    if pack.is_some() && packed_buf.len() * 2 <= PACKED_KEPT_BYTES {
        PACKED.with(|c| *c.borrow_mut() = packed_buf);
    }
    Ok(())
}

/// The most bytes of shared K/V packing one call makes (`Problem::packed`; beyond, each
/// item packs its own steps as before), and the most a thread keeps for its next call
/// (a fresh buffer's pages cost their first touch: 16 MB, about 2 ms on two cores).
const PACKED_MAX_BYTES: usize = 512 << 20;
const PACKED_KEPT_BYTES: usize = 64 << 20;

thread_local! {
    /// The calling thread's buffer of shared K/V packing, kept between calls.
    static PACKED: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `flash_attn_prefill_mask_blk`: params at 0, the F16 mask at 1, the U8 tables at 2. Tile
/// `(qt, kt)` of table b covers mask rows `[qt * bq, min(qt * bq + bq, rows))` and columns
/// `[kt * bk, kt * bk + bk)`; columns at or past `kv_len` count as masked (-inf).
pub fn run_mask_blk(d: &Dispatch) -> Result<()> {
    let bad = |what: &str| MlxError::Internal(format!("flash_attn_prefill_mask_blk (cpu): {what}"));
    let r = RecordedMaskBlk::decode(d)?.map_err(|Broken(what)| bad(what))?;
    let p = &r.params;
    let (batch, rows, kv_len) = (p.batch as usize, p.rows as usize, p.kv_len as usize);
    let (bq, bk, steps) = (p.bq as usize, p.bk as usize, p.steps as usize);
    let (mbs, mrs) = (p.mask_batch_stride as u64, p.mask_row_stride as u64);
    let mask_need = r.mask_bytes;
    let table_rows = rows.div_ceil(bq);
    let (mask, blk) = (host_ptr(r.mask)?, host_ptr(r.blk)?);
    let (mask, blk) = (SendPtr(mask as *mut u16), SendPtr(blk));
    pool::for_each(batch * table_rows, mask_need, |row| {
        let (m, t) = (mask, blk);
        let (b, qt) = (row / table_rows, row % table_rows);
        let r0 = qt * bq;
        let r1 = (r0 + bq).min(rows);
        for kt in 0..steps {
            let j0 = (kt * bk).min(kv_len);
            let j1 = (kt * bk + bk).min(kv_len);
            let class = if j0 == j1 {
                SKIP
            } else {
                let tile_rows = (r0..r1).map(|r| {
                    // SAFETY: b < batch, r < rows, j1 <= kv_len: inside the mask checked above.
                    unsafe { std::slice::from_raw_parts(m.0.add(b * mbs as usize + r * mrs as usize + j0), j1 - j0) }
                });
                match classify_rows(tile_rows) {
                    // Columns past the cache's end are masked: the tile is not all zero.
                    ZERO if j1 - j0 < bk => MIXED,
                    c => c,
                }
            };
            // SAFETY: the byte lies in table b, row qt: below table_bytes() <= blk_len; one task per row.
            unsafe { *t.0.add(row * steps + kt) = class };
        }
    })
}

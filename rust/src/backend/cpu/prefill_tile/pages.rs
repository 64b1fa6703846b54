//! Where a step's K and V rows are read from (SPEC 11, paged K/V): every loader of the work
//! items (the FMA item's f32 tiles, the AMX item's packing and in-place reads, the shared
//! packing) takes a step's rows as a base pointer and a row stride, and gets them here.
//!
//! Contiguous K/V: the step's rows in place. Paged K/V: sequence row `j` is row `j % bs` of
//! block `table[j / bs]`; a step whose rows lie in one block is read in place as well (every
//! step, for block sizes that are multiples of the step's 64 rows), and a step that spans
//! blocks is gathered into the thread's staging rows first, bit for bit. The loaders see the
//! same values in the same order either way, so the result is the contiguous layout's to
//! the bit.

use super::{Kv, Problem, Seq, C};

/// The paged caches of a prefill (strides in the kernel's u16 units, as `Problem`'s).
#[derive(Clone, Copy)]
pub(in crate::backend::cpu) struct Pages {
    /// The block table, `[batch][max_blocks]` (the sequence's row at `Seq::table`); every
    /// entry a sequence reads was checked to be a block of the caches.
    pub table: *const i32,
    pub block_size: usize,
    /// Elements from one block of K (V) to the next.
    pub k_bs: usize,
    pub v_bs: usize,
}

// SAFETY: the table is read-only while the kernel runs.
unsafe impl Send for Pages {}
unsafe impl Sync for Pages {}

/// K or V.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Which {
    K,
    V,
}

/// The element offset of row `j` of sequence `seq`, KV head `g`, in K or V (before the
/// cache's base pointer).
#[inline(always)]
pub(super) unsafe fn row_offset(pb: &Problem, seq: &Seq, which: Which, g: usize, j: usize) -> usize {
    let (base, bs_stride, rs, hs) = match which {
        Which::K => (seq.k, pb.pages.map_or(0, |p| p.k_bs), pb.k_rs, pb.k_hs),
        Which::V => (seq.v, pb.pages.map_or(0, |p| p.v_bs), pb.v_rs, pb.v_hs),
    };
    match pb.pages {
        None => base + g * hs + j * rs,
        Some(p) => {
            let block = *p.table.add(seq.table + j / p.block_size) as usize;
            block * bs_stride + g * hs + (j % p.block_size) * rs
        }
    }
}

/// Row `j`'s first element of K or V.
#[inline(always)]
pub(super) unsafe fn row(pb: &Problem, seq: &Seq, which: Which, g: usize, j: usize) -> *const u16 {
    let src = if which == Which::K { pb.k } else { pb.v };
    src.add(row_offset(pb, seq, which, g, j))
}

/// The step at cache row `c0` (`n` of its rows exist) of K or V of KV head `g`, of which
/// the loaders read rows `[lo, hi)` (clamped to `n`): its row 0 and its row stride. Paged
/// rows that span blocks are copied into `stage` (rows `[lo, hi)` at their places; `width`
/// u16 per row, a row of `d` elements) and read from there.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn step_rows(
    pb: &Problem,
    seq: &Seq,
    which: Which,
    g: usize,
    c0: usize,
    n: usize,
    lo: usize,
    hi: usize,
    d: usize,
    stage: &mut Vec<u16>,
) -> (*const u16, usize) {
    let rs = if which == Which::K { pb.k_rs } else { pb.v_rs };
    let Some(p) = pb.pages else { return (row(pb, seq, which, g, c0), rs) };
    let hi = hi.min(n);
    if n == 0 || c0 / p.block_size == (c0 + n - 1) / p.block_size || lo >= hi {
        // One block holds the step (or nothing of it is read): in place.
        return (row(pb, seq, which, g, c0), rs);
    }
    let width = if pb.kv == Kv::F32 { 2 * d } else { d };
    if stage.len() < C * width {
        stage.resize(C * width, 0);
    }
    for j in lo..hi {
        let src = row(pb, seq, which, g, c0 + j);
        std::ptr::copy_nonoverlapping(src, stage.as_mut_ptr().add(j * width), width);
    }
    (stage.as_ptr(), width)
}

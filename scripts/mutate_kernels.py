#!/usr/bin/env python3
"""Mutation testing of the kernels: plant one bug at a time, run the tests that matter, and
report which bugs the tests kill (docs/reliability.md, "Mutation testing").

    python scripts/mutate_kernels.py --check                  # every mutation still applies
    python scripts/mutate_kernels.py --family metal           # the .metal kernels, in the emulator
    python scripts/mutate_kernels.py --family cpu             # the Rust CPU kernels, Rust tests
    python scripts/mutate_kernels.py --family cuda --compile-only   # here: each mutant compiles
    python3 scripts/mutate_kernels.py --family cuda           # on a GPU machine, installed wheel
    python scripts/mutate_kernels.py --family cpu --only cpu-threshold-ge cpu-kv-head

Each mutation is data (MUTATIONS below): family, file, the exact original text (and how
many times it occurs), its replacement, what bug it plants, and, for an equivalent
mutation, why no test can see it (those are listed and left out of the kill rate). When a
kernel is rewritten, run `--check`: it names every mutation whose original text no longer
appears exactly as often as recorded, and refuses to run until the list is updated.

How each family runs a mutant (the repository's sources are never touched):
- metal: the mutated .metal file goes into a scratch folder named by MLXN_METAL_SHADER_DIR;
  the emulator is built from it (a mutant that does not compile is reported, not counted),
  then `pytest -x tests/test_metal_emulator_prefill.py tests/test_metal_emulator.py
  tests/test_metal_emulator_transforms.py tests/test_metal_emulator_coverage.py
  tests/test_metal_emulator_paged.py` (the
  front door's kernels first, then the origin's entry points, the score transforms and
  issue 27's coverage gaps; the tests that plant bugs of their own and the emulator's
  self-tests left out).
- cpu: a scratch copy of the crate (Cargo.toml, rust/, shaders/) with the mutated file, its
  own target folder kept between runs; `cargo test --test prefill_cpu --test planted --test
  flash_attn_cpu` (the front door's op, then the origin's through the same work item), then,
  for a survivor, `--test fuzz --test reliability --lib` (the crate's unit tests: the
  description's classes pair by pair, the classifier's crafted tiles), then `--test
  prefill_amx` (the AMX item, on the emulated tiles where the CPU has no AMX).
- cuda: the mutated .cu goes into a scratch folder named by MLX_NATIVE_CUDA_SOURCE_DIR (read
  by the installed library; no Rust needed). On a GPU: every mutant is compiled in parallel
  processes into a private cubin cache, then the CUDA tests run against each, a few at a
  time (`pytest -x -k cuda` over test_planted.py, test_correctness.py, test_cuda.py,
  test_cuda_split_kv.py, test_kernel_coverage.py).
  Mutations of the portable (mma.sync) form run with MLX_NATIVE_CUDA_ARCH=sm_90.
  `--compile-only` (no GPU): each mutant applies and compiles with NVRTC for its
  architecture (`cuda_compile_check`, which honours the knob).

Before the mutants, the same tests run on the unmutated sources; a failing baseline stops
the run. A short table comes last: per mutation killed / survived / equivalent, the test
that killed it, and the kill rate per family.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Mutation:
    name: str
    family: str  # metal | cuda | cpu
    file: str  # path from the repository root
    original: str
    replacement: str
    description: str
    count: int = 1  # occurrences of `original`; all of them are replaced
    equivalent: Optional[str] = None  # why no test can tell it from the original
    env: Dict[str, str] = field(default_factory=dict)  # extra environment for its tests


T_METAL = "shaders/flash_attn_prefill_tensor.metal"
B_METAL = "shaders/flash_attn_prefill_blk.metal"
CU_COMMON = "shaders/flash_attn_prefill/common.cuh"
CU_PARAMS = "shaders/flash_attn_prefill/params.cuh"
CU_RANGE = "shaders/flash_attn_prefill/block_range.cuh"
CU_LOADERS = "shaders/flash_attn_prefill/loaders.cuh"
CU_SOFTMAX = "shaders/flash_attn_prefill/softmax.cuh"
CU_EPILOGUE = "shaders/flash_attn_prefill/epilogue.cuh"
CU_SM80 = "shaders/flash_attn_prefill/mainloop_sm80.cuh"
CU_SM90 = "shaders/flash_attn_prefill/mainloop_sm90.cuh"
CU_SM90_PTX = "shaders/flash_attn_prefill/sm90_ptx.cuh"
CU_SM90_WS = "shaders/flash_attn_prefill/mainloop_sm90_ws.cuh"
CU_MERGE = "shaders/flash_attn_prefill/split_merge.cuh"
CU_PIPE = "shaders/flash_attn_prefill/pipeline_sm90.cuh"
CU_PIPE_MAIN = "shaders/flash_attn_prefill/mainloop_sm90_pipe.cuh"
CU_TILE_WALK = "shaders/flash_attn_prefill/tile_walk.cuh"
CU_TILE_SOFTMAX = "shaders/flash_attn_prefill/tile_softmax.cuh"
T_CU = "shaders/flash_attn_prefill_tensor.cu"
B_CU = "shaders/flash_attn_prefill_blk.cu"
# The CPU work item, by responsibility (rust/src/backend/cpu/prefill_tile/): the step plan
# and classes (mod.rs), the FMA item and its products (fma.rs), Q in and O out (io.rs), masks
# and transforms (transforms.rs), the softmax (softmax.rs); the AMX item (amx.rs), its
# operands' layouts (amx_layout.rs), and the tile unit (cpu/amx/).
P_DIR = "rust/src/backend/cpu/prefill_tile"
P_MOD, P_FMA, P_IO = f"{P_DIR}/mod.rs", f"{P_DIR}/fma.rs", f"{P_DIR}/io.rs"
P_TR, P_SM = f"{P_DIR}/transforms.rs", f"{P_DIR}/softmax.rs"
P_AMX, P_LAYOUT = f"{P_DIR}/amx.rs", f"{P_DIR}/amx_layout.rs"
P_PAGES = f"{P_DIR}/pages.rs"
P_SIMD = "rust/src/backend/cpu/simd.rs"
AMX_EMU, AMX_GEMM, AMX_MOD = "rust/src/backend/cpu/amx/emulated.rs", "rust/src/backend/cpu/amx/gemm.rs", "rust/src/backend/cpu/amx/mod.rs"
F_RS = "rust/src/backend/cpu/flash_attn_prefill.rs"
B_RS = "rust/src/backend/cpu/flash_attn_prefill_blk.rs"
PORTABLE = {"MLX_NATIVE_CUDA_ARCH": "sm_90"}  # the mma.sync form on a Hopper GPU

M = Mutation
MUTATIONS: List[Mutation] = [
    # ---------------------------------------------------------------- Metal: attention
    # One body (flash_attn_prefill_tile) for both ops: the front door's flash_attn_prefill_d*
    # and the origin's flash_attn_prefill_tensor_f16_d* (entry points over it).
    M("metal-threshold-ge", "metal", T_METAL, "if (m > m_run[i] + RESCALE_THRESHOLD) {",
      "if (m >= m_run[i] + RESCALE_THRESHOLD) {", "rescale at a step max of exactly M + 8"),
    M("metal-threshold-sign", "metal", T_METAL, "if (m > m_run[i] + RESCALE_THRESHOLD) {",
      "if (m > m_run[i] - RESCALE_THRESHOLD) {", "rescale threshold of the wrong sign"),
    M("metal-sums-unzeroed", "metal", T_METAL, "s_run[i] = 0.0f;", "", "row sums never zeroed"),
    M("metal-max-unset", "metal", T_METAL, "m_run[i] = -FLT_MAX / 2;", "", "running max never initialised",
      equivalent="the emulator poisons it to -1.69e38 (0xfe bytes), within 0.4% of -FLT_MAX/2: the first "
      "computed step still rescales with exp(-1.69e38 - m) = 0, exactly as from -FLT_MAX/2"),
    M("metal-max-zero", "metal", T_METAL, "m_run[i] = -FLT_MAX / 2;", "m_run[i] = 0.0f;",
      "running max starts at 0 (no rescale on a first step whose max is at most 8)"),
    M("metal-o-unzeroed", "metal", T_METAL, "            co[i] = 0.0f;\n", "", "O accumulators never zeroed"),
    M("metal-kv-head-mod", "metal", T_METAL, "const int g = h / (p.n_heads / p.n_kv_heads);",
      "const int g = h % p.n_kv_heads;", "wrong KV head: h % n_kv_heads"),
    M("metal-kv-head-div", "metal", T_METAL, "const int g = h / (p.n_heads / p.n_kv_heads);",
      "const int g = h / p.n_kv_heads;", "wrong KV head: h / n_kv_heads"),
    M("metal-q-rounded-first", "metal", T_METAL, "x = load_q4(q, p.q_dtype, at + ulong(4 * d4)) * p.scale;",
      "x = float4(half4(load_q4(q, p.q_dtype, at + ulong(4 * d4)))) * p.scale;", "Q rounded to half before the scale"),
    M("metal-scale-dropped", "metal", T_METAL, "x = load_q4(q, p.q_dtype, at + ulong(4 * d4)) * p.scale;",
      "x = load_q4(q, p.q_dtype, at + ulong(4 * d4));", "scale ignored"),
    M("metal-q-bf16-lane", "metal", T_METAL, "float4(float(x[0]), float(x[1]), float(x[2]), float(x[3]))",
      "float4(float(x[0]), float(x[1]), float(x[2]), float(x[2]))", "BF16 Q: every fourth element read from the third"),
    M("metal-last-step", "metal", T_METAL, "const int n_steps = lk / C + (lk % C != 0 ? 1 : 0);",
      "const int n_steps = (lk - 1) / C;", "the last step of the cache dropped (whole or partial)"),
    M("metal-partial-step", "metal", T_METAL, "const int n_steps = lk / C + (lk % C != 0 ? 1 : 0);",
      "const int n_steps = lk / C;", "a partial last step dropped (the cache's tail past a multiple of 64)"),
    M("metal-partial-tail-read", "metal", T_METAL, ", kn), array<int32_t, 2>({1, int32_t(p.",
      ", C), array<int32_t, 2>({1, int32_t(p.", "a partial last step reads whole K and V tiles (rows past the cache's end)",
      count=2),
    M("metal-partial-whole", "metal", T_METAL, "return whole && lo(r_last) <= c && hi(r_first) >= last ? 2 : 1;",
      "return lo(r_last) <= c && hi(r_first) >= last ? 2 : 1;",
      "a partial last step every row sees counted whole (no -inf past the cache's end)"),
    M("metal-row-bound", "metal", T_METAL, "const int valid = min(Q, lq - r0);",
      "const int valid = min(Q, lq - r0 + 1);", "one row past the prompt read and written"),
    M("metal-mask-rows-past", "metal", T_METAL, "if (add_mask && row < valid) {", "if (add_mask) {",
      "mask rows past the prompt read"),
    M("metal-mask-column", "metal", T_METAL, "s1 += slope * float(mrow[lane + NW]);", "s1 += slope * float(mrow[lane]);",
      "mask value read from the wrong column"),
    M("metal-mask-stride", "metal", T_METAL, "mask_seq + ulong(r) * ulong(p.mask_row_stride)",
      "mask_seq + ulong(r) * ulong(p.kv_len)", "mask rows at kv_len instead of the mask's row stride"),
    M("metal-mask-batch-stride", "metal", T_METAL, "device const half * mask_seq = mask + ulong(b) * ulong(p.mask_batch_stride);",
      "device const half * mask_seq = mask;", "the mask's batch stride ignored (every sequence reads mask 0)"),
    M("metal-k-stride", "metal", T_METAL, "dextents<int32_t, 2>(DK, kn), array<int32_t, 2>({1, int32_t(p.k_row_stride)}));",
      "dextents<int32_t, 2>(DK, kn), array<int32_t, 2>({1, int32_t(p.v_row_stride)}));", "K rows at V's row stride"),
    M("metal-v-head-stride", "metal", T_METAL, "v + v_at + ulong(g) * ulong(p.v_head_stride)",
      "v + v_at + ulong(g) * ulong(p.k_head_stride)", "V heads at K's head stride"),
    M("metal-q-head-stride", "metal", T_METAL, "ulong(h) * ulong(p.q_head_stride)", "ulong(h) * ulong(DK)",
      "Q heads assumed contiguous"),
    M("metal-q-batch-stride", "metal", T_METAL, "ulong(b) * ulong(p.q_batch_stride)",
      "ulong(b) * ulong(p.rows) * ulong(p.q_row_stride)", "Q's batch stride taken as rows x row stride"),
    M("metal-v-batch-stride", "metal", T_METAL, "ulong(b) * ulong(p.v_batch_stride)", "ulong(b) * ulong(p.k_batch_stride)",
      "V's sequences at K's batch stride"),
    M("metal-o-batch-stride", "metal", T_METAL, "ulong(b) * ulong(p.o_batch_stride)",
      "ulong(b) * ulong(p.rows) * ulong(p.o_row_stride)", "O's batch stride taken as rows x row stride"),
    M("metal-lse-batch-stride", "metal", T_METAL, "ulong(b) * ulong(p.lse_batch_stride)",
      "ulong(b) * ulong(p.n_heads) * ulong(p.lse_head_stride)", "lse's batch stride taken as heads x head stride"),
    M("metal-varlen-k-start", "metal", T_METAL, "varlen ? ulong(k_start) * ulong(p.k_row_stride)",
      "varlen ? ulong(q_start) * ulong(p.k_row_stride)", "variable length: K of a sequence from its cu_seqlens_q row"),
    M("metal-varlen-v-start", "metal", T_METAL, "varlen ? ulong(k_start) * ulong(p.v_row_stride)",
      "varlen ? ulong(k_start) * ulong(p.k_row_stride)", "variable length: V's sequence start at K's row stride"),
    M("metal-varlen-o-start", "metal", T_METAL, "varlen ? ulong(q_start) * ulong(p.o_row_stride)",
      "varlen ? ulong(k_start) * ulong(p.o_row_stride)", "variable length: O of a sequence at its cu_seqlens_k row"),
    M("metal-varlen-lse-start", "metal", T_METAL, "const ulong lse_at = varlen ? ulong(q_start) :",
      "const ulong lse_at = varlen ? ulong(0) :", "variable length: every sequence's lse at the first"),
    M("metal-varlen-lk", "metal", T_METAL, "lk = cu_k[b + 1] - k_start;", "lk = cu_k[b + 1] - cu_q[b];",
      "variable length: a sequence's cache length from the wrong cu_seqlens"),
    M("metal-offset-dropped", "metal", T_METAL, "(p.flags & PREFILL_OFFSET) != 0 ? p.offset : lk - lq;",
      "(p.flags & PREFILL_OFFSET) != 0 ? p.offset : 0;", "causal without the offset lk - lq (the prompt at the cache's start)"),
    M("metal-offset-ignored", "metal", T_METAL, "(p.flags & PREFILL_OFFSET) != 0 ? p.offset : lk - lq;",
      "lk - lq;", "an explicit query offset ignored (the prompt at the cache's end)"),
    M("metal-offset-flag-ignored", "metal", T_METAL, "(p.flags & PREFILL_OFFSET) != 0 ? p.offset : lk - lq;",
      "p.offset;", "the block's offset used without PREFILL_OFFSET"),
    M("metal-window-lo", "metal", T_METAL, "max(r + offset - window + 1, 0)", "max(r + offset - window, 0)",
      "the window one cache row wider"),
    M("metal-causal-hi", "metal", T_METAL, "min(r + offset + right, lk - 1)", "min(r + offset + right + 1, lk - 1)",
      "causal: each row sees the next cache row too"),
    M("metal-step-skip-edge", "metal", T_METAL, "if (c > hi(r_last) || lo(r_first) > last) {",
      "if (c > hi(r_last) || lo(r_first) >= last) {", "a step skipped whose last row only the tile's first row sees"),
    M("metal-step-skip-diagonal", "metal", T_METAL, "if (c > hi(r_last) || lo(r_first) > last) {",
      "if (c >= hi(r_last) || lo(r_first) > last) {", "a step skipped whose first row only the tile's last row sees"),
    M("metal-out-row", "metal", T_METAL, "            if (row < valid) {\n                const float s = srow[row];",
      "            if (row <= valid) {\n                const float s = srow[row];", "one output row past the prompt written"),
    M("metal-zero-guard", "metal", T_METAL, "s == 0.0f ? 0.0f : co[i] / s", "co[i] / s",
      "a fully masked row divides 0 by 0"),
    M("metal-lse-no-max", "metal", T_METAL, "m_run[i] + log(s_run[i])", "log(s_run[i])", "lse without the running max"),
    M("metal-lse-log2", "metal", T_METAL, "m_run[i] + log(s_run[i])", "m_run[i] + log(s_run[i]) * 1.44269504f",
      "lse with log2 of the row sum"),
    M("metal-lse-row", "metal", T_METAL, "ulong(h) * ulong(p.lse_head_stride) + ulong(r0 + row)]",
      "ulong(h) * ulong(p.lse_head_stride) + ulong(row)]", "lse rows of every query tile written at the first tile's"),
    M("metal-lse-unseen", "metal", T_METAL, "s_run[i] == 0.0f ? -INFINITY : m_run[i] + log(s_run[i])",
      "m_run[i] + log(s_run[i])", "the lse of a row that sees nothing not set to -inf explicitly",
      equivalent="such a row's sum is exactly 0 and its max -FLT_MAX/2 (finite): M + log(0) = -inf, the same bits"),
    M("metal-o-f16-trunc", "metal", T_METAL, "((device half *) out)[at] = half(x);",
      "((device ushort *) out)[at] = ushort(as_type<ushort>(half(x)) - (fabs(float(half(x))) > fabs(x) ? 1 : 0));",
      "F16 output truncated toward zero, not rounded to nearest even"),
    M("metal-o-bf16-trunc", "metal", T_METAL, "return ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);",
      "return ushort(u >> 16);", "BF16 output truncated, not rounded to nearest even"),
    M("metal-o-bf16-ties-away", "metal", T_METAL, "return ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);",
      "return ushort((u + 0x8000u) >> 16);", "BF16 output rounded half away from zero, not to even"),
    M("metal-barrier-final", "metal", T_METAL,
      "step's scales.\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n    if (lane == 0) {",
      "step's scales.\n    if (lane == 0) {", "missing barrier before srow is reused for the row sums"),
    M("metal-barrier-q", "metal", T_METAL, "        *sflag = -1;  // the step whose scores moved a running max (none yet)\n"
      "    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
      "        *sflag = -1;  // the step whose scores moved a running max (none yet)\n    }\n",
      "missing barrier after the Q tile is stored"),
    M("metal-blk-row", "metal", T_METAL, "+ ulong(r0 / p.blk_bq) * ulong(p.blk_steps);", "+ ulong(r0 / p.blk_bq);",
      "skip table read at the wrong row"),
    M("metal-blk-batch-stride", "metal", T_METAL, "blk + ulong(b) * ulong(p.blk_batch_stride) + ulong(r0 / p.blk_bq)",
      "blk + ulong(r0 / p.blk_bq)", "the table's batch stride ignored (every sequence reads table 0)"),
    M("metal-rescale-local", "metal", T_METAL, "if (*sflag == step) {", "if (rescaled) {",
      "O rescaled on this simdgroup's decision, not the threadgroup's"),
    M("metal-sums-unrounded", "metal", T_METAL, "simd_sum(float(p0) + float(p1))",
      "simd_sum(exp(s0 - m_run[i]) + exp(s1 - m_run[i]))", "row sums of the unrounded P"),
    M("metal-sums-no-rescale", "metal", T_METAL, "s_run[i] = s_run[i] * ms +", "s_run[i] = s_run[i] +",
      "row sums not rescaled"),
    # ---------------------------------------------------------------- Metal: tile classifier
    # One body (classify_tile) for flash_attn_prefill_mask_blk (masks of a batch, kv_len
    # columns) and the origin's flash_attn_prefill_blk (one mask of kv_pad columns).
    M("metal-blk-nan-bound", "metal", B_METAL, "&& mag >= 0x7bff && mag <= 0x7c00;", "&& mag >= 0x7bff;",
      "NaN bound dropped: a negative NaN counts as masked"),
    M("metal-blk-last-row", "metal", B_METAL, "for (long r = r0; r < r1 && (all_masked || all_zero); ++r) {",
      "for (long r = r0; r < r1 - 1 && (all_masked || all_zero); ++r) {", "a tile's last row ignored"),
    M("metal-blk-row-past", "metal", B_METAL,
      "const long r1 = r0 + long(p.bq) < long(p.rows) ? r0 + long(p.bq) : long(p.rows);",
      "const long r1 = r0 + long(p.bq) < long(p.rows) + 1 ? r0 + long(p.bq) : long(p.rows) + 1;",
      "a mask row past the prompt read"),
    M("metal-blk-sign", "metal", B_METAL, "all_masked && (bits & 0x8000) != 0 && mag", "all_masked && mag",
      "+inf counts as masked"),
    M("metal-blk-minus-zero", "metal", B_METAL, "all_zero = all_zero && mag == 0;",
      "all_zero = all_zero && bits == 0;", "-0 not counted as zero"),
    M("metal-blk-65504", "metal", B_METAL, "mag >= 0x7bff && mag <= 0x7c00", "mag >= 0x7c00 && mag <= 0x7c00",
      "-65504 not counted as masked"),
    M("metal-blk-last-column", "metal", B_METAL, "for (int j = int(lane); j < p.bk; j += 32) {",
      "for (int j = int(lane); j < p.bk - 1; j += 32) {", "a tile's last column ignored"),
    M("metal-blk-order", "metal", B_METAL, "all_masked ? 0 : (all_zero ? 2 : 1)", "all_zero ? 2 : (all_masked ? 0 : 1)",
      "the class tests in the other order",
      equivalent="no half is both masked (-inf, <= -65504) and zero, so a tile is never both"),
    M("metal-blk-cut-tile", "metal", B_METAL, "                all_zero = false;  // past the cache: masked, not read\n",
      "", "a tile of zeros cut by the cache's end counted as all zero"),
    M("metal-blk-column-past", "metal", B_METAL, "if (c0 + j >= long(p.kv_len)) {", "if (c0 + j > long(p.kv_len)) {",
      "the mask column at kv_len read"),
    M("metal-blk-mask-batch-stride", "metal", B_METAL,
      "device const ushort * tile_mask = mask + ulong(b) * ulong(p.mask_batch_stride);",
      "device const ushort * tile_mask = mask;", "the classifier ignores the masks' batch stride"),
    M("metal-blk-table-batch", "metal", B_METAL, "blk[(ulong(b) * ulong(table_rows) + ulong(qt)) * ulong(p.steps) + ulong(kt)]",
      "blk[ulong(qt) * ulong(p.steps) + ulong(kt)]", "every batch's table written over table 0"),
    # ---------------------------------------------------------------- CUDA: Hopper (wgmma) form
    M("cuda-threshold-ge", "cuda", CU_SOFTMAX, "if (mx > m + RESCALE_THRESHOLD) {", "if (mx >= m + RESCALE_THRESHOLD) {",
      "Hopper: rescale at a step max of exactly M + 8"),
    M("cuda-threshold-sign", "cuda", CU_SOFTMAX, "if (mx > m + RESCALE_THRESHOLD) {", "if (mx > m - RESCALE_THRESHOLD) {",
      "Hopper: rescale threshold of the wrong sign"),
    M("cuda-o-unzeroed", "cuda", CU_SM90, "    for (int i = 0; i < C::DW / 2; ++i) o[i] = 0.f;\n", "",
      "Hopper: O accumulators never zeroed"),
    M("cuda-sums-unzeroed", "cuda", CU_SM90, "float l_run[2] = {0.f, 0.f};", "float l_run[2];",
      "Hopper: row sums never zeroed"),
    M("cuda-kv-head", "cuda", CU_SM90, "const int kvh = ((int)cta_xy(L).y * hpc) / group;",
      "const int kvh = ((int)cta_xy(L).y * hpc) % p.n_kv_heads;", "Hopper: wrong KV head"),
    M("cuda-portable-kv-head", "cuda", CU_SM80, "const int kvh = ((int)cta_xy(L).y * hpc) / group;",
      "const int kvh = ((int)cta_xy(L).y * hpc) % p.n_kv_heads;", "portable: wrong KV head", env=PORTABLE),
    M("cuda-q-rounded-first", "cuda", CU_LOADERS,
      "for (int e = 0; e < 4; ++e) w[e] = T::pack2(scale * f[2 * e], scale * f[2 * e + 1]);",
      "for (int e = 0; e < 4; ++e) { float a, b; T::unpack2(T::pack2(f[2 * e], f[2 * e + 1]), a, b);"
      " w[e] = T::pack2(scale * a, scale * b); }", "both forms: Q rounded to half before the scale"),
    M("cuda-last-step", "cuda", CU_RANGE, "hi = (lk + STEP - 1) / STEP - 1;",
      "hi = (lk + STEP - 1) / STEP - 2;", "both forms: the last step dropped"),
    M("cuda-partial-step", "cuda", CU_RANGE, "hi = (lk + STEP - 1) / STEP - 1;",
      "hi = lk / STEP - 1;", "both forms: a partial last step dropped"),
    M("cuda-causal-offset", "cuda", CU_RANGE, "hi = (L.flags & FLAG_RIGHT_BOUND) ? min(lk - 1, r + off) : lk - 1;",
      "hi = (L.flags & FLAG_RIGHT_BOUND) ? min(lk - 1, r) : lk - 1;", "both forms: the causal offset dropped in partly visible tiles"),
    M("cuda-right-side", "cuda", CU_RANGE, "return ((p.flags & PREFILL_OFFSET) ? p.offset : lk - lq) + L.window_right;",
      "return ((p.flags & PREFILL_OFFSET) ? p.offset : lk - lq);",
      "every form: a two-sided window's right side dropped from the offset (its band shifted left by it)"),
    M("cuda-left-side", "cuda", CU_RANGE, "lo = L.window_left ? r + off - L.window_left + 1 : 0;",
      "lo = L.window_left ? r + off - L.window_left + 2 : 0;",
      "every form: a window's first column hidden in partly visible tiles"),
    M("cuda-alibi-abs", "cuda", CU_SOFTMAX, "return -slope * fabsf(d);", "return slope * d;",
      "every form: given ALiBi slopes raise the pairs right of the query (causal's sign everywhere)"),
    M("cuda-alibi-batch", "cuda", CU_SOFTMAX, '"r"(p.alibi_batch_stride)', '"r"(0)',
      "every form: every sequence takes the first sequence's ALiBi slopes ([batch, heads])"),
    M("cuda-kv-tail", "cuda", CU_LOADERS, "copy8_f16(dst + (u32)(r * W * 2) + swz(c, r & 7), s, aligned, r < nvalid);",
      "copy8_f16(dst + (u32)(r * W * 2) + swz(c, r & 7), s, aligned, true);", "portable: K/V rows past the cache read",
      env=PORTABLE),
    M("cuda-skip-class2", "cuda", CU_RANGE, "act |= b != 0;", "act |= b == 1;",
      "steps whose table byte is 2 skipped"),
    M("cuda-need-mask", "cuda", CU_RANGE, "nm |= b == 1;", "nm |= b == 2;",
      "the mask tile loaded for the wrong table bytes"),
    M("cuda-window-lane", "cuda", CU_RANGE, "step_bytes = __shfl_sync(0xffffffffu, bytes, f);",
      "step_bytes = __shfl_sync(0xffffffffu, bytes, 0);",
      "both forms: a step's table bytes taken from the window's first step"),
    M("cuda-window-skip", "cuda", CU_RANGE, "base = win + 32;", "base = win + 64;",
      "both forms: the walk past a window with no step to compute skips the next window too"),
    M("cuda-window-row", "cuda", CU_RANGE, "(8 * (ra / bq - tr_first))", "(8 * (ra / bq - tr_first) + 8)",
      "both forms: a row's table byte taken from the next table row"),
    M("cuda-ws-v-step", "cuda", CU_SM90_WS, "fill_v(j - 1, st ^ 1, tp);\n                if (j >= 2)",
      "fill_v(j - 1, st ^ 1, t);\n                if (j >= 2)",
      "Hopper d256 pairs: the producer loads the V of this step where the last one's belongs"),
    M("cuda-ws-pv-stage", "cuda", CU_SM90_WS, "if (act_prev) pv_issue(st ^ 1);", "if (act_prev) pv_issue(st);",
      "Hopper d256 pairs: the last step's P V reads V from this step's stage"),
    M("cuda-ws-act-prev", "cuda", CU_SM90_WS, "act_prev = act;", "act_prev = more;",
      "Hopper d256 pairs: a warpgroup that skipped a step still adds P V (its stale P) after it"),
    M("cuda-ws-act-true", "cuda", CU_SM90_WS, "scores_and_softmax(t, st, sb, act, cls);",
      "scores_and_softmax(t, st, sb, true, cls);",
      "Hopper d256 pairs: a warpgroup that issued no Q K^T this step runs its softmax on the last step's scores",
      equivalent="act is the union test of the warpgroup's rows (wg_computes), so when it is false every warp's own "
      "class is 0 and the softmax sets all its scores to -inf before reading them: the step's max is -inf, "
      "nothing rescales, P is 0 and the sums gain 0; P V is not issued (act_prev keeps the true act). Survived the "
      "H200 run of 2026-12-02 as this predicts; the bug it stands for, P V after a skipped step, is cuda-ws-act-prev"),
    # Hopper d64/d128 pairs: the tiled pipeline (mainloop_sm90_pipe.cuh, pipeline_sm90.cuh).
    M("cuda-pipe-pv-stage", "cuda", CU_PIPE,
      "rescale_o(o, ms);  // while Q K^T runs (O is no product's until P V below)\n        pv(rp.st, pk);",
      "rescale_o(o, ms);  // while Q K^T runs (O is no product's until P V below)\n        pv(r.st, pk);",
      "Hopper d64/d128 pairs: a tile's P V reads V from the next tile's stage"),
    M("cuda-pipe-rescale", "cuda", CU_PIPE,
      "        rescale_o(o, ms);  // while Q K^T runs (O is no product's until P V below)\n", "",
      "Hopper d64/d128 pairs: O not rescaled when a tile moves the running maxima"),
    M("cuda-pipe-last-pv", "cuda", CU_PIPE, "    rescale_o(o, ms);\n    pv(rp.st, pk);\n", "    rescale_o(o, ms);\n",
      "Hopper d64/d128 pairs: the last tile's P V dropped"),
    M("cuda-pipe-tile-bytes", "cuda", CU_PIPE, "tl.sb[h] = (TB)ld_shared_i64(addr + 8 + 8 * h);",
      "tl.sb[h] = (TB)ld_shared_i64(addr + 8);",
      "Hopper d64/d128 pairs: the consumers take a tile's second step's table bytes from its first (the producer's tile hand-over)"),
    M("cuda-pipe-mask-slot", "cuda", CU_PIPE, "load_mask(r.st * PC::NH + h, tl.step(h), lane);",
      "load_mask(r.st * PC::NH, tl.step(h), lane);",
      "Hopper d64/d128 pairs: both steps' mask tiles loaded into the first step's slot (producer-side mask tiles)"),
    M("cuda-pipe-step-class", "cuda", CU_TILE_WALK, "r.cls[h] = rows_class(tl.step(h), tl.sb[h], r.table[h]);",
      "r.cls[h] = rows_class(tl.step(0), tl.sb[h], r.table[h]);",
      "Hopper d64/d128 pairs: a tile's second step takes the description's class of its first"),
    M("cuda-pipe-mask-column", "cuda", CU_TILE_SOFTMAX, "const int j0 = t * STEP + g.tig * 2;",
      "const int j0 = t * STEP;", "Hopper d64/d128 pairs: visibility tested at each quad's first column"),
    M("cuda-pipe-walk-union", "cuda", CU_PIPE_MAIN, "r.we = max(r.we, min(qm * qpc + qpc, r.lq));",
      "r.we = min(qm * qpc + qpc, r.lq);",
      "Hopper d64/d128 query pairs: the walk covers the lower CTA's rows only (the upper one's last steps skipped)"),
    M("cuda-split-share", "cuda", CU_RANGE, "const int share = ((hi - lo) >> log2) + 1;",
      "const int share = (hi - lo) >> log2;", "split-KV: each part's share of the steps one short (steps dropped)"),
    M("cuda-split-part-out", "cuda", CU_RANGE, "    s.o += (i64)part * L.o_split_stride;\n", "",
      "split-KV: every part writes its O to the first part's place in the workspace"),
    M("cuda-merge-sink", "cuda", CU_MERGE, "if (seen && (p.flags & PREFILL_SINKS)) den = expf(sinks[h] - m);", "",
      "split-KV merge: the sink left out of the denominator"),
    M("cuda-merge-seen", "cuda", CU_MERGE, "const bool seen = m > ninf;", "const bool seen = true;",
      "split-KV merge: a row no part saw weighs its parts by e^(-inf + inf)"),
    M("cuda-merge-zero-guard", "cuda", CU_MERGE, "const float inv = den > 0.f ? 1.f / den : 0.f;",
      "const float inv = 1.f / den;", "split-KV merge: a row that sees nothing divided by its zero sum"),
    M("cuda-mask-add", "cuda", CU_SM90, "            if (b == 1) {\n                // -inf where a pair",
      "            if (b == 2) {\n                // -inf where a pair", "Hopper: class-1 work done for class 2"),
    M("cuda-mask-byte", "cuda", CU_SM90, "if (tb == 1) {\n                            unpack_half2",
      "if (tb == 2) {\n                            unpack_half2",
      "Hopper: the mask added where the table byte is 2, not 1"),
    M("cuda-minf-dropped", "cuda", CU_SM90, "for (int i = 0; i < C::NS; ++i) s[i] = -__int_as_float(0x7f800000);",
      "", "Hopper: rows whose byte is 0 in an active warpgroup keep their scores"),
    M("cuda-mask-stride", "cuda", CU_LOADERS, "(i64)qr * p.mask_row_stride", "(i64)qr * p.kv_pad",
      "mask rows at kv_pad instead of mask_row_stride",
      equivalent="the op always sets mask_row_stride = kv_pad, and the GPU machine has no Rust to build a "
      "dispatch by hand (the CPU and Metal kernels are held to the field that way)"),
    M("cuda-out-row", "cuda", CU_SM90, "\n        if (r >= lq) continue;", "\n        if (r > lq) continue;",
      "Hopper: one output row past the prompt written"),
    M("cuda-zero-guard", "cuda", CU_SM90, "const float inv = lt[hh] > 0.f ? o_scale / lt[hh] : 0.f;",
      "const float inv = o_scale / lt[hh];", "Hopper: a fully masked row divides by 0"),
    M("cuda-sums-unrounded", "cuda", CU_SOFTMAX, "    sum += r0 + r1;", "    sum += e0 + e1;",
      "Hopper: row sums of the unrounded P"),
    M("cuda-o-rescale-row", "cuda", CU_SM90, "o[i] *= ms[(i >> 1) & 1];", "o[i] *= ms[(i >> 2) & 1];",
      "Hopper: O rescaled with the other row's factor"),
    M("cuda-barrier-stage", "cuda", CU_SM90, "            __syncthreads();  // step t's tiles are in; the other stage is free\n",
      "", "Hopper, one CTA, d256: missing barrier before the next stage loads"),
    M("cuda-mask-column-512", "cuda", CU_SM90, "ld_shared_u32(row_addr + swz(ch * C::NB + nb, g8))",
      "ld_shared_u32(row_addr + swz(nb, g8))", "Hopper d512: mask columns of the wrong half"),
    # ---------------------------------------------------------------- CUDA: portable (mma.sync) form
    M("cuda-portable-o-rescale", "cuda", CU_SM80, "o[mt][nb][e] *= ms[mt][e >> 1];", "o[mt][nb][e] *= ms[mt][e & 1];",
      "portable: O rescaled with the other row's factor", env=PORTABLE),
    M("cuda-portable-barrier", "cuda", CU_SM80,
      "        __syncthreads();  // K_t and the mask tile are in; V is free (every P V of t-1 done)\n", "",
      "portable: missing barrier after K and the mask tile load", env=PORTABLE),
    M("cuda-portable-p-fragment", "cuda", CU_SM80, "pk[mt][2 * kl][0],\n                                 pk[mt][2 * kl][1],",
      "pk[mt][2 * kl][1],\n                                 pk[mt][2 * kl][0],", "portable: P fragments swapped",
      env=PORTABLE),
    M("cuda-portable-mtile-byte", "cuda", CU_SM80, "const int b1 = mtile_class(1, t, sb, tb1);",
      "const int b1 = mtile_class(0, t, sb, tb1);", "portable: the second m-tile takes the first's class",
      env=PORTABLE),
    M("cuda-portable-out-row", "cuda", CU_SM80, "\n            if (r >= lq) continue;", "\n            if (r > lq) continue;",
      "portable: one output row past the prompt written", env=PORTABLE),
    # ---------------------------------------------------------------- CUDA: tile classifier
    M("cuda-blk-nan-bound", "cuda", B_CU, "mag >= 0x7bffu && mag <= 0x7c00u;", "mag >= 0x7bffu;",
      "NaN bound dropped: a negative NaN counts as masked"),
    M("cuda-blk-last-row", "cuda", B_CU, "const i64 r1 = min((i64)p.rows, r0 + p.bq);",
      "const i64 r1 = min((i64)p.rows, r0 + p.bq - 1);", "a tile's last row ignored (both classifiers)", count=2),
    M("cuda-blk-last-chunk", "cuda", B_CU, "i < total && (masked || zero)", "i < total - 1 && (masked || zero)",
      "a tile's last element (or 16-byte chunk) ignored (both classifiers)", count=4),
    M("cuda-mask-blk-cut-tile", "cuda", B_CU, "bool masked = true, zero = c1 == c0 + p.bk;",
      "bool masked = true, zero = true;", "a tile cut by the cache's end counted as all zero"),
    M("cuda-blk-minus-zero", "cuda", B_CU, "zero = zero && mag == 0u;", "zero = zero && h == 0u;",
      "-0 not counted as zero"),
    # ---------------------------------------------------------------- CPU (Rust): attention
    # prefill_tile.rs is the work item of both ops (the front door's flash_attn_prefill_d*
    # and, through the adapter flash_attn_prefill_tensor.rs, the origin's); the host side
    # (flash_attn_prefill.rs) places each sequence (base offsets, lengths, query offset).
    M("cpu-threshold-ge", "cpu", P_SM, "let thresh = S::add(m_old, S::splat(8.0));",
      "let thresh = S::add(m_old, S::splat(8.0 - 1e-5));", "rescale at a step max of exactly M + 8"),
    M("cpu-threshold-sign", "cpu", P_SM, "let thresh = S::add(m_old, S::splat(8.0));",
      "let thresh = S::sub(m_old, S::splat(8.0));", "rescale threshold of the wrong sign"),
    M("cpu-sums-unzeroed", "cpu", P_MOD, "        *l.add(i) = 0.0;\n", "", "row sums never zeroed"),
    M("cpu-max-unset", "cpu", P_MOD, "        *m.add(i) = -f32::MAX / 2.0;\n", "", "running max never reset"),
    M("cpu-o-unzeroed", "cpu", P_FMA, "    std::ptr::write_bytes(o_b, 0, r * DV);\n", "", "O accumulators never zeroed"),
    # The old cpu-kv-head (heads g, g + n_kv_heads, ...: h % n_kv_heads) needs the head count,
    # which the work item no longer holds (its heads are the group's, consecutive, by
    # construction); the bug's new forms: the wrong KV head, and heads of a group mixed up.
    # (Every loader takes its rows' addresses from pages.rs since paged K/V, issue 29.)
    M("cpu-kv-head", "cpu", P_PAGES, "None => base + g * hs + j * rs,", "None => base + g / 2 * hs + j * rs,",
      "wrong KV head: K/V head g / 2 for the query heads of KV head g"),
    M("cpu-paged-kv-head", "cpu", P_PAGES, "block * bs_stride + g * hs + (j % p.block_size) * rs",
      "block * bs_stride + g / 2 * hs + (j % p.block_size) * rs", "paged K/V: the wrong KV head's rows"),
    M("cpu-paged-table-entry", "cpu", P_PAGES, "p.table.add(seq.table + j / p.block_size)",
      "p.table.add(seq.table + (j + 1) / p.block_size)", "paged K/V: a block's last row read from the next block"),
    M("cpu-paged-span-in-place", "cpu", P_PAGES, "if n == 0 || c0 / p.block_size == (c0 + n - 1) / p.block_size || lo >= hi {",
      "if n == 0 || lo >= hi || true {", "paged K/V: a step that spans blocks read as one block (no gathering)"),
    M("cpu-paged-stage-rows", "cpu", P_PAGES, "stage.as_mut_ptr().add(j * width)", "stage.as_mut_ptr().add((j ^ 1) * width)",
      "paged K/V: gathered rows swapped in pairs"),
    # Quantised K/V (SPEC 11): the vector loader of fma.rs, killed by its unit test against the
    # scalar one (--lib: fma.rs the_vector_kv_loaders_are_the_scalar_one; before it, 2026-12-07,
    # cpu-quant-e5m2-as-e4m3 survived every Rust test).
    M("cpu-quant-e5m2-as-e4m3", "cpu", P_FMA, "Kv::E5M2(f) => S::mul(S::load_e5m2(",
      "Kv::E5M2(f) => S::mul(S::load_e4m3(", "FP8 K/V: E5M2 bytes read as E4M3 (the vector loaders)"),
    M("cpu-quant-q8-block-stride", "cpu", P_FMA, "let b = (row as *const u8).add(col / 32 * 34);",
      "let b = (row as *const u8).add(col / 32 * 32);",
      "Q8_0 K/V: blocks read 32 bytes apart (their scales taken from the values)"),
    # The FP8 widening of simd.rs (each instruction set's lanes against the scalar e4m3_half
    # and the bytes' exact values, for all 256 bytes; killed by its unit tests, --lib).
    M("cpu-quant-e4m3-nan-lost", "cpu", P_SIMD,
      "_mm256_or_si256(_mm256_or_si256(_mm256_slli_epi16::<7>(mag), sign), nan)",
      "_mm256_or_si256(_mm256_slli_epi16::<7>(mag), sign)", "FP8 E4M3: 0x7f / 0xff widened to 480 (no NaN), AVX2 and AVX-512"),
    M("cpu-quant-e4m3-sign-bit", "cpu", P_SIMD,
      "let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(w, _mm256_set1_epi16(0x80)));",
      "let sign = _mm256_slli_epi16::<7>(_mm256_and_si256(w, _mm256_set1_epi16(0x80)));",
      "FP8 E4M3: the sign put in the half's exponent (AVX2 and AVX-512)"),
    M("cpu-quant-e4m3-scale-512", "cpu", P_SIMD,
      "_mm512_mul_ps(_mm512_cvtph_ps(e4m3_halves(p)), _mm512_set1_ps(256.0))",
      "_mm512_mul_ps(_mm512_cvtph_ps(e4m3_halves(p)), _mm512_set1_ps(128.0))",
      "FP8 E4M3: the bias difference 2^8 taken as 2^7 (AVX-512)"),
    M("cpu-quant-e4m3-scalar-nan", "cpu", P_SIMD, "    if mag == 0x7f {", "    if mag == 0x7e {",
      "FP8 E4M3: the scalar widening's NaN moved to 0x7e (the portable lanes)"),
    M("cpu-quant-e5m2-low-byte", "cpu", P_SIMD,
      "_mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)))",
      "_mm256_slli_epi16::<7>(_mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)))",
      "FP8 E5M2: the byte shifted one bit short of the half's top byte (AVX2 and AVX-512)"),
    M("cpu-q-head-in-group", "cpu", P_IO, "let h = g * pb.group + hh;\n            for rb in (0..pb.bq).step_by(W) {",
      "let h = g * pb.group + (hh + 1) % pb.group;\n            for rb in (0..pb.bq).step_by(W) {",
      "GQA: each query head's output from the next head of its group's Q (f32 and bf16-pair loads)", count=2),
    M("cpu-q-rounded-first", "cpu", P_IO, "S::round_half(S::mul(q, scale))", "S::mul(S::round_half(q), scale)",
      "Q rounded to half before the scale"),
    M("cpu-q-bf16-as-f16", "cpu", P_IO, "Elem::BF16 => S::load_bf16((pb.q as *const u16).add(at + dv)),",
      "Elem::BF16 => S::load_f16((pb.q as *const u16).add(at + dv)),", "BF16 Q read as F16"),
    M("cpu-last-step", "cpu", P_FMA, "let steps = seq.lk.div_ceil(C);", "let steps = seq.lk.saturating_sub(1) / C;",
      "the last step dropped (whole or partial)"),
    M("cpu-partial-step", "cpu", P_FMA, "let steps = seq.lk.div_ceil(C);", "let steps = seq.lk / C;",
      "a partial last step dropped (the cache's tail past a multiple of 64)"),
    M("cpu-partial-n", "cpu", P_FMA, "let n = C.min(seq.lk - c0);", "let n = C.min(seq.lk - c0 + 1);",
      "a partial last step one cache row longer (the row at Lk read)"),
    M("cpu-partial-whole", "cpu", P_MOD, "let all = n == C && (", "let all = (",
      "a partial last step every row sees counted whole (columns past the cache's end computed)"),
    M("cpu-k-tail", "cpu", P_FMA, "let x = if j < n { load_kv::<S>(s, dv, kv) } else { S::splat(0.0) };",
      "let x = load_kv::<S>(s, dv, kv);", "K rows past the cache's end read in a partial last step (no value of "
      "them reaches the output: every partial step is hidden element by element; the read faults)"),
    M("cpu-mask-tail", "cpu", P_TR,
      "*dst.add(j) = if j < n { half::f16::from_bits(*src.add(j)).to_f32() } else { f32::NEG_INFINITY };",
      "*dst.add(j) = half::f16::from_bits(*src.add(j)).to_f32();",
      "mask columns past the cache's end read in a partial last step (hidden after; the read faults)"),
    M("cpu-v-tail", "cpu", P_FMA, "let val = if j < n { load_kv::<S>(v.add(j * rs), d0 + x * W, kv) } else { S::splat(0.0) };",
      "let val = load_kv::<S>(v.add(j * rs), d0 + x * W, kv);", "V rows past the cache's end read in a partial last step"),
    M("cpu-row-bound", "cpu", P_MOD, "bq.min(seq.lq - r0) } else { 0 };", "bq.min(seq.lq - r0 + 1) } else { 0 };",
      "one row past the prompt read and written"),
    M("cpu-mask-stride", "cpu", F_RS, "mask_rs: z(p.mask_row_stride),", "mask_rs: u(p.kv_len),",
      "mask rows at kv_len (contiguous) instead of the mask's row stride"),
    M("cpu-k-stride", "cpu", P_PAGES, "let rs = if which == Which::K { pb.k_rs } else { pb.v_rs };",
      "let rs = if which == Which::K { pb.v_rs } else { pb.v_rs };",
      "a step's K rows at V's row stride (16-bit and quantised K/V)", count=2),
    M("cpu-v-head-stride", "cpu", P_PAGES, "Which::V => (seq.v, pb.pages.map_or(0, |p| p.v_bs), pb.v_rs, pb.v_hs),",
      "Which::V => (seq.v, pb.pages.map_or(0, |p| p.v_bs), pb.v_rs, pb.k_hs),", "V heads at K's head stride"),
    M("cpu-q-head-stride", "cpu", P_IO, "(sub.r0 + rr) * pb.q_rs + h * pb.q_hs", "(sub.r0 + rr) * pb.q_rs + h * D",
      "Q heads assumed contiguous (f32 and bf16-pair loads)", count=2),
    M("cpu-column-range", "cpu", P_TR, "(lo & !3, (hi + 3) & !3)", "(lo & !3, hi & !3)",
      "the last cache rows an explicit mask leaves visible in a step left out"),
    M("cpu-describe-range", "cpu", P_MOD, "(dlo & !3, ((dhi + 3) & !3).min(C))", "(dlo & !3, (dhi & !3).min(C))",
      "the last cache rows the description leaves visible in a step left out"),
    M("cpu-max-column", "cpu", P_SM, "for j in lo + 1..hi {", "for j in lo + 2..hi {",
      "one column left out of the step max"),
    M("cpu-rescale-any", "cpu", P_FMA, "rescale[k] = (sub.ib..sub.ie).any(|i| *ms.add(i) != 1.0);",
      "rescale[k] = (sub.ib..sub.ie).all(|i| *ms.add(i) != 1.0);", "O rescaled only when every row moves its max"),
    M("cpu-p-float", "cpu", P_SM, "let p = S::round_half(S::exp(S::sub(S::load(ptr), m_new)));",
      "let p = S::exp(S::sub(S::load(ptr), m_new));", "P kept in float"),
    M("cpu-sums-no-rescale", "cpu", P_SM, "S::fma(S::load(l.add(i0)), scale, sum)", "S::add(S::load(l.add(i0)), sum)",
      "row sums not rescaled"),
    M("cpu-mask-first-head", "cpu", P_TR,
      "    for hh in 0..pb.group {\n        let slope = S::splat(*pb.slopes.add(g * pb.group + hh));\n"
      "        for j in lo..hi {",
      "    for hh in 0..pb.group.min(1) {\n        let slope = S::splat(*pb.slopes.add(g * pb.group + hh));\n"
      "        for j in lo..hi {",
      "the mask added to the first head of a group only"),
    M("cpu-table-row", "cpu", P_MOD, "*pb.blk.add(seq.blk + t * pb.blk_steps + step)", "*pb.blk.add(seq.blk + step)",
      "every query tile reads the first row of the table"),
    M("cpu-table-partial", "cpu", P_MOD, "all_full &= b == FULL;", "all_full &= b != SKIP;",
      "a class-1 table byte taken as 2 (the mask not added)"),
    M("cpu-describe-offset", "cpu", P_MOD, "    let off = seq.off;\n    let (first, last, w)",
      "    let off = seq.lk as i64 - seq.lq as i64;\n    let (first, last, w)",
      "the step classes and ranges ignore an explicit offset (the per-element hiding does not)"),
    M("cpu-describe-window", "cpu", P_MOD, "let lo = if w > 0 { first - w + 1 } else { 0 }.max(c0i);",
      "let lo = if w > 0 { first - w + 2 } else { 0 }.max(c0i);",
      "the first cache row a window shows the tile's first row left out of the step's range"),
    M("cpu-describe-diagonal", "cpu", P_MOD, "c0i + C as i64 - 1 <= first", "c0i + C as i64 - 1 <= last",
      "a step the diagonal cuts counted whole when the tile's last row sees all of it"),
    M("cpu-hide-window", "cpu", P_TR, "(rel + pb.window as i64).clamp(0, bq)", "(rel + pb.window as i64 + 1).clamp(0, bq)",
      "the window one cache row wider"),
    M("cpu-hide-diagonal", "cpu", P_TR, "let a = if pb.right != NO_RIGHT { (rel - pb.right).clamp(0, bq) } else { 0 };",
      "let a = if pb.right != NO_RIGHT { (rel - pb.right + 1).clamp(0, bq) } else { 0 };", "causal: each row misses its own cache row"),
    M("cpu-hide-cache-end", "cpu", P_TR, "let (a, b) = if ja >= seq.lk as i64 {", "let (a, b) = if ja > seq.lk as i64 {",
      "the cache row at Lk left visible in a partial last step"),
    M("cpu-zero-guard", "cpu", P_IO, "let o = if l == 0.0 {", "let o = if l < 0.0 {",
      "a fully masked row divides 0 by 0"),
    M("cpu-out-row", "cpu", P_IO, "let at = seq.o + (sub.r0 + rr) * pb.o_rs + h * pb.o_hs;",
      "let at = seq.o + (sub.r0 + rr + 1) * pb.o_rs + h * pb.o_hs;", "output rows written one row down"),
    M("cpu-o-f16-trunc", "cpu", "rust/src/backend/cpu/simd.rs",
      "_mm256_storeu_si256(p as *mut __m256i, _mm512_cvtps_ph::<NEAREST>(v))",
      "_mm256_storeu_si256(p as *mut __m256i, _mm512_cvtps_ph::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v))",
      "F16 output truncated toward zero, not rounded to nearest even (the AVX-512 store; killed where the CPU "
      "has AVX-512, as the other stores are the half crate's own conversion)"),
    M("cpu-o-bf16-trunc", "cpu", P_IO, "Elem::BF16 => S::store_bf16_nearest(", "Elem::BF16 => S::store_bf16(",
      "BF16 output truncated, not rounded to nearest even"),
    M("cpu-lse-no-max", "cpu", P_IO, "{ m + ls.ln() }", "{ ls.ln() }", "lse without the running max"),
    M("cpu-lse-log2", "cpu", P_IO, "{ m + ls.ln() }", "{ m + ls.log2() }", "lse with log2 of the row sum"),
    M("cpu-lse-row", "cpu", P_IO, "seq.lse + h * pb.lse_hs + sub.r0 + rr", "seq.lse + h * pb.lse_hs + rr",
      "lse rows of every query tile written at the first tile's (both O stores)", count=2),
    M("cpu-live-rows", "cpu", P_TR, "live |= rr < nr && x != f32::NEG_INFINITY;", "live |= x != f32::NEG_INFINITY;",
      "rows past the prompt count as seeing every cache row",
      equivalent="those rows' mask is filled with 0, so they widen a step's computed cache rows only; the "
      "rows left out are -inf for every real row (p = 0 exactly), and leaving them out changes no bit"),
    M("cpu-skip-tile", "cpu", P_MOD, "        if sub.nr == 0 {\n            continue;\n        }\n        let (dc, dlo, dhi)",
      "        let (dc, dlo, dhi)", "query tiles past the prompt computed",
      equivalent="a tile past the prompt has no rows (nr = 0): its table range is empty (SKIP), without a "
      "mask its scores are computed over zero Q and never written"),
    # ---------------------------------------------------------------- CPU (Rust): the AMX item
    # Killed by rust/tests/prefill_amx.rs (the third CPU tier), which runs the AMX item on the
    # emulated tiles (and on the hardware ones where the CPU has them).
    M("amx-rescale-never", "cpu", P_AMX, "if (sub.ib..sub.ie).all(|i| *ms.add(i) == 1.0) {", "if true {",
      "O^T never rescaled when a row's max moves"),
    # (Both softmax forms, SPEC's half P and a bfloat16 model's 16-bit P, hold these two.)
    M("amx-sum-half-pair", "cpu", P_AMX, "sum = S::add(S::add(sum, p0), p1);", "sum = S::add(sum, p0);",
      "the row sum leaves out every odd cache row", count=2),
    M("amx-p-below-range", "cpu", P_AMX, "let (p0, p1) = if j >= sub.lo && j < sub.hi {", "let (p0, p1) = if j < sub.hi {",
      "P of the cache rows below the tile's range (rounding to a chunk of 32) taken from stale scores", count=2),
    M("amx-p16-odd-row", "cpu", P_AMX, "exp2_for_bf16::<S>(S::fma(s1, kl, ml)))",
      "exp2_for_bf16::<S>(S::fma(s0, kl, ml)))", "16-bit P of every odd cache row from the even row's score"),
    M("amx-packed-v-step", "cpu", P_AMX, "part.add(steps * C * dkp + step * DV * C), null);",
      "part.add(steps * C * dkp), null);", "every step's shared V^T packed over the first step's"),
    M("amx-second-product", "cpu", P_AMX, "const TERMS: [(bool, bool); 4] = [(false, false), (false, true),",
      "const TERMS: [(bool, bool); 4] = [(false, false), (false, false),",
      "the second product repeats hi.hi instead of adding hi.lo"),
    M("amx-score-blocks", "cpu", P_AMX, "let (a, b) = (sub.lo & !15, round_up(sub.hi, 16));",
      "let (a, b) = (sub.lo & !15, sub.hi & !15);", "the last block of 16 scores left out where hi is not a multiple of 16"),
    M("amx-output-chunks", "cpu", P_AMX, "let (a, b) = (sub.lo & !31, round_up(sub.hi, 32));\n    let operands",
      "let (a, b) = (sub.lo & !31, (sub.hi & !31).max(a + 32));\n    let operands",
      "P.V's last chunk of 32 cache rows left out where hi is not a multiple of 32"),
    M("amx-v-tail", "cpu", P_LAYOUT, "let row = |j: usize, d0: usize| if j < n {", "let row = |j: usize, d0: usize| if true {",
      "V rows past the cache's end read in a partial last step (0 x NaN)"),
    M("amx-k-pad-columns", "cpu", P_LAYOUT, "let x = if j < n && d0 < DK {", "let x = if j < n && d0 < DK + 16 {",
      "K's columns past DK (80, 112) read from the next head instead of zero"),
    M("amx-split-rounded", "cpu", P_LAYOUT, "    let hi = S::trunc_bf16(x);\n", "    let hi = S::round_bf16(x);\n",
      "both parts of a split taken with the nearest bfloat16 as the high part",
      equivalent="any exact split serves where both parts are multiplied: hi + lo is x either way, and "
      "with every product of the parts summed (the defaults) only the f32 additions' rounding moves"),
    M("amx-accumulate-never", "cpu", AMX_GEMM, "    if p.accumulate {\n", "    if false {\n",
      "the output tiles start from zero every step instead of O^T"),
    M("amx-gemm-block", "cpu", AMX_GEMM, "t.dot_bf16::<3, 5, 7>();", "t.dot_bf16::<3, 5, 6>();",
      "the fourth block of C takes the first B block"),
    M("amx-emu-odd-b", "cpu", AMX_EMU, "temp[2 * n + 1] = fma_bf16(a1, half(bw, true), temp[2 * n + 1]);",
      "temp[2 * n + 1] = fma_bf16(a1, half(bw, false), temp[2 * n + 1]);", "the emulated TDPBF16PS pairs an odd A with an even B"),
    M("amx-emu-daz", "cpu", AMX_EMU, "    if b & 0x7f80_0000 == 0 {\n", "    if b & 0x7f80_0000 == 0x7f80_0000 {\n",
      "the emulation flushes infinities and NaN, not denormals"),
    M("amx-bf16-default", "cpu", AMX_MOD, "pub const DEFAULT_BF16: Products = Products { qk: 2, pv: 2 };",
      "pub const DEFAULT_BF16: Products = Products { qk: 1, pv: 1 };", "BF16 K/V with Q and P rounded to bfloat16 by default"),
    M("amx-f16-default", "cpu", AMX_MOD, "pub const DEFAULT_F16: Products = Products { qk: 4, pv: 4 };",
      "pub const DEFAULT_F16: Products = Products { qk: 3, pv: 3 };", "F16 K/V without lo.lo by default (scores off by "
      "2^-14 of their size: P's half rounding differs from SPEC's)"),
    # ---------------------------------------------------------------- CPU (Rust): host side
    M("cpu-offset-dropped", "cpu", F_RS, "} else {\n            lk as i64 - lq as i64\n        }",
      "} else {\n            0\n        }",
      "causal without the offset lk - lq (the prompt at the cache's start)"),
    M("cpu-offset-ignored", "cpu", F_RS, "if has(PREFILL_OFFSET) {\n            p.offset as i64\n",
      "if has(PREFILL_OFFSET) {\n            lk as i64 - lq as i64\n", "an explicit query offset ignored"),
    M("cpu-offset-flag-ignored", "cpu", F_RS, "if has(PREFILL_OFFSET) {\n            p.offset as i64\n",
      "if true {\n            p.offset as i64\n", "the block's offset used without PREFILL_OFFSET"),
    M("cpu-varlen-q-start", "cpu", F_RS, "q: q0 * pb.q_rs,", "q: k0 * pb.q_rs,",
      "variable length: Q of a sequence from its cu_seqlens_k row"),
    M("cpu-varlen-v-start", "cpu", F_RS, "v: k0 * pb.v_rs,", "v: q0 * pb.v_rs,",
      "variable length: V of a sequence from its cu_seqlens_q row"),
    M("cpu-varlen-lse-start", "cpu", F_RS, "lse: q0,", "lse: k0,", "variable length: lse of a sequence at its cu_seqlens_k row"),
    M("cpu-varlen-lk", "cpu", F_RS, "let (lq, lk) = (cq[b + 1] - q0, ck[b + 1] - k0);",
      "let (lq, lk) = (cq[b + 1] - q0, ck[b + 1] - q0.min(k0));", "variable length: a cache length from the wrong start"),
    M("cpu-k-batch-stride", "cpu", F_RS, "k: b * z(p.k_batch_stride) * kvu,", "k: b * z(p.v_batch_stride) * kvu,",
      "K's sequences at V's batch stride"),
    M("cpu-o-batch-stride", "cpu", F_RS, "o: b * z(p.o_batch_stride),", "o: b * z(p.q_batch_stride),",
      "O's sequences at Q's batch stride"),
    M("cpu-lse-batch-stride", "cpu", F_RS, "lse: b * z(p.lse_batch_stride),", "lse: b * z(p.lse_head_stride) * nh,",
      "lse's batch stride taken as heads x head stride"),
    M("cpu-mask-batch-stride", "cpu", F_RS, "mask: b * z(p.mask_batch_stride),", "mask: 0,",
      "the mask's batch stride ignored (every sequence reads mask 0)"),
    M("cpu-blk-batch-stride", "cpu", F_RS, "blk: b * z(p.blk_batch_stride),", "blk: 0,",
      "the table's batch stride ignored (every sequence reads table 0)"),
    M("cpu-mask-blk-cut-tile", "cpu", F_RS, "                    ZERO if j1 - j0 < bk => MIXED,\n", "",
      "a tile of zeros cut by the cache's end counted as all zero"),
    M("cpu-mask-blk-batch-stride", "cpu", F_RS, "m.0.add(b * mbs as usize + r * mrs as usize + j0)",
      "m.0.add(r * mrs as usize + j0)", "the classifier ignores the masks' batch stride"),
    M("cpu-mask-blk-last-row", "cpu", F_RS, "let r1 = (r0 + bq).min(rows);", "let r1 = (r0 + bq - 1).min(rows);",
      "the classifier of a batch ignores a full tile's last row"),
    M("cpu-mask-blk-last-column", "cpu", F_RS, "let j1 = (kt * bk + bk).min(kv_len);", "let j1 = (kt * bk + bk - 1).min(kv_len);",
      "the classifier of a batch ignores a tile's last column"),
    # ---------------------------------------------------------------- CPU (Rust): tile classifier
    M("cpu-blk-nan-bound", "cpu", B_RS, "u16::from(mag.wrapping_sub(0x7bff) > 1)", "u16::from(mag < 0x7bff)",
      "NaN bound dropped: a negative NaN counts as masked"),
    M("cpu-blk-last-row", "cpu", B_RS, "let r1 = (r0 + bq).min(rows);", "let r1 = (r0 + bq - 1).min(rows);",
      "a full tile's last row ignored"),
    M("cpu-blk-early-exit", "cpu", B_RS, "        if !all_masked && !all_zero {\n            return MIXED;\n        }\n    }\n    if all_masked {\n        SKIP\n    } else if all_zero {\n        ZERO\n    } else {\n        MIXED\n    }\n}\n\n/// The class of one tile",
      "        if !all_masked || !all_zero {\n            return MIXED;\n        }\n    }\n    if all_masked {\n        SKIP\n    } else if all_zero {\n        ZERO\n    } else {\n        MIXED\n    }\n}\n\n/// The class of one tile",
      "a tile mixed as soon as one class fails"),
    M("cpu-blk-sign", "cpu", B_RS, "not_masked |= u16::from(h & 0x8000 == 0) | u16::from(", "not_masked |= u16::from(",
      "+inf counts as masked"),
    M("cpu-blk-minus-zero", "cpu", B_RS, "not_zero |= mag;", "not_zero |= h;", "-0 not counted as zero"),
    M("cpu-blk-65504", "cpu", B_RS, "mag.wrapping_sub(0x7bff) > 1", "mag.wrapping_sub(0x7c00) > 0",
      "-65504 not counted as masked"),
]

# ---------------------------------------------------------------- SPEC 10 (score transforms)
# Killed by tests/test_metal_emulator_transforms.py (softcap, ALiBi, sinks in the Metal kernels).
MUTATIONS += [
    M("metal-sink-out-of-sum", "metal", T_METAL, "const float sum = s_run[i] * f + exp(sigma - mf);",
      "const float sum = s_run[i] * f;", "the sink raises the max but is left out of the sum"),
    M("metal-alibi-slope-dropped", "metal", T_METAL, "s0 += dslope * float(-abs(c + int(lane) - (r + offset)));",
      "s0 += float(-abs(c + int(lane) - (r + offset)));", "ALiBi's distance without the head's slope (even columns)"),
    M("metal-softcap-before-scale", "metal", T_METAL, "s1 = softcap * precise::tanh(s1 / softcap);",
      "s1 = precise::tanh(s1 / softcap);", "softcap's tanh not scaled back (odd columns)"),
]


# ---------------------------------------------------------------- Metal: paged K/V (SPEC 11)
# The paged entry points' loaders (kv_walk, paged_row): K in sub-tiles of 16 rows in place in
# their blocks, V gathered a slice of columns at a time through the table. Killed by
# tests/test_metal_emulator_paged.py (bit-identity with the contiguous layout, NaN outside
# every sequence's rows) and its entry-point cases in tests/test_metal_emulator_coverage.py.
MUTATIONS += [
    M("metal-paged-table-entry", "metal", T_METAL, "cache + ulong(table[j / block_size]) * ulong(block_stride)",
      "cache + ulong(table[(j + 1) / block_size]) * ulong(block_stride)", "paged K/V: a block's last row read from the next block"),
    M("metal-paged-row-in-block", "metal", T_METAL, "ulong(j % block_size) * ulong(row_stride) + head;",
      "ulong(j % 16) * ulong(row_stride) + head;", "paged K/V: rows placed in a block as if blocks held 16"),
    M("metal-paged-k-head", "metal", T_METAL, "const ulong k_head_at = ulong(g) * ulong(pg.k_head_stride);",
      "const ulong k_head_at = ulong(g) * ulong(pg.v_head_stride);", "paged K/V: K heads at V's head stride"),
    M("metal-paged-v-head", "metal", T_METAL, "const ulong v_head_at = ulong(g) * ulong(pg.v_head_stride);",
      "const ulong v_head_at = ulong(0) * ulong(pg.v_head_stride);", "paged K/V: every query head reads KV head 0's V"),
    M("metal-paged-k-subtile", "metal", T_METAL, "const int j = c + sub * PAGE_ROWS;", "const int j = c;",
      "paged K/V: every sub-tile of a step's K reads the step's first rows"),
    M("metal-paged-k-row-stride", "metal", T_METAL, "array<int32_t, 2>({1, int32_t(pg.k_row_stride)}));",
      "array<int32_t, 2>({1, int32_t(pg.v_row_stride)}));", "paged K/V: K rows at V's row stride"),
    M("metal-paged-v-slice", "metal", T_METAL, "sv[e] = row[w * VW + e % VW];", "sv[e] = row[e % VW];",
      "paged K/V: every slice of O gathers V's first columns"),
    M("metal-paged-v-barrier", "metal", T_METAL,
      "                threadgroup_barrier(mem_flags::mem_threadgroup);\n                typename walk::v_tensor tv(",
      "                typename walk::v_tensor tv(",
      "paged and quantised K/V: the product reads V's slice before every thread has gathered it"),
    M("metal-paged-length", "metal", T_METAL, "        lk = seqused_k[b];", "        lk = p.kv_len;",
      "paged K/V: every sequence's cache taken as the longest's (fixed-length queries)"),
    M("metal-paged-o-slice-col", "metal", T_METAL, "const int col = w * walk::width + idx[0];", "const int col = idx[0];",
      "paged K/V: every slice of O written over the first"),
]


# ---------------------------------------------------------------- Metal: quantised K/V (SPEC 11)
# The _kvq entry points' widening (fp8_to_half, kv_value) and walk (K sub-tiles over the
# scores' memory, V slices, the descale factors). Killed by tests/test_metal_emulator_quant.py
# (bit-identity with the F16 kernel on the same values, every finite FP8 byte, descale per KV
# head against the reference) and the _kvq cases of tests/test_metal_emulator_coverage.py.
MUTATIONS += [
    M("metal-kvq-e4m3-scale", "metal", T_METAL, "(ushort(x & 0x7f) << 7)) * half(256.0f);",
      "(ushort(x & 0x7f) << 7)) * half(128.0f);", "E4M3 widened to half its value"),
    M("metal-kvq-e4m3-sign", "metal", T_METAL, "return (x & 0x80) != 0 ? -m : m;", "return m;",
      "E4M3: negative values widened as positive"),
    M("metal-kvq-e5m2-shift", "metal", T_METAL, "return as_type<half>(ushort(ushort(x) << 8));",
      "return as_type<half>(ushort(ushort(x) << 7));", "E5M2 read as a half's bits one place too low"),
    M("metal-kvq-q8-scale-bytes", "metal", T_METAL, "ushort(ushort(blk[0]) | ushort(ushort(blk[1]) << 8))",
      "ushort(ushort(blk[1]) | ushort(ushort(blk[0]) << 8))", "Q8_0: the block's F16 scale read big-endian"),
    M("metal-kvq-q8-block-bytes", "metal", T_METAL, "device const uchar * blk = row + (i / 32) * 34;",
      "device const uchar * blk = row + (i / 32) * 32;", "Q8_0: blocks taken as 32 bytes, not 34"),
    M("metal-kvq-q8-unsigned", "metal", T_METAL, "float(as_type<char>(blk[2 + i % 32]))", "float(blk[2 + i % 32])",
      "Q8_0: the int8 values read as unsigned"),
    M("metal-kvq-k-subtile-rows", "metal", T_METAL, "const int j = c + subs * KR + e / DK;", "const int j = c + e / DK;",
      "quantised K/V: every sub-tile of a step's K widened from the step's first rows"),
    M("metal-kvq-k-subtile-store", "metal", T_METAL, "csub[sub].store(tg_float_tensor(ss + sub * KR,",
      "csub[sub].store(tg_float_tensor(ss,", "quantised K/V: every sub-tile's scores stored over the first's"),
    M("metal-kvq-k-descale", "metal", T_METAL, "float s0 = ss[row * C + lane] * kd;", "float s0 = ss[row * C + lane];",
      "FP8: K's descale factor left off the even columns' scores"),
    M("metal-kvq-v-descale", "metal", T_METAL, "0.0f : co[i] / s * vd);", "0.0f : co[i] / s);",
      "FP8: V's descale factor left off the output"),
    M("metal-kvq-v-descale-index", "metal", T_METAL, "descale[p.n_kv_heads + g]", "descale[g]",
      "FP8: V's factors read from K's"),
    M("metal-kvq-entry-d128", "metal", T_METAL, "INSTANTIATE_PREFILL_KVQ(d128_kvq, 128, 128, 32)",
      "INSTANTIATE_PREFILL_KVQ(d128_kvq, 128, 128, 16)",
      "flash_attn_prefill_d128_kvq: 16 query rows per threadgroup where the op's tiles have 32"),
]

# ---------------------------------------------------------------- CUDA: quantised K/V (SPEC 11)
# The quant modules' loaders (loaders.cuh: fp8x4_to_f16, quant16_to_f16) and the descale
# factors folded into the mainloops. Killed on a GPU by tests/test_cuda_quant.py (FP8 to the
# bit against F16 on every finite byte, descale one to the bit, against the reference with
# factors and Q8_0; the whole file is slow: `--select` narrows it, docs/reliability.md).
FP8_INT = {"MLX_NATIVE_CUDA_DEFINES": "-DMLXN_FP8_CVT_INT=1"}  # the widening sm_80 runs
MUTATIONS += [
    M("cuda-kvq-e4m3-cvt-halves", "cuda", CU_LOADERS, "mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l;",
      "mov.b32 {h, l}, %2; cvt.rn.f16x2.e4m3x2 %0, l;", "E4M3 (sm_89+): a word's two byte pairs widened in swapped places"),
    M("cuda-kvq-e4m3-int-scale", "cuda", CU_LOADERS, "u32 h = hmul2(mag, 0x5c005c00u) | sign;",
      "u32 h = hmul2(mag, 0x58005800u) | sign;", "E4M3 (the integer widening): values times 128, not 256",
      env=FP8_INT),
    M("cuda-kvq-q8-block-bytes", "cuda", CU_LOADERS, "const u8* blk = row + (c2 >> 1) * 34;",
      "const u8* blk = row + (c2 >> 1) * 32;", "Q8_0: blocks taken as 32 bytes, not 34"),
    M("cuda-kvq-q8-half-block", "cuda", CU_LOADERS, "const u8* qs = blk + 2 + (c2 & 1) * 16;",
      "const u8* qs = blk + 2;", "Q8_0: a block's second 16 values read from its first"),
    M("cuda-kvq-k-descale-hopper", "cuda", CU_SM90, "for (int i = 0; i < C::NS; ++i) s[i] *= kd;",
      "for (int i = 1; i < C::NS; ++i) s[i] *= kd;", "Hopper form: K's descale factor left off a score register"),
    M("cuda-kvq-v-descale-portable", "cuda", CU_SM80, "o_scale / lt[mt][hh] * vdescale(p, L, kvh) : 0.f;",
      "o_scale / lt[mt][hh] : 0.f;", "portable form: V's descale factor left off the output", env=PORTABLE),
]

# ---------------------------------------------------------------- issue 27's coverage gaps
# Each a plausible one-line slip in code that no test reached before (the four classes of
# issue 27); killed by tests/test_metal_emulator_coverage.py. The entry-point slips sit in
# the six prefill kernels no test dispatched: one per kernel, each a template argument of
# its neighbour's (query rows per threadgroup, or a head dim).
_ENTRY = "INSTANTIATE_PREFILL"  # one line per entry point (shaders/flash_attn_prefill_tensor.metal)
MUTATIONS += [
    M("metal-alibi-past-n2", "metal", T_METAL, "float(2 * (h - n2) + 1)", "float(h - n2 + 1)",
      "ALiBi: heads past n2 with slope m1^(h - n2 + 1), not m1^(2 (h - n2) + 1) (the same at 3 heads)"),
    M("metal-entry-d80", "metal", T_METAL, f"{_ENTRY}(d80, 80, 80, 32, half)", f"{_ENTRY}(d80, 80, 80, 16, half)",
      "flash_attn_prefill_d80: 16 query rows per threadgroup where the op's tiles have 32"),
    M("metal-entry-d112", "metal", T_METAL, f"{_ENTRY}(d112, 112, 112, 32, half)", f"{_ENTRY}(d112, 112, 96, 32, half)",
      "flash_attn_prefill_d112: V and O of 96 columns (d96's)"),
    M("metal-entry-d192", "metal", T_METAL, f"{_ENTRY}(d192, 192, 192, 32, half)", f"{_ENTRY}(d192, 128, 192, 32, half)",
      "flash_attn_prefill_d192: Q and K of 128 columns (d128's)"),
    M("metal-entry-d96-bf16", "metal", T_METAL, f"{_ENTRY}(d96_bf16, 96, 96, 32, bfloat)", f"{_ENTRY}(d96_bf16, 80, 80, 32, bfloat)",
      "flash_attn_prefill_d96_bf16: the body of d80"),
    M("metal-entry-d256-bf16", "metal", T_METAL, f"{_ENTRY}(d256_bf16, 256, 256, 32, bfloat)", f"{_ENTRY}(d256_bf16, 256, 256, 16, bfloat)",
      "flash_attn_prefill_d256_bf16: 16 query rows per threadgroup (d512's) where the op's tiles have 32"),
    M("metal-entry-d576-bf16", "metal", T_METAL, f"{_ENTRY}(d576_512_bf16, 576, 512, 16, bfloat)", f"{_ENTRY}(d576_512_bf16, 512, 512, 16, bfloat)",
      "flash_attn_prefill_d576_512_bf16: Q and K of 512 columns (d512's)"),
    M("metal-o-bf16-nan", "metal", T_METAL,
      "    if ((u & 0x7fffffffu) > 0x7f800000u) {\n        return ushort((u >> 16) | 0x0040u);\n    }\n", "",
      "BF16 output: NaN rounded like a number (a full payload carries into the sign: -0 or +0)"),
    M("metal-q-bf16-via-half", "metal", T_METAL, "return float4(float(x[0]), float(x[1]), float(x[2]), float(x[3]));",
      "return float4(half4(float(x[0]), float(x[1]), float(x[2]), float(x[3])));",
      "BF16 Q widened through half before the scale (inf past 65504, subnormals below 2^-14)"),
    # The same classes in the CUDA kernels (killed by tests/test_kernel_coverage.py on a GPU):
    # the slope and Q's load are shared by every form; the entry points are those of head
    # dims that only that file's tests dispatch (96, 112, 192: the portable form everywhere).
    M("cuda-alibi-past-n2", "cuda", CU_SOFTMAX, "0.5f * (float)(2 * (h - n2) + 1)", "0.5f * (float)(h - n2 + 1)",
      "both forms: ALiBi's heads past n2 with slope m1^(h - n2 + 1) (the same at 3 heads)"),
    M("cuda-q-bf16-via-half", "cuda", CU_LOADERS,
      "                f[2 * e + 1] = bf16_bits_to_float(r[e] >> 16);\n",
      "                f[2 * e + 1] = bf16_bits_to_float(r[e] >> 16);\n"
      "                unpack_half2(pack_half2(f[2 * e], f[2 * e + 1]), f[2 * e], f[2 * e + 1]);\n",
      "both forms: BF16 Q widened through half before the scale"),
    M("cuda-entry-d96", "cuda", "shaders/flash_attn_prefill_d96.cu", "(flash_attn_prefill_d96, 96, 96, ElemF16)",
      "(flash_attn_prefill_d96, 96, 96, ElemBF16)", "flash_attn_prefill_d96 (and _xf): F16 K/V read as BF16"),
    M("cuda-entry-d112-bf16", "cuda", "shaders/flash_attn_prefill_d112.cu", "(flash_attn_prefill_d112_bf16, 112, 112, ElemBF16)",
      "(flash_attn_prefill_d112_bf16, 112, 112, ElemF16)", "flash_attn_prefill_d112_bf16 (and _xf): BF16 K/V read as F16"),
    M("cuda-entry-d192", "cuda", "shaders/flash_attn_prefill_d192.cu", "(flash_attn_prefill_d192, 192, 192, ElemF16)",
      "(flash_attn_prefill_d192, 192, 192, ElemBF16)", "flash_attn_prefill_d192 (and _xf): F16 K/V read as BF16"),
]


# ---------------------------------------------------------------------------- applying


def source_text(m: Mutation, root: Path = REPO) -> str:
    return (root / m.file).read_text()


def applies(m: Mutation, root: Path = REPO) -> Optional[str]:
    """None if the mutation applies as recorded, else why not."""
    n = source_text(m, root).count(m.original)
    if n != m.count:
        return f"{m.file}: the original text occurs {n} times, {m.count} recorded: {m.original[:70]!r}"
    return None


def mutated_text(m: Mutation, root: Path = REPO) -> str:
    src = source_text(m, root)
    out = src.replace(m.original, m.replacement)
    assert out != src
    return out


# ---------------------------------------------------------------------------- running


@dataclass
class Result:
    name: str
    family: str
    status: str  # killed | survived | equivalent | stale | no-compile | compiled | timeout | error
    seconds: float = 0.0
    killer: str = ""
    detail: str = ""


def _run(cmd, env, cwd=REPO, timeout=None):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out, time.time() - t0


def _pytest_killer(out: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return m.group(1) if m else "(pytest failed)"


def _cargo_killer(out: str) -> str:
    m = re.search(r"^test (\S+) \.\.\. FAILED", out, re.M) or re.search(r"^---- (\S+) stdout ----", out, re.M)
    if m:
        return m.group(1)
    # A test binary killed by a signal (a read past a guarded buffer: SIGSEGV).
    m = re.search(r"deps/(\w+?)-[0-9a-f]+ .*\(signal: \d+, (\w+)", out)
    if m:
        return f"{m.group(1)} ({m.group(2)})"
    m = re.search(r"error(?:\[E\d+\])?: .*", out)
    return m.group(0)[:80] if m else "(cargo test failed)"


METAL_TESTS = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_metal_emulator_prefill.py",
               "tests/test_metal_emulator.py", "tests/test_metal_emulator_transforms.py",
               "tests/test_metal_emulator_coverage.py", "tests/test_metal_emulator_paged.py",
               "tests/test_metal_emulator_quant.py", "-k", "not caught and not test_emulator_"]  # fmt: skip


def _select(cmd: List[str], args) -> List[str]:
    """The pytest command with `--select EXPR` added to its -k expression."""
    if not args.select:
        return cmd
    i = cmd.index("-k") + 1
    return cmd[:i] + [f"({cmd[i]}) and ({args.select})"] + cmd[i + 1 :]


def run_metal(muts: List[Mutation], args) -> List[Result]:
    METAL = _select(METAL_TESTS, args)
    sys.path.insert(0, str(REPO / "tests"))
    import metal_emu  # noqa: E402

    scratch = Path(tempfile.mkdtemp(prefix="mlxn-metal-mutants-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rc, out, dt = _run(METAL, env, timeout=args.timeout)
    if rc != 0:
        sys.exit(f"the Metal emulator tests fail on the unmutated sources:\n{out[-3000:]}")
    print(f"baseline: emulator tests pass ({dt:.0f} s)", flush=True)
    results = []
    for m in muts:
        d = scratch / m.name
        d.mkdir()
        # The backend looks a replaced file up by its name relative to shaders/ (a part of
        # the CUDA kernel is flash_attn_prefill/<part>.cuh).
        target = d / Path(m.file).relative_to("shaders")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(mutated_text(m))
        sources = {name: (d / name if (d / name).exists() else path).read_text() for name, path in metal_emu.SHADER_FILES.items()}
        try:
            metal_emu.build(scratch / "build", sources)
        except metal_emu.EmulatorError as e:
            results.append(Result(m.name, m.family, "no-compile", detail=str(e)[-500:]))
            report(results[-1])
            continue
        rc, out, dt = _run(METAL, {**env, "MLXN_METAL_SHADER_DIR": str(d)}, timeout=args.timeout)
        status = "timeout" if rc is None else ("survived" if rc == 0 else "killed")
        results.append(Result(m.name, m.family, status, dt, _pytest_killer(out) if rc else ""))
        report(results[-1])
    shutil.rmtree(scratch, ignore_errors=True)
    return results


CPU_TIERS = [
    ["cargo", "test", "-q", "--test", "prefill_cpu", "--test", "planted", "--test", "flash_attn_cpu", "--test",
     "prefill_paged"],
    ["cargo", "test", "-q", "--test", "fuzz", "--test", "reliability", "--lib"],
    # The AMX item, on the emulated tiles wherever the CPU has none.
    ["cargo", "test", "-q", "--test", "prefill_amx"],
]


def _scratch_crate(where: Path) -> Path:
    """A copy of the crate (Cargo.toml, Cargo.lock, README.md, rust/, shaders/) at `where`,
    refreshed from the working tree; its target folder is kept."""
    tree = where / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    # Fresh modification times (shutil.copy, not copy2): the kept target folder may hold the
    # last mutant's build, newer than the sources' own times.
    for f in ("Cargo.toml", "Cargo.lock", "README.md"):
        shutil.copy(REPO / f, tree / f)
    for d in ("rust", "shaders"):
        shutil.copytree(REPO / d, tree / d, copy_function=shutil.copy)
    return tree


#: --cpu-tiers lib: the library's unit tests alone (the FP8 / Q8_0 loaders' and the paged
#: walk's are there).
CPU_LIB_TIER = [["cargo", "test", "-q", "--lib"]]


def run_cpu(muts: List[Mutation], args) -> List[Result]:
    where = Path(args.scratch or Path(tempfile.gettempdir()) / "mlxn-cpu-mutants")
    tree = _scratch_crate(where)
    env = {**os.environ, "CARGO_TARGET_DIR": str(where / "target"), "CARGO_TERM_COLOR": "never"}
    tiers = CPU_LIB_TIER if getattr(args, "cpu_tiers", "all") == "lib" else CPU_TIERS
    for tier in tiers:
        rc, out, dt = _run(tier, env, cwd=tree, timeout=args.timeout)
        if rc != 0:
            sys.exit(f"{' '.join(tier)} fails on the unmutated sources:\n{out[-3000:]}")
        print(f"baseline: {' '.join(tier[3:])} pass ({dt:.0f} s)", flush=True)
    results = []
    for m in muts:
        path = tree / m.file
        original = path.read_text()
        path.write_text(mutated_text(m))
        try:
            t0, status, killer = time.time(), "survived", ""
            for tier in tiers:
                rc, out, _ = _run(tier, env, cwd=tree, timeout=args.timeout)
                if rc is None:
                    status, killer = "timeout", " ".join(tier[3:])
                    break
                if rc != 0:
                    if "could not compile" in out and "error" in out and "test result" not in out:
                        status, killer = "no-compile", _cargo_killer(out)
                    else:
                        status, killer = "killed", _cargo_killer(out)
                    break
            results.append(Result(m.name, m.family, status, time.time() - t0, killer))
        finally:
            path.write_text(original)
        report(results[-1])
    return results


WARM = r"""
import numpy as np, mlx_native as mx
dev = mx.Device("cuda")
rng = np.random.default_rng(0)
for hd in (256, 512):
    q = rng.uniform(-1, 1, (20, 2, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, (70, 1, hd)).astype(np.float16)
    mx.flash_attn_prefill(q, k, k, causal=True, device=dev)
print("WARM OK")
"""

CUDA_TESTS = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_planted.py",
              "tests/test_correctness.py", "tests/test_cuda.py", "tests/test_cuda_split_kv.py",
              "tests/test_kernel_coverage.py", "tests/test_cuda_quant.py",
              "-k", "cuda and not source_dir and not compile and not torch and not cupy and not wrap and not forced"
              " and not entry_point_is_launched"]  # fmt: skip


def _cuda_env(m: Optional[Mutation], d: Optional[Path], cache: Path) -> dict:
    env = {**os.environ, "MLX_NATIVE_CUDA_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    env.pop("MLX_NATIVE_CUDA_SOURCE_DIR", None)
    if d is not None:
        env["MLX_NATIVE_CUDA_SOURCE_DIR"] = str(d)
    if m is not None:
        env.update(m.env)
    return env


def _arch(m: Mutation) -> str:
    return m.env.get("MLX_NATIVE_CUDA_ARCH", "sm_90a")


def run_cuda(muts: List[Mutation], args) -> List[Result]:
    CUDA = _select(CUDA_TESTS, args)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="mlxn-cuda-mutants-"))
    scratch.mkdir(parents=True, exist_ok=True)
    cache = scratch / "cubins"
    dirs = {}
    for m in muts:
        d = scratch / m.name
        d.mkdir(exist_ok=True)
        # The backend looks a replaced file up by its name relative to shaders/ (a part of
        # the CUDA kernel is flash_attn_prefill/<part>.cuh).
        target = d / Path(m.file).relative_to("shaders")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(mutated_text(m))
        dirs[m.name] = d
    jobs = args.jobs or os.cpu_count() or 1

    if args.compile_only:
        check = "import mlx_native as mx, sys; mx.cuda_compile_check(sys.argv[1]); print('COMPILED')"

        def one(m):
            rc, out, dt = _run([sys.executable, "-c", check, _arch(m)], _cuda_env(m, dirs[m.name], cache), timeout=args.timeout)
            ok = rc == 0 and "COMPILED" in out and f"in place of the built-in {Path(m.file).relative_to('shaders')}" in out
            return Result(m.name, m.family, "compiled" if ok else "no-compile", dt, detail="" if ok else out[-800:])

        results = []
        with cf.ThreadPoolExecutor(jobs) as pool:
            for r in pool.map(one, muts):
                results.append(r)
                report(r)
        return results

    # On a GPU: the knob must be honoured (a broken source fails), and the baseline pass.
    broken = scratch / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "flash_attn_prefill_tensor.cu").write_text('#error "planted"\n')
    rc, out, _ = _run([sys.executable, "-c", WARM], _cuda_env(None, broken, cache), timeout=args.timeout)
    if rc == 0 or "planted" not in out:
        sys.exit(f"MLX_NATIVE_CUDA_SOURCE_DIR is not honoured by the installed library:\n{out[-2000:]}")
    rc, out, dt = _run(CUDA, _cuda_env(None, None, cache), timeout=args.timeout)
    if rc != 0:
        sys.exit(f"the CUDA tests fail on the unmutated sources:\n{out[-3000:]}")
    print(f"baseline: CUDA tests pass ({dt:.0f} s)", flush=True)
    # Compile every mutant, in parallel, into the private cache (one module per file and arch).
    compiled = {}

    def warm(m):
        rc, out, dt = _run([sys.executable, "-c", WARM], _cuda_env(m, dirs[m.name], cache), timeout=args.timeout)
        return m.name, rc == 0 and "WARM OK" in out, out

    t0 = time.time()
    with cf.ThreadPoolExecutor(jobs) as pool:
        for name, ok, out in pool.map(warm, muts):
            compiled[name] = (ok, out)
    print(f"compiled {len(muts)} mutants in {time.time() - t0:.0f} s", flush=True)

    def test(m):
        ok, out = compiled[m.name]
        if not ok:
            # A mutant that cannot run the warm-up dispatch: a compile error, or killed by it.
            status = "no-compile" if "ShaderCompilationError" in out else "killed"
            return Result(m.name, m.family, status, 0.0, "warm-up dispatch", out[-500:])
        rc, out, dt = _run(CUDA, _cuda_env(m, dirs[m.name], cache), timeout=args.timeout)
        status = "timeout" if rc is None else ("survived" if rc == 0 else "killed")
        return Result(m.name, m.family, status, dt, _pytest_killer(out) if rc else "")

    results = []
    with cf.ThreadPoolExecutor(args.gpu_jobs) as pool:
        for r in pool.map(test, muts):
            results.append(r)
            report(r)
    return results


# ---------------------------------------------------------------------------- reporting


def report(r: Result) -> None:
    print(f"  {r.name:28} {r.status:10} {r.seconds:6.1f} s  {r.killer}", flush=True)
    if r.detail and r.status in ("no-compile", "error"):
        print(textwrap_indent(r.detail), flush=True)


def textwrap_indent(s: str) -> str:
    return "\n".join("      " + line for line in s.strip().splitlines()[-12:])


def summary(results: List[Result], equivalent: List[Mutation]) -> int:
    print("\n== mutation testing")
    print(f"{'mutation':30} {'family':6} {'result':11} {'time':>7}  killed by")
    for r in results:
        print(f"{r.name:30} {r.family:6} {r.status:11} {r.seconds:6.1f}s  {r.killer}")
    for m in equivalent:
        print(f"{m.name:30} {m.family:6} {'equivalent':11} {'':7}  {m.equivalent}")
    bad = 0
    for fam in sorted({r.family for r in results} | {m.family for m in equivalent}):
        rs = [r for r in results if r.family == fam]
        killed = sum(r.status in ("killed", "timeout") for r in rs)
        survived = sum(r.status == "survived" for r in rs)
        compiled = sum(r.status == "compiled" for r in rs)
        broken = sum(r.status in ("no-compile", "stale", "error") for r in rs)
        eq = sum(m.family == fam for m in equivalent)
        if compiled:
            print(f"{fam}: {compiled} of {compiled + broken} mutants apply and compile ({eq} equivalent not run)")
        else:
            rate = f"{100.0 * killed / (killed + survived):.0f}%" if killed + survived else "n/a"
            print(f"{fam}: killed {killed} of {killed + survived} non-equivalent mutants ({rate}); "
                  f"{eq} equivalent; {broken} did not apply or compile")  # fmt: skip
        bad += survived + broken
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["metal", "cpu", "cuda", "all"], default="all")
    ap.add_argument("--only", nargs="*", help="run only these mutations (names)")
    ap.add_argument("--check", action="store_true", help="only check that every mutation applies")
    ap.add_argument("--compile-only", action="store_true", help="cuda: only apply and compile (no GPU)")
    ap.add_argument("--list", action="store_true", help="list the mutations")
    ap.add_argument("--jobs", type=int, default=0, help="parallel compiles (cuda; default: every core)")
    ap.add_argument("--gpu-jobs", type=int, default=4, help="cuda: mutants tested at a time on the GPU")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test command")
    ap.add_argument("--select", help="metal, cuda: only the tests this pytest -k expression also selects "
                    "(e.g. 'planted or sharper': the tests that judge against float64, not another backend)")
    ap.add_argument("--scratch", help="scratch folder (cpu: keeps its target folder between runs)")
    ap.add_argument("--cpu-tiers", choices=["all", "lib"], default="all",
                    help="cpu: every tier of tests (default), or the library's unit tests alone (cargo test --lib: "
                         "minutes, not half an hour, for mutations their unit tests cover; a survivor there is "
                         "no survivor of the whole suite)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    names = [m.name for m in MUTATIONS]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        sys.exit(f"duplicate mutation names: {sorted(dup)}")
    muts = [m for m in MUTATIONS if args.family in ("all", m.family)]
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            sys.exit(f"no such mutation: {sorted(unknown)}")
        muts = [m for m in muts if m.name in args.only]
    if args.list:
        for m in muts:
            print(f"{m.name:30} {m.family:6} {m.file}: {m.description}" + (" [equivalent]" if m.equivalent else ""))
        return 0
    stale = [(m, why) for m in muts if (why := applies(m))]
    for m, why in stale:
        print(f"STALE {m.name}: {why}")
    if stale:
        print(f"{len(stale)} mutation(s) no longer apply: update MUTATIONS in {Path(__file__).name} "
              "(the kernel changed; plant the same bug in the new text, or drop it with a reason)")  # fmt: skip
        return 2
    if args.check:
        for fam in ("metal", "cuda", "cpu"):
            fm = [m for m in muts if m.family == fam]
            if fm:
                print(f"{fam}: {len(fm)} mutations apply ({sum(bool(m.equivalent) for m in fm)} equivalent)")
        return 0
    equivalent = [m for m in muts if m.equivalent]
    live = [m for m in muts if not m.equivalent]
    results: List[Result] = []
    for fam, runner in (("metal", run_metal), ("cpu", run_cpu), ("cuda", run_cuda)):
        fm = [m for m in live if m.family == fam]
        if fm:
            if fam == "cuda" and args.family == "all" and not args.compile_only:
                print("cuda: skipped (run --family cuda on a GPU machine, or --compile-only)")
                continue
            print(f"== {fam}: {len(fm)} mutants", flush=True)
            results += runner(fm, args)
    rc = summary(results, equivalent)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": [asdict(r) for r in results],
                                               "equivalent": [asdict(m) for m in equivalent]}, indent=1))  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark's shapes (SPEC section 4 and dense cases), the rows and cases run by
default on each kind of device, and each case's inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .. import causal_mask
from ..reference import random_qkv


@dataclass(frozen=True)
class Case:
    """A benchmark shape: heads, head dim and mask (``causal``, ``window`` or ``zero``);
    ``paged``: the K/V are also laid out as a paged cache (SPEC 11), which ours reads through
    its block table (:func:`paged_cache`)."""

    name: str
    title: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mask: str
    window: Optional[int] = None
    paged: bool = False
    #: Quantised K/V (SPEC 11): ours reads K/V in this format (``"float8_e4m3fn"``), the same
    #: values in the run's 16-bit K/V beside it (:func:`quantised_kv`); None: not quantised.
    kv_quant: Optional[str] = None

    def describe(self) -> str:
        m = {"causal": "causal", "zero": "zero mask"}.get(self.mask, f"causal, window {self.window}")
        return (
            f"{self.title}: {self.n_heads}/{self.n_kv_heads} heads, dim {self.head_dim}, {m}"
            + (", paged K/V" if self.paged else "")
            + (f", {self.kv_quant} K/V" if self.kv_quant else "")
        )


#: SPEC section 4 (Gemma 4 26B-A4B) and dense cases.
CASES: Dict[str, Case] = {
    c.name: c
    for c in (
        Case("sliding", "26B sliding", 16, 8, 256, "window", 1024),
        Case("global", "26B global", 16, 2, 512, "causal"),
        Case("dense", "dense", 16, 8, 256, "zero"),
        Case("causal-8h", "causal 8h", 8, 8, 256, "causal"),
        Case("dense-8h", "dense 8h", 8, 8, 256, "zero"),
        # Most LLMs' head dims (issue: head dims 64 to 576), 32 query heads over 8 KV heads.
        Case("causal-128", "causal d128", 32, 8, 128, "causal"),
        Case("dense-128", "dense d128", 32, 8, 128, "zero"),
        Case("causal-64", "causal d64", 32, 8, 64, "causal"),
        # Causal GQA at 256 (issue 26's table: 16/8 heads).
        Case("causal-256", "causal d256", 16, 8, 256, "causal"),
        # Paged K/V (issue 29, SPEC 11): the causal-128 and causal-256 shapes with the cache
        # in shuffled blocks of --block-size rows; ours paged against ours contiguous on the
        # same rows, PyTorch on the K/V gathered from the blocks (the gather timed).
        Case("paged-128", "paged d128", 32, 8, 128, "causal", paged=True),
        Case("paged-256", "paged d256", 16, 8, 256, "causal", paged=True),
        # FP8 K/V (issue 29, SPEC 11): the causal-128 and causal-256 shapes with K/V in FP8
        # E4M3; ours on them against ours on the same values in 16 bits (every E4M3 value is a
        # float16 and a bfloat16), and the peers on those 16-bit K/V.
        Case("fp8-128", "fp8 d128", 32, 8, 128, "causal", kv_quant="float8_e4m3fn"),
        Case("fp8-256", "fp8 d256", 16, 8, 256, "causal", kv_quant="float8_e4m3fn"),
        # Q8_0 K/V (ggml's blocks, issue 29: >= 0.9x of 16-bit K/V): ours on the bytes against
        # ours on their values rounded to float16 (not exact there: outputs differ slightly).
        Case("q8-128", "q8_0 d128", 32, 8, 128, "causal", kv_quant="q8_0"),
    )
}
#: Rows of a block of a paged case's cache (``--block-size``; the library takes multiples of
#: 16 from 16 to 256).
DEFAULT_BLOCK_SIZE = 16
#: Rows and cases run when none are named, by device kind: the CPU at the sizes a CPU user
#: prefills, a GPU at long prompts too.
DEFAULT_ROWS = {"cpu": (1024, 2048, 4096)}
DEFAULT_ROWS_GPU = (2048, 8192, 16384)
DEFAULT_CASES = {"cpu": ("sliding", "global", "dense")}
DEFAULT_CASES_GPU = ("sliding", "global", "causal-8h", "dense-8h")


def select(kind: str, rows: Optional[Sequence[int]] = None, cases: Optional[Sequence[str]] = None) -> Tuple[List[int], List[str]]:
    """The sorted rows and the cases of a run on a device of kind ``kind``, the defaults of
    that kind where ``rows`` or ``cases`` is None; raises ValueError for an unknown case, a
    quantised K/V case on Metal (named; the CPU and CUDA read them), or a row count below 1
    (paged cases run on every backend)."""
    if rows is None:
        rows = DEFAULT_ROWS.get(kind, DEFAULT_ROWS_GPU)
    if cases is None:
        cases = DEFAULT_CASES.get(kind, DEFAULT_CASES_GPU)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    rows = sorted({int(r) for r in rows})
    if not rows or rows[0] < 1:
        raise ValueError(f"rows must be positive integers, got {rows}")
    return rows, list(cases)


def case_mask(case: Case, rows: int, kv_len: int) -> np.ndarray:
    """The additive float16 mask ``[rows, kv_len]`` of a case."""
    if case.mask == "zero":
        return np.zeros((rows, kv_len), dtype=np.float16)
    return causal_mask(rows, kv_len, case.window if case.mask == "window" else None)


#: The data types a run feeds every implementation (``--dtype``): float32 is Q float32 with
#: K/V float16 to us (our K/V are 16-bit) and float32 to the peers; float16 and bfloat16
#: are Q, K and V all in that type, for us and the peers alike (the output too).
DTYPES = ("float32", "float16", "bfloat16")


def case_inputs(case: Case, rows: int, rng: np.random.Generator, kv_len: Optional[int] = None, dtype: str = "float32"):
    """Uniform random Q (float32), K, V (float16) and the mask of ``case`` at ``rows`` rows,
    the cache as long as the prompt, or ``kv_len`` rows (a chunk of a prompt at the end of a
    longer cache): ``(q, k, v, mask)``. With ``dtype`` float16 or bfloat16, Q, K and V are
    that type (the same draws rounded to it)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    kv = rows if kv_len is None else kv_len
    q, k, v = random_qkv(rows, case.n_heads, case.n_kv_heads, case.head_dim, kv, rng)
    if dtype != "float32":
        from ..dtypes import bfloat16_dtype

        to = np.float16 if dtype == "float16" else bfloat16_dtype()
        q, k, v = q.astype(to), k.astype(np.float32).astype(to), v.astype(np.float32).astype(to)
    return q, k, v, case_mask(case, rows, kv)


def quantised_kv(k: np.ndarray, v: np.ndarray, fmt: str) -> tuple:
    """``k`` and ``v`` rounded to the FP8 format ``fmt`` (ml_dtypes' type), and those values
    back in ``k``'s dtype (exact: every E4M3 value is a float16 and a bfloat16):
    ``(k8, v8, k16, v16)``; ``fmt`` ``"q8_0"``: Q8_0 bytes, their values rounded to ``k``'s dtype."""
    from ..dtypes import float8_dtype

    if fmt == "q8_0":
        # ggml's Q8_0 bytes; the 16-bit K/V are their values rounded to ``k``'s dtype.
        from ..reference import dequantise, quantise_q8_0

        k8, v8 = quantise_q8_0(k), quantise_q8_0(v)
        return k8, v8, dequantise(k8, "q8_0").astype(k.dtype), dequantise(v8, "q8_0").astype(v.dtype)
    f8 = float8_dtype(fmt)
    k8, v8 = k.astype(np.float32).astype(f8), v.astype(np.float32).astype(f8)
    return k8, v8, k8.astype(np.float32).astype(k.dtype), v8.astype(np.float32).astype(v.dtype)


class PagedCache(NamedTuple):
    """A sequence's K/V as a paged cache (SPEC 11): ``k``/``v`` ``[num_blocks, block_size,
    kv_heads, dim]``, the int32 ``block_table`` ``[1, num_blocks]`` and ``seqused_k``
    ``[1]``."""

    k: np.ndarray
    v: np.ndarray
    block_table: np.ndarray
    seqused_k: np.ndarray

    @property
    def block_size(self) -> int:
        return int(self.k.shape[1])


def paged_cache(k: np.ndarray, v: np.ndarray, block_size: int, rng: np.random.Generator) -> PagedCache:
    """``k`` and ``v`` (``[kv_len, kv_heads, dim]``) as a paged cache of blocks of
    ``block_size`` rows in a shuffled order (the table a permutation; the last block's rows
    past ``kv_len`` zero): the same values, as an engine's block pool holds them."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    n = k.shape[0]
    blocks = -(-n // block_size)
    table = rng.permutation(blocks).astype(np.int32)

    def pool(x):
        rows = np.zeros((blocks * block_size,) + x.shape[1:], x.dtype)
        rows[:n] = x
        out = np.empty((blocks, block_size) + x.shape[1:], x.dtype)
        out[table] = rows.reshape(out.shape)
        return out

    return PagedCache(pool(k), pool(v), table[None], np.array([n], np.int32))


#: The cases of the former ``scripts/gpu_bench.py``, by its names: bench cases at one size
#: (its causal and dense cases are the 8/8-head ones); the default GPU run covers them all.
GPU_BENCH_CASES: Dict[str, Tuple[str, int]] = {
    "global-2048": ("global", 2048),
    "global-8192": ("global", 8192),
    "sliding-2048": ("sliding", 2048),
    "sliding-8192": ("sliding", 8192),
    "causal-16384": ("causal-8h", 16384),
    "dense-16384": ("dense-8h", 16384),
}


def sized_case(name: str) -> Tuple[Case, int]:
    """A case at one size by name: ``<case>-<rows>`` (``global-8192``, ``dense-8h-16384``),
    or a name of ``GPU_BENCH_CASES`` (which wins: ``dense-16384`` is the 8/8-head case)."""
    if name in GPU_BENCH_CASES:
        case, rows = GPU_BENCH_CASES[name]
        return CASES[case], rows
    case, _, rows = name.rpartition("-")
    if case not in CASES or not rows.isdigit() or int(rows) < 1:
        raise ValueError(f"unknown sized case {name!r}: <case>-<rows> with a case of {', '.join(CASES)}, or one of {', '.join(GPU_BENCH_CASES)}")
    return CASES[case], int(rows)

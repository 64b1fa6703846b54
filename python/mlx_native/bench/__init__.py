"""``python -m mlx_native bench``: the SPEC section 4 shapes on one device, against every
installed peer in the same run, with useful FLOP/s (SPEC section 5), the ratio of each
peer's time to ours, NMSE against the float64 reference on a sample of heads and rows, and
the share of the machine's measured FMA peak.

Importable::

    from mlx_native.bench import run_bench
    report = run_bench(rows=[1024], cases=["dense"], repeats=2)

Modules: :mod:`.cases` (shapes, defaults, inputs), :mod:`.core` (the run and its report),
:mod:`.ours` (our runners), :mod:`.timing`, :mod:`.peers` (the peer registry),
:mod:`.cpu_peers` and :mod:`.cuda_peers` (the peers), :mod:`.report` (tables, summary,
plot), :mod:`.machine`, :mod:`.progress`, :mod:`.cli` (the command).
"""

from .cases import (
    CASES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CASES,
    DEFAULT_CASES_GPU,
    DEFAULT_ROWS,
    DEFAULT_ROWS_GPU,
    GPU_BENCH_CASES,
    Case,
    PagedCache,
    case_inputs,
    case_mask,
    paged_cache,
    select,
    sized_case,
)
from .cli import NMSE_BAR, add_arguments, main, main_from_args
from .core import REFERENCE_FULL_PAIRS, REFERENCE_SAMPLE_ROWS, run_bench
from .ours import DEVICE_TARGET_S, OURS, OURS_16BIT_KV, OURS_ATTENTION, OURS_CONTIGUOUS, OURS_DESCRIBED, ours_variants
from .report import plot_report, print_summary, print_table, summarize

__all__ = [
    "CASES",
    "Case",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CASES",
    "DEFAULT_CASES_GPU",
    "DEFAULT_ROWS",
    "DEFAULT_ROWS_GPU",
    "DEVICE_TARGET_S",
    "GPU_BENCH_CASES",
    "NMSE_BAR",
    "OURS",
    "OURS_ATTENTION",
    "OURS_16BIT_KV",
    "OURS_CONTIGUOUS",
    "OURS_DESCRIBED",
    "PagedCache",
    "REFERENCE_FULL_PAIRS",
    "REFERENCE_SAMPLE_ROWS",
    "add_arguments",
    "case_inputs",
    "case_mask",
    "main",
    "main_from_args",
    "paged_cache",
    "ours_variants",
    "plot_report",
    "print_summary",
    "print_table",
    "run_bench",
    "select",
    "sized_case",
    "summarize",
]

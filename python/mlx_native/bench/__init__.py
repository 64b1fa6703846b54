"""``python -m mlx_native bench``: the SPEC section 4 shapes on one device, against every
installed peer in the same run, with useful FLOP/s (SPEC section 5), the ratio of each
peer's time to ours, NMSE against the float64 reference on a sample of heads and rows, and
the share of the machine's measured FMA peak.

Importable::

    from mlx_native.bench import run_bench
    report = run_bench(rows=[1024], cases=["dense"], repeats=2)

Modules: :mod:`.cases` (shapes, defaults, inputs), :mod:`.core` (the run and its report),
:mod:`.ours` (our runner), :mod:`.peers` (the peer registry), :mod:`.cpu_peers` and
:mod:`.cuda_peers` (the peers), :mod:`.report` (table, plot), :mod:`.cli` (the command).
"""

from .cases import CASES, DEFAULT_CASES, DEFAULT_CASES_GPU, DEFAULT_ROWS, DEFAULT_ROWS_GPU, Case, case_inputs, case_mask
from .cli import NMSE_BAR, add_arguments, main, main_from_args
from .core import REFERENCE_FULL_PAIRS, REFERENCE_SAMPLE_ROWS, run_bench
from .ours import DEVICE_TARGET_S, OURS
from .report import plot_report, print_table

__all__ = [
    "CASES",
    "Case",
    "DEFAULT_CASES",
    "DEFAULT_CASES_GPU",
    "DEFAULT_ROWS",
    "DEFAULT_ROWS_GPU",
    "DEVICE_TARGET_S",
    "NMSE_BAR",
    "OURS",
    "REFERENCE_FULL_PAIRS",
    "REFERENCE_SAMPLE_ROWS",
    "add_arguments",
    "case_inputs",
    "case_mask",
    "main",
    "main_from_args",
    "plot_report",
    "print_table",
    "run_bench",
]

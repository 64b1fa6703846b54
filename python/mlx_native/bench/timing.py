"""Wall-clock timing of a variant's runs, each after a pause."""

from __future__ import annotations

import time
from typing import Callable, List, Sequence

from .peers import Variant

#: Pause before every timed run: worker threads of the implementation that ran before
#: (OpenMP spins for a while after a parallel region) must not run into the next one's time.
SETTLE_S = 0.05


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn()`` takes, after a pause of ``SETTLE_S``."""
    time.sleep(SETTLE_S)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_seconds(vt: Variant) -> float:
    """Seconds one run of ``vt`` takes (its ``calls`` calls); its ``prepare`` runs first,
    untimed."""
    if vt.prepare is not None:
        vt.prepare()
    return timed(vt.run)


def per_call_seconds(vt: Variant, runs: int) -> List[float]:
    """Seconds per call of ``runs`` runs of ``vt``, one after the other."""
    return [run_seconds(vt) / vt.calls for _ in range(runs)]


def best_in_turn(fns: Sequence[Callable[[], object]], repeats: int) -> List[float]:
    """The best seconds of each of ``fns`` over ``repeats`` rounds after one warm-up call
    each, the functions called in turn within a round (a load that comes and goes slows
    them alike); no pause between calls. The timing of ``scripts/bench_paged.py`` and
    ``scripts/bench_head_dims.py``."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best

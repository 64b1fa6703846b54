"""Wall-clock timing of one run, after a pause."""

from __future__ import annotations

import time
from typing import Callable

#: Pause before every timed run: worker threads of the implementation that ran before
#: (OpenMP spins for a while after a parallel region) must not run into the next one's time.
SETTLE_S = 0.05


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn()`` takes, after a pause of ``SETTLE_S``."""
    time.sleep(SETTLE_S)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

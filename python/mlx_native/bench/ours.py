"""Our runner in the benchmark: a :class:`~mlx_native.PrefillPlan` as a timed variant."""

from __future__ import annotations

import time

import numpy as np

from .. import Device, PrefillPlan
from .peers import Variant

OURS = "mlx-native"
#: A device run of ours repeats the prefill until about this long, then waits once.
DEVICE_TARGET_S = 0.02


def ours_variant(plan: PrefillPlan, dev: Device) -> Variant:
    """Our runner: on the CPU one prefill per run; on a device several prefills recorded in
    one encoder and committed once (so launch and wait overhead is not what is timed), as
    many as fill about ``DEVICE_TARGET_S``; the output is read back only for the check."""
    if dev.backend == "cpu":
        return Variant(OURS, plan.run, lambda: plan.run().copy())
    plan.run()  # compile and first touch
    t = time.perf_counter()
    with dev.encoder() as enc:
        plan.encode(enc)
    once = time.perf_counter() - t
    calls = int(np.clip(round(DEVICE_TARGET_S / max(once, 1e-6)), 1, 50))

    def run():
        with dev.encoder() as enc:
            for _ in range(calls):
                plan.encode(enc)

    return Variant(OURS, run, plan.run, calls=calls)

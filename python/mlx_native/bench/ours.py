"""Our runners in the benchmark: a :class:`~mlx_native.PrefillPlan` as timed variants."""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from .. import Device, PrefillPlan
from .peers import Variant

OURS = "mlx-native"
#: Ours without the mask classification: the attention alone, on the skip table an earlier
#: run left (device runs only).
OURS_ATTENTION = "mlx-native, attention only"
#: Ours given the mask as a description (``causal=True``, ``window=w``) instead of the array,
#: on a causal or sliding case: no mask to classify or read, as a model calls it (CPU runs).
OURS_DESCRIBED = "mlx-native, described mask"
#: Ours on a paged case's rows contiguous (the same plan but for the layout of K/V), beside
#: ``OURS`` on the paged cache: the ratio of the two is what reading through the block table
#: costs (CPU runs).
OURS_CONTIGUOUS = "mlx-native, contiguous K/V"
#: Ours on a quantised case's K/V in 16 bits (the same values), beside ``OURS`` on the FP8
#: K/V: the ratio of the two is what reading FP8 costs or saves (CPU and CUDA runs).
OURS_16BIT_KV = "mlx-native, 16-bit K/V"
#: A device run of ours repeats the prefill until about this long, then waits once.
DEVICE_TARGET_S = 0.02
#: The most prefills one device run records.
DEVICE_MAX_CALLS = 50


def described_variant(plan: PrefillPlan) -> Variant:
    """``OURS_DESCRIBED`` on ``plan`` (a plan built from a description): one prefill a run."""
    return Variant(OURS_DESCRIBED, plan.run, lambda: plan.run().copy())


def contiguous_variant(plan: PrefillPlan, dev: Device, calls: Optional[int] = None) -> Variant:
    """``OURS_CONTIGUOUS`` on ``plan`` (a paged case's plan on contiguous K/V), timed as
    ``OURS`` is (:func:`twin_variant`)."""
    return twin_variant(OURS_CONTIGUOUS, plan, dev, calls)


def sixteen_bit_variant(plan: PrefillPlan, dev: Device, calls: Optional[int] = None) -> Variant:
    """``OURS_16BIT_KV`` on ``plan`` (a quantised case's plan on 16-bit K/V), timed as
    ``OURS`` is (:func:`twin_variant`)."""
    return twin_variant(OURS_16BIT_KV, plan, dev, calls)


def twin_variant(label: str, plan: PrefillPlan, dev: Device, calls: Optional[int]) -> Variant:
    """``label`` on ``plan``, a twin of ``OURS``'s plan timed the same way, so that the ratio
    of the two is the kernels' alone: one prefill a run on the CPU; on a device ``calls``
    prefills (``OURS``'s count) recorded in one encoder and committed in the run, not a run
    of host arrays, whose uploads and read-back a device run would time too."""
    if dev.backend == "cpu":
        return Variant(label, plan.run, lambda: plan.run().copy())
    plan.run()  # compile, first touch, and the skip table
    return _recorded(label, plan, dev, calls or 1, classify=True, output=plan.run)


def ours_variants(plan: PrefillPlan, dev: Device, *, calls: Optional[int] = None, batched: Optional[bool] = None) -> List[Variant]:
    """Our runners on ``plan`` (a plan of ``dev``).

    On the CPU: ``OURS``, one prefill a run (classification and attention, as
    ``plan.run()``). On a device (or with ``batched``): ``OURS`` and ``OURS_ATTENTION``,
    each a run of ``calls`` prefills (default: as many as fill about ``DEVICE_TARGET_S``)
    recorded in one encoder before the run and committed in it, so that what is timed is
    the commit, which launches them back to back and waits; ``OURS_ATTENTION`` records the
    attention alone (``plan.encode(enc, classify=False)``) on the skip table of a first,
    classifying run. Only ``OURS`` reads its output back (``OURS_ATTENTION`` computes the
    same output from the same buffers)."""
    if batched is None:
        batched = dev.backend != "cpu"
    if not batched:
        return [Variant(OURS, plan.run, lambda: plan.run().copy())]
    plan.run()  # compile, first touch, and the skip table the attention-only runs use
    if calls is None:
        t = time.perf_counter()
        with dev.encoder() as enc:
            plan.encode(enc)
        once = time.perf_counter() - t
        calls = int(np.clip(round(DEVICE_TARGET_S / max(once, 1e-6)), 1, DEVICE_MAX_CALLS))
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    return [
        _recorded(OURS, plan, dev, calls, classify=True, output=plan.run),
        _recorded(OURS_ATTENTION, plan, dev, calls, classify=False, output=None),
    ]


def _recorded(label: str, plan: PrefillPlan, dev: Device, calls: int, *, classify: bool, output) -> Variant:
    state = {}

    def prepare():
        _close(state)
        enc = dev.encoder()
        for _ in range(calls):
            plan.encode(enc, classify=classify)
        state["enc"] = enc

    def run():
        if "enc" not in state:
            prepare()
        enc = state.pop("enc")
        try:
            enc.commit()
        finally:
            enc.close()

    return Variant(label, run, output, calls=calls, prepare=prepare)


def _close(state: dict) -> None:
    enc = state.pop("enc", None)
    if enc is not None:
        enc.close()  # recorded and never run: dropped

"""SPEC 10's score transforms as keywords of the front door: ``softcap``, ``max_bias``
(ALiBi) and ``sinks``. The callers above the array call (the torch operators, the
transformers integration) take them already; they pass one on only when it is not its
default, so the same code runs on an array call that computes them and on one that does
not yet, where a non-default one is refused by name instead of being dropped."""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Optional

import numpy as np

from . import attention
from .errors import ArgumentTypeError, UnsupportedFeatureError

__all__ = ["score_transforms", "check_transform_scalar"]

_taken: Optional[frozenset] = None


def _names_taken() -> frozenset:
    """The keywords of SPEC 10 that the array call (attention.flash_attn_prefill) takes."""
    global _taken
    if _taken is None:
        params = inspect.signature(attention.flash_attn_prefill).parameters
        _taken = frozenset(n for n in ("softcap", "max_bias", "sinks") if n in params)
    return _taken


def check_transform_scalar(x: Any, name: str) -> float:
    """``softcap`` or ``max_bias`` as a float (None, as transformers passes for "no
    softcap", is 0.0: off)."""
    if x is None:
        return 0.0
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be a real number (0.0: off), got {x!r} ({type(x).__name__})")
    return float(x)


def score_transforms(softcap: Any = 0.0, max_bias: Any = 0.0, sinks: Any = None) -> dict:
    """The keywords to pass on to the array call: those not at their default. A
    non-default one that the array call does not take is an ``UnsupportedFeatureError``
    naming it."""
    if sinks is None and softcap == 0.0 and max_bias == 0.0 and type(softcap) is float and type(max_bias) is float:
        return {}  # every call without them: no checks to make
    given = {}
    softcap = check_transform_scalar(softcap, "softcap")
    max_bias = check_transform_scalar(max_bias, "max_bias")
    if softcap != 0.0:
        given["softcap"] = softcap
    if max_bias != 0.0:
        given["max_bias"] = max_bias
    if sinks is not None:
        given["sinks"] = sinks
    missing = [n for n in given if n not in _names_taken()]
    if missing:
        what = {"softcap": "logit soft-capping (softcap)", "max_bias": "ALiBi slopes (max_bias)",
                "sinks": "attention sinks (sinks)"}  # fmt: skip
        raise UnsupportedFeatureError(
            f"{', '.join(what[n] for n in missing)}: this build of mlx_native does not compute "
            f"{'it' if len(missing) == 1 else 'them'} yet (SPEC 10); leave {' and '.join(missing)} at the default, "
            f"or use another attention implementation for this model"
        )
    return given

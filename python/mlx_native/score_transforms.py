"""SPEC 10's score transforms as keywords of the layers above the array call (the front
door, the torch operators, the transformers integration): ``softcap``, ``max_bias``
(ALiBi) and ``sinks``, each passed on to ``attention.flash_attn_prefill`` only when it is
not its default (``None`` for softcap or max_bias, as transformers passes "off", is 0.0)."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .errors import ArgumentTypeError

__all__ = ["score_transforms", "check_transform_scalar"]


def check_transform_scalar(x: Any, name: str) -> float:
    """``softcap`` or ``max_bias`` as a float (None, as transformers passes for "no
    softcap", is 0.0: off)."""
    if x is None:
        return 0.0
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be a real number (0.0: off), got {x!r} ({type(x).__name__})")
    return float(x)


def score_transforms(softcap: Any = 0.0, max_bias: Any = 0.0, sinks: Any = None) -> dict:
    """The keywords to pass on to the array call: those not at their default (which
    checks their values)."""
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
    return given

"""The test suite's low-level cases: the builders live in :mod:`mlx_native.testing` (the GPU
scripts use them too); the case table shared by every backend's tests is here."""

from __future__ import annotations

from mlx_native.testing import LowLevelCase, _span, make_case, run_low_level

__all__ = ["CASES", "LowLevelCase", "_span", "case_id", "make_case", "run_low_level"]


# The correctness suite's strided low-level cases, shared by every backend's tests:
# (rows, n_heads, n_kv_heads, head_dim, kv_len, scale, mask, window)
CASES = [
    (45, 4, 4, 256, 130, 1.0, "peer", None),  # GQA 1, partial tiles, kv not a multiple of 64
    (37, 4, 2, 256, 100, 0.6, "peer", None),  # GQA 2, scale != 1
    (20, 8, 1, 256, 200, 1.0, "causal", 64),  # GQA 8, window, longer cache
    (33, 2, 1, 512, 77, 1.0, "causal", None),  # d512, GQA 2, causal, partial
    (17, 8, 1, 512, 64, 1.3, "peer", None),  # d512, GQA 8
    (64, 4, 2, 512, 192, 1.0, "zero", None),  # d512 full tiles, zero mask
]


def case_id(c):
    rows, nh, nkv, hd, kv, scale, mask, w = c
    return f"r{rows}-h{nh}/{nkv}-d{hd}-kv{kv}-s{scale}-{mask}{'' if w is None else w}"

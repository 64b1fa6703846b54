"""Point the native library at NVRTC from the ``nvidia-cuda-nvrtc`` wheel when one is
installed (the library also looks in CUDA_HOME, CUDA_PATH and /usr/local/cuda)."""

from __future__ import annotations

import os
import sys

ENV = "MLX_NATIVE_NVRTC"

# Where the wheels put the library: CUDA 13 (nvidia/cu13), CUDA 12 (nvidia/cuda_nvrtc).
_CANDIDATES = (
    ("nvidia", "cu13", "lib", "libnvrtc.so.13"),
    ("nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"),
)


def find_wheel_nvrtc() -> str | None:
    """The path of NVRTC inside an installed ``nvidia-cuda-nvrtc`` wheel, or None."""
    for base in sys.path:
        if not base or not os.path.isdir(base):
            continue
        for parts in _CANDIDATES:
            p = os.path.join(base, *parts)
            if os.path.isfile(p):
                return p
    return None


def point_at_wheel() -> None:
    """Set ``MLX_NATIVE_NVRTC`` to the wheel's NVRTC unless the user already set it."""
    if os.environ.get(ENV):
        return
    p = find_wheel_nvrtc()
    if p:
        os.environ[ENV] = p

"""The machine a benchmark runs on, and the CPU backend's thread count."""

from __future__ import annotations

import os
import platform

from .. import Device, cpu_info, set_num_threads


def use_threads(n: int) -> None:
    """Make the CPU backend use ``n`` threads from its next run on."""
    if int(n) != n or n < 1:
        raise ValueError(f"threads must be a positive integer, got {n!r}")
    set_num_threads(int(n))


def machine_info(device: Device) -> dict:
    """CPU model, cores, the CPU backend's instruction set and threads."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ci = cpu_info()
    return dict(
        cpu_model=model,
        cores=os.cpu_count(),
        isa=ci["isa"],
        threads=ci["threads"],
        device=device.description,
        platform=platform.platform(),
        python=platform.python_version(),
    )

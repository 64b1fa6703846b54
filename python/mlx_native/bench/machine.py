"""The machine a benchmark runs on, and the CPU backend's thread count."""

from __future__ import annotations

import os
import platform

from .. import Device, cpu_info


def use_threads(n: int) -> None:
    """Make the CPU backend use ``n`` threads: only possible before its thread pool starts
    (the first kernel or ``cpu_info()`` starts it), through ``RAYON_NUM_THREADS``."""
    if int(n) != n or n < 1:
        raise ValueError(f"threads must be a positive integer, got {n!r}")
    before = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = str(int(n))
    got = cpu_info()["threads"]
    if got != n:
        if before is None:
            del os.environ["RAYON_NUM_THREADS"]
        else:
            os.environ["RAYON_NUM_THREADS"] = before
        raise ValueError(
            f"the CPU backend already runs {got} threads in this process (set RAYON_NUM_THREADS={n} "
            "before the library first runs, or use the command line)"
        )


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

"""Command line: ``python -m mlx_native info | demo | bench``."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    from . import backends, cpu_fma_peak, cpu_info, version
    from .device import Device

    print(f"mlx-native {version()}")
    print(f"backends: {', '.join(backends())}")
    ci = cpu_info()
    print(f"cpu: {ci['threads']} threads, instruction set {ci['isa']} (detected: {', '.join(ci['detected'])})")
    one, allc = cpu_fma_peak(1), cpu_fma_peak(0)
    print(f"cpu FMA peak ({ci['isa']}, measured): {one:.1f} GFLOP/s one core, {allc:.1f} GFLOP/s all {ci['threads']} threads")
    if "amx" in ci["detected"]:
        from . import cpu_amx_peak

        one, allc = cpu_amx_peak(1), cpu_amx_peak(0)
        print(f"cpu AMX-BF16 peak (measured): {one:.1f} GFLOP/s one core, {allc:.1f} GFLOP/s all {ci['threads']} threads")
    print(f"default device: {Device('auto').description}")
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    results = run_demo(rows=args.rows, device=args.device, repeats=args.repeats, seed=args.seed)
    return 0 if all(r["nmse"] <= 5e-4 for r in results) else 1


def _bench(args) -> int:
    from .bench import main_from_args

    return main_from_args(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_native", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, backends, CPU features in use")
    demo = sub.add_parser("demo", help="a Gemma-4-26B-shaped prefill, checked and timed")
    demo.add_argument("--rows", type=int, default=2048)
    demo.add_argument("--device", default=None, help="auto (default), cpu, cuda, metal")
    demo.add_argument("--repeats", type=int, default=3)
    demo.add_argument("--seed", type=int, default=0)
    from .bench import add_arguments as bench_arguments

    bench_arguments(sub.add_parser("bench", help="the SPEC shapes against the installed peers (PyTorch, MLX), timed"))
    args = parser.parse_args(argv)
    return {"info": _info, "demo": _demo, "bench": _bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

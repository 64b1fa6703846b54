"""``python -m mlx_native bench``: the command line (see :func:`add_arguments`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from math import inf

from .. import MlxError
from .cases import CASES, DEFAULT_BLOCK_SIZE
from .core import run_bench
from .ours import OURS
from .report import plot_report

#: SPEC section 3's accuracy bar.
NMSE_BAR = 5e-4


DESCRIPTION = (
    "The SPEC section 4 shapes on one device, against every installed peer in the same run, with useful "
    "FLOP/s (SPEC section 5), the ratio of each peer's time to ours, NMSE against the float64 reference on "
    "a sample of heads and rows, and the share of the machine's measured FMA peak; on a GPU also our time "
    "without the mask classification and a summary against the best peer of each kind."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options, added to ``p``."""
    p.add_argument("--device", default=None, help="device name for mlx_native.Device: auto (default), cpu, cuda, cuda:N, metal")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="prompt lengths (kv_len = rows; default 1024 2048 4096 on the CPU, 2048 8192 16384 on a GPU)")
    p.add_argument("--kv-len", type=int, default=None, help="cache rows (default: each prompt's own): every prompt a chunk at the end of a longer cache, as chunked prefill runs (peers with a built-in causal mode that aligns it to the cache's start are left out)")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=None, help="shapes to run (default: sliding global dense on the CPU; sliding global causal-8h dense-8h on a GPU; paged-128 and paged-256: paged K/V, CPU, CUDA and Metal)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=f"rows of a block of the paged cases' cache (default {DEFAULT_BLOCK_SIZE}; multiples of 16 up to 256): ours paged against ours on the same rows contiguous, and the peers on K/V gathered from the blocks inside their time")
    p.add_argument("--described", action="store_true", help="ours takes each case's mask as its description (causal / window; none for the zero mask: SPEC 6), as a model hands it over, not as an explicit additive mask; the peers keep theirs")
    p.add_argument("--q-dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="Q's dtype and our output's (default float32; float16: what a half-precision model hands over)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up, one run of each implementation per round (the best is kept)")
    p.add_argument("--peers", nargs="*", default=None, help="peers to run (on a CPU device: torch, mlx, reference; on a CUDA device: torch, fa4, flex; default: every one installed; --peers alone: none)")
    p.add_argument("--peer-budget", type=float, default=20.0, help="seconds one peer may spend at one size (slow peers are skipped at larger sizes)")
    p.add_argument("--sample-heads", type=int, default=3, help="query heads checked against the float64 reference")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--threads", type=int, default=None, help="threads of the CPU backend and the CPU peers (default: every core)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON (rewritten after every size, so a run cut short leaves what it measured)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the ratios to the peers (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--transformers", action="store_true", help="time instead the forward of Gemma 3, Gemma 4 and Llama 3 shaped transformers models (random weights) with eager, SDPA and mlx_native attention, and the attention's share (--rows default 1024 4096; --device cpu, cuda or cuda:N, default cuda when PyTorch has a GPU)")
    p.add_argument("--models", nargs="+", default=None, help="with --transformers: gemma3, gemma4, llama (default gemma3 and gemma4)")
    p.add_argument("--layers", type=int, default=None, help="with --transformers: decoder layers, five sliding to one global, the last global (default 6 on CUDA, 2 on the CPU)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="the data every implementation gets: float32 (default: Q float32 and K/V float16 to us, float32 to the peers), float16 or bfloat16 (Q, K, V and the output in that type, for us and the peers alike); with --transformers: the model's dtype (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--overhead", action="store_true", help="time instead one call of flash_attn_prefill, a plan's run and the kernels alone (causal, window and explicit masks; --rows default 2048) and the memory of a described-mask call")


def main_from_args(args) -> int:
    """Run the benchmark as ``args`` (from a parser :func:`add_arguments` filled) say;
    returns the exit status: 0 when our worst NMSE is within SPEC's bar, 1 when not (or a
    plot lacks matplotlib), 2 for a bad option or a missing device."""
    def checkpoint(report):
        if args.json:
            _write_json(report, args.json)

    if getattr(args, "overhead", False):
        return _overhead(args)
    if getattr(args, "transformers", False):
        return _transformers(args)

    try:
        report = run_bench(
            rows=args.rows,
            cases=args.cases,
            repeats=args.repeats,
            device=args.device,
            peers=args.peers,
            sample_heads=args.sample_heads,
            peer_budget_s=args.peer_budget,
            seed=args.seed,
            progress=not args.no_progress,
            threads=args.threads,
            on_size=checkpoint,
            kv_len=args.kv_len,
            described=getattr(args, "described", False),
            q_dtype=getattr(args, "q_dtype", "float32"),
            dtype=args.dtype or "float32",
            block_size=getattr(args, "block_size", DEFAULT_BLOCK_SIZE),
        )
    except (ValueError, MlxError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.json:
        _write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot_report(report, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
    ours = [d for d in report["results"] if d["impl"] == OURS]
    # No NMSE: ours failed there, which fails the check.
    worst = max((inf if d["nmse"] is None else d["nmse"] for d in ours), default=0.0)
    worst_row = max((inf if d.get("nmse_worst_row") is None else d["nmse_worst_row"] for d in ours), default=0.0)
    ok = worst <= NMSE_BAR
    print(f"worst NMSE of {OURS}: {worst:.2e}, of one (row, head) {worst_row:.2e} (SPEC bar {NMSE_BAR:g}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


def _overhead(args) -> int:
    from .overhead import run_overhead

    if args.threads is not None:
        from .machine import use_threads

        use_threads(args.threads)
    try:
        results = run_overhead(rows=args.rows or [2048], device=args.device, repeats=args.repeats, seed=args.seed)
    except ImportError as e:
        print(f"bench: --overhead on a CUDA device needs PyTorch with CUDA ({e})", file=sys.stderr)
        return 2
    except (ValueError, MlxError, RuntimeError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.json:
        _write_json(dict(overhead=results), args.json)
        print(f"wrote {args.json}")
    return 0


def _transformers(args) -> int:
    try:
        from .transformers_forward import run_transformers_bench
    except ImportError as e:  # pragma: no cover - depends on the environment
        print(f"bench: --transformers needs PyTorch and transformers (pip install '.[transformers]'): {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        from .machine import use_threads

        use_threads(args.threads)
        torch.set_num_threads(args.threads)

    def checkpoint(report):
        if args.json:
            _write_json(report, args.json)

    try:
        report = run_transformers_bench(
            rows=args.rows or [1024, 4096], models=args.models or ["gemma3", "gemma4"], layers=args.layers,
            device=None if args.device in (None, "auto") else args.device, dtype=args.dtype,
            repeats=args.repeats, seed=args.seed, on_result=checkpoint,
        )  # fmt: skip
    except ImportError as e:
        print(f"bench: --transformers needs PyTorch and transformers (pip install '.[transformers]'): {e}", file=sys.stderr)
        return 2
    except (ValueError, MlxError, RuntimeError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.json:
        _write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


def _write_json(report: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_native bench", description=DESCRIPTION)
    add_arguments(p)
    return main_from_args(p.parse_args(argv))

"""Command line: ``python -m mlx_native info | demo | bench`` (also ``mlx-native ...``).

Every error is one line on stderr that says what to do (exit status 2 for a bad option or
a missing device); a closed output pipe (``... | head -1``) ends the command quietly."""

from __future__ import annotations

import argparse
import os
import sys

PROG = "python -m mlx_native"


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line (argparse prints the usage first)."""

    def error(self, message: str):
        raise _CliError(f"{message} (see {self.prog} --help)")


class _CliError(Exception):
    """A mistake on the command line: printed as one line, exit status 2."""


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

    if args.rows < 1:
        raise _CliError(f"demo: --rows must be at least 1, got {args.rows} (the prompt length; default 2048)")
    if args.repeats < 1:
        raise _CliError(f"demo: --repeats must be at least 1, got {args.repeats}")
    results = run_demo(rows=args.rows, device=args.device, repeats=args.repeats, seed=args.seed)
    return 0 if all(r["nmse"] <= 5e-4 for r in results) else 1


def _bench(args) -> int:
    from .bench import main_from_args

    return main_from_args(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    from .device import version

    try:
        package = dist_version("mlx-native")
    except PackageNotFoundError:  # run from a source tree without an installed package
        package = "not installed"
    return f"mlx-native {package} (native library {version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Flash attention for LLM prefill: the library's commands.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,bench}", parser_class=_Parser)
    sub.add_parser("info", help="version, backends, CPU features in use", description="Print the version, the "
                   "backends this build has, the CPU's instruction set and measured peak, and the default device.")  # fmt: skip
    demo = sub.add_parser("demo", help="a Gemma-4-26B-shaped prefill, checked and timed",
                          description="A Gemma 4 26B prefill (its sliding-window and global layers) on random inputs, "
                          "checked against the float64 reference on a sample of heads and timed. Exit status 0 when "
                          "every NMSE is within SPEC's 5e-4.")  # fmt: skip
    demo.add_argument("--rows", type=int, default=2048, help="prompt length: query rows = cache rows (default 2048)")
    demo.add_argument("--device", default=None, help="auto (default: Metal, else a CUDA GPU, else the CPU), cpu, cuda, "
                      "cuda:N, metal")  # fmt: skip
    demo.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; the best is kept (default 3)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    from .bench import add_arguments as bench_arguments

    bench = sub.add_parser("bench", help="the SPEC shapes against the installed peers (PyTorch, MLX), timed",
                           description="Time the SPEC shapes on mlx_native and on the installed peers, check each "
                           "against the float64 reference (docs/benchmarks.md).")  # fmt: skip
    bench_arguments(bench)
    return parser


def main(argv=None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)
            return {"info": _info, "demo": _demo, "bench": _bench}[args.command](args)
        except _CliError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            from .errors import MlxError

            if not isinstance(e, MlxError):
                raise
            print(f"{PROG}: error: {_one_line(str(e))}{_advice(e)}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        # The reader went away (``| head -1``): what it wanted it has. Point stdout at
        # /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _advice(e: Exception) -> str:
    from .errors import DeviceNotFoundError

    if isinstance(e, DeviceNotFoundError):
        return f". Run `{PROG} info` for the backends here, or pass --device cpu"
    return ""


if __name__ == "__main__":
    sys.exit(main())

"""``python -m mlx_native`` as a user runs it (subprocesses): ``--version``; every error one
line on stderr that says what to do, with no traceback; each subcommand's ``--help``
describes every option; a closed output pipe is not an error."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import mlx_native as mn
from mlx_native.__main__ import build_parser


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mlx_native", *args], capture_output=True, text=True, timeout=timeout)


def test_version():
    r = _run("--version")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith("mlx-native ") and mn.version() in r.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (("demo", "--rows", "0"), "--rows must be at least 1"),
        (("demo", "--rows", "-5"), "--rows must be at least 1"),
        (("demo", "--repeats", "0"), "--repeats must be at least 1"),
        (("demo", "--rows", "x"), "invalid int value"),
        (("nope",), "invalid choice"),
        ((), "required"),
        (("demo", "--device", "tpu"), "device"),
    ],
)
def test_errors_are_one_line_with_what_to_do(args, says):
    r = _run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("python -m mlx_native: error:") and says in lines[0]


def test_a_missing_gpu_is_one_line_that_points_to_the_cpu():
    try:
        mn.Device("cuda")
        pytest.skip("a CUDA device is present here: the demo would run")
    except mn.MlxError:
        pass
    r = _run("demo", "--device", "cuda", "--rows", "64")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cpu" in lines[0], r.stderr


def test_every_option_of_every_subcommand_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        assert sub.description, f"{name} has no description"
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help"
    r = _run("demo", "--help")
    assert r.returncode == 0
    for opt in ("--rows", "--device", "--repeats", "--seed"):
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith(opt))
        assert len(line.split()) > 2, f"{opt} is not described: {line!r}"


def test_a_closed_pipe_is_not_an_error():
    # `python -m mlx_native info | head -1`: the reader leaves after one line.
    p = subprocess.Popen([sys.executable, "-m", "mlx_native", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0
    assert first.startswith(b"mlx-native ")
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_demo_runs_small():
    r = _run("demo", "--rows", "64", "--repeats", "1", "--device", "cpu", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout

"""The machine's measured FMA peak and the benchmark command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import mlx_native as mx
from mlx_native import bench
from mlx_native.bench import peers, progress


def test_fma_peak_is_positive_for_every_instruction_set():
    for isa in mx.cpu_info()["detected"]:
        mx.force_cpu_isa(isa)
        try:
            one = mx.cpu_fma_peak(1)
            every = mx.cpu_fma_peak()
        finally:
            mx.force_cpu_isa(None)
        assert one > 0.1 and every > 0.1, (isa, one, every)


def test_fma_peak_rejects_bad_thread_counts():
    with pytest.raises(mx.InvalidArgumentError):
        mx.cpu_fma_peak(-1)
    with pytest.raises(mx.InvalidArgumentError, match="at most"):
        mx.cpu_fma_peak(100000)


def test_bench_runs_a_tiny_case_end_to_end_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "mlx_native", "bench", "--rows", "64", "--cases", "sliding", "global",
         "--repeats", "1", "--device", "cpu", "--peers", "reference", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "26B sliding" in r.stdout and "26B global" in r.stdout and "OK" in r.stdout
    report = json.loads(out.read_text())
    assert report["device_kind"] == "cpu" and report["machine"]["cores"] >= 1
    assert report["fma_peak_gflops"]["all_cores"] > 0
    ours = [d for d in report["results"] if d["impl"] == "mlx-native"]
    assert [(d["case"], d["rows"]) for d in ours] == [("sliding", 64), ("global", 64)]
    for d in ours:
        # 64 rows, causal: 64 * 65 / 2 visible pairs (the window of 1024 hides nothing).
        assert d["visible_pairs"] == 64 * 65 // 2
        assert d["ms"] > 0 and d["gflops"] > 0 and d["pct_peak"] > 0
        assert d["nmse"] < 1e-5
    refs = [d for d in report["results"] if d["impl"] == "numpy float64 reference"]
    assert len(refs) == 2 and all(d["speedup_vs"] > 0 and d["nmse"] < 1e-12 for d in refs)


def test_bench_api_with_no_peers_and_the_table(capsys):
    report = bench.run_bench(rows=[32], cases=["dense"], repeats=1, device="cpu", peers=[], progress=False)
    (ours,) = report["results"]
    assert ours["impl"] == bench.OURS and ours["visible_pairs"] == 32 * 32
    assert ours["useful_gflop"] == pytest.approx(4 * 256 * 16 * 32 * 32 / 1e9)
    text = capsys.readouterr().out
    assert "dense" in text and "GFLOP/s" in text and "%peak" in text


def test_bench_says_which_peers_are_missing(monkeypatch, capsys):
    class Absent(peers.Peer):
        name = "absent-peer"

        def missing(self):
            return "not installed (pip install absent-peer)"

    monkeypatch.setitem(peers._REGISTRY, "cpu", [Absent()])
    report = bench.run_bench(rows=[16], cases=["global"], repeats=1, device="cpu", progress=False)
    assert report["missing_peers"] == {"absent-peer": "not installed (pip install absent-peer)"}
    assert "peer absent-peer missing: not installed" in capsys.readouterr().out


def test_bench_rejects_bad_options():
    with pytest.raises(ValueError, match="unknown peer"):
        bench.run_bench(rows=[16], peers=["no-such-peer"], quiet=True, progress=False)
    with pytest.raises(ValueError, match="unknown case"):
        bench.run_bench(rows=[16], cases=["nope"], quiet=True, progress=False)
    with pytest.raises(ValueError, match="repeats"):
        bench.run_bench(rows=[16], repeats=0, quiet=True, progress=False)


def test_bench_plot(tmp_path):
    report = bench.run_bench(rows=[16, 32], cases=["dense"], repeats=1, device="cpu",
                             peers=["reference"], progress=False, quiet=True)
    path = tmp_path / "ratios.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # matplotlib is an optional extra: without it the plot is a clear ImportError.
        with pytest.raises(ImportError):
            bench.plot_report(report, str(path))
        return
    bench.plot_report(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now fails
    bar = progress.Progress(4, enabled=True)
    bar.step("first")
    bar.advance()
    bar.step("second")
    bar.close()
    err = capsys.readouterr().err
    assert "0/4 first" in err and "1/4 second" in err and "#" in err


def test_cli_bench_reports_a_missing_device_cleanly():
    r = subprocess.run([sys.executable, "-m", "mlx_native", "bench", "--device", "no-such-backend", "--rows", "16"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.startswith("bench: ") and "Traceback" not in r.stderr


def test_cli_bench_threads(tmp_path):
    out = tmp_path / "one.json"
    r = subprocess.run(
        [sys.executable, "-m", "mlx_native", "bench", "--device", "cpu", "--rows", "32", "--cases", "dense",
         "--repeats", "1", "--peers", "--threads", "1", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["machine"]["threads_used"] == 1
    assert "on the 1 threads in use" in r.stdout


def test_bench_threads_cannot_change_a_running_pool():
    mx.cpu_info()  # the pool runs now, with every core
    n = mx.cpu_info()["threads"]
    before = os.environ.get("RAYON_NUM_THREADS")
    with pytest.raises(ValueError, match="already runs"):
        bench.run_bench(rows=[16], threads=n + 1, quiet=True, progress=False)
    assert os.environ.get("RAYON_NUM_THREADS") == before

"""The machine's measured FMA peak and the benchmark command."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mlx_native as mx
import mlx_native.reference  # noqa: F401  (mx.reference below)
from mlx_native import bench
from mlx_native.bench import peers, progress

from helpers import import_test_extra


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


def test_bench_feeds_every_implementation_the_dtype_asked_for():
    # bfloat16: Q, K, V and the output in bfloat16 for us (the mask as an array and as a
    # description) and for PyTorch (same mask, is_causal, is_causal with enable_gqa), each
    # checked against the float64 reference; the AMX peak where the CPU has the tiles.
    import_test_extra("torch")
    report = bench.run_bench(rows=[48], cases=["causal-128"], repeats=1, device="cpu", peers=["torch"],
                             progress=False, quiet=True, dtype="bfloat16")  # fmt: skip
    assert report["dtype"] == "bfloat16"
    by = {d["impl"]: d for d in report["results"]}
    assert set(by) == {bench.OURS, bench.OURS_DESCRIBED, "torch sdpa, same mask", "torch sdpa, is_causal",
                       "torch sdpa, is_causal, enable_gqa"}  # fmt: skip
    for d in by.values():
        assert d["dtype"] == "bfloat16" and d["ms"] > 0
        # bfloat16 outputs: about 2.5e-6 against the float64 reference (rounding included).
        assert d["nmse"] < 2e-5, d
    assert by["torch sdpa, is_causal, enable_gqa"]["kv_repeated"] is False
    assert by["torch sdpa, is_causal"]["kv_repeated"] is True
    assert by[bench.OURS_DESCRIBED]["speedup_vs"] is None  # ours: no ratio to itself
    assert ("amx_peak_gflops" in report) == ("amx" in mx.cpu_info()["detected"])
    with pytest.raises(ValueError, match="unknown dtype"):
        bench.run_bench(rows=[16], cases=["dense"], peers=[], quiet=True, progress=False, dtype="float64")


def test_bench_float16_runs_ours_on_float16_data():
    report = bench.run_bench(rows=[40], cases=["sliding"], repeats=1, device="cpu", peers=["reference"],
                             progress=False, quiet=True, dtype="float16")  # fmt: skip
    by = {d["impl"]: d for d in report["results"]}
    assert by[bench.OURS]["nmse"] < 1e-6 and by[bench.OURS_DESCRIBED]["nmse"] < 1e-6
    assert by["numpy float64 reference"]["nmse"] < 1e-12


def test_bench_runs_chunks_against_a_longer_cache():
    # --kv-len: the prompt is the end of a longer cache; the visible pairs are the causal
    # chunk's (row r sees r + kv - rows + 1 cache rows), and the output is checked.
    # The described mask places the prompt at the cache's end as the array does.
    report = bench.run_bench(rows=[16], cases=["causal-8h"], repeats=1, device="cpu", peers=[], progress=False,
                             quiet=True, kv_len=200)  # fmt: skip
    ours, described = report["results"]
    assert (ours["impl"], described["impl"]) == (bench.OURS, bench.OURS_DESCRIBED)
    for d in (ours, described):
        assert d["kv_len"] == 200 and d["rows"] == 16
        assert d["visible_pairs"] == sum(r + 200 - 16 + 1 for r in range(16))
        assert d["nmse"] is not None and d["nmse"] < 1e-5
    with pytest.raises(ValueError, match="shorter than the prompt"):
        bench.run_bench(rows=[16, 300], cases=["causal-8h"], peers=[], quiet=True, progress=False, kv_len=200)


def test_bench_runs_ours_with_a_described_mask_and_a_half_precision_q():
    # --described --q-dtype float16: ours plans causal=True (no mask array) on a float16 Q and
    # returns float16; the visible pairs are the explicit mask's, and the output still
    # matches the float64 reference on the same rounded inputs.
    kw = dict(rows=[40], cases=["causal-64", "dense-128"], repeats=1, device="cpu", peers=[], progress=False, quiet=True)
    explicit = bench.run_bench(**kw)
    described = bench.run_bench(described=True, q_dtype="float16", **kw)
    assert (explicit["ours_mask"], explicit["ours_q_dtype"]) == ("explicit", "float32")
    assert (described["ours_mask"], described["ours_q_dtype"]) == ("described", "float16")
    # On the CPU the explicit run also times the described mask beside ours (its own label);
    # with described=True ours is that already.
    assert not any(d["impl"] == bench.OURS_DESCRIBED for d in described["results"])
    mine = [d for d in explicit["results"] if d["impl"] == bench.OURS]
    for a, b in zip(mine, described["results"], strict=True):
        assert (a["case"], a["impl"]) == (b["case"], b["impl"]) and b["impl"] == bench.OURS
        assert a["visible_pairs"] == b["visible_pairs"]
        assert b["nmse"] is not None and b["nmse"] < 1e-5
    assert [d["visible_pairs"] for d in described["results"]] == [40 * 41 // 2, 40 * 40]
    with pytest.raises(ValueError, match="q_dtype"):
        bench.run_bench(q_dtype="float64", **kw)


def test_paged_cache_holds_the_rows_in_shuffled_blocks():
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((70, 2, 8)).astype(np.float16) for _ in range(2))
    pc = bench.paged_cache(k, v, 16, rng)
    assert pc.k.shape == pc.v.shape == (5, 16, 2, 8) and pc.block_size == 16
    assert pc.block_table.dtype == np.int32 and pc.block_table.shape == (1, 5) and pc.seqused_k.tolist() == [70]
    assert sorted(pc.block_table[0].tolist()) == list(range(5)) and pc.block_table[0].tolist() != list(range(5))
    for cache, x in ((pc.k, k), (pc.v, v)):
        rows = cache[pc.block_table[0]].reshape(-1, 2, 8)
        assert np.array_equal(rows[:70], x) and not rows[70:].any()


def test_bench_paged_cases_time_ours_paged_against_contiguous_and_torch_on_gathered_kv(capsys):
    # Small rows: ours on the cache in shuffled blocks of 16 (a chunk of 24 rows at the end of
    # a 40-row cache: 3 blocks, the last part-filled) and on the same rows contiguous, the two
    # outputs bit-identical; PyTorch with the gather timed; an unpaged case beside them keeps
    # its rows as they were (no paged fields).
    import_test_extra("torch")
    report = bench.run_bench(rows=[24], kv_len=40, cases=["causal-64", "paged-128", "paged-256"], repeats=1,
                             device="cpu", peers=["torch", "reference"], progress=False, block_size=16)  # fmt: skip
    text = capsys.readouterr().out
    assert report["block_size"] == 16
    assert "shuffled blocks of 16 rows" in text and "gather timed': the peer's K/V gathered" in text
    assert text.count("(paged, blocks of 16: ") == 2 and text.count("x the contiguous time; outputs equal)") == 2
    for d in report["results"]:
        if d["case"] == "causal-64":
            assert not {"block_size", "num_blocks", "paged_over_contiguous", "paged_equals_contiguous"} & set(d)
            continue
        assert (d["block_size"], d["num_blocks"], d["kv_len"], d["rows"]) == (16, 3, 40, 24)
        assert d["visible_pairs"] == sum(r + 40 - 24 + 1 for r in range(24))
    for name, dim in (("paged-128", 128), ("paged-256", 256)):
        by = {d["impl"]: d for d in report["results"] if d["case"] == name}
        # A chunk: no is_causal form (it aligns the prompt to the cache's start).
        assert set(by) == {bench.OURS, bench.OURS_CONTIGUOUS, "torch sdpa, same mask, gather timed",
                           "numpy float64 reference"}, by  # fmt: skip
        mine, cont, torch_row = by[bench.OURS], by[bench.OURS_CONTIGUOUS], by["torch sdpa, same mask, gather timed"]
        assert mine["head_dim"] == dim and mine["paged_equals_contiguous"] is True
        assert mine["paged_over_contiguous"] == pytest.approx(mine["ms"] / cont["ms"])
        assert cont["speedup_vs"] == pytest.approx(cont["ms"] / mine["ms"])  # "ours x": over the paged time
        assert mine["nmse"] == cont["nmse"] and mine["nmse"] < 1e-5  # the same output
        assert torch_row["peer"] == "torch" and torch_row["nmse"] < 1e-5 and torch_row["ms"] > 0
    # At the cache's start (no chunk) the built-in causal forms run on the gathered K/V too.
    report = bench.run_bench(rows=[32], cases=["paged-128"], repeats=1, device="cpu", peers=["torch"], progress=False,
                             quiet=True, dtype="bfloat16", block_size=32)  # fmt: skip
    by = {d["impl"]: d for d in report["results"]}
    assert by["torch sdpa, is_causal, enable_gqa, gather timed"]["kv_repeated"] is False
    assert by["torch sdpa, is_causal, gather timed"]["nmse"] < 2e-5 and by[bench.OURS]["num_blocks"] == 1
    assert by[bench.OURS]["paged_equals_contiguous"] is True


def test_best_in_turn_calls_in_turn_after_a_warm_up_and_keeps_the_best():
    from mlx_native.bench import timing

    calls = []
    best = timing.best_in_turn([lambda: calls.append("a"), lambda: calls.append("b")], 2)
    assert calls == ["a", "b"] * 3 and len(best) == 2 and all(0 <= t < 1 for t in best)


def test_paged_cases_run_on_every_backend():
    # The CPU, CUDA and Metal read paged K/V: the bench refuses the paged cases nowhere.
    for kind in ("cpu", "cuda", "metal"):
        assert bench.select(kind, [64], ["paged-256"]) == ([64], ["paged-256"])
    assert "paged-128" not in bench.DEFAULT_CASES["cpu"] and "paged-128" not in bench.DEFAULT_CASES_GPU
    with pytest.raises(ValueError, match="block_size"):
        bench.run_bench(rows=[16], cases=["paged-128"], peers=[], quiet=True, progress=False, block_size=0)
    with pytest.raises(mx.MlxError, match="block_size"):  # the library's bounds: multiples of 16
        bench.run_bench(rows=[16], cases=["paged-128"], peers=[], quiet=True, progress=False, block_size=24)


def test_bench_fp8_cases_time_ours_on_fp8_against_the_same_values_in_16_bits():
    # Ours on FP8 E4M3 K/V against ours on the same values in float16 (exact): the outputs
    # bit-identical, the speed-up in the JSON; the peers run on the 16-bit K/V.
    report = bench.run_bench(rows=[24], kv_len=40, cases=["fp8-128"], repeats=1, device="cpu", peers=["reference"],
                             progress=False, quiet=True)  # fmt: skip
    by = {d["impl"]: d for d in report["results"]}
    mine, sixteen = by[bench.OURS], by[bench.OURS_16BIT_KV]
    assert mine["kv_quant"] == "float8_e4m3fn" and mine["fp8_equals_16bit"] is True
    assert mine["fp8_speedup_over_16bit"] == pytest.approx(sixteen["ms"] / mine["ms"])
    assert mine["nmse"] == sixteen["nmse"] and mine["nmse"] < 1e-5
    # The CPU, CUDA and Metal read quantised K/V: the bench refuses the quantised cases nowhere.
    for kind in ("cpu", "cuda", "metal"):
        assert bench.select(kind, [2048], ["fp8-128", "q8-128"]) == ([2048], ["fp8-128", "q8-128"])


def test_bench_q8_0_case_times_ours_on_q8_0_bytes_against_their_values_in_16_bits():
    # Q8_0's values are not all float16s: the 16-bit K/V are rounded, the outputs close, not equal.
    report = bench.run_bench(rows=[24], kv_len=40, cases=["q8-128"], repeats=1, device="cpu", peers=["reference"],
                             progress=False, quiet=True)  # fmt: skip
    by = {d["impl"]: d for d in report["results"]}
    mine, sixteen = by[bench.OURS], by[bench.OURS_16BIT_KV]
    assert mine["kv_quant"] == "q8_0"
    assert mine["fp8_speedup_over_16bit"] == pytest.approx(sixteen["ms"] / mine["ms"])
    assert mine["nmse"] < 1e-5 and sixteen["nmse"] < 1e-5


def test_cli_bench_paged_case_writes_its_fields(tmp_path):
    out = tmp_path / "paged.json"
    r = subprocess.run(
        [sys.executable, "-m", "mlx_native", "bench", "--device", "cpu", "--rows", "48", "--cases", "paged-256",
         "--block-size", "32", "--repeats", "1", "--peers", "reference", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["block_size"] == 32
    ours = next(d for d in report["results"] if d["impl"] == "mlx-native")
    assert ours["num_blocks"] == 2 and ours["paged_equals_contiguous"] is True and ours["paged_over_contiguous"] > 0
    assert "(paged, blocks of 32: " in r.stdout and "OK" in r.stdout


def test_the_issue_rows_have_their_cases():
    # The speed issue's head-dim 128 and 64 rows: 32 query heads over 8 KV heads.
    for name, dim, mask in [("dense-128", 128, "zero"), ("causal-128", 128, "causal"), ("causal-64", 64, "causal")]:
        c = bench.CASES[name]
        assert (c.n_heads, c.n_kv_heads, c.head_dim, c.mask) == (32, 8, dim, mask)


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


def test_bench_threads_change_a_running_pool():
    # The pool is the library's own (set_num_threads): a bench in a process that already ran
    # the kernels still runs on the threads it asks for.
    mx.flash_attn_prefill(*(np.ones((16, 1, 64), dt) for dt in (np.float32, np.float16, np.float16)))
    n = mx.cpu_info()["threads"]
    try:
        report = bench.run_bench(rows=[16], cases=["dense"], threads=n + 1, quiet=True, progress=False, repeats=1,
                                 peers=[])
        assert report["machine"]["threads_used"] == n + 1
    finally:
        mx.set_num_threads(None)
    with pytest.raises(ValueError, match="positive integer"):
        bench.run_bench(rows=[16], threads=0, quiet=True, progress=False)


# ---------------------------------------------------------------- the GPU report, without a GPU


def test_default_gpu_run_covers_the_former_gpu_bench_cases():
    rows, cases = bench.select("cuda")
    assert rows == [2048, 8192, 16384] and cases == ["sliding", "global", "causal-8h", "dense-8h"]
    assert bench.select("cpu") == ([1024, 2048, 4096], ["sliding", "global", "dense"])
    for name in bench.GPU_BENCH_CASES:
        case, r = bench.sized_case(name)
        assert case.name in cases and r in rows, name
    assert bench.sized_case("dense-16384")[0].n_heads == 8  # gpu_bench's dense case: 8/8 heads
    assert bench.sized_case("dense-8h-2048") == (bench.CASES["dense-8h"], 2048)
    assert bench.sized_case("global-4096") == (bench.CASES["global"], 4096)
    for bad in ("global", "global-0", "nope-2048", "global-x"):
        with pytest.raises(ValueError, match="unknown sized case"):
            bench.sized_case(bad)
    with pytest.raises(ValueError, match="unknown case"):
        bench.select("cuda", cases=["nope"])


def test_batched_runners_time_the_commit_with_and_without_classification():
    from mlx_native.bench import ours, timing

    dev = mx.Device("cpu")
    q, k, v, mask = bench.case_inputs(bench.CASES["global"], 64, np.random.default_rng(0))
    plan = mx.PrefillPlan(q, k, v, mask, scale=1.0, device=dev)
    full, attn = ours.ours_variants(plan, dev, calls=3, batched=True)
    assert (full.label, attn.label) == (bench.OURS, bench.OURS_ATTENTION)
    assert full.calls == attn.calls == 3 and full.prepare and attn.prepare and attn.output is None
    for vt in (full, attn):
        t = timing.per_call_seconds(vt, 2)
        assert len(t) == 2 and all(x > 0 for x in t)
    attn.prepare()
    attn.prepare()  # a second recording drops the first, unrun
    attn.run()
    ref = mx.reference.reference_attention(q, k, v, mask)
    assert mx.reference.nmse(full.output(), ref) < 1e-5
    (alone,) = ours.ours_variants(plan, dev)  # the CPU default: one prefill a run
    assert alone.label == bench.OURS and alone.calls == 1 and alone.prepare is None


def test_round_robin_notes_refusals_failures_and_keeps_the_best():
    from mlx_native.bench import core, peers, progress

    def refuse():
        raise peers.Refused("no such backend here")

    def fail():
        raise RuntimeError("out of memory")

    ran = []
    vts = [
        peers.Variant(bench.OURS, lambda: ran.append("ours"), None, calls=2, prepare=lambda: ran.append("prep")),
        peers.Variant("refuses", refuse, None, mode="mask"),
        peers.Variant("fails", fail, None, mode="mask"),
    ]
    notes = {}
    best, runs, live = core.round_robin(vts, 2, 10.0, notes, progress.Progress(1, False), "t")
    assert notes == {"refuses": "refused: no such backend here", "fails": "failed: RuntimeError: out of memory"}
    assert [vt.label for vt in live] == [bench.OURS] and runs == {bench.OURS: 2}
    assert ran == ["prep", "ours"] * 3  # warm-up and two rounds, each recorded first
    assert 0 < best[bench.OURS] < 1


def _fake_cuda_rows():
    """Report rows of one GPU-sized problem from made-up times (seconds per call)."""
    from mlx_native.bench import core

    base = dict(case="global", title="26B global", rows=8192, kv_len=8192, n_heads=16, n_kv_heads=2, head_dim=512,
                mask="causal", window=None, visible_pairs=8192 * 8193 // 2, useful_gflop=1.0,
                nmse_rows_checked=192, nmse_heads_checked=[0, 15])
    flops = 4.0 * 512 * 16 * base["visible_pairs"]

    def m(mode, repeated):
        return dict(peer="torch", mode=mode, kv_repeated=repeated, calls=5)

    meta = {
        bench.OURS: dict(peer=None, mode=None, kv_repeated=None, calls=5),
        bench.OURS_ATTENTION: dict(peer=None, mode=None, kv_repeated=None, calls=5),
        "torch math, same mask": m("mask", True),
        "torch efficient, same mask": m("mask", True),
        "torch efficient, is_causal": m("causal", True),
        "torch flash, same mask": m("mask", True),
        "torch math, same mask, enable_gqa": m("mask", False),
        "torch efficient, same mask, enable_gqa": m("mask", False),
    }
    best = {bench.OURS: 4e-3, bench.OURS_ATTENTION: 3.9e-3, "torch math, same mask": 60e-3,
            "torch efficient, same mask": 16e-3, "torch efficient, is_causal": 8e-3,
            "torch math, same mask, enable_gqa": 61e-3}
    notes = {"torch flash, same mask": "refused: Flash Attention does not support non-null attn_mask.",
             "torch efficient, same mask, enable_gqa": "refused: both fused kernels require the same num_heads"}
    runs = {k: 3 for k in best}
    errors = {bench.OURS: (5.7e-9, 1.1e-7), "torch efficient, same mask": (4e-8, 2e-7)}
    rate = {}
    rows = core.result_rows(base, list(meta), flops, best, runs, notes, errors, rate, meta)
    return rows, flops, rate


def test_result_rows_and_the_summary_from_fake_gpu_times():
    rows, flops, rate = _fake_cuda_rows()
    by = {d["impl"]: d for d in rows}
    ours, attn = by[bench.OURS], by[bench.OURS_ATTENTION]
    assert ours["ms"] == pytest.approx(4.0) and ours["gflops"] == pytest.approx(flops / 4e-3 / 1e9)
    assert ours["speedup_vs"] is None and attn["speedup_vs"] is None and attn["nmse"] is None
    assert ours["nmse"] == 5.7e-9 and ours["nmse_worst_row"] == 1.1e-7
    assert by["torch efficient, same mask"]["speedup_vs"] == pytest.approx(4.0)
    assert by["torch efficient, is_causal"]["speedup_vs"] == pytest.approx(2.0)
    flash = by["torch flash, same mask"]
    assert flash["ms"] is None and flash["speedup_vs"] is None and flash["note"].startswith("refused:")
    assert ("global", "torch flash, same mask") not in rate and rate[("global", bench.OURS)] == ours["gflops"]

    (s,) = bench.summarize(rows)
    assert s["ours_ms"] == pytest.approx(4.0) and s["ours_attention_only_ms"] == pytest.approx(3.9)
    assert s["ours_tflops"] == pytest.approx(flops / 4e-3 / 1e12)
    assert s["nmse_worst_row"] == 1.1e-7 and s["nmse_rows_checked"] == 192
    assert s["best_mask"]["impl"] == "torch efficient, same mask" and s["best_mask"]["speedup_vs"] == pytest.approx(4.0)
    assert s["best_causal"]["impl"] == "torch efficient, is_causal"
    assert s["best_mask_gqa"]["impl"] == "torch math, same mask, enable_gqa"
    assert s["best_mask_gqa"]["speedup_vs"] == pytest.approx(15.25)
    assert s["best_none"] is None


def test_gpu_table_shows_tflops_both_times_of_ours_and_the_summary():
    rows, _, _ = _fake_cuda_rows()
    report = dict(version="0", machine=dict(device="cuda:0 Fake GPU", cpu_model="cpu", cores=16, isa="avx2+fma+f16c", threads=16),
                  device_kind="cuda", repeats=3, peers=["torch"], peer_versions={"torch": "2.11.0, cuDNN 91900"},
                  missing_peers={}, results=rows)
    buf = io.StringIO()
    bench.print_table(report, buf)
    text = buf.getvalue()
    assert "TFLOP/s" in text and "%peak" not in text and "peer versions: torch 2.11.0, cuDNN 91900" in text
    assert "mlx-native, attention only" in text and "3.900" in text  # ms with three decimals
    assert "torch efficient, same mask, enable_gqa" in text  # labels are not cut
    assert "refused: Flash Attention does not support non-null attn_mask." in text
    summary = text[text.index("summary:"):].splitlines()
    assert "attn ms" in summary[1] and "best peer, same mask" in summary[1] and "best, same mask, own GQA form" in summary[1]
    assert "best peer, no mask" not in summary[1]  # no problem has such a peer
    line = summary[3]
    assert line.startswith("26B global") and "4.000" in line and "3.900" in line and "1.10e-07" in line
    assert "torch efficient 16.000 ms" in line and "4.00x" in line and "torch efficient 8.000 ms" in line and "2.00x" in line
    assert "torch math, enable_gqa 61.000 ms" in line and "15.25x" in line


def test_a_gpu_style_run_end_to_end_on_the_cpu(monkeypatch, capsys):
    """The device path of the run (ours batched, with and without classification; peers with
    modes and K/V forms; the summary in the report and the JSON checkpoints) on the CPU."""
    import functools
    import time

    from mlx_native.bench import core, ours

    class FakeSdpa(peers.Peer):
        name = "fake"

        def version(self):
            return "1.0"

        def variants(self, problem):
            ref = mx.reference.reference_attention(problem.q, problem.k, problem.v, problem.mask).astype(np.float32)

            def make(label, mode, repeated, seconds):
                return peers.Variant(label, lambda: time.sleep(seconds), lambda: ref, mode=mode, kv_repeated=repeated)

            def refused():
                raise peers.Refused("head_dim should be no more than 256")

            return [make("fake a, same mask", "mask", True, 0.004), make("fake b, is_causal", "causal", True, 0.002),
                    make("fake a, same mask, enable_gqa", "mask", False, 0.003),
                    peers.Variant("fake c, same mask", refused, lambda: None, mode="mask")]

    monkeypatch.setitem(peers._REGISTRY, "cpu", [FakeSdpa()])
    monkeypatch.setattr(core, "ours_variants", functools.partial(ours.ours_variants, batched=True))
    seen = []
    report = bench.run_bench(rows=[64], cases=["global"], repeats=2, device="cpu", progress=False, quiet=True,
                             on_size=lambda r: seen.append(len(r["results"])))
    # Six rows, and the described mask's (a CPU device runs ours on a causal case that way too).
    assert seen == [7] and report["peer_versions"] == {"fake": "1.0"}
    by = {d["impl"]: d for d in report["results"]}
    assert by[bench.OURS]["nmse_worst_row"] < 1e-5 and by[bench.OURS]["calls"] >= 1
    assert by[bench.OURS_ATTENTION]["ms"] > 0 and by[bench.OURS_ATTENTION]["nmse"] is None
    assert by["fake c, same mask"]["note"] == "refused: head_dim should be no more than 256"
    assert by["fake a, same mask"]["nmse"] < 1e-12 and by["fake a, same mask"]["speedup_vs"] > 0
    (s,) = report["summary"]
    assert s["best_mask"]["impl"] == "fake a, same mask, enable_gqa" and s["best_causal"]["impl"] == "fake b, is_causal"
    assert s["ours_attention_only_ms"] == by[bench.OURS_ATTENTION]["ms"]
    report["device_kind"] = "cuda"
    bench.print_table(report)
    assert "summary:" in capsys.readouterr().out


def test_cuda_peers_without_torch(monkeypatch):
    from mlx_native.bench import cuda_peers

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    assert "not importable" in cuda_peers.TorchCudaSdpa().missing()
    assert [p.name for p in peers.peers_for("cuda")] == ["torch", "fa4", "flex"]
    assert "not importable" in cuda_peers.FlashAttention4().missing()
    assert "not importable" in cuda_peers.FlexAttention().missing()
    reason = cuda_peers.refusal_reason(
        ["Memory efficient kernel not used because:", "Flash Attention does not support non-null attn_mask. (Triggered internally at x.cpp)"],
        "No available kernel.  Aborting execution.\nmore",
    )
    assert reason == "Flash Attention does not support non-null attn_mask."
    assert cuda_peers.refusal_reason([], "No available kernel.\nmore") == "No available kernel."


def test_worst_row_nmse():
    from mlx_native.bench.core import worst_row_nmse

    ref = np.ones((3, 2, 4))
    out = ref.copy()
    out[1, 1, 0] = 1.5  # one (row, head): 0.25 / 4
    assert worst_row_nmse(out, ref) == pytest.approx(0.0625)
    ref[2, 0] = 0
    out[2, 0] = 0.5  # a zero reference row counts its plain squared error
    assert worst_row_nmse(out, ref) == pytest.approx(1.0)


def test_overhead_bench_times_a_call_a_run_and_the_kernels(capsys):
    from mlx_native.bench.overhead import CASES, run_overhead

    res = run_overhead(rows=[64], device="cpu", repeats=1)
    assert [d["case"] for d in res] == list(CASES)
    for d in res:
        assert d["kernels_s"] > 0 and d["run_s"] > 0 and d["call_s"] > 0
        assert d["run_over_kernels"] == d["run_s"] / d["kernels_s"] and d["call_over_run"] == d["call_s"] / d["run_s"]
    described = [d for d in res if d["case"] != "explicit"]
    assert all(d["mask_bytes"] == 64 * 64 * 2 and "host_growth_bytes" in d for d in described)
    out = capsys.readouterr().out
    assert "run/kern" in out and "call/run" in out and "a float16 mask would be" in out


def test_cli_bench_overhead(tmp_path):
    path = tmp_path / "overhead.json"
    r = subprocess.run([sys.executable, "-m", "mlx_native", "bench", "--overhead", "--device", "cpu", "--rows", "64",
                        "--repeats", "1", "--json", str(path)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "worst run/kernels" in r.stdout
    assert {d["case"] for d in json.loads(path.read_text())["overhead"]} == {"causal", "window", "explicit"}

"""scripts/cp_model.py (the model of context-parallel scaling) on synthetic pieces whose
answers are known in closed form, and scripts/cp_pieces.py end to end on the CPU at a tiny
size, its JSON fed to the model."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from mlx_native.distributed import ring_schedule

ROOT = pathlib.Path(__file__).resolve().parents[1]
MS_PER_PAIR = 1e-3
ROW_BYTES = 4096  # 2 KV heads x dim 512 x (K, V) x 2 bytes


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _synthetic(n, ranks, merge_ms=0.0):
    """Pieces whose every block takes MS_PER_PAIR per visible pair: one GPU's whole
    sequence is then n(n+1)/2 pairs' worth."""
    blocks, rows = {}, set()
    for p in ranks:
        sch = ring_schedule(n, p, "zigzag", True, None)
        for rank in sch.steps:
            for st in rank:
                for w in st.work:
                    for b in w.blocks:
                        blocks[(b.q1 - b.q0, b.k1 - b.k0, b.offset)] = b.pairs
                        rows.add(b.q1 - b.q0)
    case = dict(
        seq_len=n,
        blocks=[dict(rows=r, kv_rows=k, offset=o, pairs=x, ms=x * MS_PER_PAIR) for (r, k, o), x in blocks.items()],
        merges=[dict(rows=r, ms=merge_ms) for r in rows],
        packs=[dict(ranks=p, rows=n // p, ms=0.0) for p in ranks],
    )
    layer = dict(heads=16, kv_heads=2, head_dim=512, causal=True, window=None, layout="zigzag")
    return dict(device="synthetic", backend="none", layer=layer, ranks=ranks, kv_bytes_per_row=ROW_BYTES, cases=[case],
                one_device=[dict(seq_len=n, ms=n * (n + 1) / 2 * MS_PER_PAIR)])  # fmt: skip


def test_with_free_communication_zigzag_scales_linearly():
    model = _script("cp_model")
    out = model.predict(_synthetic(256, [2, 4, 8]), bandwidth_gbs=1e12, latency_us=0.0)
    for p in out["predictions"]:
        assert p["speedup"] == pytest.approx(p["ranks"], rel=1e-9), p
        assert p["efficiency"] == pytest.approx(1.0, rel=1e-9)
        assert p["uncovered_share"] == pytest.approx(0.0, abs=1e-9)
        assert p["imbalance"] == pytest.approx(1.0, rel=1e-9)
        assert p["steps"] and len(p["steps"]) == p["ranks"]
    assert out["what"].startswith("model, not measurement")


def test_slow_links_leave_the_hops_uncovered():
    model = _script("cp_model")
    n, p = 256, 4
    # 64 local rows x 4096 bytes = 256 KiB a hop; at 0.001 GB/s: 262.144 ms, far above a
    # step's compute (2 * 32^2 pairs = 2.048 ms).
    (pred,) = model.predict(_synthetic(n, [p]), bandwidth_gbs=0.001, latency_us=0.0)["predictions"]
    hop = 64 * ROW_BYTES / (0.001 * 1e6)
    assert pred["hop_ms"] == pytest.approx(hop)
    step_compute = 2 * 32 * 32 * MS_PER_PAIR
    # Three steps carry a hop (it lasts longer than their compute), the last one none.
    assert [s["ms"] for s in pred["steps"]] == pytest.approx([hop, hop, hop, step_compute])
    assert pred["total_ms"] == pytest.approx(3 * hop + step_compute)
    first_compute = step_compute + 32 * MS_PER_PAIR  # the diagonals of step 0 hold the diagonal itself
    uncovered = (hop - first_compute) + 2 * (hop - step_compute)
    assert pred["uncovered_share"] == pytest.approx(uncovered / pred["total_ms"], rel=1e-9)
    assert pred["one_gpu_from"] == "measured whole sequence"
    # Merges count on rows already reached only (the first partial of a range is taken).
    (merged,) = model.predict(_synthetic(n, [p], merge_ms=1.0), bandwidth_gbs=1e12, latency_us=0.0)["predictions"]
    (free,) = model.predict(_synthetic(n, [p]), bandwidth_gbs=1e12, latency_us=0.0)["predictions"]
    # Step 0: 3 blocks on 2 chunks (one merge); each later step: 1 block (1 merge); the
    # rank with the joined step-0 block has one merge fewer, but the slowest sets the step.
    assert merged["total_ms"] == pytest.approx(free["total_ms"] + 1 + (p - 1))


def test_the_command_line_writes_its_json(tmp_path, capsys):
    model = _script("cp_model")
    src = tmp_path / "pieces.json"
    src.write_text(json.dumps(_synthetic(128, [2, 4])))
    dst = tmp_path / "model.json"
    assert model.main([str(src), "--bandwidth-gbs", "300", "--json", str(dst), "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert "model, not measurement" in printed and "| N | GPUs |" in printed
    saved = json.loads(dst.read_text())
    assert saved["bandwidth_gbs"] == 300 and [p["ranks"] for p in saved["predictions"]] == [2, 4]


def test_cp_pieces_on_the_cpu_feeds_the_model(tmp_path):
    out = tmp_path / "pieces.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "cp_pieces.py"), "--device", "cpu", "--quick", "--seq-lens", "256",
           "--ranks", "2", "--repeats", "1", "--heads", "4", "--json", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    pieces = json.loads(out.read_text())
    assert pieces["layer"]["head_dim"] == 512 and pieces["kv_bytes_per_row"] == ROW_BYTES
    (case,) = pieces["cases"]
    assert {(b["rows"], b["kv_rows"], b["offset"]) for b in case["blocks"]} == {(64, 64, 0), (64, 64, None), (128, 128, 0),
                                                                            (64, 128, None), (128, 64, None)}  # fmt: skip
    assert all(b["ms"] > 0 for b in case["blocks"]) and pieces["one_device"][0]["ms"] > 0
    (pred,) = _script("cp_model").predict(pieces)["predictions"]
    assert pred["ranks"] == 2 and pred["total_ms"] > 0 and 0 < pred["speedup"]

"""``python -m mlx_native bench --transformers`` end to end on tiny models (the real shapes
take minutes: the lead runs them, docs/benchmarks.md). torch and transformers are test
extras: without them this module fails, not skips."""

from __future__ import annotations

import json

import pytest

from helpers import import_test_extra

transformers = import_test_extra("transformers")
torch = import_test_extra("torch")

from mlx_native.bench import cli, transformers_forward as tf  # noqa: E402


def _tiny(make):
    # The benchmark's model with the width of a test: same classes, same attention pattern.
    def config(transformers, layer_types):
        cfg = make(transformers, layer_types)
        for name, value in dict(hidden_size=32, intermediate_size=64, sliding_window=16).items():
            setattr(cfg, name, value)
        return cfg

    return config


@pytest.fixture
def tiny_models(monkeypatch):
    for name, make in list(tf.MODELS.items()):
        monkeypatch.setitem(tf.MODELS, name, _tiny(make))


def test_the_layer_pattern_is_gemmas():
    assert tf.layer_pattern(2) == ["sliding_attention", "full_attention"]
    assert tf.layer_pattern(6) == ["sliding_attention"] * 5 + ["full_attention"]
    assert tf.layer_pattern(7)[5:] == ["full_attention", "full_attention"]
    with pytest.raises(ValueError):
        tf.layer_pattern(0)


def test_every_implementation_is_timed_with_its_attention_share(tiny_models, capsys):
    report = tf.run_transformers_bench(rows=[32], layers=2, device="cpu", repeats=1)
    res = report["results"]
    assert [(r["model"], r["impl"]) for r in res] == [(m, i) for m in ("gemma3", "gemma4") for i in tf.IMPLS]
    for r in res:
        assert 0 < r["attention_s"] < r["forward_s"] and r["share"] == r["attention_s"] / r["forward_s"]
    ours = [r for r in res if r["impl"] == "mlx_native"]
    assert all(r["ours_x"] == 1.0 and r["ours_x_attention"] == 1.0 for r in ours)
    assert report["machine"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert "attention ms" in capsys.readouterr().out


def test_the_clock_times_what_runs_inside_it():
    import time

    clock = tf.AttentionClock(lambda: None)
    slow = clock.timed(lambda x: time.sleep(0.02) or x)
    assert slow(3) == 3 and slow(4) == 4 and 0.04 <= clock.seconds < 0.5
    clock.reset()
    assert clock.seconds == 0.0


def test_the_command_line_writes_json(tiny_models, tmp_path):
    path = tmp_path / "forward.json"
    status = cli.main(["--transformers", "--device", "cpu", "--rows", "24", "--models", "gemma4", "--layers", "1",
                       "--repeats", "1", "--json", str(path)])  # fmt: skip
    assert status == 0
    report = json.loads(path.read_text())
    assert {r["impl"] for r in report["results"]} == {"eager", "sdpa", "mlx_native"}
    assert cli.main(["--transformers", "--device", "cpu", "--models", "gpt2"]) == 2  # a model it does not have


def test_the_llama_model_runs_every_layer_global(tiny_models):
    report = tf.run_transformers_bench(rows=[40], models=["llama"], layers=2, device="cpu", repeats=1)
    res = report["results"]
    assert [(r["model"], r["impl"]) for r in res] == [("llama", i) for i in tf.IMPLS]
    assert all(0 < r["attention_s"] < r["forward_s"] for r in res)

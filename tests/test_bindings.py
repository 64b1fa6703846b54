"""The Python API over the C ABI: devices, buffers, encoders, constants, errors, CLI."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

import mlx_native as mx


def test_version_backends_and_cpu_info():
    assert mx.__version__ == mx.version() and mx.version().count(".") == 2
    assert "cpu" in mx.backends()
    info = mx.cpu_info()
    assert info["isa"] in info["detected"] and "portable" in info["detected"]
    assert info["threads"] >= 1


def test_constants_mirror_the_rust_op():
    assert mx.CACHE_ROWS_PER_STEP == 64
    assert mx.queries_per_threadgroup(256) == 32
    assert mx.queries_per_threadgroup(512) == 16
    assert mx.threadgroup_memory_bytes(256) == 28816
    assert mx.threadgroup_memory_bytes(512) == 22608
    assert [mx.kv_pad(n) for n in (1, 64, 65, 1281)] == [64, 64, 128, 1344]
    assert mx.K_TENSOR_F16_D256 == "flash_attn_prefill_tensor_f16_d256"
    with pytest.raises(mx.InvalidArgumentError, match="unsupported head_dim 128"):
        mx.queries_per_threadgroup(128)
    with pytest.raises(mx.InvalidArgumentError, match="cannot be padded"):
        mx.kv_pad(2**32 - 1)
    with pytest.raises(mx.InvalidArgumentError):
        mx.kv_pad(-1)


def test_devices():
    dev = mx.Device("cpu")
    assert dev.backend == "cpu" and "cpu" in dev.description
    assert mx.Device().backend == mx.backends()[0]
    assert mx.flash_attn_prefill_tensor_available(dev, 256)
    assert mx.flash_attn_prefill_tensor_available(dev, 512)
    with pytest.raises(mx.InvalidArgumentError):
        mx.flash_attn_prefill_tensor_available(dev, 100)
    with pytest.raises(mx.DeviceNotFoundError, match="unknown backend") as e:
        mx.Device("tpu")
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, mx.MlxError)
    with pytest.raises(mx.InvalidArgumentError):
        mx.Device(3)


@pytest.mark.skipif("cuda" in mx.backends(), reason="checks the no-GPU answer")
def test_a_missing_gpu_backend_is_a_clean_error():
    with pytest.raises(mx.BackendUnavailableError) as e:
        mx.Device("cuda")
    assert isinstance(e.value, mx.DeviceNotFoundError)


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8", "uint16", "uint32", "int32", "bfloat16"])
def test_buffer_round_trip(device, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    arr = (np.arange(60).reshape(3, 4, 5) % 50).astype(dt)
    b = device.buffer(arr)
    assert b.dtype == dt and b.shape == (3, 4, 5) and b.nbytes == arr.nbytes
    back = b.numpy()
    assert back.dtype == dt and np.array_equal(back.view(np.uint8), arr.view(np.uint8))
    e = device.empty((2, 3), dt)
    assert e.shape == (2, 3) and not e.numpy().view(np.uint8).any()


def test_cpu_buffers_wrap_contiguous_arrays_in_place(cpu):
    arr = np.zeros(16, np.float32)
    b = cpu.buffer(arr)
    arr[3] = 5.0
    assert b.numpy()[3] == 5.0, "a contiguous array is used in place"
    strided = np.zeros(32, np.float32)[::2]
    c = cpu.buffer(strided)
    strided[0] = 1.0
    assert c.numpy()[0] == 0.0, "a non-contiguous array is copied"
    d = cpu.buffer(arr, copy=True)
    arr[4] = 2.0
    assert d.numpy()[4] == 0.0


def test_a_buffer_keeps_its_array_alive(cpu):
    b = cpu.buffer(np.full(1 << 16, 3.0, np.float32))  # the only reference
    gc.collect()
    _ = [np.ones(1 << 16, np.float32) for _ in range(8)]  # reuse freed memory if any
    assert (b.numpy() == 3.0).all()


def test_unsupported_dtypes(cpu):
    for arr in (np.zeros(3, np.float64), np.zeros(3, np.int64), np.zeros(3, np.complex64)):
        with pytest.raises(mx.UnsupportedDtypeError) as e:
            cpu.buffer(arr)
        assert isinstance(e.value, TypeError)
    with pytest.raises(mx.InvalidArgumentError, match="negative"):
        cpu.empty((-1, 2))
    b = cpu.empty(4, np.float32)
    with pytest.raises(mx.UnsupportedDtypeError):
        b.write(np.zeros(4, np.float16))


def test_buffer_protocol_objects(cpu):
    raw = bytearray(np.arange(8, dtype=np.float32).tobytes())
    b = cpu.buffer(np.frombuffer(raw, dtype=np.float32))
    assert b.numpy()[7] == 7.0
    ro = cpu.buffer(np.frombuffer(bytes(16), dtype=np.uint8))
    assert not ro.writable
    with pytest.raises(mx.InvalidArgumentError, match="read-only"):
        ro.write(np.ones(16, np.uint8))


def test_closed_handles_are_errors_not_crashes(cpu):
    b = cpu.empty(8, np.float32)
    b.free()
    with pytest.raises(mx.InvalidHandleError, match="closed"):
        b.numpy()
    with pytest.raises(mx.InvalidHandleError):
        b.free()
    enc = cpu.encoder()
    enc.close()
    with pytest.raises(mx.InvalidHandleError):
        enc.commit()
    with pytest.raises(mx.InvalidHandleError):
        enc.close()
    d = mx.Device("cpu")
    buf = d.empty(4, np.float32)
    d.close()
    with pytest.raises(mx.InvalidHandleError):
        d.close()
    with pytest.raises(mx.InvalidHandleError):
        d.encoder()
    assert (buf.numpy() == 0).all(), "buffers outlive their device handle"


def test_buffers_of_another_device_are_refused(rng):
    a, b = mx.Device("cpu"), mx.Device("cpu")
    mask = a.empty((32, 64), np.float16)
    blk = b.empty((1, 1), np.uint8)
    enc = a.encoder()
    with pytest.raises(mx.InvalidArgumentError, match="buffer of device"):
        mx.dispatch_flash_attn_prefill_blk(enc, mask, blk, rows=32, kv_pad=64, bq=32)
    assert enc.pending == 0


def test_encoder_commits_on_exit_and_discards_on_error(cpu):
    mask = cpu.buffer(np.full((32, 64), -np.inf, np.float16))
    blk = cpu.buffer(np.full((1, 1), 9, np.uint8), copy=True)
    with cpu.encoder() as enc:
        mx.dispatch_flash_attn_prefill_blk(enc, mask, blk, rows=32, kv_pad=64, bq=32)
        assert enc.pending == 1
        assert blk.numpy()[0, 0] == 9, "nothing runs before the commit"
    assert blk.numpy()[0, 0] == 0
    blk.write(np.full((1, 1), 9, np.uint8))
    with pytest.raises(KeyError):
        with cpu.encoder() as enc:
            mx.dispatch_flash_attn_prefill_blk(enc, mask, blk, rows=32, kv_pad=64, bq=32)
            raise KeyError("boom")
    assert blk.numpy()[0, 0] == 9, "an encoder left by an exception runs nothing"


def test_blk_helper_classifies_crafted_masks():
    m = np.zeros((40, 128), np.float16)
    m[:32, :64] = -np.inf  # tile (0,0): skip
    m[0, 64] = -0.0  # tile (0,1): still all zero
    m[32:, :64] = np.float16(-65504)  # tile (1,0): <= -65504 counts as masked
    m[35, 100] = np.nan  # tile (1,1): NaN is "anything else"
    blk = mx.flash_attn_prefill_blk(m, bq=32, bk=64)
    assert blk.dtype == np.uint8 and blk.shape == (2, 2)
    assert blk.tolist() == [[0, 2], [0, 1]]
    with pytest.raises(mx.UnsupportedDtypeError):
        mx.flash_attn_prefill_blk(m.astype(np.float32), bq=32)


def test_causal_mask():
    m = mx.causal_mask(3, 5)
    assert m.dtype == np.float16 and m.shape == (3, 5)
    assert (np.isfinite(m) == np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)).all()
    w = mx.causal_mask(3, 5, window=2)
    assert (np.isfinite(w) == np.array([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], bool)).all()


def test_empty_problems(rng):
    q = np.zeros((0, 2, 256), np.float32)
    k = np.zeros((5, 1, 256), np.float16)
    assert mx.flash_attn_prefill(q, k, k).shape == (0, 2, 256)
    q = rng.uniform(-1, 1, (3, 2, 256)).astype(np.float32)
    k0 = np.zeros((0, 1, 256), np.float16)
    assert (mx.flash_attn_prefill(q, k0, k0) == 0).all()


def test_error_classes():
    pairs = [
        (mx.InvalidArgumentError, ValueError),
        (mx.UnsupportedDtypeError, TypeError),
        (mx.DeviceNotFoundError, RuntimeError),
        (mx.BufferAllocationError, MemoryError),
        (mx.KernelNotFoundError, LookupError),
        (mx.ShaderCompilationError, RuntimeError),
        (mx.CommandBufferError, RuntimeError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, mx.MlxError) and issubclass(cls, builtin)
    assert issubclass(mx.BackendUnavailableError, mx.DeviceNotFoundError)


def test_allocation_failure_is_a_memory_error(cpu):
    with pytest.raises(mx.BufferAllocationError) as e:
        cpu.empty((1 << 40, 1 << 30), np.float32)
    assert isinstance(e.value, MemoryError)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mlx_native", *args], capture_output=True, text=True, timeout=600)


def test_cli_info():
    r = _cli("info")
    assert r.returncode == 0, r.stderr
    assert "mlx-native" in r.stdout and "backends: " in r.stdout and "instruction set" in r.stdout


def test_cli_demo_small():
    r = _cli("demo", "--rows", "192", "--repeats", "1", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "26B sliding" in r.stdout and "26B global" in r.stdout and "OK" in r.stdout


def test_demo_times_the_device_resident_runs_on_a_device(device):
    """On a GPU the demo's speed is that of the plan's device-resident runs (encoded and
    committed together), the host round trip reported beside it; the encoded runs compute
    what plan.run does."""
    from mlx_native.demo import time_on_device
    from mlx_native.reference import random_qkv

    dev = mx.Device(device.backend)
    q, k, v = random_qkv(96, 4, 2, 256, 96, np.random.default_rng(3))
    plan = mx.PrefillPlan(q, k, v, causal=True, window=32, device=dev)
    assert time_on_device(plan, dev, repeats=1, runs=2) > 0
    assert np.array_equal(np.asarray(plan.encoded_result()), np.asarray(plan.run()))
    results = mx.demo.run_demo(rows=64, device=device.backend, repeats=1)
    assert [r["layer"] for r in results] == ["26B sliding", "26B global"]
    assert all(r["ms"] > 0 and r["host_ms"] > 0 and r["nmse"] <= 5e-4 for r in results)

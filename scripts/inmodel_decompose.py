"""Where the attention's time goes inside a transformers forward on the CPU (issue 26):
one Llama-3-8B-shaped layer's attention call (d128, 32 query / 8 KV heads, causal, one
prompt of ROWS tokens) timed piece by piece, in one process, best of N rounds taken in turn.

    python scripts/inmodel_decompose.py [--rows 2048] [--dtype float32 bfloat16] [--repeats 5]

The inputs are made as transformers makes them: the projections' outputs ``[1, S, H*D]``
viewed ``[1, S, H, D]`` and transposed to ``[1, H, S, D]``, then RoPE (``q*cos +
rotate_half(q)*sin``), which keeps that layout. Rows:

- ``sdpa (transformers fn)``: transformers' ``sdpa_attention_forward`` on them (enable_gqa,
  is_causal), with its transpose back and ``.contiguous()``;
- ``ours (transformers fn)``: ``integrations.transformers.attention_forward`` on them (the
  whole in-model call: K/V cast, the front door, the torch operator, the kernels);
- ``kv cast``: the cast of K and V that it makes;
- ``front door, model layout``: ``mn.flash_attn_prefill`` on the views with K/V already in
  the kernel's K/V dtype;
- ``front door, contiguous``: the same on contiguous ``[1, S, H, D]`` copies;
- ``torch op, model layout``: the registered operator called directly;
- ``front door, K/V in model dtype``: (bfloat16) the front door on the views with K/V as
  the model gives them, uncast.
"""

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

import mlx_native as mn
from mlx_native import _lib
from mlx_native.integrations import transformers as mn_hf
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def model_inputs(rows, dt, hq=32, hkv=8, d=128, hidden=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, hidden, generator=g).to(dt)
    wq = (torch.randn(hq * d, hidden, generator=g) / hidden**0.5).to(dt)
    wk = (torch.randn(hkv * d, hidden, generator=g) / hidden**0.5).to(dt)
    wv = (torch.randn(hkv * d, hidden, generator=g) / hidden**0.5).to(dt)
    pos = torch.arange(rows, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = pos[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dt)[None, None], emb.sin().to(dt)[None, None]

    def rot(t):
        t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2 :]
        return torch.cat((-t2, t1), dim=-1)

    with torch.inference_mode():
        q = F.linear(x, wq).view(1, rows, hq, d).transpose(1, 2)
        k = F.linear(x, wk).view(1, rows, hkv, d).transpose(1, 2)
        v = F.linear(x, wv).view(1, rows, hkv, d).transpose(1, 2)
        q = q * cos + rot(q) * sin
        k = k * cos + rot(k) * sin
    return q, k, v


class Module(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def best_of(fns, repeats):
    best = {name: float("inf") for name in fns}
    for name, fn in fns.items():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="run only these rows (substring match)")
    a = ap.parse_args()
    mod = Module()
    scale = 128**-0.5
    report = dict(rows=a.rows, threads=torch.get_num_threads(), torch=torch.__version__, results={})
    for name in a.dtype:
        dt = getattr(torch, name)
        q, k, v = model_inputs(a.rows, dt)
        kvdt = mn_hf.KV_DTYPE
        k16, v16 = k.to(kvdt), v.to(kvdt)
        kb, vb = k.clone(), v.clone()  # as given (bf16/f32), model layout
        qc, kc, vc = (t.transpose(1, 2).contiguous() for t in (q, k16, v16))
        out = {}

        def run_sdpa():
            with torch.inference_mode():
                out["sdpa"] = sdpa_attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True)[0]

        def run_ours():
            with torch.inference_mode():
                out["ours"] = mn_hf.attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True)[0]

        def run_cast():
            with torch.inference_mode():
                out["cast"] = (k.to(kvdt), v.to(kvdt))

        def run_front_model():
            with torch.inference_mode():
                out["fm"] = mn.flash_attn_prefill(q.transpose(1, 2), k16.transpose(1, 2), v16.transpose(1, 2),
                                                  causal=True, scale=scale)

        def run_front_same():
            # K/V in the model's own dtype (no cast): bf16 K/V to the bf16 kernels
            with torch.inference_mode():
                out["fs"] = mn.flash_attn_prefill(q.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                                  causal=True, scale=scale)

        def run_front_contig():
            with torch.inference_mode():
                out["fc"] = mn.flash_attn_prefill(qc, kc, vc, causal=True, scale=scale)

        def run_op():
            with torch.inference_mode():
                out["op"] = torch.ops.mlx_native.flash_attn_prefill(q.transpose(1, 2), k16.transpose(1, 2),
                                                                    v16.transpose(1, 2), None, True, None, scale)

        from mlx_native._lib import lib as _native

        def run_front_rayon():
            # the kernels' jobs on our own pool (as the kernel benchmark's numpy plans run)
            _native.mlxn_cpu_use_openmp(0, _lib.ffi.NULL)
            try:
                run_front_model()
            finally:
                _native.mlxn_cpu_use_openmp(1, _lib.ffi.NULL)

        fns = {
            "sdpa (transformers fn)": run_sdpa,
            "ours (transformers fn)": run_ours,
            "kv cast": run_cast,
            "front door, model layout": run_front_model,
            "front door, contiguous": run_front_contig,
            "torch op, model layout": run_op,
            "front door, model layout, rayon": run_front_rayon,
        }
        if dt != kvdt:
            fns["front door, K/V in model dtype"] = run_front_same
        if a.only:
            fns = {k_: f for k_, f in fns.items() if any(s in k_ for s in a.only)}
        best = best_of(fns, a.repeats)
        # same results either layout?
        run_front_model(); run_front_contig(); run_ours()
        same = torch.equal(out["fm"], out["fc"]) and torch.equal(out["ours"], out["fm"])
        if "fs" in out:
            run_front_same()
            same = f"{same}; K/V uncast == cast: {torch.equal(out['fs'], out['fm'])}"
        print(f"q/k/v as the model gives them, transposed to [B, S, H, D]: contiguous "
              f"{[t.transpose(1, 2).is_contiguous() for t in (q, k, v)]}, strides {q.stride()} {k.stride()}")
        print(f"{name}: rows {a.rows}, torch threads {torch.get_num_threads()}, runtime "
              f"model layout == contiguous == transformers fn: {same}")
        for k_, t in best.items():
            print(f"  {k_:34s} {1e3 * t:9.2f} ms")
        if "sdpa (transformers fn)" in best and "ours (transformers fn)" in best:
            print(f"  sdpa / ours (transformers fn)       {best['sdpa (transformers fn)'] / best['ours (transformers fn)']:.3f}x")
        report["results"][name] = {k_: 1e3 * t for k_, t in best.items()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

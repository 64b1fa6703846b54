"""What keeping a bfloat16 model's K/V uncast changes on the AMX item, on a CPU without AMX:
the AMX kernels on software tiles (``amx-emulated``: the same arithmetic as the hardware
tiles, far slower), K/V cast to float16 (the split-product F16 item) against K/V as given
(the BF16 item), one Llama-shaped layer (d128, 32/8 heads, causal) on inputs made as
transformers makes them. Prints the NMSE of each against float64 attention on the same
bfloat16 values (and PyTorch's bfloat16 SDPA's), and the time of each on the software tiles
(a count of the work, not a hardware time), best of 3.

    python scripts/inmodel_amx_emulated.py [--rows 256]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inmodel_decompose import Module, model_inputs  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import mlx_native as mn  # noqa: E402
from mlx_native.integrations import transformers as mn_hf  # noqa: E402


def reference(q, k, v, scale):
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    a = ap.parse_args()
    q, k, v = model_inputs(a.rows, torch.bfloat16)
    mod, scale = Module(), 128**-0.5
    want = reference(q, k, v, scale)
    nmse = lambda o: (((o.double() - want) ** 2).sum() / (want**2).sum()).item()  # noqa: E731
    as_given = mn_hf._kv
    cast = lambda x: x.to(torch.float16)  # noqa: E731
    with torch.inference_mode():
        sdpa = sdpa_attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True)[0]
        print(f"rows {a.rows}; PyTorch bf16 SDPA NMSE {nmse(sdpa):.3e}")
        for isa in ("amx-emulated", mn.cpu_info()["isa"]):
            mn.force_cpu_isa(isa)
            try:
                outs = {}
                for label, kv in (("K/V cast to float16", cast), ("K/V as given (bf16)", as_given)):
                    mn_hf._kv = kv
                    try:
                        mn_hf.attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True)
                        dt = float("inf")
                        for _ in range(3):
                            t = time.perf_counter()
                            outs[label] = mn_hf.attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True)[0]
                            dt = min(dt, time.perf_counter() - t)
                    finally:
                        mn_hf._kv = as_given
                    print(f"  {isa:14s} {label:22s} NMSE {nmse(outs[label]):.3e}  {1e3 * dt:9.1f} ms")
                a_, b_ = outs.values()
                print(f"  {isa:14s} bit-identical: {torch.equal(a_, b_)}")
            finally:
                mn.force_cpu_isa(None)


if __name__ == "__main__":
    main()

"""The Python layers of one in-model call, on a problem small enough that the kernel is a
few microseconds (Llama's heads, d128 32/8, ROWS rows, bfloat16 model inputs made as
transformers makes them): each layer timed as a whole, best of BLOCKS blocks of N calls, so
that each layer's own cost is its time less the next one's.

    python scripts/inmodel_layers.py [--rows 8] [--n 300] [--blocks 15] [--clock thread|wall]
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
from mlx_native import attention, torch_ops  # noqa: E402,F401  (torch_ops registers the operators)
from mlx_native.integrations import transformers as mn_hf  # noqa: E402
from mlx_native.options import PrefillArgs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--clock", default="thread", choices=["thread", "wall"],
                    help="thread: the calling thread's CPU time (time.thread_time), which a loaded machine's "
                         "other processes do not inflate; our kernel at these sizes runs on the calling thread "
                         "alone (below the pool's SERIAL_WORK), PyTorch's SDPA may not (then it under-counts)")
    a = ap.parse_args()
    q, k, v = model_inputs(a.rows, getattr(torch, a.dtype))
    mod, scale = Module(), 128**-0.5
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    kk, vv = mn_hf._kv(k), mn_hf._kv(v)
    qt, kt, vt = t(q), t(kk), t(vv)
    args = PrefillArgs(causal=True, scale=scale)
    op = torch.ops.mlx_native.flash_attn_prefill.default
    fns = {
        "transformers' sdpa_attention_forward": lambda: sdpa_attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True),
        "our attention_forward (integration)": lambda: mn_hf.attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True),
        "mn.flash_attn_prefill (front door)": lambda: mn.flash_attn_prefill(qt, kt, vt, causal=True, scale=scale),
        "torch op (dispatcher + kernel fn)": lambda: op(qt, kt, vt, None, True, None, scale),
        "attention.prefill (array call)": lambda: attention.prefill(qt, kt, vt, args),
    }
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    best = {n: float("inf") for n in fns}
    with torch.inference_mode():
        for f in fns.values():
            for _ in range(20):
                f()
        for _ in range(a.blocks):
            for n, f in fns.items():
                s = clock()
                for _ in range(a.n):
                    f()
                best[n] = min(best[n], (clock() - s) / a.n)
    print(f"{a.dtype}, {a.rows} rows, d128 32/8, {torch.get_num_threads()} threads: us per call ({a.clock} clock), "
          f"best of {a.blocks} blocks of {a.n}")
    for n, x in best.items():
        print(f"  {n:40s} {1e6 * x:8.1f}")


if __name__ == "__main__":
    main()

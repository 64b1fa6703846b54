"""The transformers attention function with K/V cast to float16 (as before) against K/V
handed in the model's own dtype, in one process, taken in turn, best of N (issue 26's
in-model question): one Llama-3-8B-shaped layer (d128, 32/8 heads, causal).

    python scripts/inmodel_kv_ab.py [--rows 2048] [--dtype bfloat16 float32] [--repeats 8]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inmodel_decompose import Module, model_inputs  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from mlx_native.integrations import transformers as mn_hf  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=8)
    a = ap.parse_args()
    mod, scale = Module(), 128**-0.5
    as_given = mn_hf._kv

    def cast(x):  # the integration before: every K/V to float16
        return x if x.dtype == torch.float16 else x.to(torch.float16)

    def uncast(x):
        return x

    for name in a.dtype:
        q, k, v = model_inputs(a.rows, getattr(torch, name))
        outs = {}

        def ours(kv):
            def run():
                mn_hf._kv = kv
                try:
                    with torch.inference_mode():
                        outs[kv.__name__] = mn_hf.attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True)[0]
                finally:
                    mn_hf._kv = as_given
            return run

        def sdpa():
            with torch.inference_mode():
                sdpa_attention_forward(mod, q, k, v, None, scaling=scale, is_causal=True)

        fns = {"K/V cast to float16": ours(cast), "K/V as given": ours(uncast), "integration as it is": ours(as_given),
               "sdpa": sdpa}
        best = {n: [] for n in fns}
        for f in fns.values():
            f()
        for _ in range(a.repeats):
            for n, f in fns.items():
                t = time.perf_counter()
                f()
                best[n].append(time.perf_counter() - t)
        same = torch.equal(outs["cast"], outs["uncast"])
        diff = (outs["cast"].float() - outs["uncast"].float()).abs().max().item()
        print(f"{name}, {a.rows} rows, {torch.get_num_threads()} threads; outputs bit-identical: {same}"
              + ("" if same else f" (max diff {diff:.3g})"))
        for n, ts in best.items():
            ts.sort()
            print(f"  {n:24s} best {1e3 * ts[0]:8.2f} ms  second {1e3 * ts[1]:8.2f}  median {1e3 * ts[len(ts) // 2]:8.2f}")
        print(f"  sdpa / ours: cast {best['sdpa'][0] / best['K/V cast to float16'][0]:.3f}x, "
              f"as given {best['sdpa'][0] / best['K/V as given'][0]:.3f}x")


if __name__ == "__main__":
    main()

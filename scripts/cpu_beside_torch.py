"""Our CPU calls inside a torch program with its default environment: a run of small
flash-attn-style cases, each a few torch ops (OpenMP, whose threads spin-wait after each op)
around one call of ours, against the same run with PyTorch's SDPA in our place. Prints the
seconds of each and their ratio; run it with and without OMP_WAIT_POLICY=PASSIVE to see
what the spinning costs.

    python scripts/cpu_beside_torch.py [--cases 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import mlx_native as mn


def case(i: int, attend):
    g = torch.Generator().manual_seed(i)
    b, s, h, hkv, d = 2, 16 + 7 * (i % 9), 4, 2, (64, 128)[i % 2]
    q = torch.randn(b, s, h, d, generator=g)
    k = torch.randn(b, s + 5, hkv, d, generator=g).half()
    v = torch.randn(b, s + 5, hkv, d, generator=g).half()
    qn = q / q.norm(dim=-1, keepdim=True)  # a few torch ops around the call, as a test does
    out = attend(qn, k, v)
    return (out.float() - qn).abs().amax()


def ours(q, k, v):
    return mn.flash_attn_prefill(q, k, v, causal=True)


def sdpa(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
                                       is_causal=False, enable_gqa=True)  # fmt: skip
    return o.transpose(1, 2)


def run(attend, cases: int) -> float:
    t0 = time.perf_counter()
    for i in range(cases):
        case(i, attend)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    run(ours, 4), run(sdpa, 4)  # warm-up: plans, kernels, torch's pools
    t_ours = min(run(ours, a.cases) for _ in range(a.repeats))
    t_sdpa = min(run(sdpa, a.cases) for _ in range(a.repeats))
    print(f"torch threads {torch.get_num_threads()}, ours {mn.get_num_threads()}: {a.cases} cases, "
          f"ours {t_ours:.3f} s, sdpa {t_sdpa:.3f} s, ours / sdpa {t_ours / t_sdpa:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

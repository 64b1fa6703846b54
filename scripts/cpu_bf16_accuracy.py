"""bfloat16 attention on the CPU against float64 (issue 26): ours with the default products and
with one product of P (P rounded to bfloat16), and PyTorch's SDPA, causal GQA, 1024 rows,
uniform and normal inputs; NMSE against the float64 reference on the rounded inputs, and
each result's NMSE against PyTorch's (how near ours is to what PyTorch computes).

    python scripts/cpu_bf16_accuracy.py
"""
import torch
import torch.nn.functional as F

import mlx_native as mn


def reference(q, k, v):
    q, k, v = (x.double() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("shd,thd->hst", q, k) / q.shape[-1] ** 0.5
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hst,thd->shd", s.softmax(-1), v)


def nmse(a, r):
    a, r = a.double(), r.double()
    return float(((a - r) ** 2).sum() / (r**2).sum())


def main():
    torch.manual_seed(0)
    print("head dim, inputs: NMSE against float64 (against PyTorch's result)")
    for d, hq, hk in [(128, 32, 8), (256, 16, 8)]:
        for dist in ["uniform", "normal"]:
            n = 1024
            make = (lambda *s: torch.rand(*s) * 2 - 1) if dist == "uniform" else torch.randn
            q, k, v = (make(n, h, d).to(torch.bfloat16) for h in (hq, hk, hk))
            ref = reference(q, k, v)
            t = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
            row = {"torch": f"{nmse(t, ref):.3e}"}
            for name, products in [("default", None), ("one product of P", (1, 1))]:
                if products:
                    mn.set_cpu_amx_products("bfloat16", *products)
                try:
                    out = mn.flash_attn_prefill(q, k, v, causal=True)
                finally:
                    mn.set_cpu_amx_products("bfloat16")
                row[name] = f"{nmse(out, ref):.3e} ({nmse(out, t):.1e})"
            print(f"d{d} {dist}: {row}")


if __name__ == "__main__":
    main()

"""The CPU peers of the benchmark: PyTorch's ``scaled_dot_product_attention`` and MLX's
``mx.fast.scaled_dot_product_attention`` on the CPU, and the float64 reference; each is
imported only when it runs."""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from ..reference import reference_attention
from .peers import Peer, Problem, Variant, group, register_peer


# ---------------------------------------------------------------- PyTorch on the CPU


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _torch_heads_first(x: np.ndarray, dtype):
    """``[rows, heads, dim]`` numpy (any float type, bfloat16 through ml_dtypes, which torch
    cannot take directly) as a contiguous torch ``[heads, rows, dim]`` of ``dtype``; the
    values are exact in it."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32).transpose(1, 0, 2))).to(dtype)


class TorchCpuSdpa(Peer):
    """``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors ``[1, heads, rows,
    dim]`` in the run's data type (float32, float16 or bfloat16, where PyTorch takes its
    AMX path on CPUs that have one); the KV heads are repeated to the query heads beforehand
    (outside the timing), and for the built-in causal mode also given as they are with
    ``enable_gqa`` (what a model calls). On a paged case (``problem.paged``) the same
    variants, labelled ``gather timed``, each gather the K/V from the cache's blocks through
    the block table inside its timed run (and repeat them to the query heads there too, where
    the variant repeats them): what calling SDPA on a paged cache costs a user."""

    name = "torch"
    install_hint = "pip install torch"
    paged_ok = True

    def missing(self) -> Optional[str]:
        try:
            import torch  # noqa: F401
            import torch.nn.functional as F

            if not hasattr(F, "scaled_dot_product_attention"):
                return f"torch {torch.__version__} has no scaled_dot_product_attention"
        except Exception as e:  # an ImportError, or a broken install's OSError
            return f"not importable ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def version(self) -> Optional[str]:
        import torch

        return torch.__version__

    def variants(self, problem: Problem) -> List[Variant]:
        import torch
        import torch.nn.functional as F

        if problem.threads:
            torch.set_num_threads(problem.threads)
        g = group(problem)
        dt = _torch_dtype(problem.dtype)
        q = _torch_heads_first(problem.q, dt)[None]
        if problem.paged is not None:
            return self._paged_variants(problem, q, g, dt)
        kg = _torch_heads_first(problem.k, dt)[None]
        vg = _torch_heads_first(problem.v, dt)[None]
        k = kg[0].repeat_interleave(g, dim=0).contiguous()[None]
        v = vg[0].repeat_interleave(g, dim=0).contiguous()[None]
        # The additive mask in the inputs' type (-inf and 0 are exact in every one).
        mask = torch.from_numpy(problem.mask.astype(np.float32)).to(dt)
        state = {}

        def make(label, mode, kk=k, vv=v, **kw):
            def run():
                with torch.inference_mode():
                    state[label] = F.scaled_dot_product_attention(q, kk, vv, scale=problem.scale, **kw)

            def output():
                return state[label][0].permute(1, 0, 2).float().numpy()

            return Variant(label, run, output, mode=mode, kv_repeated=kk is k)

        out = [make("torch sdpa, same mask", "mask", attn_mask=mask)]
        if problem.causal and problem.q.shape[0] == problem.k.shape[0]:  # is_causal: the prompt at the cache's start
            out.append(make("torch sdpa, is_causal", "causal", is_causal=True))
            if g > 1:
                out.append(make("torch sdpa, is_causal, enable_gqa", "causal", kg, vg, is_causal=True, enable_gqa=True))
        if problem.dense:
            out.append(make("torch sdpa, no mask", "none"))
        return out

    def _paged_variants(self, problem: Problem, q, g: int, dt) -> List[Variant]:
        import torch
        import torch.nn.functional as F

        pc = problem.paged
        n = int(pc.seqused_k[0])
        table = torch.from_numpy(pc.block_table[0].astype(np.int64))
        # The caches in the run's type, as the blocks lie (float32 through ml_dtypes' bfloat16).
        kc = torch.from_numpy(np.ascontiguousarray(pc.k.astype(np.float32))).to(dt)
        vc = torch.from_numpy(np.ascontiguousarray(pc.v.astype(np.float32))).to(dt)
        mask = torch.from_numpy(problem.mask.astype(np.float32)).to(dt)
        state = {}

        def gathered(cache, repeat):
            # [blocks, block_size, kv_heads, dim] -> the sequence's rows -> [1, heads, n, dim].
            rows = cache.index_select(0, table).flatten(0, 1)[:n].transpose(0, 1)
            return (rows.repeat_interleave(g, dim=0) if repeat else rows)[None]

        def make(label, mode, repeat=True, **kw):
            def run():
                with torch.inference_mode():
                    k, v = gathered(kc, repeat), gathered(vc, repeat)
                    state[label] = F.scaled_dot_product_attention(q, k, v, scale=problem.scale, **kw)

            def output():
                return state[label][0].permute(1, 0, 2).float().numpy()

            return Variant(label, run, output, mode=mode, kv_repeated=repeat)

        out = [make("torch sdpa, same mask, gather timed", "mask", attn_mask=mask)]
        if problem.causal and problem.q.shape[0] == n:
            out.append(make("torch sdpa, is_causal, gather timed", "causal", is_causal=True))
            if g > 1:
                out.append(make("torch sdpa, is_causal, enable_gqa, gather timed", "causal", False, is_causal=True,
                                enable_gqa=True))  # fmt: skip
        if problem.dense:
            out.append(make("torch sdpa, no mask, gather timed", "none"))
        return out


# ---------------------------------------------------------------- MLX on the CPU


class MlxFastSdpa(Peer):
    """MLX's ``mx.fast.scaled_dot_product_attention`` on arrays ``[1, heads, rows, dim]`` of
    the run's data type (MLX handles GQA itself) on the CPU stream."""

    name = "mlx"
    install_hint = "pip install 'mlx[cpu]' (Linux) or mlx (macOS)"

    def __init__(self, stream: str = "cpu"):
        self.stream = stream

    def missing(self) -> Optional[str]:
        try:
            import mlx.core as mc

            q = mc.zeros((1, 1, 2, 4))
            mc.eval(mc.fast.scaled_dot_product_attention(q, q, q, scale=1.0, stream=getattr(mc, self.stream)))
        except Exception as e:
            return f"cannot run ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def version(self) -> Optional[str]:
        import mlx.core as mc

        return getattr(mc, "__version__", None)

    def variants(self, problem: Problem) -> List[Variant]:
        import mlx.core as mc

        dev = getattr(mc, self.stream)
        dt = getattr(mc, problem.dtype)

        def arr(x):
            # Through float32: MLX takes no ml_dtypes bfloat16 array; the values are exact.
            return mc.array(np.ascontiguousarray(x.astype(np.float32).transpose(1, 0, 2))[None]).astype(dt)

        q, k, v = arr(problem.q), arr(problem.k), arr(problem.v)
        mask = mc.array(problem.mask.astype(np.float32)).astype(dt)
        mc.eval(q, k, v, mask)
        state = {}

        def make(label, mode, m):
            def run():
                o = mc.fast.scaled_dot_product_attention(q, k, v, scale=problem.scale, mask=m, stream=dev)
                mc.eval(o)
                state[label] = o

            def output():
                return np.array(state[label].astype(mc.float32))[0].transpose(1, 0, 2)

            return Variant(label, run, output, mode=mode, kv_repeated=False)

        out = [make("mlx fast sdpa, same mask", "mask", mask)]
        if problem.causal:
            out.append(make("mlx fast sdpa, causal", "causal", "causal"))
        return out


# ---------------------------------------------------------------- the float64 reference


class NumpyReference(Peer):
    """``mlx_native.reference.reference_attention``: exact float64 numpy, every head (run
    at the smallest size only; a reference, so no competitor in the summary); on a paged
    case, on the same rows contiguous."""

    name = "reference"
    paged_ok = True

    def variants(self, problem: Problem) -> List[Variant]:
        state = {}

        def run():
            state["o"] = reference_attention(problem.q, problem.k, problem.v, problem.mask, scale=problem.scale)

        return [Variant("numpy float64 reference", run, lambda: state["o"].astype(np.float32), smallest_only=True)]


register_peer("cpu", TorchCpuSdpa())
register_peer("cpu", MlxFastSdpa("cpu"))
register_peer("cpu", NumpyReference())

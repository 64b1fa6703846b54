"""A pool of processes that stay up for many context-parallel cases (torch.multiprocessing,
spawn, gloo): each joins one world, makes the same subgroups, then runs the cases it is sent
and answers with its rows of the result (or the error it raised), the calls of
``flash_attn_prefill`` it made and the K/V rows it sent. Imported by the spawned children,
so it holds only what they need."""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Dict, List, Optional

import numpy as np

#: Seconds a case may take before the pool is declared stuck.
CASE_TIMEOUT_S = 120


def whole_sequence(case: dict):
    """q, k, v of the whole sequence of a case, the same on every process (numpy)."""
    rng = np.random.default_rng(case["seed"])
    n, nh, nkv, hd = case["seq_len"], case["heads"], case["kv_heads"], case["head_dim"]
    q = rng.uniform(-1, 1, (n, nh, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, (n, nkv, hd)).astype(np.float16)
    v = rng.uniform(-1, 1, (n, nkv, hd)).astype(np.float16)
    return q, k, v


def _run_case(rank: int, groups: Dict[str, Any], case: dict, device: str = "cpu") -> Optional[dict]:
    import torch
    import torch.distributed as dist

    import mlx_native.distributed.prefill as prefill
    from mlx_native.distributed import context_parallel_prefill, shard_sequence

    name = case.get("group")
    group = None if name is None else groups[name]
    members = case["members"]
    if rank not in members and not case.get("call_anyway"):
        return None
    size, me = len(members), members.index(rank) if rank in members else 0
    q, k, v = (torch.from_numpy(x) for x in whole_sequence(case))
    q = q.to(getattr(torch, case.get("q_dtype", "float32")))
    q, k, v = (x.to(device) for x in (q, k, v))
    q, k, v = (shard_sequence(x, size, me, case.get("shard_layout", case["layout"])) for x in (q, k, v))
    kw = dict(causal=case.get("causal", True), window=case.get("window"), scale=case.get("scale"),
              layout=case["layout"], seq_len=case.get("pass_seq_len"), return_lse=True, out_dtype=case.get("out_dtype"))  # fmt: skip
    kw.update(case.get("per_rank", {}).get(rank, {}))
    edit = case.get("edit", {}).get(rank)
    if edit == "rows-1":
        q, k, v = q[1:], k[1:], v[1:]
    elif edit == "k-float32":
        k = k.float()
    elif edit == "numpy":
        q = q.numpy()

    calls: List[tuple] = []
    sent: List[int] = []
    real_call, real_batch = prefill.flash_attn_prefill, dist.batch_isend_irecv

    def counted_call(qq, kk, vv, **a):
        calls.append((int(qq.shape[0]), int(kk.shape[0]), a.get("offset"), bool(a.get("causal"))))
        return real_call(qq, kk, vv, **a)

    def counted_batch(ops):
        sent.extend(int(op.tensor.shape[0]) for op in ops if op.op is dist.isend)
        return real_batch(ops)

    prefill.flash_attn_prefill, dist.batch_isend_irecv = counted_call, counted_batch
    try:
        out, lse = context_parallel_prefill(q, k, v, group=group, **kw)
    finally:
        prefill.flash_attn_prefill, dist.batch_isend_irecv = real_call, real_batch
    dtype = str(out.dtype).replace("torch.", "")
    assert out.device == q.device and lse.device == q.device
    return dict(out=out.float().cpu().numpy(), out_dtype=dtype, lse=lse.cpu().numpy(), calls=calls, sent=sent)


def _worker(rank: int, world: int, init: str, groups: Dict[str, List[int]], tasks, results, backend: str) -> None:
    import torch
    import torch.distributed as dist

    device = "cpu"
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    made = {name: dist.new_group(ranks) for name, ranks in groups.items()}  # every rank, in one order
    while True:
        case = tasks.get()
        if case is None:
            break
        try:
            results.put((rank, "ok", _run_case(rank, made, case, device)))
        except Exception as e:  # reported to the test, which decides
            from mlx_native import MlxError

            kind = dict(cls=type(e).__name__, message=str(e), mlx=isinstance(e, MlxError),
                        value=isinstance(e, ValueError), type=isinstance(e, TypeError), trace=traceback.format_exc())  # fmt: skip
            results.put((rank, "error", kind))
    dist.destroy_process_group()


class RankPool:
    """``world`` processes of one world (gloo on the CPU, or NCCL with one GPU each) with the
    subgroups ``groups`` (name -> global ranks); :meth:`run` sends a case to every process
    and returns each one's answer."""

    def __init__(self, world: int, groups: Dict[str, List[int]], backend: str = "gloo"):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world = world
        fd, self._init_file = tempfile.mkstemp(prefix="mlxn-cp-")
        os.close(fd)
        os.unlink(self._init_file)  # file:// rendezvous wants a path that does not exist yet
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world, f"file://{self._init_file}", groups, self._tasks[r], self._results, backend),
                        daemon=True)
            for r in range(world)
        ]  # fmt: skip
        for p in self._procs:
            p.start()

    def run(self, case: dict) -> Dict[int, tuple]:
        for t in self._tasks:
            t.put(case)
        answers = {}
        while len(answers) < self.world:
            try:
                rank, status, value = self._results.get(timeout=CASE_TIMEOUT_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise AssertionError(f"the ranks did not answer within {CASE_TIMEOUT_S} s (dead: {dead}); case {case}")
            answers[rank] = (status, value)
        return answers

    def close(self) -> None:
        for t in self._tasks:
            t.put(None)
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)

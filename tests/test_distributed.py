"""Context-parallel prefill (``mlx_native.distributed``): ring attention over torch.distributed,
run here on CPU processes with gloo. One pool of 4 processes serves every case; groups of 1,
2 (global ranks 1 and 3: group ranks are not global ranks), 3 and 4 ranks. Each rank's rows
must match the one-process prefill of the whole sequence (``flash_attn_prefill``) and the
float64 reference, lse too; the calls each rank made and the K/V it sent must be those of
the schedule (nothing computed or sent that nobody needs). The schedule itself is checked
in-process against the visibility of every (query, key) pair.

torch is required (the test extra): without it this module fails to import, it does not skip."""

from __future__ import annotations

import itertools
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch  # noqa: F401  (required: fail, not skip, without it)

import mlx_native as mn
from mlx_native.distributed import (
    chunk_bounds,
    context_parallel_prefill,
    local_positions,
    local_rows,
    rank_chunks,
    ring_schedule,
    shard_sequence,
)
from mlx_native.distributed.accumulate import Accumulator, merge_into
from mlx_native.distributed.schedule import OWN, pair_kind
from mlx_native.reference import merge_reference, nmse, reference_prefill, visible_mask

from distributed_ranks import RankPool, whole_sequence

BAR = 1e-5  # against the float64 reference, as the front door's tests
SAME = 1e-6  # against the one-process prefill (both within ~5e-8 of the reference)
LSE_TOL = 2e-3  # SPEC 8

GROUPS = {"solo": [2], "pair": [1, 3], "trio": [0, 1, 2]}
MEMBERS = {None: [0, 1, 2, 3], "solo": [2], "pair": [1, 3], "trio": [0, 1, 2]}


@pytest.fixture(scope="module")
def pool():
    p = RankPool(4, GROUPS)
    yield p
    p.close()


def _case(group, seq_len, layout="zigzag", heads=4, kv_heads=2, head_dim=256, seed=0, **kw):
    return dict(group=group, members=MEMBERS[group], seq_len=seq_len, layout=layout, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, seed=seed, **kw)  # fmt: skip


def _answers(pool, case):
    answers = pool.run(case)
    members = case["members"]
    for rank, (status, value) in answers.items():
        if rank not in members:
            assert status == "ok" and value is None
        elif status != "ok":
            pytest.fail(f"rank {rank} raised {value['cls']}: {value['message']}\n{value['trace']}")
    return {members.index(r): answers[r][1] for r in members}


# ------------------------------------------------------------------ results


def _check_results(case, got):
    n, layout, hd, causal, window = case["seq_len"], case["layout"], case["head_dim"], case["causal"], case["window"]
    q, k, v = whole_sequence(case)
    tq = torch.from_numpy(q).to(getattr(torch, case.get("q_dtype", "float32")))
    scale = case.get("scale")
    one, one_lse = mn.flash_attn_prefill(tq, torch.from_numpy(k), torch.from_numpy(v), causal=causal, window=window,
                                         scale=scale, return_lse=True, out_dtype=torch.float32)  # fmt: skip
    ref, ref_lse = reference_prefill(tq.float().numpy(), k, v, causal=causal, window=window, scale=scale or 1 / np.sqrt(hd))
    size = len(case["members"])
    out_dtype = case.get("out_dtype") or case.get("q_dtype", "float32")
    schedule = ring_schedule(n, size, layout, causal, window)
    for r, ans in got.items():
        rows = local_rows(n, size, r, layout)
        mine = shard_sequence(one.numpy(), size, r, layout)
        mine_ref = shard_sequence(ref, size, r, layout)
        mine_lse = shard_sequence(ref_lse.T, size, r, layout).T
        assert ans["out"].shape == (rows, case["heads"], hd) and ans["lse"].shape == (case["heads"], rows)
        assert ans["out_dtype"] == out_dtype
        if out_dtype == "float32":
            assert nmse(ans["out"], mine) < SAME, f"rank {r}: {nmse(ans['out'], mine):.2e} from the one-process prefill"
            assert nmse(ans["out"], mine_ref) < BAR
        else:  # rounded once, at the end, from the float32 merge (the front door's bars)
            rounded = mine_ref.astype({"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[out_dtype])
            assert nmse(ans["out"], rounded) < {"float16": 1.5e-6, "bfloat16": 6.5e-5}[out_dtype]
        assert np.all(np.isfinite(ans["lse"]))  # self-attention: every row sees itself at least
        assert np.abs(ans["lse"] - mine_lse).max(initial=0) < LSE_TOL
        assert np.abs(ans["lse"] - shard_sequence(one_lse.numpy().T, size, r, layout).T).max(initial=0) < LSE_TOL
        # The calls are the schedule's blocks (none for pairs that see nothing), and the
        # K/V sent are the schedule's hops.
        blocks = [(b.q1 - b.q0, b.k1 - b.k0, b.offset, b.offset is not None)
                  for s in schedule.steps[r] for w in s.work for b in w.blocks]  # fmt: skip
        assert ans["calls"] == blocks
        assert ans["sent"] == [t.rows for s in schedule.steps[r] for t in s.sends]


CASES = [
    # (group, seq_len, layout, heads, kv_heads, head_dim, causal, window, extra)
    (None, 150, "zigzag", 4, 2, 256, True, None, {}),  # 150 = 8 * 18 + 6: uneven chunks
    (None, 101, "contiguous", 4, 1, 512, True, None, {}),
    ("trio", 101, "zigzag", 4, 2, 256, True, 5, {}),  # a window smaller than a chunk (~17 rows)
    ("trio", 101, "contiguous", 2, 2, 512, True, 40, {}),  # a window spanning chunks (~34 rows)
    ("pair", 77, "zigzag", 4, 2, 256, True, 1000, {}),  # a window longer than the sequence
    ("pair", 64, "contiguous", 4, 4, 256, False, None, {}),  # no mask: every row sees every row
    (None, 130, "zigzag", 8, 2, 512, True, 23, {}),  # window over ~1.4 chunks of 16-17 rows
    (None, 50, "contiguous", 4, 2, 256, True, 3, {}),
    (None, 200, "zigzag", 4, 1, 256, True, 1, {}),  # each row sees itself only
    ("solo", 40, "zigzag", 4, 2, 512, True, None, {}),  # one rank: no ring at all
    ("pair", 3, "zigzag", 4, 2, 256, True, None, {}),  # fewer rows than chunks: some are empty
    ("trio", 90, "zigzag", 4, 2, 256, True, None, dict(q_dtype="bfloat16", out_dtype="float32")),
    (None, 60, "zigzag", 4, 2, 512, True, 9, dict(pass_seq_len=60, scale=1.0)),  # no all_gather
    (None, 120, "contiguous", 4, 2, 256, True, None, dict(q_dtype="float16", out_dtype="bfloat16")),
]


@pytest.mark.parametrize("group,n,layout,nh,nkv,hd,causal,window,extra", CASES)
def test_each_rank_gets_its_rows_of_the_whole_prefill(pool, group, n, layout, nh, nkv, hd, causal, window, extra):
    case = _case(group, n, layout, nh, nkv, hd, seed=n + hd + (window or 0), causal=causal, window=window, **extra)
    _check_results(case, _answers(pool, case))


N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() and "cuda" in mn.backends() else 0


@pytest.mark.skipif(N_GPUS == 0, reason="NCCL needs a CUDA GPU per rank (the lead runs this on GPU machines)")
def test_nccl_on_cuda_tensors():
    # As many ranks as GPUs (up to 4): one GPU runs the machinery with no hop.
    world = min(N_GPUS, 4)
    nccl = RankPool(world, {}, backend="nccl")
    try:
        for group, n, layout, nh, nkv, hd, causal, window, extra in CASES:
            if group is not None or len(MEMBERS[group]) != 4:
                continue
            case = _case(None, n, layout, nh, nkv, hd, seed=n, causal=causal, window=window, **extra)
            case["members"] = list(range(world))
            _check_results(case, _answers(nccl, case))
    finally:
        nccl.close()


def test_a_window_stops_the_ring_early_and_skips_what_nobody_needs(pool):
    # 4 ranks, 200 rows (25-row zigzag chunks), window 10: each rank needs its ring
    # neighbours' K/V only, one hop each way, instead of three hops around the ring.
    full = ring_schedule(200, 4, "zigzag", True, None)
    windowed = ring_schedule(200, 4, "zigzag", True, 10)
    assert (full.forward_steps, full.backward_steps, full.transfers()) == (3, 0, 12)
    assert windowed.n_steps == 2 and windowed.transfers() < 8
    got = _answers(pool, _case(None, 200, window=10, seed=5))
    sent = sum(len(a["sent"]) for a in got.values())
    assert sent == windowed.transfers()
    # Contiguous and causal: nobody needs the last rank's K/V, nothing wraps around.
    contiguous = ring_schedule(200, 4, "contiguous", True, None)
    assert contiguous.transfers() == 6 and all(not s.sends for s in contiguous.steps[3])


# ------------------------------------------------------------------ mistakes


def _errors(pool, case):
    answers = pool.run(case)
    out = {}
    for rank in case["members"]:
        status, value = answers[rank]
        assert status == "error", f"rank {rank} did not raise: {value}"
        out[rank] = value
    return out


def _all_raise(pool, case, cls, match, builtin="value"):
    errs = _errors(pool, case)
    for rank, e in errs.items():
        assert e["cls"] == cls and e["mlx"] and e[builtin], (rank, e)
        assert match in e["message"], (rank, e["message"])
    return errs


def test_a_bad_layout_name_is_refused_on_every_rank(pool):
    _all_raise(pool, _case("trio", 60, layout="diagonal", shard_layout="zigzag"), "InvalidArgumentError",
               "layout 'diagonal' is not a sequence layout")  # fmt: skip
    _all_raise(pool, _case("pair", 60, layout=3, shard_layout="zigzag"), "ArgumentTypeError", "layout must be one of",
               builtin="type")  # fmt: skip


def test_rows_that_do_not_match_the_layout_are_refused_on_every_rank(pool):
    # Sharded contiguously but called as zigzag: the ranks hold 16, 15, 15, 15 rows where
    # zigzag gives 15, 15, 15, 16. (Rows of other chunks in the right number cannot be
    # told apart: they are data.)
    errs = _all_raise(pool, _case(None, 61, layout="zigzag", shard_layout="contiguous"), "InvalidArgumentError",
                      "'zigzag' layout of a sequence of 61 rows over 4 ranks")  # fmt: skip
    assert "shard_sequence" in errs[0]["message"]
    errs = _all_raise(pool, _case("trio", 60, edit={1: "rows-1"}), "InvalidArgumentError", "rank 1 holds 19 (wants")
    # With seq_len given each rank checks its own rows (a length every rank gets wrong).
    _all_raise(pool, _case("pair", 40, pass_seq_len=80), "InvalidArgumentError", "sequence of 80 rows over 2 ranks")


def test_one_rank_refusing_its_arguments_stops_every_rank(pool):
    errs = _errors(pool, _case("trio", 60, edit={2: "k-float32"}))
    # Rank 2's k is float32 beside a float16 v (float32 K/V are taken, mixed ones are not).
    assert errs[2]["cls"] == "UnsupportedDtypeError" and "k is float32 and v is float16" in errs[2]["message"]
    for r in (0, 1):
        assert errs[r]["cls"] == "UnsupportedDtypeError" and errs[r]["type"]
        assert "rank 2 of the group refused its arguments" in errs[r]["message"] and "k is float32 and v is float16" in errs[r]["message"]
    errs = _errors(pool, _case("pair", 40, edit={3: "numpy"}))
    assert errs[3]["cls"] == "ArgumentTypeError" and "q must be a torch tensor" in errs[3]["message"]
    assert "rank 1 of the group refused" in errs[1]["message"]


@pytest.mark.parametrize(
    "per_rank,field",
    [
        ({1: dict(window=8)}, "window"),
        ({0: dict(layout="contiguous")}, "layout"),
        ({2: dict(scale=0.5)}, "scale"),
        ({0: dict(causal=False, window=None)}, "causal"),
    ],
)
def test_ranks_that_disagree_are_refused_on_every_rank(pool, per_rank, field):
    errs = _all_raise(pool, _case("trio", 60, window=4, per_rank=per_rank), "InvalidArgumentError",
                      f"must pass the same {field}")  # fmt: skip
    assert len({e["message"] for e in errs.values()}) == 1, "every rank says the same"


def test_a_process_outside_the_group_is_refused(pool):
    # Global rank 0 calls with the pair {1, 3}, of which it is not a member; the pair's
    # members are not called and wait for nothing.
    case = _case("pair", 40, call_anyway=True)
    case["members"] = [0]
    errs = _errors(pool, case)
    assert errs[0]["cls"] == "InvalidArgumentError" and "not a member of the group" in errs[0]["message"]


def test_without_torch_distributed_initialized():
    q = torch.zeros(8, 2, 256)
    k = torch.zeros(8, 1, 256, dtype=torch.float16)
    with pytest.raises(mn.InvalidArgumentError, match="torch.distributed is not initialized"):
        context_parallel_prefill(q, k, k)


# ------------------------------------------------------------------ the chunks and the schedule (in-process)


def test_chunk_bounds_give_the_first_chunks_one_row_more():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert rank_chunks(10, 2, "zigzag") == [[(0, 3), (8, 10)], [(3, 6), (6, 8)]]
    assert rank_chunks(10, 3, "contiguous") == [[(0, 4)], [(4, 7)], [(7, 10)]]
    for n, p, layout in itertools.product([0, 1, 7, 64, 101], [1, 2, 3, 5], ["zigzag", "contiguous"]):
        pos = np.concatenate([local_positions(n, p, r, layout) for r in range(p)])
        assert sorted(pos.tolist()) == list(range(n)), "every row on exactly one rank"
        sizes = [local_rows(n, p, r, layout) for r in range(p)]
        assert max(sizes) - min(sizes) <= 2
        x = np.arange(n)
        assert np.concatenate([shard_sequence(x, p, r, layout) for r in range(p)]).tolist() == pos.tolist()
    t = torch.arange(10)
    assert shard_sequence(t, 2, 0, "zigzag").tolist() == [0, 1, 2, 8, 9]
    with pytest.raises(mn.InvalidArgumentError, match="rank 2 is not in a group of 2"):
        local_rows(10, 2, 2)
    with pytest.raises(mn.ArgumentTypeError, match="seq_len must be an integer"):
        chunk_bounds(10.0, 2)


def test_pair_kinds():
    assert pair_kind((10, 20), (0, 10), True, None) == "full"
    assert pair_kind((10, 20), (10, 20), True, None) == "part"
    assert pair_kind((10, 20), (20, 30), True, None) == "none"
    assert pair_kind((10, 20), (0, 5), True, 6) == "none"  # 5 - 1 <= 10 - 6: out of every row's window
    assert pair_kind((10, 20), (0, 5), True, 7) == "part"
    assert pair_kind((10, 20), (5, 10), True, 15) == "full"  # 5 > 19 - 15
    assert pair_kind((10, 20), (20, 30), False, None) == "full"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_schedule_computes_every_visible_pair_once_and_nothing_else(layout):
    for n, p, causal, window in itertools.product([1, 5, 37, 64, 101], [1, 2, 3, 4, 6], [True, False], [None, 1, 3, 10, 30, 200]):
        if window is not None and not causal:
            continue
        sch = ring_schedule(n, p, layout, causal, window)
        pos = [local_positions(n, p, r, layout) for r in range(p)]
        truth = visible_mask(n, n, True, window) if causal else np.ones((n, n), bool)
        seen = np.zeros((n, n), int)
        for r in range(p):
            for t, st in enumerate(sch.steps[r]):
                for w in st.work:
                    assert w.direction == OWN and t == 0 or (r - w.direction * t) % p == w.source
                    for b in w.blocks:
                        qp, kp = pos[r][b.q0 : b.q1], pos[w.source][b.k0 : b.k1]
                        vis = np.ones((len(qp), len(kp)), bool) if b.offset is None else visible_mask(len(qp), len(kp), True, window, b.offset)
                        assert np.array_equal(vis, truth[np.ix_(qp, kp)]), "the call's mask is the pairs' visibility"
                        assert b.pairs == vis.sum() > 0
                        seen[np.ix_(qp, kp)] += vis
                # Every hop has its other end, with the same rows.
                for s in st.sends:
                    (match,) = [x for x in sch.steps[s.peer][t].recvs if x.direction == s.direction]
                    assert match.peer == r and match.rows == s.rows
                for x in st.recvs:
                    assert any(s.peer == r and s.direction == x.direction for s in sch.steps[x.peer][t].sends)
        assert np.array_equal(seen, truth), (n, p, layout, causal, window)
        assert sum(sch.pairs(r) for r in range(p)) == truth.sum()


def test_zigzag_balances_causal_work():
    sch = ring_schedule(4096, 8, "zigzag", True, None)
    work = [sch.pairs(r) for r in range(8)]
    assert max(work) / min(work) < 1.002
    # One call per later step: the two chunks of the K/V in hand are both fully seen by one
    # of this rank's chunks, or by one chunk each.
    for r in range(8):
        assert all(sum(len(w.blocks) for w in s.work) == 1 for s in sch.steps[r][1:])
    contiguous = ring_schedule(4096, 8, "contiguous", True, None)
    work = [contiguous.pairs(r) for r in range(8)]
    assert max(work) / min(work) > 10


# ------------------------------------------------------------------ the merge


def test_the_in_place_merge_is_exact_for_rows_that_see_nothing(rng):
    o1 = rng.standard_normal((6, 2, 8)).astype(np.float32)
    o2 = rng.standard_normal((6, 2, 8)).astype(np.float32)
    l1 = rng.uniform(-3, 3, (2, 6)).astype(np.float32)
    l2 = rng.uniform(-3, 3, (2, 6)).astype(np.float32)
    l1[:, 0] = l2[:, 0] = -np.inf  # nobody sees row 0
    o1[0] = o2[0] = 0
    l1[:, 1] = -np.inf  # only the second part sees row 1
    o1[1] = 0
    l2[0, 2] = 80.0  # one part dominates by far: no overflow
    acc_o, acc_l = torch.from_numpy(o1.copy()), torch.from_numpy(l1.copy())
    merge_into(acc_o, acc_l, torch.from_numpy(o2), torch.from_numpy(l2))
    ref_o, ref_l = merge_reference(o1.astype(np.float64), l1, o2.astype(np.float64), l2)
    assert np.all(acc_o[0].numpy() == 0) and not np.signbit(acc_o[0].numpy()).any()
    assert np.all(np.isneginf(acc_l[:, 0].numpy()))
    assert np.array_equal(acc_o[1].numpy(), o2[1]) and np.array_equal(acc_l[:, 1].numpy(), l2[:, 1])
    assert np.abs(acc_o.numpy() - ref_o).max() < 1e-6
    fin = np.isfinite(ref_l)
    assert np.abs(acc_l.numpy()[fin] - ref_l[fin]).max() < 1e-6
    lib_o, lib_l = mn.merge_attention_states(o1, l1, o2, l2)
    assert np.abs(acc_o.numpy() - lib_o).max() < 1e-6 and np.array_equal(np.isneginf(lib_l), np.isneginf(acc_l.numpy()))
    # The accumulator takes a range's first partial as it is, then merges.
    acc = Accumulator(6, 2, 8, torch.device("cpu"))
    acc.add(0, 3, torch.from_numpy(o1[:3]), torch.from_numpy(l1[:, :3]))
    assert np.array_equal(acc.out[:3].numpy(), o1[:3]) and np.all(acc.out[3:].numpy() == 0)
    acc.add(0, 6, torch.from_numpy(o2), torch.from_numpy(l2))
    assert np.array_equal(acc.out[3:].numpy(), o2[3:])  # rows 3..5 had nothing yet: merged with -inf, exactly o2
    assert np.abs(acc.out[:3].numpy() - ref_o[:3]).max() < 1e-6


def test_importing_mlx_native_does_not_import_torch():
    code = "import sys, mlx_native; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr

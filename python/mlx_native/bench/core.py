"""The benchmark run: every implementation on each (case, rows) problem, timed round-robin,
checked against the float64 reference, and the report that ``--json`` writes."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .. import Device, PrefillPlan, cpu_amx_peak, cpu_fma_peak, cpu_info, version
from ..reference import nmse, reference_attention, useful_flops
from . import cpu_peers, cuda_peers  # noqa: F401  (each registers its peers)
from .cases import CASES, DEFAULT_BLOCK_SIZE, DTYPES, Case, case_inputs, paged_cache, quantised_kv, select
from .machine import machine_info, use_threads
from .ours import (
    OURS,
    OURS_16BIT_KV,
    OURS_ATTENTION,
    OURS_CONTIGUOUS,
    OURS_DESCRIBED,
    contiguous_variant,
    described_variant,
    ours_variants,
    sixteen_bit_variant,
)
from .peers import Problem, Refused, Variant, peers_for
from .progress import Progress
from .report import print_table, summarize
from .timing import run_seconds

#: Above this many (row, cache row) pairs the float64 reference is computed on a sample of
#: rows (rows are independent given their mask rows).
REFERENCE_FULL_PAIRS = 2048 * 4096
REFERENCE_SAMPLE_ROWS = 192
#: Our labels: never cut short by the peer budget, and no ratio to ours.
OWN = (OURS, OURS_ATTENTION, OURS_DESCRIBED)


def run_bench(
    rows: Optional[Sequence[int]] = None,
    cases: Optional[Sequence[str]] = None,
    repeats: int = 3,
    device: Optional[str] = None,
    peers: Optional[Sequence[str]] = None,
    sample_heads: int = 3,
    peer_budget_s: float = 20.0,
    seed: int = 0,
    progress: bool = True,
    out=None,
    quiet: bool = False,
    threads: Optional[int] = None,
    on_size: Optional[Callable[[dict], None]] = None,
    kv_len: Optional[int] = None,
    described: bool = False,
    q_dtype: str = "float32",
    dtype: str = "float32",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict:
    """Run the benchmark and return its report (what ``--json`` writes); prints the table
    to ``out`` (default stdout) unless ``quiet``.

    ``peers``: names of the peers to run (default: every one installed for the device's
    kind); ``peer_budget_s``: a peer whose runs at a size would take longer than this (as
    predicted from its rate at a smaller size, or from its warm-up) is timed fewer times, or
    skipped at the larger sizes. ``rows`` and ``cases`` default by device kind (see
    ``DEFAULT_ROWS`` and ``DEFAULT_CASES``). ``kv_len``: the cache's rows (default: each
    prompt's own), so that each prompt is a chunk at the end of a longer cache (it must be
    at least the largest of ``rows``). ``on_size``: called with the report so far after
    each (case, rows). ``dtype``: the data every implementation gets (``cases.DTYPES``:
    float32 is Q float32 with K/V float16 to us and float32 to the peers; float16 and
    bfloat16 are Q, K, V and the output in that type for all). Ours: ``described`` plans
    the case's mask as its description (``causal=True``, ``window=``; none for the zero
    mask: SPEC 6) instead of the explicit additive mask, as a model hands it over (the peers
    keep theirs); ``q_dtype`` (with ``dtype`` float32) is Q's dtype and our output's
    (``float16`` or ``bfloat16``: what a half-precision model hands over and takes back).
    ``block_size``: the rows of a block of a paged case's cache (``paged-128``,
    ``paged-256``; CPU, CUDA and Metal devices): ours runs on the cache through a shuffled
    block table (``OURS``) and on the same rows contiguous (``OURS_CONTIGUOUS``), their ratio
    in ``paged_over_contiguous`` of ours' row and their outputs' equality in
    ``paged_equals_contiguous``; the peers that run it gather the K/V from the blocks inside
    their timed runs."""
    if threads is not None:
        use_threads(threads)
    dev = Device(device or "auto")
    kind = dev.backend
    rows, cases = select(kind, rows, cases)
    if kv_len is not None and kv_len < rows[-1]:
        raise ValueError(f"kv_len {kv_len} is shorter than the prompt of {rows[-1]} rows: a chunk is the end of its cache")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if q_dtype not in Q_DTYPES:
        raise ValueError(f"q_dtype must be one of {', '.join(Q_DTYPES)}, got {q_dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    out = None if quiet else (out or sys.stdout)

    registered = peers_for(kind)
    if peers is not None:
        unknown = sorted(set(peers) - {p.name for p in registered})
        if unknown:
            raise ValueError(
                f"unknown peer(s) {', '.join(unknown)} for a {kind} device; known: {', '.join(p.name for p in registered) or 'none'}"
            )
    available, missing = [], {}
    for p in registered:
        if peers is not None and p.name not in peers:
            continue
        why = p.missing()
        if why is None:
            available.append(p)
        else:
            missing[p.name] = why
    report = dict(
        version=version(),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=" ".join([os.path.basename(sys.executable), "-m", "mlx_native", "bench"] + sys.argv[2:])
        if sys.argv and sys.argv[0].endswith("__main__.py")
        else None,
        machine=machine_info(dev),
        device_kind=kind,
        dtype=dtype,
        repeats=repeats,
        peers=[p.name for p in available],
        peer_versions={p.name: _version(p) for p in available},
        missing_peers=missing,
        ours_mask="described" if described else "explicit",
        ours_q_dtype=q_dtype,
        results=[],
    )
    if any(CASES[c].paged for c in cases):
        report["block_size"] = block_size
    # The peak is measured before and after the runs and the higher kept: a load on the
    # machine lowers a measurement, never raises it. Where the CPU has AMX, its BF16 peak
    # too: the limit of the AMX kernels' products.
    amx = kind == "cpu" and "amx" in cpu_info()["detected"]
    peaks = [_peaks(amx)] if kind == "cpu" else []
    report["machine"]["threads_used"] = cpu_info()["threads"]

    # Per (case, rows): preparing ours, preparing each peer, and the timed rounds.
    per_size = 2 + len(available)
    bar = Progress(len(cases) * len(rows) * per_size, progress)
    rate: Dict[tuple, float] = {}  # (case, label) -> last GFLOP/s, to predict run times
    rng = np.random.default_rng(seed)
    try:
        for cname in cases:
            case = CASES[cname]
            for r in rows:
                report["results"].extend(
                    _one_size(case, r, r == rows[0], dev, available, repeats, sample_heads, peer_budget_s, rate, rng, bar,
                              kv_len, Ours(described, q_dtype), dtype, block_size)
                )
                if on_size is not None:
                    report["summary"] = summarize(report["results"])
                    on_size(report)
    finally:
        bar.close()
    if peaks:
        peaks.append(_peaks(amx))
        best = {k: max(p[k] for p in peaks) for k in peaks[0]}
        report["fma_peak_gflops"] = dict(one_core=best["one_core"], all_cores=best["all_cores"])
        if amx:
            report["amx_peak_gflops"] = dict(one_core=best["amx_one_core"], all_cores=best["amx_all_cores"])
        for d in report["results"]:
            if d["gflops"] is not None:
                # all_cores: the peak of the threads in use (as many as --threads says).
                d["pct_peak"] = 100.0 * d["gflops"] / report["fma_peak_gflops"]["all_cores"]
                if amx:
                    d["pct_amx_peak"] = 100.0 * d["gflops"] / report["amx_peak_gflops"]["all_cores"]
    report["summary"] = summarize(report["results"])
    if out is not None:
        print_table(report, out)
    return report


#: Q's dtypes ours may take in the benchmark (the output takes the same).
Q_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Ours:
    """How ours takes a case: the mask described or explicit, and Q's (and O's) dtype."""

    described: bool = False
    q_dtype: str = "float32"

    def plan(self, case: Case, q, k, v, mask, dev, **paged) -> PrefillPlan:
        """Our plan of the case on ``dev`` (scale 1, as Gemma 4 runs: SPEC 4); ``paged``:
        ``block_table=`` and ``seqused_k=`` where ``k``/``v`` are a paged cache."""
        if self.q_dtype != "float32":
            dt = _np_dtype(self.q_dtype)
            q = q.astype(dt)
        else:
            dt = None
        if not self.described:
            return PrefillPlan(q, k, v, mask, scale=1.0, device=dev, out_dtype=dt, **paged)
        # The prompt is the end of its cache (SPEC 6's default offset), as case_mask has it.
        causal = case.mask in ("causal", "window")
        window = case.window if case.mask == "window" else None
        return PrefillPlan(q, k, v, None, causal=causal, window=window, scale=1.0, device=dev, out_dtype=dt, **paged)


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _peaks(amx: bool) -> dict:
    """The FMA peak of one core and of the threads in use, and the AMX-BF16 peak's too
    (``amx_one_core``, ``amx_all_cores``) when ``amx``."""
    p = dict(one_core=cpu_fma_peak(1), all_cores=cpu_fma_peak(0))
    if amx:
        p.update(amx_one_core=cpu_amx_peak(1), amx_all_cores=cpu_amx_peak(0))
    return p


def _one_size(case: Case, r, smallest, dev, available, repeats, sample_heads, budget, rate, rng, bar, kv_len=None,
              ours: Ours = Ours(), dtype="float32", block_size=DEFAULT_BLOCK_SIZE) -> List[dict]:  # fmt: skip
    """Every implementation on one problem, timed round-robin (one warm-up each, then
    ``repeats`` rounds of one run each, the best kept), so that a load that comes and goes
    on the machine falls on all of them alike. A paged case: ours on the paged cache and on
    the same rows contiguous; the peers without ``paged_ok`` left out."""
    nh, nkv, hd = case.n_heads, case.n_kv_heads, case.head_dim
    q, k, v, mask = case_inputs(case, r, rng, kv_len, dtype)
    kv = k.shape[0]
    heads = sorted({0, nh - 1} | set(rng.choice(nh, size=min(sample_heads, nh), replace=False).tolist()))
    base = dict(case=case.name, title=case.title, rows=r, kv_len=kv, n_heads=nh, n_kv_heads=nkv, head_dim=hd, mask=case.mask, window=case.window,
                dtype=dtype)  # fmt: skip

    pc = contiguous = k8 = None
    if case.kv_quant:
        # Ours on FP8 K/V; everyone else (and ours beside it) on the same values in 16 bits.
        k8, v8, k, v = quantised_kv(k, v, case.kv_quant)
        base.update(kv_quant=case.kv_quant)
    if case.paged:
        pc = paged_cache(k, v, block_size, rng)
        base.update(block_size=block_size, num_blocks=int(pc.k.shape[0]))

    bar.step(f"{case.name} {r}: preparing {OURS}")
    if k8 is not None:
        kv_dtype = {"kv_dtype": "q8_0"} if case.kv_quant == "q8_0" else {}
        plan = ours.plan(case, q, k8, v8, mask, dev, **kv_dtype)
    elif pc is None:
        plan = ours.plan(case, q, k, v, mask, dev)
    else:
        plan = ours.plan(case, q, pc.k, pc.v, mask, dev, block_table=pc.block_table, seqused_k=pc.seqused_k)
    flops = useful_flops(hd, nh, plan.visible_pairs)
    base.update(visible_pairs=plan.visible_pairs, useful_gflop=flops / 1e9)
    runners: List[Variant] = ours_variants(plan, dev)
    if pc is not None:
        contiguous = ours.plan(case, q, k, v, mask, dev)
        runners.append(contiguous_variant(contiguous, dev, runners[0].calls))
    if k8 is not None:
        contiguous = ours.plan(case, q, k, v, mask, dev)
        runners.append(sixteen_bit_variant(contiguous, dev, runners[0].calls))
    described = None
    if dev.backend == "cpu" and case.mask in ("causal", "window") and not ours.described and pc is None and k8 is None:
        # The same mask as a description (the prompt at the end of its cache, as case_mask).
        w = case.window if case.mask == "window" else None
        described = PrefillPlan(q, k, v, causal=True, window=w, scale=1.0, device=dev)
        runners.append(described_variant(described))
    notes: Dict[str, str] = {}
    labels = [vt.label for vt in runners]
    meta = {vt.label: dict(peer=None, mode=None, kv_repeated=None, calls=vt.calls) for vt in runners}
    bar.advance()
    problem = Problem(
        q, k, v, mask,
        causal=case.mask == "causal",
        dense=case.mask == "zero",
        window=case.window if case.mask == "window" else None,
        threads=cpu_info()["threads"],
        dtype=dtype,
        paged=pc,
    )
    for p in available:
        bar.step(f"{case.name} {r}: preparing {p.name}")
        if pc is not None and not p.paged_ok:
            labels.append(p.name)
            notes[p.name] = "skipped: no paged form in the bench (its K/V gathered from the blocks in its time)"
            meta[p.name] = dict(peer=p.name, mode=None, kv_repeated=None, calls=None)
            bar.advance()
            continue
        try:
            variants: List[Variant] = p.variants(problem)
        except Exception as e:  # a peer that fails to build is reported, not fatal
            labels.append(p.name)
            notes[p.name] = f"failed: {type(e).__name__}: {e}"
            meta[p.name] = dict(peer=p.name, mode=None, kv_repeated=None, calls=None)
            variants = []
        for vt in variants:
            if vt.smallest_only and not smallest:
                continue
            labels.append(vt.label)
            meta[vt.label] = dict(peer=p.name, mode=vt.mode, kv_repeated=vt.kv_repeated, calls=vt.calls)
            if (case.name, vt.label) in rate:
                predicted = flops / (rate[(case.name, vt.label)] * 1e9)
                if predicted > budget:
                    notes[vt.label] = f"skipped: ~{predicted:.0f} s a run, over the {budget:.0f} s budget"
                    continue
            runners.append(vt)
        bar.advance()

    best, runs, live = round_robin(runners, repeats, budget, notes, bar, f"{case.name} {r}")
    # The float64 reference on the sampled heads, and on a sample of rows when the problem
    # is large (a row's output depends only on its own Q row and mask row).
    if r * kv > REFERENCE_FULL_PAIRS:
        ref_rows = np.unique(np.linspace(0, r - 1, REFERENCE_SAMPLE_ROWS).astype(int))
    else:
        ref_rows = np.arange(r)
    base.update(nmse_rows_checked=int(len(ref_rows)), nmse_heads_checked=heads)
    bar.step(f"{case.name} {r}: float64 reference, heads {heads}, {len(ref_rows)} rows")
    ref = reference_attention(q[ref_rows], k, v, mask[ref_rows], heads=heads)[:, heads]
    errors: Dict[str, tuple] = {}
    for vt in live:
        if vt.label not in notes and vt.output is not None:
            try:
                o = vt.output()[ref_rows][:, heads]
                errors[vt.label] = (nmse(o, ref), worst_row_nmse(o, ref))
            except Exception as e:
                notes[vt.label] = f"failed: {type(e).__name__}: {e}"
    same = None
    second = OURS_16BIT_KV if k8 is not None else OURS_CONTIGUOUS
    if contiguous is not None and OURS not in notes and second not in notes:
        same = bool(np.array_equal(np.asarray(plan.run()), np.asarray(contiguous.run())))
    del plan, described, contiguous
    bar.advance()
    out = result_rows(base, labels, flops, best, runs, notes, errors, rate, meta)
    if pc is not None:
        by = {d["impl"]: d for d in out}
        mine, cont = by[OURS], by[OURS_CONTIGUOUS]
        ratio = mine["ms"] / cont["ms"] if mine["ms"] and cont["ms"] else None
        mine.update(paged_over_contiguous=ratio, paged_equals_contiguous=same)
    if k8 is not None:
        by = {d["impl"]: d for d in out}
        mine, cont = by[OURS], by[OURS_16BIT_KV]
        ratio = cont["ms"] / mine["ms"] if mine["ms"] and cont["ms"] else None
        # Speed-up of FP8 over 16-bit K/V (above 1: FP8 faster); the same values, so the same output.
        mine.update(fp8_speedup_over_16bit=ratio, fp8_equals_16bit=same)
    return out


def round_robin(runners: Sequence[Variant], repeats: int, budget: float, notes: Dict[str, str], bar, prefix: str = ""):
    """Time ``runners`` in turn: a timed warm-up each (it sets how many runs a slow one
    gets within ``budget`` seconds), then rounds of one run of each, the best kept.
    A variant that raises :class:`Refused` or fails gets a note in ``notes`` (by label).
    Returns ``(best seconds per call, runs, the variants that ran)`` by label."""
    best: Dict[str, float] = {}
    runs: Dict[str, int] = {}
    want: Dict[str, int] = {}
    live = []
    for vt in runners:
        bar.step(f"{prefix}: warm-up {vt.label}")
        try:
            warm = run_seconds(vt)
        except Refused as e:
            notes[vt.label] = f"refused: {e}"
            continue
        except Exception as e:
            notes[vt.label] = f"failed: {type(e).__name__}: {e}"
            continue
        n = 1 if vt.smallest_only else repeats
        if vt.label not in OWN and warm * n > budget:
            n = max(1, int(budget / warm))
        want[vt.label], best[vt.label], runs[vt.label] = n, float("inf"), 0
        live.append(vt)
    for rnd in range(max(want.values(), default=0)):
        for vt in live:
            if runs[vt.label] >= want[vt.label] or vt.label in notes:
                continue
            bar.step(f"{prefix}: round {rnd + 1}/{repeats} {vt.label}")
            try:
                best[vt.label] = min(best[vt.label], run_seconds(vt) / vt.calls)
                runs[vt.label] += 1
            except Exception as e:
                notes[vt.label] = f"failed: {type(e).__name__}: {e}"
    return best, runs, live


def result_rows(base: dict, labels, flops: float, best, runs, notes, errors, rate, meta=None) -> List[dict]:
    """One report row per label: ms, useful GFLOP/s, the time over ours (``speedup_vs``)
    and the NMSEs (over the checked rows and heads, and of the worst (row, head)), from the
    best times (seconds per call), run counts, notes, ``(nmse, worst-row nmse)`` and the
    peer, mode, K/V form and calls per run (``meta``) by label; records each label's rate in ``rate`` (by
    case and label). A label with a note has no time."""
    meta = meta or {}
    ours_s = best.get(OURS) if OURS not in notes else None
    if ours_s == float("inf"):
        ours_s = None
    rows_out = []
    for label in labels:
        seconds = best.get(label) if label not in notes else None
        d = dict(base, impl=label, **meta.get(label, dict(peer=None, mode=None, kv_repeated=None, calls=None)))
        d.update(ms=None, gflops=None, pct_peak=None, nmse=None, nmse_worst_row=None, runs=runs.get(label, 0), speedup_vs=None, note=notes.get(label))
        if seconds is not None and seconds != float("inf"):
            d.update(ms=seconds * 1e3, gflops=flops / seconds / 1e9)
            if label not in OWN and ours_s:
                d["speedup_vs"] = seconds / ours_s
            rate[(base["case"], label)] = d["gflops"]
        if label in errors:
            d["nmse"], d["nmse_worst_row"] = errors[label]
        rows_out.append(d)
    return rows_out


def worst_row_nmse(out: np.ndarray, ref: np.ndarray) -> float:
    """The largest NMSE of one (row, head) of ``out`` against ``ref`` (both ``[rows, heads,
    dim]``); a (row, head) whose reference is zero counts its plain squared error, as
    :func:`mlx_native.reference.nmse` does."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    num = ((out - ref) ** 2).sum(axis=-1)
    den = (ref**2).sum(axis=-1)
    e = np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
    return float(e.max()) if e.size else 0.0


def _version(peer) -> Optional[str]:
    try:
        return peer.version()
    except Exception:  # a version is nice to have, never a reason to fail
        return None

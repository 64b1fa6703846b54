"""``python -m mlx_native bench``: the SPEC section 4 shapes on one device, against every
installed peer in the same run (see :mod:`mlx_native.peers`), with useful GFLOP/s (SPEC
section 5), the ratio of each peer's time to ours, NMSE against the float64 reference on a
sample of heads, and the share of the machine's measured FMA peak.

Importable::

    from mlx_native.bench import run_bench
    report = run_bench(rows=[1024], cases=["dense"], repeats=2)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .attention import PrefillPlan, causal_mask
from .device import Device, cpu_fma_peak, cpu_info, version
from .peers import Problem, Refused, Variant, peers_for
from .reference import nmse, random_qkv, reference_attention, useful_flops


@dataclass(frozen=True)
class Case:
    """A benchmark shape: heads, head dim and mask (``causal``, ``window`` or ``zero``)."""

    name: str
    title: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mask: str
    window: Optional[int] = None

    def describe(self) -> str:
        m = {"causal": "causal", "zero": "zero mask"}.get(self.mask, f"causal, window {self.window}")
        return f"{self.title}: {self.n_heads}/{self.n_kv_heads} heads, dim {self.head_dim}, {m}"


#: SPEC section 4 (Gemma 4 26B-A4B) and a dense case.
CASES: Dict[str, Case] = {
    c.name: c
    for c in (
        Case("sliding", "26B sliding", 16, 8, 256, "window", 1024),
        Case("global", "26B global", 16, 2, 512, "causal"),
        Case("dense", "dense", 16, 8, 256, "zero"),
        Case("causal-8h", "causal 8h", 8, 8, 256, "causal"),
        Case("dense-8h", "dense 8h", 8, 8, 256, "zero"),
    )
}
#: Rows and cases run when none are named, by device kind: the CPU at the sizes a CPU user
#: prefills, a GPU at long prompts too.
DEFAULT_ROWS = {"cpu": (1024, 2048, 4096)}
DEFAULT_ROWS_GPU = (2048, 8192, 16384)
DEFAULT_CASES = {"cpu": ("sliding", "global", "dense")}
DEFAULT_CASES_GPU = ("sliding", "global", "causal-8h", "dense-8h")
#: Above this many (row, cache row) pairs the float64 reference is computed on a sample of
#: rows (rows are independent given their mask rows).
REFERENCE_FULL_PAIRS = 2048 * 4096
REFERENCE_SAMPLE_ROWS = 192
#: A device run of ours repeats the prefill until about this long, then waits once.
DEVICE_TARGET_S = 0.02
OURS = "mlx-native"
#: SPEC section 3's accuracy bar.
NMSE_BAR = 5e-4


def case_mask(case: Case, rows: int, kv_len: int) -> np.ndarray:
    """The additive float16 mask ``[rows, kv_len]`` of a case."""
    if case.mask == "zero":
        return np.zeros((rows, kv_len), dtype=np.float16)
    return causal_mask(rows, kv_len, case.window if case.mask == "window" else None)


class _Progress:
    """tqdm when installed, else a one-line bar on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self._tqdm = total, 0, enabled, None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True, leave=False)
        except ImportError:
            pass

    def step(self, label: str) -> None:
        """Say what runs next."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_description_str(label)
            return
        n = 30
        fill = n * self.done // max(self.total, 1)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (n - fill)}] {self.done}/{self.total} {label[:60]:60}")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.update(1)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


def _use_threads(n: int) -> None:
    """Make the CPU backend use ``n`` threads: only possible before its thread pool starts
    (the first kernel or ``cpu_info()`` starts it), through ``RAYON_NUM_THREADS``."""
    if int(n) != n or n < 1:
        raise ValueError(f"threads must be a positive integer, got {n!r}")
    before = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = str(int(n))
    got = cpu_info()["threads"]
    if got != n:
        if before is None:
            del os.environ["RAYON_NUM_THREADS"]
        else:
            os.environ["RAYON_NUM_THREADS"] = before
        raise ValueError(
            f"the CPU backend already runs {got} threads in this process (set RAYON_NUM_THREADS={n} "
            "before the library first runs, or use the command line)"
        )


def machine_info(device: Device) -> dict:
    """CPU model, cores, the CPU backend's instruction set and threads."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ci = cpu_info()
    return dict(
        cpu_model=model,
        cores=os.cpu_count(),
        isa=ci["isa"],
        threads=ci["threads"],
        device=device.description,
        platform=platform.platform(),
        python=platform.python_version(),
    )


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
) -> dict:
    """Run the benchmark and return its report (what ``--json`` writes); prints the table
    to ``out`` (default stdout) unless ``quiet``.

    ``peers``: names of the peers to run (default: every one installed for the device's
    kind); ``peer_budget_s``: a peer whose runs at a size would take longer than this (as
    predicted from its rate at a smaller size, or from its warm-up) is timed fewer times, or
    skipped at the larger sizes. ``rows`` and ``cases`` default by device kind (see
    ``DEFAULT_ROWS`` and ``DEFAULT_CASES``)."""
    if threads is not None:
        _use_threads(threads)  # before anything starts the CPU backend's thread pool
    dev = Device(device or "auto")
    kind = dev.backend
    if rows is None:
        rows = DEFAULT_ROWS.get(kind, DEFAULT_ROWS_GPU)
    if cases is None:
        cases = DEFAULT_CASES.get(kind, DEFAULT_CASES_GPU)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    rows = sorted({int(r) for r in rows})
    if not rows or rows[0] < 1:
        raise ValueError(f"rows must be positive integers, got {rows}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
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
        repeats=repeats,
        peers=[p.name for p in available],
        missing_peers=missing,
        results=[],
    )
    # The peak is measured before and after the runs and the higher kept: a load on the
    # machine lowers a measurement, never raises it.
    peaks = [dict(one_core=cpu_fma_peak(1), all_cores=cpu_fma_peak(0))] if kind == "cpu" else []
    report["machine"]["threads_used"] = cpu_info()["threads"]

    # Per (case, rows): preparing ours, preparing each peer, and the timed rounds.
    per_size = 2 + len(available)
    bar = _Progress(len(cases) * len(rows) * per_size, progress)
    rate: Dict[tuple, float] = {}  # (case, label) -> last GFLOP/s, to predict run times
    rng = np.random.default_rng(seed)
    try:
        for cname in cases:
            case = CASES[cname]
            for r in rows:
                report["results"].extend(
                    _one_size(case, r, r == rows[0], dev, available, repeats, sample_heads, peer_budget_s, rate, rng, bar)
                )
    finally:
        bar.close()
    if peaks:
        peaks.append(dict(one_core=cpu_fma_peak(1), all_cores=cpu_fma_peak(0)))
        report["fma_peak_gflops"] = {k: max(p[k] for p in peaks) for k in peaks[0]}
        for d in report["results"]:
            if d["gflops"] is not None:
                # all_cores: the peak of the threads in use (as many as --threads says).
                d["pct_peak"] = 100.0 * d["gflops"] / report["fma_peak_gflops"]["all_cores"]
    if out is not None:
        print_table(report, out)
    return report


#: Pause before every timed run: worker threads of the implementation that ran before
#: (OpenMP spins for a while after a parallel region) must not run into the next one's time.
SETTLE_S = 0.05


def _timed(fn: Callable[[], None]) -> float:
    time.sleep(SETTLE_S)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _ours(plan: PrefillPlan, dev: Device) -> Variant:
    """Our runner: on the CPU one prefill per run; on a device several prefills recorded in
    one encoder and committed once (so launch and wait overhead is not what is timed), as
    many as fill about ``DEVICE_TARGET_S``; the output is read back only for the check."""
    if dev.backend == "cpu":
        return Variant(OURS, plan.run, lambda: plan.run().copy())
    plan.run()  # compile and first touch
    t = time.perf_counter()
    with dev.encoder() as enc:
        plan.encode(enc)
    once = time.perf_counter() - t
    calls = int(np.clip(round(DEVICE_TARGET_S / max(once, 1e-6)), 1, 50))

    def run():
        with dev.encoder() as enc:
            for _ in range(calls):
                plan.encode(enc)

    return Variant(OURS, run, plan.run, calls=calls)


def _one_size(case, r, smallest, dev, available, repeats, sample_heads, budget, rate, rng, bar) -> List[dict]:
    """Every implementation on one problem, timed round-robin (one warm-up each, then
    ``repeats`` rounds of one run each, the best kept), so that a load that comes and goes
    on the machine falls on all of them alike."""
    nh, nkv, hd = case.n_heads, case.n_kv_heads, case.head_dim
    q, k, v = random_qkv(r, nh, nkv, hd, r, rng)
    mask = case_mask(case, r, r)
    heads = sorted({0, nh - 1} | set(rng.choice(nh, size=min(sample_heads, nh), replace=False).tolist()))
    base = dict(case=case.name, title=case.title, rows=r, kv_len=r, n_heads=nh, n_kv_heads=nkv, head_dim=hd, mask=case.mask, window=case.window)

    bar.step(f"{case.name} {r}: preparing {OURS}")
    plan = PrefillPlan(q, k, v, mask, device=dev)
    flops = useful_flops(hd, nh, plan.visible_pairs)
    base.update(visible_pairs=plan.visible_pairs, useful_gflop=flops / 1e9)
    runners: List[Variant] = [_ours(plan, dev)]
    notes: Dict[str, str] = {}
    labels = [OURS]
    bar.advance()
    problem = Problem(q, k, v, mask, causal=case.mask == "causal", dense=case.mask == "zero", threads=cpu_info()["threads"])
    for p in available:
        bar.step(f"{case.name} {r}: preparing {p.name}")
        try:
            variants: List[Variant] = p.variants(problem)
        except Exception as e:  # a peer that fails to build is reported, not fatal
            labels.append(p.name)
            notes[p.name] = f"failed: {type(e).__name__}: {e}"
            variants = []
        for vt in variants:
            if vt.smallest_only and not smallest:
                continue
            labels.append(vt.label)
            if (case.name, vt.label) in rate:
                predicted = flops / (rate[(case.name, vt.label)] * 1e9)
                if predicted > budget:
                    notes[vt.label] = f"skipped: ~{predicted:.0f} s a run, over the {budget:.0f} s budget"
                    continue
            runners.append(vt)
        bar.advance()

    # Warm-up (timed: it sets how many runs a slow peer gets), then the rounds.
    best: Dict[str, float] = {}
    runs: Dict[str, int] = {}
    want: Dict[str, int] = {}
    live = []
    for vt in runners:
        bar.step(f"{case.name} {r}: warm-up {vt.label}")
        try:
            warm = _timed(vt.run)
        except Refused as e:
            notes[vt.label] = f"refused: {e}"
            continue
        except Exception as e:
            notes[vt.label] = f"failed: {type(e).__name__}: {e}"
            continue
        n = 1 if vt.smallest_only else repeats
        if vt.label != OURS and warm * n > budget:
            n = max(1, int(budget / warm))
        want[vt.label], best[vt.label], runs[vt.label] = n, float("inf"), 0
        live.append(vt)
    for rnd in range(max(want.values(), default=0)):
        for vt in live:
            if runs[vt.label] >= want[vt.label] or vt.label in notes:
                continue
            bar.step(f"{case.name} {r}: round {rnd + 1}/{repeats} {vt.label}")
            try:
                best[vt.label] = min(best[vt.label], _timed(vt.run) / vt.calls)
                runs[vt.label] += 1
            except Exception as e:
                notes[vt.label] = f"failed: {type(e).__name__}: {e}"
    # The float64 reference on the sampled heads, and on a sample of rows when the problem
    # is large (a row's output depends only on its own Q row and mask row).
    if r * r > REFERENCE_FULL_PAIRS:
        ref_rows = np.unique(np.linspace(0, r - 1, REFERENCE_SAMPLE_ROWS).astype(int))
    else:
        ref_rows = np.arange(r)
    base.update(nmse_rows_checked=int(len(ref_rows)), nmse_heads_checked=heads)
    bar.step(f"{case.name} {r}: float64 reference, heads {heads}, {len(ref_rows)} rows")
    ref = reference_attention(q[ref_rows], k, v, mask[ref_rows], heads=heads)[:, heads]
    outputs = {}
    for vt in live:
        if vt.label not in notes:
            try:
                outputs[vt.label] = vt.output()[ref_rows]
            except Exception as e:
                notes[vt.label] = f"failed: {type(e).__name__}: {e}"
    del plan
    bar.advance()

    ours_s = best.get(OURS)
    rows_out = []
    for label in labels:
        seconds = best.get(label) if label not in notes else None
        d = dict(base, impl=label, ms=None, gflops=None, pct_peak=None, nmse=None, runs=runs.get(label, 0), speedup_vs=None, note=notes.get(label))
        if seconds is not None and seconds != float("inf"):
            d.update(ms=seconds * 1e3, gflops=flops / seconds / 1e9)
            if label != OURS and ours_s:
                d["speedup_vs"] = seconds / ours_s
            rate[(case.name, label)] = d["gflops"]
        if label in outputs:
            d["nmse"] = nmse(outputs[label][:, heads], ref)
        rows_out.append(d)
    return rows_out


def _fmt(x, f):
    """``x`` in format ``f`` (``"10.1f"``), or a dash as wide."""
    return format(x, f) if x is not None else "-".rjust(int(f.split(".")[0]))


def print_table(report: dict, out=None) -> None:
    """The report as a text table: one line per implementation, grouped by case and rows;
    "ours x" is the peer's time over ours (above 1: we are faster)."""
    out = out or sys.stdout
    m = report["machine"]
    p = report.get("fma_peak_gflops")
    print(f"mlx-native {report['version']} bench on {m['device']}; CPU {m['cpu_model']}, {m['cores']} cores", file=out)
    if p:
        n = m.get("threads_used", m["threads"])
        print(f"measured FMA peak ({m['isa']}): {p['one_core']:.1f} GFLOP/s one core, {p['all_cores']:.1f} GFLOP/s on the {n} threads in use (%peak)", file=out)
    print(f"timing: best of {report['repeats']} rounds after a warm-up, implementations in turn; GFLOP/s = useful FLOP (SPEC section 5) / time", file=out)
    for name, why in report["missing_peers"].items():
        print(f"peer {name} missing: {why}", file=out)
    if not report["peers"] and not report["missing_peers"]:
        print(f"no peer run (none asked for, or none registered for {report['device_kind']} devices)", file=out)
    hdr = f"{'case':12} {'rows':>5} {'implementation':28} {'ms':>10} {'GFLOP/s':>8} {'%peak':>6} {'NMSE':>9} {'ours x':>7}"
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    last = None
    for d in report["results"]:
        key = (d["case"], d["rows"])
        lead = f"{d['title']:12} {d['rows']:>5}" if key != last else " " * 18
        last = key
        ratio = "" if d["speedup_vs"] is None else f"{d['speedup_vs']:.2f}x"
        line = (
            f"{lead} {d['impl'][:28]:28} {_fmt(d['ms'], '10.1f')} {_fmt(d['gflops'], '8.1f')} "
            f"{_fmt(d['pct_peak'], '5.0f')}{'%' if d['pct_peak'] is not None else ' '} {_fmt(d['nmse'], '9.1e')} {ratio:>7}"
        )
        if d.get("note"):
            line += f"  ({d['note']})"
        print(line, file=out)


def plot_report(report: dict, path: str) -> None:
    """Bar chart of "ours x" (each peer's time over ours) per case and size, one panel per
    case, a line at 1 (parity). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(d["case"] for d in report["results"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.2), squeeze=False)
    for ax, c in zip(axes[0], cases):
        res = [d for d in report["results"] if d["case"] == c and d["speedup_vs"] is not None]
        rows = sorted({d["rows"] for d in res})
        labels = list(dict.fromkeys(d["impl"] for d in res))
        width = 0.8 / max(len(labels), 1)
        for i, lab in enumerate(labels):
            xs, ys = [], []
            for j, r in enumerate(rows):
                hit = [d for d in res if d["rows"] == r and d["impl"] == lab]
                if hit:
                    xs.append(j + (i - (len(labels) - 1) / 2) * width)
                    ys.append(hit[0]["speedup_vs"])
            bars = ax.bar(xs, ys, width, label=lab)
            ax.bar_label(bars, fmt="%.2g", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        top = max([d["speedup_vs"] for d in res] + [1.0])
        ax.set_ylim(top=top * 8)  # room for the legend above the bars
        ax.set_xticks(range(len(rows)), [str(r) for r in rows])
        ax.set_xlabel("rows (fresh prefill, kv_len = rows)")
        title = next((d["title"] for d in report["results"] if d["case"] == c), c)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    axes[0][0].set_ylabel(f"peer time / {OURS} time (>1: {OURS} faster)")
    fig.suptitle(f"{OURS} on {report['machine']['device']} ({report['machine']['cpu_model']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="device name for mlx_native.Device: auto (default), cpu, cuda, cuda:N, metal")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="prompt lengths (kv_len = rows; default 1024 2048 4096 on the CPU, 2048 8192 16384 on a GPU)")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=None, help="shapes to run (default: sliding global dense on the CPU; sliding global causal-8h dense-8h on a GPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up, one run of each implementation per round (the best is kept)")
    p.add_argument("--peers", nargs="*", default=None, help="peers to run (on a CPU device: torch, mlx, reference; default: every one installed; --peers alone: none)")
    p.add_argument("--peer-budget", type=float, default=20.0, help="seconds one peer may spend at one size (slow peers are skipped at larger sizes)")
    p.add_argument("--sample-heads", type=int, default=3, help="query heads checked against the float64 reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="threads of the CPU backend and the CPU peers (default: every core)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the ratios to the peers (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main_from_args(args) -> int:
    from .errors import MlxError

    try:
        report = run_bench(
            rows=args.rows,
            cases=args.cases,
            repeats=args.repeats,
            device=args.device,
            peers=args.peers,
            sample_heads=args.sample_heads,
            peer_budget_s=args.peer_budget,
            seed=args.seed,
            progress=not args.no_progress,
            threads=args.threads,
        )
    except (ValueError, MlxError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot_report(report, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
    worst = max((d["nmse"] for d in report["results"] if d["impl"] == OURS), default=0.0)
    print(f"worst NMSE of {OURS}: {worst:.2e} (SPEC bar {NMSE_BAR:g}): {'OK' if worst <= NMSE_BAR else 'FAIL'}")
    return 0 if worst <= NMSE_BAR else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_native bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return main_from_args(p.parse_args(argv))

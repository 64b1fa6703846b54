"""The benchmark report as text (the table of every implementation, and on a GPU the
summary of ours against the best peer of each kind), the summary itself, and a bar chart
of the ratios to the peers."""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .ours import OURS, OURS_ATTENTION, OURS_CONTIGUOUS

#: The summary's comparisons: key (``best_<key>`` in each summary entry), heading, and
#: which timed peer rows compete in it.
COMPARISONS: Tuple[Tuple[str, str, Callable[[dict], bool]], ...] = (
    ("mask", "best peer, same mask", lambda d: d.get("mode") == "mask"),
    ("causal", "best peer, built-in causal", lambda d: d.get("mode") == "causal"),
    ("none", "best peer, no mask", lambda d: d.get("mode") == "none"),
    (
        "mask_gqa",
        "best, same mask, own GQA form",
        lambda d: d.get("mode") == "mask" and d.get("kv_repeated") is False and d["n_heads"] != d["n_kv_heads"],
    ),
)
#: Words of a label that name its mode, left out of the summary's short names.
_MODE_WORDS = {"same mask", "is_causal", "causal", "no mask"}


def summarize(results: Sequence[dict]) -> List[dict]:
    """One entry per (case, rows) of ``results`` (the report's rows): our time with the mask
    classification and without it (attention only), useful TFLOP/s, our NMSEs, and for each
    of ``COMPARISONS`` the fastest peer (``impl``, ``ms``, ``tflops``, ``speedup_vs``: its
    time over ours) or None when none ran."""
    groups: Dict[tuple, List[dict]] = {}
    for d in results:
        groups.setdefault((d["case"], d["rows"]), []).append(d)
    out = []
    for rows in groups.values():
        first = rows[0]
        by_impl = {d["impl"]: d for d in rows}
        ours = by_impl.get(OURS, {})
        attn = by_impl.get(OURS_ATTENTION, {})
        s = {k: first.get(k) for k in ("case", "title", "rows", "n_heads", "n_kv_heads", "head_dim", "mask", "window", "visible_pairs", "useful_gflop")}
        s.update(
            ours_ms=ours.get("ms"),
            ours_tflops=_tflops(ours),
            ours_attention_only_ms=attn.get("ms"),
            ours_attention_only_tflops=_tflops(attn),
            nmse=ours.get("nmse"),
            nmse_worst_row=ours.get("nmse_worst_row"),
            nmse_rows_checked=first.get("nmse_rows_checked"),
            nmse_heads_checked=first.get("nmse_heads_checked"),
        )
        for key, _, competes in COMPARISONS:
            timed = [d for d in rows if d.get("peer") is not None and d["ms"] is not None and competes(d)]
            b = min(timed, key=lambda d: d["ms"]) if timed else None
            s[f"best_{key}"] = None if b is None else dict(impl=b["impl"], ms=b["ms"], tflops=_tflops(b), speedup_vs=b["speedup_vs"])
        out.append(s)
    return out


def _tflops(d: dict) -> Optional[float]:
    return None if d.get("gflops") is None else d["gflops"] / 1e3


def short_name(impl: str) -> str:
    """A label without the words that name its mode: ``torch cudnn, same mask, enable_gqa``
    is ``torch cudnn, enable_gqa``."""
    return ", ".join(w for w in impl.split(", ") if w not in _MODE_WORDS)


def _fmt(x, f):
    """``x`` in format ``f`` (``"10.1f"``), or a dash as wide."""
    return format(x, f) if x is not None else "-".rjust(int(f.split(".")[0]))


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[bool]) -> List[str]:
    """Lines of a table of text cells, each column as wide as its widest cell."""
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if lj else c.rjust(w) for c, w, lj in zip(cells, widths, left)).rstrip()

    head = line(header)
    return [head, "-" * len(head)] + [line(r) for r in rows]


def print_table(report: dict, out=None) -> None:
    """The report as a text table: one line per implementation, grouped by case and rows;
    "ours x" is the peer's time over ours (above 1: we are faster). On a GPU (no CPU FMA
    peak in the report) times have three decimals, rates are TFLOP/s, and the summary
    (:func:`print_summary`) follows."""
    out = out or sys.stdout
    m = report["machine"]
    p = report.get("fma_peak_gflops")
    gpu = report.get("device_kind", "cpu") != "cpu"
    print(f"mlx-native {report['version']} bench on {m['device']}; CPU {m['cpu_model']}, {m['cores']} cores", file=out)
    amx = report.get("amx_peak_gflops")
    if p:
        n = m.get("threads_used", m["threads"])
        print(f"measured FMA peak ({m['isa']}): {p['one_core']:.1f} GFLOP/s one core, {p['all_cores']:.1f} GFLOP/s on the {n} threads in use (%peak)", file=out)
    if amx:
        print(f"measured AMX-BF16 peak: {amx['one_core']:.1f} GFLOP/s one core, {amx['all_cores']:.1f} GFLOP/s on the {n} threads in use (%amx)", file=out)
    dtype = report.get("dtype", "float32")
    if dtype != "float32":
        print(f"data: Q, K, V and the output in {dtype}, for every implementation", file=out)
    unit = "TFLOP/s" if gpu else "GFLOP/s"
    print(f"timing: best of {report['repeats']} rounds after a warm-up, implementations in turn; {unit} = useful FLOP (SPEC section 5) / time", file=out)
    if gpu:
        print(
            f"{OURS}: several prefills recorded in one encoder, the commit that runs them timed, per prefill; "
            f"'{OURS_ATTENTION}': without the mask classification, on the skip table of an earlier run",
            file=out,
        )
    if "block_size" in report:
        print(
            f"paged cases: {OURS} reads K/V from a cache in shuffled blocks of {report['block_size']} rows through its block "
            f"table; '{OURS_CONTIGUOUS}': the same rows contiguous; 'gather timed': the peer's K/V gathered from the "
            "blocks (and repeated to the query heads where not enable_gqa) inside its time, as a user of the paged cache pays",
            file=out,
        )
    versions = {k: v for k, v in report.get("peer_versions", {}).items() if v}
    if versions:
        print("peer versions: " + "; ".join(f"{k} {v}" for k, v in versions.items()), file=out)
    for name, why in report["missing_peers"].items():
        print(f"peer {name} missing: {why}", file=out)
    if not report["peers"] and not report["missing_peers"]:
        print(f"no peer run (none asked for, or none registered for {report['device_kind']} devices)", file=out)
    iw = max([28] + [len(d["impl"]) for d in report["results"]])
    ms_f, rate_f, rate_scale = ("10.3f", "8.1f", 1e-3) if gpu else ("10.1f", "8.1f", 1.0)
    peak = "" if gpu else f" {'%peak':>6}" + (f" {'%amx':>5}" if amx else "")
    hdr = f"{'case':12} {'rows':>5} {'implementation':{iw}} {'ms':>10} {unit:>8}{peak} {'NMSE':>9} {'ours x':>7}"
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    last = None
    for d in report["results"]:
        key = (d["case"], d["rows"])
        lead = f"{d['title']:12} {d['rows']:>5}" if key != last else " " * 18
        last = key
        ratio = "" if d["speedup_vs"] is None else f"{d['speedup_vs']:.2f}x"
        rate = None if d["gflops"] is None else d["gflops"] * rate_scale
        pct = "" if gpu else f" {_fmt(d['pct_peak'], '5.0f')}{'%' if d['pct_peak'] is not None else ' '}"
        if amx:
            pa = d.get("pct_amx_peak")
            pct += f" {_fmt(pa, '4.0f')}{'%' if pa is not None else ' '}"
        line = f"{lead} {d['impl']:{iw}} {_fmt(d['ms'], ms_f)} {_fmt(rate, rate_f)}{pct} {_fmt(d['nmse'], '9.1e')} {ratio:>7}"
        if d.get("note"):
            line += f"  ({d['note']})"
        elif d.get("paged_over_contiguous") is not None:
            same = {True: "outputs equal", False: "OUTPUTS DIFFER", None: "outputs not compared"}[d.get("paged_equals_contiguous")]
            line += f"  (paged, blocks of {d['block_size']}: {d['paged_over_contiguous']:.3f}x the contiguous time; {same})"
        print(line, file=out)
    if gpu:
        print(file=out)
        print_summary(report.get("summary") or summarize(report["results"]), out)


def summary_lines(summary: Sequence[dict]) -> List[str]:
    """The summary as text lines: per (case, rows) our time with the mask classification
    and with the attention alone, useful TFLOP/s, our worst (row, head) NMSE, and the
    fastest peer of each comparison that any problem has, with its time over ours."""
    shown = [(k, h) for k, h, _ in COMPARISONS if any(s.get(f"best_{k}") for s in summary)]
    header = ["case", "rows", "ours ms", "TFLOP/s", "attn ms", "TFLOP/s", "worst-row NMSE"]
    left = [True, False, False, False, False, False, False]
    for _, heading in shown:
        header += [heading, "ours x"]
        left += [True, False]
    rows = []
    for s in summary:
        cells = [
            s["title"] or s["case"],
            str(s["rows"]),
            _fmt(s["ours_ms"], "1.3f"),
            _fmt(s["ours_tflops"], "1.1f"),
            _fmt(s["ours_attention_only_ms"], "1.3f"),
            _fmt(s["ours_attention_only_tflops"], "1.1f"),
            _fmt(s["nmse_worst_row"], "1.2e"),
        ]
        for key, _ in shown:
            b = s.get(f"best_{key}")
            if b is None:
                cells += ["-", "-"]
            else:
                cells += [f"{short_name(b['impl'])} {b['ms']:.3f} ms", "-" if b["speedup_vs"] is None else f"{b['speedup_vs']:.2f}x"]
        rows.append(cells)
    return _columns(header, rows, left)


def print_summary(summary: Sequence[dict], out=None) -> None:
    """Print :func:`summary_lines` under a title."""
    out = out or sys.stdout
    print(f"summary: {OURS} with the mask classification ('ours'), and the attention alone ('attn'); "
          "'ours x': the peer's time over ours", file=out)
    for line in summary_lines(summary):
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

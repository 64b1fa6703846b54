"""The benchmark report as a text table, and as a bar chart of the ratios to the peers."""

from __future__ import annotations

import sys

from .ours import OURS


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

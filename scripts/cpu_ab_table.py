"""The table of an A/B run of CPU builds (scripts/gpu_cpu_ab.sh): for each case and build,
our described-mask time in every round and the best; PyTorch's time in the same run
(``is_causal`` with ``enable_gqa``) over ours, each round's ratio (above 1, ours is faster),
and their median, which a host whose speed drifts between runs moves least.

    python scripts/cpu_ab_table.py OUT_DIR [build names, in the order A, B, ...]
"""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict

OURS = "mlx-native, described mask"
PEER = "torch sdpa, is_causal, enable_gqa"


def main():
    out, names = sys.argv[1], sys.argv[2:]
    ours, peer = defaultdict(list), defaultdict(list)
    for path in sorted(glob.glob(os.path.join(out, "ab-*.json"))):
        m = re.match(r"ab-([A-Z])(\d+)\.json$", os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            report = json.load(f)
        for r in report["results"]:
            key = (r["case"], m.group(1))
            if r["impl"] == OURS:
                ours[key].append(r["ms"])
            elif r["impl"] == PEER:
                peer[key].append(r["ms"])
    print("| case | build | ours ms, each round | ours best | ratio, each round | median ratio |")
    print("| --- | --- | --- | ---: | --- | ---: |")
    for case, b in sorted(ours):
        o, p = ours[(case, b)], peer.get((case, b), [])
        name = names[ord(b) - ord("A")] if ord(b) - ord("A") < len(names) else b
        ratios = [t / x for t, x in zip(p, o)]
        med = f"{statistics.median(ratios):.2f}" if ratios else "-"
        print(f"| {case} | {b} {name} | {' / '.join(f'{x:.2f}' for x in o)} | {min(o):.2f} | "
              f"{' / '.join(f'{x:.2f}' for x in ratios) or '-'} | {med} |")

if __name__ == "__main__":
    main()

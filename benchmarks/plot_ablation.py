"""Bar chart of benchmarks/e2e.py's ablation rows (`--ablations`): ms per step of each
variant next to the row it changes, per batch / index policy, from one or more JSONs.

    python benchmarks/plot_ablation.py e2e-a.json [e2e-b.json ...] -o ablation.png [--density 0.3]

Rows measured in several files are averaged (the label says how many runs).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_SYS = re.compile(r"dejavu_d(?P<d>[0-9.]+)_on(?P<sh>_shared)?(?:_(?P<var>[a-z0-9]+))?$")


def collect(paths, model, density):
    """{(batch, policy): {variant: [ms, ...]}}; variant "" is the unchanged row."""
    out: dict = {}
    for path in paths:
        for r in json.loads(Path(path).read_text()).get("results", []):
            m = _SYS.match(r.get("system", ""))
            if r.get("model") != model or not m or float(m["d"]) != density or not r.get("ms_per_step"):
                continue
            if m["var"] and not r.get("variant"):
                continue  # "_fullkv" and the like: not an ablation
            key = (r["batch"], "shared" if m["sh"] else "per-seq")
            out.setdefault(key, {}).setdefault(m["var"] or "", []).append(r["ms_per_step"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="+")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--model", default="opt-30b")
    p.add_argument("--density", type=float, default=0.3)
    a = p.parse_args(argv)
    data = collect(a.json, a.model, a.density)
    if not data:
        print(f"no ablation rows for {a.model} at density {a.density}", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(k for k in data if "" in data[k])  # panels with the unchanged row to compare against
    if not keys:
        print("no ablation row has its unchanged row in these files", file=sys.stderr)
        return 1
    width = max(5.5, 0.6 * max(len(data[k]) for k in keys) + 1.5)  # wide enough for the title and labels
    fig, axes = plt.subplots(1, len(keys), figsize=(width * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = data[key]
        names = [""] + sorted(v for v in rows if v)
        names = [n for n in names if n in rows]
        ms = [sum(rows[n]) / len(rows[n]) for n in names]
        bars = ax.bar(range(len(names)), ms, color=["tab:blue" if n == "" else "tab:gray" for n in names])
        for b, n, v in zip(bars, names, ms):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}\n({len(rows[n])}x)", ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(range(len(names)), [n or "defaults (as run)" for n in names], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"batch {key[0]}, {key[1]}", fontsize=9)
        ax.set_ylabel("ms per decode step")
        ax.set_ylim(0, max(ms) * 1.25)
    fig.suptitle(f"{a.model} shape, density {a.density}, overlap on: one change per bar", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plot decode latency vs density from benchmarks/e2e.py's JSON, with the bandwidth floor.

    python benchmarks/plot_e2e.py e2e.json [-o e2e.png] [--model opt-30b]

One panel per batch size: dejavu (overlap on / off, and shared indices when measured) as
lines over density, the floor of each as a dashed line, and the dense baselines (our dense
CUDA graph, Hugging Face eager) as horizontal lines at density 1.0 for reference.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_SYS = re.compile(r"dejavu_d(?P<d>[0-9.]+)_(?P<ov>on|off)(?P<kv>_fullkv|_deferredkv)?(?P<sh>_shared)?$")


def series(results: list[dict], model: str, batch: int) -> dict:
    """{label: [(density, ms, floor_ms)]} for one model and batch."""
    out: dict[str, list] = {}
    for r in results:
        if r.get("model") != model or r.get("batch") != batch or not r.get("ms_per_step"):
            continue
        if r.get("variant"):  # ablation rows (e2e.py --ablations): plot_ablation.py draws them
            continue
        m = _SYS.match(r["system"])
        if m:
            label = f"dejavu overlap {m['ov']}" + (" (shared idx)" if m["sh"] else "")
            label += {"_fullkv": " (full K/V)", "_deferredkv": " (deferred K/V)"}.get(m["kv"] or "", "")
            out.setdefault(label, []).append((float(m["d"]), r["ms_per_step"], r["floor_ms"]))
        else:
            out.setdefault(r["system"], []).append((1.0, r["ms_per_step"], r["floor_ms"]))
    return {k: sorted(v) for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", help="e2e.json from benchmarks/e2e.py")
    p.add_argument("-o", "--out", default=None, help="PNG path (default: beside the JSON)")
    p.add_argument("--model", default=None, help="model to plot (default: the first in the JSON)")
    a = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_e2e: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    data = json.loads(Path(a.json).read_text())
    res = [r for r in data.get("results", []) if r.get("ms_per_step")]
    if not res:
        print("plot_e2e: no results in the JSON", file=sys.stderr)
        return 2
    model = a.model or res[0]["model"]
    batches = sorted({r["batch"] for r in res if r["model"] == model})
    fig, axes = plt.subplots(1, len(batches), figsize=(max(7.0, 5.2 * len(batches)), 4.2), squeeze=False)
    for ax, B in zip(axes[0], batches):
        s = series(res, model, B)
        floor_done = False
        for label, pts in s.items():
            xs, ms, fl = zip(*pts)
            if label.startswith("dejavu"):
                ax.plot(xs, ms, "o-", label=label)
                if "on" in label and not floor_done:
                    ax.plot(xs, fl, "kx--", lw=1, label="bandwidth floor (dejavu)")
                    floor_done = True
            else:
                ax.axhline(ms[0], ls=":", lw=1.5, label=f"{label} ({ms[0]:.1f} ms)",
                           color="tab:red" if label.startswith("hf") else "tab:gray")
                if label == "dense_graph":
                    ax.axhline(fl[0], ls="--", lw=0.8, color="tab:gray", label=f"dense floor ({fl[0]:.1f} ms)")
        ax.set_title(f"{model}, batch {B}")
        ax.set_xlabel("density (fraction of neurons and heads kept)")
        ax.set_ylabel("decode latency per step (ms)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    note = data.get("meta", {}).get("gpu", "")
    fig.suptitle(f"dejavu decode latency vs density ({note}; random weights and predictors)", fontsize=10)
    fig.tight_layout()
    out = Path(a.out) if a.out else Path(a.json).with_name(f"e2e_{model}.png")
    fig.savefig(out, dpi=120)
    print(f"plot_e2e: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

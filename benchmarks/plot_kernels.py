"""Plot sparse-MLP time vs density from benchmarks/kernels.py's JSON.

    python benchmarks/plot_kernels.py benchmarks/results/kernels-h200.json [--out kernels.png]

One panel per layer shape: batch-1 sparse time and the dense cuBLAS time (flat line), plus
batch 8 with the shared index set; the dashed line is bytes / measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(args.json).read_text())
    bw = res["bandwidth"]["copy_GBps"]
    shapes = sorted({r["shape"] for r in res["mlp"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for B, policy, style in ((1, "per_seq", "o-"), (8, "shared", "s-")):
            rows = sorted((r for r in res["mlp"] if r["shape"] == shape and r["B"] == B
                           and r["policy"] == policy), key=lambda r: r["density"])
            if not rows:
                continue
            d = [r["density"] for r in rows]
            ax.plot(d, [r["ms"] * 1e3 for r in rows], style, label=f"sparse B={B} ({policy})")
            ax.axhline(rows[0]["dense_ms"] * 1e3, ls=":", color=ax.lines[-1].get_color(),
                       label=f"dense cuBLAS B={B}")
            if B == 1:
                ax.plot(d, [r["bytes"] / bw / 1e3 for r in rows], "k--", lw=1,
                        label="bytes / copy bandwidth")
        ax.set_title(f"{shape} MLP, fp16, {res.get('device', '')}")
        ax.set_xlabel("density (fraction of neurons)")
        ax.set_ylabel("time per token (us)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    out = args.out or str(Path(args.json).with_suffix(".png"))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

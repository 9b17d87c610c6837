"""Plot sparse-MLP time vs density from benchmarks/kernels.py's JSON.

    python benchmarks/plot_kernels.py benchmarks/results/kernels-2026-12-04-mlp.json [--out kernels.png]
    python benchmarks/plot_kernels.py RESULTS.json --parts [--out parts.png]   (--sections mlp_parts)

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
    ap.add_argument("--parts", action="store_true",
                    help="bars of the batch-1 pieces (mlp_parts) instead, per shape and density")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(args.json).read_text())
    bw = res["bandwidth"]["copy_GBps"]
    if args.parts:
        return plot_parts(res, bw, args.out or str(Path(args.json).with_suffix(".parts.png")), plt)
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


def plot_parts(res, bw, out, plt):
    """One bar group per (shape, density): the pair, fc1 and fc2 alone, the reduction, one launch
    of the pair's bytes (fc1's kernel over 2K rows), the fastest fc1 + fc2 chain config, cuBLAS;
    a line at bytes / copy bandwidth (the pair's bytes)."""
    rows = res["mlp_parts"]
    groups = sorted({(r["shape"], r["density"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(3.4 * len(groups), 4), squeeze=False)
    for ax, (shape, d) in zip(axes[0], groups):
        mine = {r["case"]: r for r in rows if (r["shape"], r["density"]) == (shape, d) and r["graph_ms"]}
        chains = [c for c in mine if c.startswith("chain")]
        best = min(chains, key=lambda c: mine[c]["graph_ms"]) if chains else None
        cases = [c for c in ("pair", "fc1", "fc2", "reduce", "fc1_2k_rows", best, "cublas_pair") if c in mine]
        ax.bar(range(len(cases)), [mine[c]["graph_ms"] * 1e3 for c in cases],
               color=["C0", "C1", "C1", "C1", "C2", "C3", "C7"][:len(cases)])
        ax.set_xticks(range(len(cases)), cases, fontsize=7, rotation=35, ha="right")
        ax.axhline(mine["pair"]["bytes"] / bw / 1e3, color="k", ls="--", lw=1, label="pair bytes / copy bw")
        ax.axhline(mine["pair"]["bytes"] / bw / 1e3 / 0.8, color="k", ls=":", lw=1,
                   label="time at 80% of copy bw (#4's bar)")
        ax.set_title(f"{shape} d{d}", fontsize=9)
        ax.set_ylabel("us per call (graph)")
        ax.legend(fontsize=6)
    fig.suptitle(f"sparse MLP at batch 1, piece by piece ({res.get('device', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

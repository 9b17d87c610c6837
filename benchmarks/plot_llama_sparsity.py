"""Perplexity vs fraction of block weight bytes skipped, one line per method, from
benchmarks/llama_sparsity.py's JSON (realized skip on the x axis, dense as a dashed level).

    python benchmarks/plot_llama_sparsity.py benchmarks/results/llama_sparsity_ppl.json -o docs/img/llama_sparsity.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json")
    p.add_argument("-o", "--out", required=True)
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(a.json).read_text())
    runs = res["runs"]
    dense = next(r["perplexity"] for r in runs if r["method"] == "dense")
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for method in sorted({r["method"] for r in runs} - {"dense"}):
        pts = sorted((r["realized_skip"], r["perplexity"]) for r in runs if r["method"] == method)
        ax.plot([100 * x for x, _ in pts], [y for _, y in pts], "o-", label=method)
    ax.axhline(dense, ls="--", color="gray", label="dense")
    for pct in (1, 3):
        ax.axhline(dense * (1 + pct / 100), ls=":", color="gray", lw=0.8)
    ax.set_xlabel("block weight bytes skipped per decode step (%)")
    ax.set_ylabel(f"WikiText-2 test perplexity ({runs[0]['ppl_tokens']} tokens)")
    ax.set_title(f"{res['model']}: masked-dense simulation", fontsize=10)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

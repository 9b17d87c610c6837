"""Perplexity increase over dense and MLP recall vs MLP density: oracle, random and the predictors
(fixed K, per-token K, per-token K fitted to rows read) on the same WikiText-2 test tokens.

    python benchmarks/plot_density_quality.py docs/results/sparsity_quality_mlp_2026-12-05_8k.json \\
        --engines docs/results/engines_int8_read_2026-12-05_8k.json -o docs/img/ppl_recall_vs_density_mlp.png

The first JSON is benchmarks/sparsity_quality.py's (scope "mlp", masked dense: oracle, random,
predicted with fixed K, and the recall columns); --engines are `dejavu-eval --json` files whose
engines carry benchmarks/build_density_set.py's names: `mD-aA.engine` (`--token-k off`),
`mD-aA-tkshare.engine` (per-token K, rows `selected`), `mD-aA-tkshare-read.engine` (rows `read`, the
default since 2026-12-05).
Every perplexity must be over the same tokens as the masked-dense dense figure (checked).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from dejavu.fileio import atomic_path

_ENGINE = re.compile(r"m(?P<d>[0-9.]+)-a1\.0(?P<kind>|-tkshare|-tkshare-read)\.engine$")
ENGINE_CURVES = {  # engine name suffix -> legend label, style
    "": ("predicted, fixed K (`--token-k off`)", "s-"),
    "-tkshare": ("predicted, per-token K, rows `selected` (`--token-k-rows selected`)", "o-"),
    "-tkshare-read": ("predicted, the default: per-token K fitted to rows read\n(fc1 kept + fc2 nonzero rows; "
                      "bytes counted as rows read)", "D-"),
}


def curves(quality: dict, engine_files: list[str]) -> tuple[dict, dict]:
    """({label: [(mlp density, increase %)]}, {label: style}); engines only at the densities of the
    masked-dense rows, and only over the masked-dense evaluation's tokens."""
    dense, tokens = quality["dense_ppl"], quality["eval_tokens"]
    rows = [r for r in quality["rows"]["mlp"] if r["mlp_density"] < 1.0]
    out = {"oracle (top-K of the true activations)": [], "random (same K)": []}
    for r in rows:
        out["oracle (top-K of the true activations)"].append((r["mlp_density"], r["oracle"]["perplexity"]))
        out["random (same K)"].append((r["mlp_density"], r["random"]["perplexity"]))
    styles = {"oracle (top-K of the true activations)": "^-", "random (same K)": "x:"}
    densities = {r["mlp_density"] for r in rows}
    engines: dict = {}  # label -> {mlp density: perplexity}
    for path in engine_files:
        for run in json.loads(Path(path).read_text())["runs"]:
            if run["kind"] == "dense":
                if abs(run["perplexity"] - dense) > 1e-3 * dense or run["ppl_tokens"] != tokens:
                    sys.exit(f"{path}: dense {run['perplexity']:.3f} over {run['ppl_tokens']} tokens, "
                             f"not {dense:.3f} over {tokens}")
                continue
            m = _ENGINE.search(run["model"])
            if not m or float(m["d"]) not in densities:
                continue
            label, style = ENGINE_CURVES[m["kind"]]
            seen = engines.setdefault(label, {})  # an engine scored in two files: the same tokens, one point
            if float(m["d"]) in seen and abs(seen[float(m["d"])] - run["perplexity"]) > 1e-6 * dense:
                sys.exit(f"{path}: {run['model']} scored {run['perplexity']} here, {seen[float(m['d'])]} before")
            seen[float(m["d"])] = run["perplexity"]
            styles[label] = style
    out.update({label: list(seen.items()) for label, seen in engines.items()})
    pct = {k: sorted((d, 100.0 * (p / dense - 1.0)) for d, p in v) for k, v in out.items()}
    return pct, styles


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("quality", help="benchmarks/sparsity_quality.py's JSON (--scopes mlp)")
    p.add_argument("--engines", nargs="*", default=[], help="dejavu-eval --json files")
    p.add_argument("-o", "--out", required=True)
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    quality = json.loads(Path(a.quality).read_text())
    pct, styles = curves(quality, a.engines)
    fig, (ax, axr) = plt.subplots(1, 2, figsize=(13, 6.4), gridspec_kw={"width_ratios": [1.35, 1]})
    for label, pts in pct.items():
        values = " / ".join(f"{v:+.0f}" if abs(v) >= 100 else f"{v:+.2f}" for _, v in pts)
        ax.plot(*zip(*pts), styles[label], label=f"{label}: {values}%")
    ax.axhline(0.0, color="gray", lw=0.8, ls="--")
    ax.set_yscale("symlog", linthresh=1.0)  # linear within ±1%, log beyond: random is +100s of %
    ax.set_ylim(-1.5, 3e4)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    ds = sorted({d for pts in pct.values() for d, _ in pts})
    ax.set_xticks(ds)
    ax.set_xlabel("MLP density (heads dense)")
    ax.set_ylabel("perplexity increase over dense (linear within ±1%, log beyond)")
    ax.set_title(f"WikiText-2 test, {quality['eval_tokens']:,} tokens, dense {quality['dense_ppl']:.3f}; "
                 f"legend: at MLP {' / '.join(map(str, ds))}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)

    rows = [r for r in quality["rows"]["mlp"] if r["mlp_density"] < 1.0]
    ds = [r["mlp_density"] for r in rows]
    axr.plot(ds, [r["mlp_mass"] for r in rows], "s-", color="C2", label="predicted, fixed K: contribution captured")
    axr.plot(ds, [r["mlp_recall"] for r in rows], "s--", color="C2", label="predicted, fixed K: active neurons")
    axr.plot(ds, [r["oracle_mlp_mass"] for r in rows], "^-", color="C0", label="oracle: contribution captured")
    axr.plot(ds, [r["oracle_mlp_recall"] for r in rows], "^--", color="C0", label="oracle: active neurons")
    axr.plot(ds, ds, "x:", color="C1", label="random (expected K / F)")
    axr.set_xlabel("MLP density (heads dense)")
    axr.set_ylabel("share captured at each layer's K (mean over layers)")
    axr.set_title(f"MLP recall, fixed K, calibration held-out tail "
                  f"(its first {quality['predictor_settings']['curve_tokens']:,} tokens)", fontsize=10)
    axr.set_ylim(0, 1.02)
    axr.set_xticks(ds)
    axr.grid(alpha=0.3)
    axr.legend(fontsize=7.5, loc="center right")
    fig.suptitle(f"{quality['model']}: masked dense (oracle, random; the K of its --k-from engines) and engines "
                 "(predicted; each its own K)")
    fig.tight_layout()
    with atomic_path(Path(a.out)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    for label, pts in pct.items():
        print(label.replace("\n", " "), " ".join(f"{d}: {v:+.2f}%" for d, v in pts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

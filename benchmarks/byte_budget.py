"""Perplexity vs byte density: sensitivity allocation vs the even split vs heads-dense-then-neurons.

    python benchmarks/byte_budget.py --model opt-mini --ppl-tokens 16384 --out byte_budget.json \
        [--predictors preds] [--plot docs/img/ppl_vs_bytes.png]

One calibration and one predictor training (saved to --predictors PATH.safetensors + .json
and reused when present), then for each density an engine per scheme through `build_engine`
(the sensitivity table is cached, so it is measured once), each scored by `dejavu-eval`'s
perplexity code on WikiText-2 test (never seen by the allocator, whose held-out windows are
WikiText-2 validation tokens by default):
  sensitivity   --density D (the default allocation)
  uniform       --density D --allocation uniform (the same fraction of neurons and heads)
  recall        --mlp-density f --attn-density f, f the even split's fraction (the allocation
                before byte budgets: MLP K spread by recall curves, heads even)
  heads_dense   --attn-density 1.0 --mlp-density f, f the largest neuron fraction within D's
                bytes (MLP K spread by recall curves, as before byte budgets)
and one `--max-ppl-increase P` engine. Raw JSON to --out, rewritten after every engine.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def _save_predictors(preds, path: Path):
    from safetensors.torch import save_file

    from dejavu.fileio import write_json

    save_file({k: v.contiguous() for k, v in preds.state_dict().items()}, str(path) + ".safetensors")
    meta = {"predictor_input": preds.predictor_input,
            "recall_curves": {k: [list(map(float, c)) for c in v] for k, v in preds.recall_curves.items()},
            "calibration": preds.metrics.get("calibration")}
    write_json(str(path) + ".json", meta, indent=None)


def _load_predictors(path: Path):
    from safetensors.torch import load_file

    from dejavu.compiler.predictors import Predictors

    meta = json.loads(Path(str(path) + ".json").read_text())
    p = Predictors.from_state_dict(load_file(str(path) + ".safetensors"), meta["predictor_input"])
    p.recall_curves = {k: [np.asarray(c) for c in v] for k, v in meta["recall_curves"].items()}
    p.metrics["calibration"] = meta["calibration"]
    return p


def train_in_memory(model, tokenizer, model_id: str, base):
    """Calibration (cached on disk, so a head-predictor refit can reuse it) and predictors of
    the build's settings `base` (a BuildConfig), by the in-memory path (`train_predictors`)."""
    from dejavu.compiler.build import _predictor_settings
    from dejavu.compiler.calibrate import calibrate
    from dejavu.compiler.config import CalibSettings
    from dejavu.compiler.predictors import train_predictors

    cal = calibrate(model, tokenizer, CalibSettings(calib_tokens=base.calib_tokens, window=base.calib_window,
                                                    corpus=base.calib), model_id=model_id)
    preds = train_predictors(cal, _predictor_settings(base), model=model)
    preds.metrics["calibration"] = {"corpus": cal.manifest["corpus"], "n_tokens": cal.n_tokens,
                                    "window": cal.window, "tokens_fingerprint": cal.manifest["tokens_fingerprint"]}
    return preds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-mini")
    p.add_argument("--densities", default="0.35,0.4,0.5,0.6,0.7,0.8")
    p.add_argument("--schemes", default="sensitivity,uniform,heads_dense")
    p.add_argument("--max-ppl-increase", default="1", help="percent, or 'none'")
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--predictors", default=None, help="PATH (PATH.safetensors + PATH.json): saved / reused")
    p.add_argument("--engines", default="/tmp/byte_budget_engines")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="byte_budget.json")
    p.add_argument("--plot", default=None, help="only plot --out's JSON to this PNG")
    p.add_argument("--table", action="store_true", help="only print --out's JSON as a markdown table")
    args = p.parse_args(argv)
    if args.plot or args.table:
        res = json.loads(Path(args.out).read_text())
        if args.plot:
            plot(res, args.plot)
        if args.table:
            print(table(res))
        return 0
    torch.set_num_threads(args.threads)
    from dejavu.compiler.allocate import ByteCosts, allocate_uniform, heads_dense_fraction
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.models.loader import load_model, load_tokenizer
    from dejavu.models.presets import resolve
    from dejavu.datafiles import WIKITEXT2_TEST
    from dejavu.fileio import write_json
    from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text

    text = read_text(WIKITEXT2_TEST)
    eng_dir = Path(args.engines)
    eng_dir.mkdir(parents=True, exist_ok=True)
    base = BuildConfig(density=0.5)  # its calibration and predictor settings (the budget is per engine)
    folder = resolve(args.model)
    model, cfg = load_model(folder)
    t0 = time.perf_counter()
    if args.predictors and Path(args.predictors + ".safetensors").is_file():
        preds = _load_predictors(Path(args.predictors))
    else:
        preds = train_in_memory(model, load_tokenizer(folder), args.model, base)
        if args.predictors:
            _save_predictors(preds, Path(args.predictors))
    out = {"model": args.model, "ppl_tokens": args.ppl_tokens, "ppl_file": "dejavu/data/wikitext-2/test.txt",
           "train_seconds": round(time.perf_counter() - t0, 1), "settings": base.to_dict(), "rows": []}
    dense = eval_perplexity(load_scoring_model(args.model), text, None, args.ppl_tokens, progress=False)
    out["dense_ppl"] = dense["perplexity"]
    out["ppl_tokens_scored"] = dense["tokens"]
    # mean ranks over layers, rounded up, as resolve_k counts them (MLP ranks may differ per layer)
    ranks = tuple(-(-sum(int(p["a"].shape[0]) for p in ps) // len(ps)) for ps in (preds.mlp, preds.attn))
    costs = ByteCosts.of(cfg, ranks, 2)

    def run(name: str, **kw):
        path = eng_dir / f"{name}.engine"
        t = time.perf_counter()
        s = build_engine(args.model, BuildConfig(**kw), path, progress=False, predictors=preds)
        r = eval_perplexity(load_scoring_model(str(path)), text, None, args.ppl_tokens, progress=False)
        row = {"name": name, "config": kw, "mlp_k": s["mlp_k"], "attn_k": s["attn_k"],
               "bytes_per_token": s["bytes_per_token"], "heldout": s["heldout"], "density_found": s["density"],
               "test_ppl": r["perplexity"], "test_increase_pct": 100 * (r["perplexity"] / out["dense_ppl"] - 1),
               "seconds": round(time.perf_counter() - t, 1)}
        out["rows"].append(row)
        write_json(args.out, out, indent=1)
        print(f"{name:28s} bytes {row['bytes_per_token']['fraction']:.4f} held-out "
              f"{row['heldout']['increase_pct']:+7.2f}% test {row['test_ppl']:.3f} ({row['test_increase_pct']:+.2f}%)"
              f"  mlp_k {row['mlp_k']} attn_k {row['attn_k']}", flush=True)

    for d in [float(x) for x in args.densities.split(",")]:
        for scheme in args.schemes.split(","):
            if scheme == "sensitivity":
                run(f"sens_{d}", density=d)
            elif scheme == "uniform":
                run(f"uniform_{d}", density=d, allocation="uniform")
            elif scheme == "recall":  # before byte budgets: one unit density, MLP spread by recall curves
                mk, _ = allocate_uniform(costs, math.floor(d * costs.dense))
                f = mk[0] / cfg.ffn_dim
                run(f"recall_{d}", density=d, mlp_density=f, attn_density=f)
            elif scheme == "heads_dense":
                f = heads_dense_fraction(costs, math.floor(d * costs.dense))
                if f is None:
                    out["rows"].append({"name": f"heads_dense_{d}", "infeasible": True, "density": d})
                    continue
                run(f"heads_dense_{d}", density=d, attn_density=1.0, mlp_density=f)
    if args.max_ppl_increase != "none":
        run(f"max_ppl_{float(args.max_ppl_increase):g}", max_ppl_increase=float(args.max_ppl_increase))
    return 0


def table(res: dict) -> str:
    """Perplexity (test, and +% over dense) per density and scheme; held-out increase in brackets."""
    by = {r["name"]: r for r in res["rows"]}
    ds = sorted({float(r["name"].rsplit("_", 1)[1]) for r in res["rows"] if not r["name"].startswith("max_ppl")})
    keys = [k for k in ("sens", "uniform", "recall", "heads_dense") if any(n.startswith(k + "_") for n in by)]
    head = {"sens": "sensitivity", "uniform": "even split", "recall": "even, MLP by recall",
            "heads_dense": "heads dense, then neurons"}
    lines = ["| density | " + " | ".join(head[k] for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for d in ds:
        cells = []
        for k in keys:
            r = by.get(f"{k}_{d}")
            cells.append("infeasible" if r is None or r.get("infeasible") else
                         f"{r['test_ppl']:.2f} ({r['test_increase_pct']:+.1f}%)")
        lines.append(f"| {d:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict, png: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = {"sens": "sensitivity (knapsack)", "uniform": "even split", "recall": "even, MLP spread by recall",
              "heads_dense": "heads dense, then neurons"}
    for key, label in labels.items():
        rows = [r for r in res["rows"] if r["name"].startswith(key + "_") and not r.get("infeasible")]
        rows.sort(key=lambda r: r["bytes_per_token"]["fraction"])
        if not rows:
            continue
        ax.plot([r["bytes_per_token"]["fraction"] for r in rows], [r["test_ppl"] for r in rows], "o-", label=label)
    ax.axhline(res["dense_ppl"], color="k", lw=0.8, ls="--", label="dense")
    ax.set_yscale("log")
    ax.set_xlabel("bytes read per decode token (fraction of dense)")
    ax.set_ylabel(f"WikiText-2 test perplexity ({res['ppl_tokens_scored']} tokens)")
    ax.set_title(f"{res['model']}: perplexity vs byte density")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

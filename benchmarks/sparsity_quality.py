"""Perplexity vs density with exact selection semantics (masked dense), and the lookahead study.

    python benchmarks/sparsity_quality.py --model opt-mini --eval-tokens 16384

Steps: calibrate on the shipped WikiText-2 train head; train predictors on each candidate
input (same-layer attn_in, attn_in of l-1, mlp_in of l-1) and report held-out recall at the
report density; with the default input, compute WikiText-2 *test* perplexity at each density
for predicted (recall-allocated K and uniform K), oracle and random top-k selection.
Writes docs/results/sparsity_quality.{json,md} and docs/img/ppl_vs_density.png. Asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from dejavu.compiler.calibrate import calibrate
from dejavu.compiler.config import CalibSettings, PredictorSettings
from dejavu.compiler.density import resolve_density
from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.predictors import CANDIDATE_INPUTS, train_predictors
from dejavu.compiler.text import encode_text
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import atomic_path, write_json
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.metrics import perplexity

ROOT = Path(__file__).resolve().parents[1]
MODES = ["predicted", "predicted-uniform", "oracle", "random"]
SCOPES = {"both": "MLP neurons and heads", "mlp": "MLP neurons only (all heads)",
          "attn": "heads only (all MLP neurons)"}


def curve_recall(curves: list, ks: list[int]) -> float:
    """Mean over layers of the held-out recall at each layer's K."""
    return float(np.mean([c[k - 1] for c, k in zip(curves, ks)]))


def lookahead_study(cal, base: PredictorSettings, model) -> list[dict]:
    rows = []
    for cand in CANDIDATE_INPUTS:
        t = time.time()
        p = train_predictors(cal, PredictorSettings(**{**asdict(base), **cand}), progress=True, model=model)
        m = p.metrics
        rows.append({**cand, "mlp_recall_mean": m["mlp_recall_mean"], "mlp_precision_mean": m["mlp_precision_mean"],
                     "attn_recall_mean": m["attn_recall_mean"],
                     "mlp_recall": [r["mlp_recall"] for r in m["per_layer"]],
                     "attn_recall": [r["attn_recall"] for r in m["per_layer"]], "train_s": time.time() - t})
    return rows


def engine_predictors(path: str, cal, s: PredictorSettings, model):
    """The predictors an engine carries, with the curves train_predictors would report (the same
    held-out tail of the calibration, the first curve_tokens of it: the MLP curves are the
    contribution share the build spreads K by) and, in metrics["label_curves"], the share of
    active neurons (the recall column). metrics["oracle_curves"]: the same two shares for the
    oracle selection (top-K of the true activations), {"label"|"mass": [L curves]}."""
    from dejavu.compiler.predictors import Predictors, _curve, mlp_contributions, predictor_cost
    from dejavu.engine_file import read_engine

    header, tensors = read_engine(path)
    sd = {k: v.float() for k, v in tensors.items() if ".pred_" in k}
    preds = Predictors.from_state_dict(sd, header["build_config"]["predictor_input"])
    split = (cal.n_windows - max(1, round(cal.n_windows * s.holdout))) * cal.window
    rows = slice(split, split + s.curve_tokens)
    pi = preds.predictor_input
    curves, labels, oracle = {"mlp": [], "attn": []}, [], {"label": [], "mass": []}
    with torch.no_grad():
        for l in range(cal.cfg.num_hidden_layers):
            x = np.array(cal.predictor_input(l, pi["source"], pi["lookahead"])[rows], dtype=np.float32)
            x = torch.from_numpy(x)
            norms = torch.from_numpy(np.array(cal.head_importance(l)[rows]))
            sm = preds.scores("mlp", l, x)
            layer = model.decoder.layers[l]
            y, c = torch.from_numpy(cal.mlp_labels(l, rows)), mlp_contributions(layer, cal.source("mlp_in", l)[rows])
            labels.append(_curve(sm, y))
            curves["mlp"].append(_curve(sm, c))
            act = c / layer.fc2.weight.detach().float().norm(dim=0).clamp_min(1e-12)  # relu(fc1(.)), the oracle's rank
            oracle["label"].append(_curve(act, y))
            oracle["mass"].append(_curve(act, c))
            curves["attn"].append(_curve(preds.scores("attn", l, x), norms))
    preds.recall_curves = curves
    bc = header["build_config"]
    preds.metrics = {"cost": predictor_cost(cal.cfg, bc["predictor_rank_mlp"], bc["predictor_rank_attn"]),
                     "per_layer": [], "holdout_tokens": cal.n_tokens - split, "engine": str(path),
                     "label_curves": labels, "oracle_curves": oracle}
    return preds


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scopes = [sc for sc in SCOPES if results["rows"].get(sc)]
    fig, axes = plt.subplots(1, len(scopes) + 1, figsize=(5 * len(scopes) + 5, 4.4))
    dense = results["dense_ppl"]
    for ax, scope in zip(axes, scopes):
        for mode, style in zip(MODES, ["o-", "s--", "^-", "x:"]):
            pts = [(r["density"], r[mode]["perplexity"]) for r in results["rows"][scope]]
            ax.plot(*zip(*pts), style, label=mode)
        ax.axhline(dense, color="gray", lw=0.8, ls="--", label=f"dense ({dense:.2f})")
        ax.set_xlabel("density (fraction read per token)")
        ax.set_title(f"sparse: {SCOPES[scope]}", fontsize=10)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.set_ylabel("WikiText-2 test perplexity")
    axes[0].legend(fontsize=8)
    ax = axes[-1]  # held-out MLP recall at each layer's K (predicted), vs random (K / N) and oracle
    rows = results["rows"][scopes[0]]
    ds = [r["mlp_density"] for r in rows]
    ax.plot(ds, [r["mlp_recall"] for r in rows], "o-", label="predicted (held-out, allocated K)")
    ax.plot(ds, [1.0] * len(ds), "^-", label="oracle (top-K of the activations)")
    ax.plot(ds, ds, "x:", label="random (K / N)")
    ax.set_xlabel("MLP density")
    ax.set_ylabel("recall of active neurons")
    ax.set_title("MLP recall at K", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"{results['model']}: perplexity and recall vs density, masked dense "
                 f"({results['eval_tokens']} test tokens)")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    out = []
    for scope, title in SCOPES.items():
        if not results["rows"].get(scope):
            continue
        out += [f"**Sparse: {title}**", "",
                "| density | predicted | predicted (uniform K) | oracle | random | MLP recall (pred.) "
                "| head norm captured (pred.) |", "|---|---|---|---|---|---|---|"]
        for r in results["rows"][scope]:
            cells = [f"{r[m]['perplexity']:.2f}" for m in MODES]
            out.append(f"| {r['density']:.1f} | " + " | ".join(cells) +
                       f" | {r['mlp_recall']:.3f} | {r['attn_recall']:.3f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-mini")
    ap.add_argument("--calib-tokens", type=int, default=CalibSettings.calib_tokens)
    ap.add_argument("--eval-tokens", type=int, default=16384, help="WikiText-2 test tokens (0: all)")
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.3, 0.2, 0.1])
    ap.add_argument("--scopes", nargs="+", choices=list(SCOPES), default=list(SCOPES))
    ap.add_argument("--no-lookahead-study", action="store_true")
    ap.add_argument("--allocate-attn", action="store_true",
                    help="spread heads by measured head-norm curves too (default: uniform heads)")
    ap.add_argument("--study-from", default=None, help="reuse the lookahead study of an earlier JSON")
    ap.add_argument("--study-epochs", type=int, default=0,
                    help="BCE epochs per candidate in the lookahead study (0: least-squares fit only)")
    ap.add_argument("--epochs", type=int, default=None, help="BCE epochs of the final predictors "
                    "(default: PredictorSettings.max_epochs)")
    ap.add_argument("--engine", default=None, help="score the predictors of this engine (a float32 build of "
                    "the same model) instead of training them; curves from the calibration's held-out tail")
    ap.add_argument("--k-from", nargs="+", default=[], metavar="ENGINE",
                    help="at an MLP density one of these engines was built for, score every mode at that "
                    "engine's per-layer K (its header) instead of the K resolved here")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, cfg = load_model(args.model)
    tok = load_tokenizer(args.model)
    cal = calibrate(model, tok, CalibSettings(calib_tokens=args.calib_tokens, cache_dir=args.cache_dir),
                    model_id=str(args.model))
    base = PredictorSettings(**({} if args.epochs is None else {"max_epochs": args.epochs}))
    study_settings = PredictorSettings(**{**asdict(base), "max_epochs": args.study_epochs})
    if args.study_from:
        study = json.loads(Path(args.study_from).read_text())["lookahead_study"]
    else:
        study = [] if args.no_lookahead_study else lookahead_study(cal, study_settings, model)
    preds = engine_predictors(args.engine, cal, base, model) if args.engine else train_predictors(cal, base, model=model)
    window = min(512, cfg.max_position_embeddings)
    ids = encode_text(tok, WIKITEXT2_TEST.read_text(encoding="utf-8"), cfg.bos_token_id,
                      max_tokens=args.eval_tokens or None)
    ids = torch.from_numpy(ids.astype(np.int64))

    def ppl() -> dict:
        t = time.time()
        r = perplexity(lambda x: model(x), ids, window, batch=4)
        return {**r, "seconds": time.time() - t}

    engine_k = {}  # MLP density -> (mlp_k, attn_k) of an engine built for it
    for path in args.k_from:
        from dejavu.engine_file import read_engine

        bc = read_engine(path)[0]["build_config"]
        engine_k[bc["settings"]["mlp_density"]] = (bc["mlp_k"], bc["attn_k"])
    dense = ppl()
    print(f"dense: ppl {dense['perplexity']:.3f} over {dense['tokens']} tokens")
    rows = {scope: [] for scope in args.scopes}
    for scope in args.scopes:
        for d in args.densities:
            dm, da = {"both": (d, d), "mlp": (d, 1.0), "attn": (1.0, d)}[scope]
            if scope == "mlp" and dm in engine_k:
                mlp_k, attn_k = engine_k[dm]
            else:
                mlp_k, attn_k = resolve_density(cfg, d, dm, da, recall_curves=preds.recall_curves,
                                                allocate_attn=args.allocate_attn)
            uni = resolve_density(cfg, d, dm, da)
            row = {"density": d, "mlp_density": dm, "attn_density": da, "mlp_k": mlp_k, "attn_k": attn_k,
                   "k_from": "engine" if scope == "mlp" and dm in engine_k else "resolved",
                   "uniform_mlp_k": uni[0], "uniform_attn_k": uni[1],
                   "mlp_recall": curve_recall(preds.metrics.get("label_curves") or preds.recall_curves["mlp"], mlp_k),
                   "mlp_mass": curve_recall(preds.recall_curves["mlp"], mlp_k),
                   "attn_recall": curve_recall(preds.recall_curves["attn"], attn_k)}
            if "oracle_curves" in preds.metrics:
                row["oracle_mlp_recall"] = curve_recall(preds.metrics["oracle_curves"]["label"], mlp_k)
                row["oracle_mlp_mass"] = curve_recall(preds.metrics["oracle_curves"]["mass"], mlp_k)
            for mode in MODES:
                if d >= 1.0:
                    row[mode] = dense
                    continue
                mk, ak = uni if mode == "predicted-uniform" else (mlp_k, attn_k)
                with torch.no_grad(), masked_sparsity(model, mk, ak, mode.split("-")[0], preds, seed=0):
                    row[mode] = ppl()
                print(f"{scope} density {d}: {mode:18s} ppl {row[mode]['perplexity']:.3f} "
                      f"({row[mode]['seconds']:.0f}s)", flush=True)
            rows[scope].append(row)
    results = {"model": str(args.model), "model_config": cfg.to_hf_dict(), "calib_tokens": cal.n_tokens,
               "eval_tokens": dense["tokens"], "window": window, "dense_ppl": dense["perplexity"],
               "predictor_input": preds.predictor_input, "predictor_settings": asdict(base),
               "study_settings": asdict(study_settings),
               "cost": preds.metrics["cost"], "predictor_metrics": preds.metrics["per_layer"],
               "holdout_tokens": preds.metrics["holdout_tokens"], "lookahead_study": study, "rows": rows}
    out = Path(args.out)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "img").mkdir(parents=True, exist_ok=True)
    write_json(out / "results" / "sparsity_quality.json", results, indent=1, sort_keys=True)
    with atomic_path(out / "results" / "sparsity_quality.md") as tmp:
        tmp.write_text(table(results))
    plot(results, out / "img" / "ppl_vs_density.png")
    print(table(results))
    return results


if __name__ == "__main__":
    main()

"""Engines at several MLP densities from one predictor training, as `dejavu-compile` builds each.

`dejavu-compile MODEL --mlp-density D --attn-density A` trains the same predictors at every D
(their training does not depend on the density; only the reported recall does), so this
trains them once (calibration + `train_predictors` with `dejavu-compile`'s predictor settings)
and writes one engine
per density with `build_engine(..., predictors=)`. Prints the stage times. `--save-predictors P.pkl`
pickles the trained predictors, `--predictors P.pkl` reads them instead of training.

    python benchmarks/build_density_set.py opt-mini --densities 0.1 0.2 0.3 \
        --attn-density 1.0 --dtype float32 --out-dir /tmp/engines [--token-k off share] \
        [--token-k-rows selected read]
"""
from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import torch

from dejavu.compiler import build as build_mod
from dejavu.compiler.build import build_engine
from dejavu.compiler.calibrate import calibrate
from dejavu.compiler.config import TOKEN_K_FORMS, TOKEN_K_ROWS, BuildConfig, CalibSettings
from dejavu.compiler.predictors import train_predictors
from dejavu.models.loader import load_model, load_tokenizer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--densities", type=float, nargs="+", required=True)
    ap.add_argument("--attn-density", type=float, default=1.0)
    ap.add_argument("--dtype", default=BuildConfig.dtype)
    ap.add_argument("--token-k", nargs="+", default=[BuildConfig.token_k], choices=TOKEN_K_FORMS,
                    help="one engine per density and form (m{D}-a{A}.engine for off, m{D}-a{A}-tkshare.engine "
                         "for share; default: the build's, share here)")
    ap.add_argument("--token-k-rows", nargs="+", default=[BuildConfig.token_k_rows], choices=TOKEN_K_ROWS,
                    help="with a per-token K, one engine per rows measure (-tkshare-read.engine for read)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--predictors", default=None, metavar="P.pkl", help="pickled predictors (no training)")
    ap.add_argument("--save-predictors", default=None, metavar="P.pkl", help="pickle the trained predictors here")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfg0 = BuildConfig(mlp_density=args.densities[0], attn_density=args.attn_density, dtype=args.dtype)
    if args.predictors:
        preds = pickle.loads(Path(args.predictors).read_bytes())
    else:
        model, _ = load_model(args.model)
        model = model.float()
        cal = calibrate(model, load_tokenizer(args.model), CalibSettings(calib_tokens=cfg0.calib_tokens,
                        window=cfg0.calib_window, corpus=cfg0.calib), model_id=args.model, progress=True)
        preds = train_predictors(cal, build_mod._predictor_settings(cfg0), progress=True, model=model)
        print(json.dumps({"train_seconds": round(time.time() - t0, 1), "metrics": {
            k: v for k, v in preds.metrics.items() if k in ("mlp_recall_mean", "cost", "holdout_tokens")}}))
        if args.save_predictors:
            Path(args.save_predictors).write_bytes(pickle.dumps(preds))
    for d in args.densities:
        for form in args.token_k:
            for rows in (args.token_k_rows if form != "off" else [BuildConfig.token_k_rows]):
                t = time.time()
                c = BuildConfig(mlp_density=d, attn_density=args.attn_density, dtype=args.dtype, token_k=form,
                                token_k_rows=rows)
                name = f"m{d}-a{args.attn_density}" + ("" if form == "off" else "-tkshare") + \
                    ("-read" if rows == "read" else "")
                s = build_engine(args.model, c, out / f"{name}.engine", progress=False, predictors=preds)
                tk = s["token_k"] or {}
                print(json.dumps({"density": d, "token_k": form, "token_k_rows": rows, "seconds": round(time.time() - t, 1),
                                  "stage_seconds": s["stage_seconds"], "mlp_k": s["mlp_k"],
                                  "predictor_bytes": s["predictor_bytes"], "engine_bytes": s["engine_bytes"],
                                  "bytes_per_token": s["bytes_per_token"], "heldout": s["heldout"],
                                  "k_max": tk.get("k_max"), "mean_rows": tk.get("heldout", {}).get("mean_rows"),
                                  "mean_rows_fc2": tk.get("heldout", {}).get("mean_rows_fc2")}), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()

"""Training variants of one layer's MLP predictor (`_fit` as the build calls it): held-out share
of the neurons' contribution in the predicted top-k, k = 77, 154, 230, 307, 461.

Variants: base | lr=X | gamma=X (listwise target c**X / sum, early stopping still on c) |
epochs=N | patience=N | batch=N. Layer l is seeded with l.

    python benchmarks/predictor_training_variants.py --layers 1 4 --variants base lr=0.01 gamma=0.5 --out F
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from dejavu.compiler.calibrate import calibrate
from dejavu.compiler.config import CalibSettings, PredictorSettings
from dejavu.compiler.predictors import _fit, _layer_data, mlp_ranks
from dejavu.fileio import write_json
from dejavu.models.loader import load_model, load_tokenizer

FIELDS = {"lr": ("lr", float), "epochs": ("max_epochs", int), "patience": ("patience", int),
          "batch": ("batch_tokens", int)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", required=True)
    ap.add_argument("--variants", nargs="+", default=["base"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, cfg = load_model("opt-mini")
    model = model.float()
    cal = calibrate(model, load_tokenizer("opt-mini"), CalibSettings(), model_id="opt-mini", progress=False)
    s0 = PredictorSettings(dtype="float")  # the float rank rule these variants measured
    ranks = mlp_ranks(cfg, s0)
    out = {}
    for l in args.layers:
        x, y, c, _, split = _layer_data(cal, l, s0, torch.device("cpu"), model.decoder.layers[l])
        cv = c[split:]
        for v in args.variants:
            name, val = v.split("=") if "=" in v else (v, None)
            s, gamma = s0, 1.0
            if name in FIELDS:
                field, conv = FIELDS[name]
                s = replace(s0, **{field: conv(val)})
            elif name == "gamma":
                gamma = float(val)
            t = time.time()
            p = _fit(x[:split], y[:split], x[split:], y[split:], ranks[l], 154, s, torch.Generator().manual_seed(l),
                     c[:split] ** gamma, cv)
            with torch.no_grad():
                sc = (x[split:] @ p["a"].T) @ p["b"].T + p["bias"]
                cum = cv.gather(-1, sc.argsort(-1, descending=True)).sum(0).cumsum(0) / cv.sum()
            out[f"{l}:{v}"] = {k: round(float(cum[k - 1]), 4) for k in (77, 154, 230, 307, 461)}
            print(l, v, out[f"{l}:{v}"], round(time.time() - t), flush=True)
    write_json(args.out, out, indent=1)
    return out


if __name__ == "__main__":
    main()

"""The build's predictors with the MLP ranks of `int8_ranks` (160 / 112 on opt-mini) and the MLP A and B
through `int8_rows` (int8 per row with an fp16 scale, dequantized): an fp32 engine built from them
carries exactly the int8 values. Heads' predictors as the build trains them.

    python benchmarks/int8_predictors.py P_fp32.pkl P_int8.pkl
    python benchmarks/build_density_set.py opt-mini ... --predictors P_int8.pkl
"""
import json
import pickle
import sys
import time
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).parent))
from predictor_rank_study import int8_ranks, int8_rows
import dejavu.compiler.predictors as P
import dejavu.compiler.build as build_mod
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.calibrate import calibrate
from dejavu.compiler.config import CalibSettings
from dejavu.models.loader import load_model, load_tokenizer

torch.manual_seed(0)
t0 = time.time()
cfg0 = BuildConfig(mlp_density=0.1, attn_density=1.0, dtype="float32")
s = build_mod._predictor_settings(cfg0)
model, _ = load_model("opt-mini")
model = model.float()
ranks = int8_ranks(model.config, s)
print("ranks", ranks, flush=True)
P.mlp_ranks = lambda cfg, settings: list(ranks)
cal = calibrate(model, load_tokenizer("opt-mini"), CalibSettings(calib_tokens=cfg0.calib_tokens,
                window=cfg0.calib_window, corpus=cfg0.calib), model_id="opt-mini", progress=True)
preds = P.train_predictors(cal, s, progress=True, model=model)
print(json.dumps({"train_seconds": round(time.time() - t0, 1), "mlp_recall_mean": preds.metrics["mlp_recall_mean"],
                  "ranks": [int(p["a"].shape[0]) for p in preds.mlp]}), flush=True)
Path(sys.argv[1]).write_bytes(pickle.dumps(preds))
err = []
for p in preds.mlp:
    qa, qb = int8_rows(p["a"]), int8_rows(p["b"])
    err.append(float(((qa - p["a"]).norm() / p["a"].norm())))
    p["a"], p["b"] = qa.contiguous(), qb.contiguous()
print("rel err a", err, flush=True)
Path(sys.argv[2]).write_bytes(pickle.dumps(preds))

"""Where head predictors lose: per layer, the share of the heads' contribution mass
sum_h ||W_o[:, h] y_h|| that the predicted top-K, the oracle top-K and one static top-6 (the
layer's largest mean contribution) keep, and how many heads a token needs for 80% of its mass.

    python benchmarks/head_mass.py PREDICTORS   (PATH.safetensors + PATH.json, byte_budget.py --predictors)

On the held-out tail of the default build's 65,536-token calibration (cached by calibrate)."""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_budget import _load_predictors
from dejavu.compiler.calibrate import calibrate
from dejavu.compiler.config import CalibSettings, PredictorSettings
from dejavu.compiler.predictors import holdout_split
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.presets import resolve


def main() -> int:
    torch.set_num_threads(1)
    folder = resolve("opt-mini")
    model, cfg = load_model(folder)
    cal = calibrate(model, load_tokenizer(folder), CalibSettings(calib_tokens=65536), model_id="opt-mini", progress=False)
    s = PredictorSettings()
    split = holdout_split(cal.n_tokens, cal.n_windows, cal.window, s)
    p = _load_predictors(Path(sys.argv[1]))
    for l in range(cfg.num_hidden_layers):
        x = torch.from_numpy(np.array(cal.predictor_input(l, "attn_in", 1)[split:], dtype=np.float32))
        c = torch.from_numpy(np.array(cal.head_importance(l)[split:]))
        sc = p.scores("attn", l, x)
        row = []
        for k in (3, 6, 9):
            pm = c.gather(-1, sc.topk(k, -1).indices).sum() / c.sum()
            om = c.topk(k, -1).values.sum() / c.sum()
            row.append(f"k{k}: pred {pm:.3f} oracle {om:.3f}")
        # one static set: the 6 heads of largest mean contribution, the same for every token
        static = c.mean(0).topk(6).indices
        sm = c[:, static].sum() / c.sum()
        # how concentrated a token's mass is: heads needed for 80% of it
        srt = c.sort(-1, descending=True).values.cumsum(-1) / c.sum(-1, keepdim=True)
        need = (srt < 0.8).sum(-1).float() + 1
        print(l, " | ".join(row), f"| static top-6 {sm:.3f} | heads for 80%: mean {need.mean():.2f} p10 {need.quantile(0.1):.0f} p90 {need.quantile(0.9):.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

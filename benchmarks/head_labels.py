"""Head predictors: which label makes predicted heads track the oracle (opt-mini, heads only).

    python benchmarks/head_labels.py --calib-tokens 16384 --eval-tokens 4096 --out head_labels.json

Per layer, head predictors are trained (`compiler.predictors._fit`, the build's trainer) on
the calibration stream with labels "top ceil(0.5 H) heads of the token" ranked by
  norm          ||y_h||, the head's slice of the out_proj input (the labels before 2026-12-05)
  contribution  ||W_o[:, h] y_h||, what the head adds to the layer output
  regression    no labels: ridge least squares onto log ||W_o[:, h] y_h||, heads ranked by it
                (`predictors._fit_heads`, shipped)
and scored on WikiText-2 test (first --eval-tokens) with K heads per layer and every MLP
neuron kept: predicted by each label's predictor, and the oracles top-K by norm and by
contribution (exact per-token selections, masked dense, fp32 on CPU).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_predictor_form import load_opt, norm_oracle, perplexity, test_windows  # noqa: E402


def contributions(model, ids: torch.Tensor, window: int) -> tuple[dict, dict]:
    """Per layer [T, H] of ||y_h|| and of ||W_o[:, h] y_h|| over the stream ids [T] (windows of `window`)."""
    cfg = model.config
    H, hd = cfg.num_attention_heads, cfg.head_dim
    out: dict[int, list] = {l: [] for l in range(cfg.num_hidden_layers)}
    norm: dict[int, list] = {l: [] for l in range(cfg.num_hidden_layers)}
    handles = []
    for l, layer in enumerate(model.decoder.layers):
        w = layer.self_attn.out_proj.weight.detach().view(-1, H, hd)  # [D, H, hd]
        gram = torch.einsum("dhi,dhj->hij", w, w)  # [H, hd, hd]

        def hook(m, a, l=l, gram=gram):
            y = a[0].detach().unflatten(-1, (H, hd)).reshape(-1, H, hd)  # [T, H, hd]
            out[l].append(torch.einsum("thi,hij,thj->th", y, gram, y).clamp_min(0).sqrt())
            norm[l].append(y.norm(dim=-1))
        handles.append(layer.self_attn.out_proj.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for i in range(0, len(ids) - window + 1, window):
                model(ids[i:i + window][None])
    finally:
        for h in handles:
            h.remove()
    return {l: torch.cat(v) for l, v in norm.items()}, {l: torch.cat(v) for l, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-mini")
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--head-density", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--labels", default="norm,contribution", help="norm, contribution, regression")
    p.add_argument("--lookahead", type=int, default=1, help="predictor input: attn_in of layer l - lookahead")
    p.add_argument("--no-oracles", action="store_true")
    p.add_argument("--out", default="head_labels.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from dejavu.compiler.calibrate import calibrate
    from dejavu.compiler.config import CalibSettings, PredictorSettings
    from dejavu.compiler.masking import masked_sparsity
    from dejavu.compiler.predictors import Predictors, _fit, _fit_heads, _head_labels
    from dejavu.fileio import write_json

    t0 = time.perf_counter()
    model, cfg, tok = load_opt(a.model)
    L, H, Fd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.ffn_dim
    s = PredictorSettings(max_epochs=a.epochs, lookahead=a.lookahead)
    cal = calibrate(model, tok, CalibSettings(calib_tokens=a.calib_tokens), model_id=a.model, progress=False)
    norms, contrib = contributions(model, torch.from_numpy(np.asarray(cal.tokens).astype(np.int64)), cal.window)
    k_lab = math.ceil(0.5 * H)
    gen = torch.Generator().manual_seed(0)
    preds = {}
    for label in a.labels.split(","):
        layers = []
        for l in range(L):
            x = torch.from_numpy(np.array(cal.predictor_input(l, s.source, s.lookahead), dtype=np.float32))
            imp = norms[l] if label == "norm" else contrib[l]
            split = int(len(x) * 0.9) // cal.window * cal.window
            if label == "regression":  # the shipped fit: least squares onto log contribution
                pa = _fit_heads(x[:split], imp[:split], x[split:], _head_labels(imp[split:len(x)], k_lab), H, k_lab,
                                s.ridge)
                pa.pop("val_loss")
                layers.append(pa)
                continue
            y = _head_labels(imp[:len(x)], k_lab)
            pa = _fit(x[:split], y[:split], x[split:], y[split:], H, k_lab, s, gen)
            pa.pop("val_loss")
            layers.append(pa)
        preds[label] = Predictors(layers, layers, s.predictor_input)  # MLP stays dense: its slot is unused
    ids = test_windows(tok, cfg, a.eval_tokens)
    k = max(1, round(a.head_density * H))
    ppl = lambda ctx_fn: perplexity(model, ids, ctx_fn)

    mk, ak = [Fd] * L, [k] * L
    res = {"model": a.model, "calib_tokens": a.calib_tokens, "eval_tokens": ids.shape[0] * (ids.shape[1] - 1),
           "heads_k": k, "epochs": a.epochs, "lookahead": a.lookahead, "dense": ppl(lambda: torch.no_grad())}
    if not a.no_oracles:
        res.update(oracle_norm=ppl(lambda: norm_oracle(model, ak)),
                   oracle_contribution=ppl(lambda: masked_sparsity(model, mk, ak, "oracle")))
    for label, pr in preds.items():
        res[f"predicted_{label}"] = ppl(lambda pr=pr: masked_sparsity(model, mk, ak, "predicted", pr))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(a.out, res, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

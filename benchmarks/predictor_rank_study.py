"""Layer 0 and the rest at small K: rank per layer, layer 0's input, curves for the allocator.

MLP predictors fitted as the build fits them (`compiler.predictors._fit`: least-squares start,
listwise loss on the neurons' contributions, early stopping at 0.1 F), one calibration (the last
10% of its windows held out), each layer seeded on its own. WikiText-2 test perplexity of the
masked-dense model (MLP only, heads dense), K spread over layers by each variant's held-out
curves as `dejavu-compile --mlp-density D` spreads it. Variants:
  base          rank 56 everywhere, input attn_in of l-1, K by the share of active neurons
  mass curves   the same predictors, K by the share of the contribution (the build's now)
  l0 rank       layer 0 at the rank the budget leaves it (`mlp_ranks`), mass curves
  l0 own input  layer 0 reads its own mlp_in (lookahead 0, rank 56), mass curves
  oracle l0     layer 0 selects the true top-K contributions, the rest predicted (base)
  oracle l1+    layers 1.. select the true top-K, layer 0 predicted (base)

    python benchmarks/predictor_rank_study.py --eval-tokens 2048 --out /tmp/rank_study.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dejavu.compiler.calibrate import calibrate
from dejavu.compiler.config import CalibSettings, PredictorSettings
from dejavu.compiler.density import resolve_density
from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.predictors import _curve, _fit, default_ranks, holdout_split, mlp_contributions, mlp_ranks
from dejavu.compiler.text import encode_text
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.metrics import perplexity

VARIANTS = ["base", "mass curves", "l0 rank", "l0 own input", "oracle l0", "oracle l1+"]


def fit_layer(cal, model, l: int, source: str, lookahead: int, rank: int, s: PredictorSettings) -> dict:
    """One layer's MLP predictor (raw-input a/b/bias) and its held-out curves."""
    layer = model.decoder.layers[l]
    c = mlp_contributions(layer, cal.source("mlp_in", l))
    y = torch.from_numpy(cal.mlp_labels(l))
    split = holdout_split(cal.n_tokens, cal.n_windows, cal.window, s)
    j = l - lookahead
    x = torch.from_numpy(np.array(cal.source("attn_in", 0) if j < 0 else cal.source(source, j), dtype=np.float32))
    k_stop = max(1, round(s.stop_density * cal.cfg.ffn_dim))
    p = _fit(x[:split], y[:split], x[split:], y[split:], rank, k_stop, s, torch.Generator().manual_seed(1000 + l),
             c[:split], c[split:])
    with torch.no_grad():
        sv = (x[split:] @ p["a"].T) @ p["b"].T + p["bias"]
        n = s.curve_tokens
        return {"a": p["a"], "b": p["b"], "bias": p["bias"], "source": (source, lookahead),
                "label_curve": _curve(sv[:n], y[split:][:n]), "mass_curve": _curve(sv[:n], c[split:][:n]),
                "mass_at": {k: float(_curve(sv, c[split:])[k - 1]) for k in (154, 307, 461)}}


@contextlib.contextmanager
def selection(model, mk, ak, fits: list[dict], oracle: set[int]):
    """masked_sparsity with each layer's own predictor input (layer 0 may read its mlp_in) or
    the true contributions for the layers in `oracle`."""
    mlp_in: dict = {}
    hooks = [layer.final_layer_norm.register_forward_pre_hook(
        lambda m, a, l=l: mlp_in.__setitem__(l, a[0].detach())) for l, layer in enumerate(model.decoder.layers)]

    class Scores:
        predictor_input = {"source": "attn_in", "lookahead": 1}

        def scores(self, kind, l, x):
            if l in oracle:
                layer = model.decoder.layers[l]
                return F.relu(layer.fc1(layer.final_layer_norm(mlp_in[l]))) * layer.fc2.weight.norm(dim=0)
            f = fits[l]
            if f["source"] == ("mlp_in", 0):
                x = mlp_in[l]
            return (x.float() @ f["a"].T) @ f["b"].T + f["bias"]

    try:
        with masked_sparsity(model, mk, ak, "predicted", Scores()) as m:
            yield m
    finally:
        for h in hooks:
            h.remove()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-mini")
    ap.add_argument("--calib-tokens", type=int, default=CalibSettings.calib_tokens)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2])
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, cfg = load_model(args.model)
    model = model.float().eval()
    tok = load_tokenizer(args.model)
    cal = calibrate(model, tok, CalibSettings(calib_tokens=args.calib_tokens), model_id=args.model)
    s = PredictorSettings()
    L, base_rank = cfg.num_hidden_layers, default_ranks(cfg, s)[0]
    base = [fit_layer(cal, model, l, "attn_in", 1, base_rank, s) for l in range(L)]
    extra = {}
    if "l0 rank" in args.variants:
        extra["l0 rank"] = fit_layer(cal, model, 0, "attn_in", 1, mlp_ranks(cfg, s)[0], s)
    if "l0 own input" in args.variants:
        extra["l0 own input"] = fit_layer(cal, model, 0, "mlp_in", 0, base_rank, s)
    ids = encode_text(tok, WIKITEXT2_TEST.read_text(encoding="utf-8"), cfg.bos_token_id,
                      max_tokens=args.eval_tokens or None)
    ids = torch.from_numpy(ids.astype(np.int64))
    ppl = lambda: perplexity(lambda x: model(x), ids, min(512, cfg.max_position_embeddings), batch=4)  # noqa: E731
    res = {"model": args.model, "calib_tokens": cal.n_tokens, "rank": base_rank, "l0_rank": mlp_ranks(cfg, s)[0],
           "mass_at": {}, "quality": {}}
    with torch.no_grad():
        dense = ppl()
        res["quality"]["dense"] = dense
        for name in args.variants:
            fits = [extra[name]] + base[1:] if name in extra else base
            oracle = {0} if name == "oracle l0" else set(range(1, L)) if name == "oracle l1+" else set()
            curve = "label_curve" if name == "base" else "mass_curve"
            res["mass_at"][name] = [f["mass_at"] for f in fits]
            for d in args.densities:
                mk, ak = resolve_density(cfg, 1.0, d, 1.0, recall_curves={"mlp": [f[curve] for f in fits]})
                with selection(model, mk, ak, fits, oracle):
                    got = ppl()
                res["quality"][f"{name}@{d}"] = {**got, "mlp_k": mk,
                                                 "increase_pct": 100 * (got["perplexity"] / dense["perplexity"] - 1)}
                print(name, d, round(res["quality"][f"{name}@{d}"]["increase_pct"], 2), mk, flush=True)
    with atomic_path(Path(args.out)) as tmp:
        tmp.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()

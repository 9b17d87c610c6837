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
  l0 rank int8  l0 rank with A [r, D] and B [F, r] quantized to int8, one fp16 scale a row
                (symmetric; quantize then dequantize, bias kept), curves of the quantized scores
  ranks x2      every layer at twice its `mlp_ranks` rank (layer 0 included), mass curves
  ranks x2 int8 ranks x2 with A and B quantized as in l0 rank int8
  int8 budget   int8 A and B at the ranks the same byte budget pays for (`int8_ranks`)

    python benchmarks/predictor_rank_study.py --eval-tokens 2048 --out /tmp/rank_study.json
"""
from __future__ import annotations

import argparse
import contextlib

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
from dejavu.fileio import write_json
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.metrics import perplexity

VARIANTS = ["base", "mass curves", "l0 rank", "l0 own input", "oracle l0", "oracle l1+",
            "l0 rank int8", "ranks x2", "ranks x2 int8", "int8 budget"]


def int8_ranks(cfg, s: PredictorSettings) -> list[int]:
    """`mlp_ranks`' rule when A and B are int8 with an fp16 scale a row and the bias fp16:
    r (D + F) / 2 + (r + F) + F fp16 elements a layer against the budget share of fc1 + fc2."""
    L, D, Fd = cfg.num_hidden_layers, cfg.hidden_size, cfg.ffn_dim
    room, per_rank = s.cost_budget * (2 * D * Fd + Fd + D) - 2 * Fd, (D + Fd) / 2 + 1
    base = int(room // per_rank) // 8 * 8
    return [int(L * room / per_rank - (L - 1) * base) // 8 * 8] + [base] * (L - 1)


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """w [R, C] through symmetric per-row int8 with an fp16 scale a row (quantize, dequantize)."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-8).half().float()
    return (w / scale).round().clamp(-127, 127) * scale


def held_out(p: dict, source: tuple, xv, yv, cv, s: PredictorSettings) -> dict:
    """p's held-out curves and mass@K / recall@K at K = 0.1, 0.2, 0.3 F."""
    with torch.no_grad():
        sv = (xv @ p["a"].T) @ p["b"].T + p["bias"]
        n = s.curve_tokens
        mass, recall = _curve(sv, cv), _curve(sv, yv)
        return {**p, "source": source, "label_curve": _curve(sv[:n], yv[:n]), "mass_curve": _curve(sv[:n], cv[:n]),
                "mass_at": {k: float(mass[k - 1]) for k in (154, 307, 461)},
                "recall_at": {k: float(recall[k - 1]) for k in (154, 307, 461)}}


def fit_layer(cal, model, l: int, source: str, lookahead: int, rank: int, s: PredictorSettings) -> dict:
    """One layer's MLP predictor (raw-input a/b/bias) and its held-out curves: {"fp32": .., "int8": ..}."""
    layer = model.decoder.layers[l]
    c = mlp_contributions(layer, cal.source("mlp_in", l))
    y = torch.from_numpy(cal.mlp_labels(l))
    split = holdout_split(cal.n_tokens, cal.n_windows, cal.window, s)
    j = l - lookahead
    x = torch.from_numpy(np.array(cal.source("attn_in", 0) if j < 0 else cal.source(source, j), dtype=np.float32))
    k_stop = max(1, round(s.stop_density * cal.cfg.ffn_dim))
    p = _fit(x[:split], y[:split], x[split:], y[split:], rank, k_stop, s, torch.Generator().manual_seed(1000 + l),
             c[:split], c[split:])
    p = {"a": p["a"], "b": p["b"], "bias": p["bias"]}
    q = {**p, "a": int8_rows(p["a"]), "b": int8_rows(p["b"])}
    held = (x[split:], y[split:], c[split:], s)
    print(f"fitted layer {l} rank {rank}", flush=True)
    return {"fp32": held_out(p, (source, lookahead), *held), "int8": held_out(q, (source, lookahead), *held)}


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
    s = PredictorSettings(dtype="float")  # the float rank rule (int8_ranks: the int8 one)
    L, base_rank = cfg.num_hidden_layers, default_ranks(cfg, s)[0]
    x2 = {"ranks x2", "ranks x2 int8"}
    fp32 = lambda fits: [f["fp32"] for f in fits]  # noqa: E731
    int8 = lambda fits: [f["int8"] for f in fits]  # noqa: E731
    base = [fit_layer(cal, model, l, "attn_in", 1, base_rank, s) for l in range(L) if l or set(args.variants) - x2
            - {"l0 rank", "l0 rank int8", "int8 budget"}]
    base = [None] * (L - len(base)) + base
    extra, rows = {}, {}
    if {"l0 rank", "l0 rank int8"} & set(args.variants):
        l0 = fit_layer(cal, model, 0, "attn_in", 1, mlp_ranks(cfg, s)[0], s)
        rows["l0 rank"], rows["l0 rank int8"] = fp32([l0] + base[1:]), int8([l0] + base[1:])
    if "l0 own input" in args.variants:
        extra["l0 own input"] = fit_layer(cal, model, 0, "mlp_in", 0, base_rank, s)
    memo: dict = {}

    def fitted(l: int, r: int) -> dict:  # one fit per (layer, rank), shared by the variants
        if (l, r) not in memo:
            memo[l, r] = fit_layer(cal, model, l, "attn_in", 1, r, s)
        return memo[l, r]

    if x2 & set(args.variants):
        fits = [fitted(l, 2 * r) for l, r in enumerate(mlp_ranks(cfg, s))]
        rows["ranks x2"], rows["ranks x2 int8"] = fp32(fits), int8(fits)
    if "int8 budget" in args.variants:
        rows["int8 budget"] = int8([fitted(l, r) for l, r in enumerate(int8_ranks(cfg, s))])
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
            fits = rows.get(name) or fp32([extra[name]] + base[1:] if name in extra else base)
            oracle = {0} if name == "oracle l0" else set(range(1, L)) if name == "oracle l1+" else set()
            curve = "label_curve" if name == "base" else "mass_curve"
            res["mass_at"][name] = [f["mass_at"] for f in fits]
            res.setdefault("recall_at", {})[name] = [f["recall_at"] for f in fits]
            res.setdefault("ranks", {})[name] = [int(f["a"].shape[0]) for f in fits]
            for d in args.densities:
                mk, ak = resolve_density(cfg, 1.0, d, 1.0, recall_curves={"mlp": [f[curve] for f in fits]})
                with selection(model, mk, ak, fits, oracle):
                    got = ppl()
                res["quality"][f"{name}@{d}"] = {**got, "mlp_k": mk,
                                                 "increase_pct": 100 * (got["perplexity"] / dense["perplexity"] - 1)}
                print(name, d, round(res["quality"][f"{name}@{d}"]["increase_pct"], 2), mk, flush=True)
    write_json(args.out, res, indent=1)
    return res


if __name__ == "__main__":
    main()

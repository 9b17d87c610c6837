"""MLP-only budgets: K across layers by measured loss, and a per-token K from the predicted mass.

Predictors: the build's (`train_predictors` with `dejavu-compile`'s settings), trained once and
pickled (`--predictors`; trained and written there when the file is missing). Masked dense,
heads dense, WikiText-2 test perplexity. Variants at each MLP density D (total K =
round(D F L), as `--mlp-density D` spends it):
  curves      K spread by the predictors' held-out contribution-share curves (the build's
              `resolve_density`)
  loss        K per layer by a knapsack on the measured held-out loss increase of each
              candidate K applied alone (`allocate.measure_sensitivity` on the build's
              held-out windows, WikiText-2 validation; never the test text), same neuron total
  pertoken-C  per-layer K of `curves` as the mean: each token keeps the smallest k whose
              predicted mass (softmax of the listwise scores) reaches tau_l, capped at C x K_l;
              tau_l set so the mean k over the held-out windows equals K_l
  pthresh-C   the same with the rows whose predicted share is >= theta_l (no sort needed)
  matched     fixed K per layer = the mean k the preceding pertoken-/pthresh- variant kept on the
              test tokens (the fixed selection at the per-token one's row count; list it after one)
  build       the K that the build's `resolve_k` picks for `--density B --attn-density 1.0`, B the
              byte fraction of the `curves` K (heads frozen dense, neurons free; the knapsack
              until commit 50dc07d, the curves since)
Also reported: the share of the predicted top-K rows whose activation is zero (ReLU), per layer.

    python benchmarks/mlp_allocation_study.py --predictors /tmp/preds.pkl --eval-tokens 2048 --out F
"""
from __future__ import annotations

import argparse
import contextlib
import math
import pickle
from pathlib import Path

import numpy as np
import torch

from dejavu.compiler.allocate import (ByteCosts, allocate_knapsack, heldout_windows, measure_sensitivity,
                                      model_parts, resolve_k)
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.density import resolve_density
from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.text import encode_text
from dejavu.compiler.token_k import TokenK, fit_token_k, token_counts
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import write_json
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.metrics import perplexity

FINE = (0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.12, 0.14, 0.17, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6)


def train(path: Path, model):
    from dejavu.compiler import build as build_mod
    from dejavu.compiler.calibrate import calibrate
    from dejavu.compiler.config import BuildConfig, CalibSettings
    from dejavu.compiler.predictors import train_predictors

    c = BuildConfig(mlp_density=0.1, attn_density=1.0, dtype="float32")
    cal = calibrate(model, load_tokenizer("opt-mini"), CalibSettings(calib_tokens=c.calib_tokens,
                    window=c.calib_window, corpus=c.calib), model_id="opt-mini", progress=False)
    preds = train_predictors(cal, build_mod._predictor_settings(c), progress=False, model=model)
    path.write_bytes(pickle.dumps(preds))
    return preds


@torch.no_grad()
def predictor_inputs(model, ids, pi) -> list[torch.Tensor]:
    """Dense forward over ids [B, S]: each layer's predictor input [B, S, D]."""
    src = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, l=l: src.__setitem__(("attn_in", l), a[0]))
             for l, layer in enumerate(model.decoder.layers)]
    hooks += [layer.final_layer_norm.register_forward_pre_hook(lambda m, a, l=l: src.__setitem__(("mlp_in", l), a[0]))
              for l, layer in enumerate(model.decoder.layers)]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    L = len(model.decoder.layers)
    return [src[("attn_in", 0)] if l - pi["lookahead"] < 0 else src[(pi["source"], l - pi["lookahead"])]
            for l in range(L)]


def prob_counts(scores: torch.Tensor, t: float, cap: int) -> torch.Tensor:
    """k per token [...]: the rows whose predicted share softmax(scores) is >= exp(-t), in [1, cap]."""
    return (torch.softmax(scores.float(), -1) >= math.exp(-t)).sum(-1).clamp(1, cap)


def fit_prob_t(scores: torch.Tensor, k_mean: int, cap: int) -> float:
    lo, hi = 0.0, 40.0  # counts grow with t
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if prob_counts(scores, mid, cap).float().mean().item() <= k_mean else (lo, mid)
    return lo


@contextlib.contextmanager
def prob_threshold(model, predictors, ts, caps, counts: list):
    """Masked dense MLP: each token keeps its top-scored rows whose predicted share is >= exp(-t_l)."""
    src, handles = {}, []
    pi = predictors.predictor_input

    def mlp_hook(m, a, out, l):
        j = l - pi["lookahead"]
        s = predictors.scores("mlp", l, (src[0] if j < 0 else src[j]).float())
        k = prob_counts(s, ts[l], caps[l])  # [B, S]
        counts[l].append(k.flatten())
        keep = (torch.arange(caps[l]) < k[..., None]).to(out.dtype)
        return out * torch.zeros_like(out).scatter_(-1, s.topk(caps[l], -1).indices, keep)

    for l, layer in enumerate(model.decoder.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, l=l: src.__setitem__(l, a[0])))
        handles.append(layer.activation_fn.register_forward_hook(lambda m, a, o, l=l: mlp_hook(m, a, o, l)))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def counting(model, predictors, tk: TokenK, counts: list):
    """Record each token's count (token_k.token_counts) while masked_sparsity(token_k=) runs."""
    src, handles = {}, []
    pi = predictors.predictor_input

    def count(m, a, l):
        j = l - pi["lookahead"]
        s = predictors.scores("mlp", l, (src[0] if j < 0 else src[j]).float())
        counts[l].append(token_counts(s, tk.threshold[l], tk.k_max[l]).flatten())

    for l, layer in enumerate(model.decoder.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, l=l: src.__setitem__(l, a[0])))
        handles.append(layer.fc2.register_forward_pre_hook(lambda m, a, l=l: count(m, a, l)))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def zero_rows(model, predictors, ids, mlp_k) -> list[float]:
    """Per layer: share of the predicted top-K rows (dense run) whose ReLU output is 0."""
    h = {}
    hooks = [layer.activation_fn.register_forward_hook(lambda m, a, o, l=l: h.__setitem__(l, o))
             for l, layer in enumerate(model.decoder.layers)]
    try:
        xs = predictor_inputs(model, ids, predictors.predictor_input)
    finally:
        for hk in hooks:
            hk.remove()
    out = []
    for l, k in enumerate(mlp_k):
        idx = predictors.scores("mlp", l, xs[l].float()).topk(k, -1).indices
        out.append(float((h[l].gather(-1, idx) == 0).float().mean()))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predictors", required=True)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2])
    ap.add_argument("--variants", nargs="+", default=["curves", "loss", "pertoken-2", "pertoken-3"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, cfg = load_model("opt-mini")
    model = model.float().eval()
    tok = load_tokenizer("opt-mini")
    path = Path(args.predictors)
    preds = pickle.loads(path.read_bytes()) if path.is_file() else train(path, model)
    L, Fd, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    held, held_source = heldout_windows(tok, None, 0, args.heldout_tokens, 512, cfg.bos_token_id)
    ids = torch.from_numpy(encode_text(tok, WIKITEXT2_TEST.read_text(encoding="utf-8"), cfg.bos_token_id,
                                       max_tokens=args.eval_tokens or None).astype(np.int64))
    ppl = lambda: perplexity(lambda x: model(x), ids, 512, batch=4)  # noqa: E731
    res = {"heldout": held_source, "quality": {}, "zero_rows": {}}
    with torch.no_grad():
        dense = ppl()
        res["quality"]["dense"] = dense
        print("dense", dense, flush=True)
        sens = None
        if "loss" in args.variants:
            ks = sorted({max(1, round(f * Fd)) for f in FINE})
            sens = measure_sensitivity(*model_parts(model), held, preds, {"mlp": ks}, progress=False)
            res["sensitivity"] = sens.to_dict()
        xs = predictor_inputs(model, held, preds.predictor_input) if any(
            v.startswith(("pertoken", "pthresh")) for v in args.variants) else None
        costs = ByteCosts.of(cfg, (int(preds.mlp[1]["a"].shape[0]), int(preds.attn[0]["a"].shape[0])), 4)
        last_counts = None  # the mean k per layer of the last per-token variant (for "matched")
        for d in args.densities:
            mk, ak = resolve_density(cfg, 1.0, d, 1.0, recall_curves=preds.recall_curves)
            res["zero_rows"][str(d)] = zero_rows(model, preds, held, mk)
            for name in args.variants:
                counts = [[] for _ in range(L)]
                ctx, ks = None, mk
                if name == "curves":
                    ctx = masked_sparsity(model, mk, ak, "predicted", preds)
                elif name == "matched":
                    if last_counts is None:
                        raise SystemExit("--variants: list 'matched' after a pertoken-/pthresh- variant")
                    ks = [max(1, round(v)) for v in last_counts]
                    ctx = masked_sparsity(model, ks, ak, "predicted", preds)
                elif name == "build":
                    rank = math.ceil(sum(int(p["a"].shape[0]) for p in preds.mlp) / L)  # as resolve_k counts it
                    bc = ByteCosts.of(cfg, (rank, int(preds.attn[0]["a"].shape[0])), 4)
                    frac = math.ceil(bc.total(mk, ak) / bc.dense * 1e6) / 1e6
                    c = BuildConfig(density=frac, attn_density=1.0, dtype="float32")
                    ks, ka, rep = resolve_k(lambda: model_parts(model), cfg, c, preds, tok, "opt-mini")
                    ctx = masked_sparsity(model, ks, ka, "predicted", preds)
                elif name == "loss":
                    budget = costs.total(mk, ak)
                    ks, _ = allocate_knapsack(costs, sens, budget, frozen={"attn": ak})
                    ks = list(ks)
                    ctx = masked_sparsity(model, ks, ak, "predicted", preds)
                else:
                    c = float(name.split("-")[1])  # pertoken-C | pthresh-C
                    score = lambda l: preds.scores("mlp", l, xs[l].float()).flatten(0, 1)  # noqa: E731
                    if name.startswith("pertoken"):
                        tk = fit_token_k(score, mk, cap=c)
                        taus = list(tk.threshold)
                        ctx = contextlib.ExitStack()
                        ctx.enter_context(masked_sparsity(model, mk, ak, "predicted", preds, token_k=tk))
                        ctx.enter_context(counting(model, preds, tk, counts))
                    else:
                        caps = [min(Fd, int(c * k)) for k in mk]
                        taus = [fit_prob_t(score(l), mk[l], caps[l]) for l in range(L)]
                        ctx = prob_threshold(model, preds, taus, caps, counts)
                with ctx:
                    got = ppl()
                row = {**got, "mlp_k": ks, "increase_pct": 100 * (got["perplexity"] / dense["perplexity"] - 1)}
                if counts[0]:
                    row["mean_k_test"] = last_counts = [float(torch.cat(c).float().mean()) for c in counts]
                    row["taus"] = taus
                res["quality"][f"{name}@{d}"] = row
                print(name, d, round(row["increase_pct"], 3), ks, row.get("mean_k_test"), flush=True)
    write_json(args.out, res, indent=1)
    return res


if __name__ == "__main__":
    main()

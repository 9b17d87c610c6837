"""Where MLP-predictor recall is lost at small K: one factor at a time, on one calibration.

Per layer, every variant is fitted on the same calibration tokens (the last 10% of the
windows held out) and scored on the held-out tokens by
  recall@K  share of the active neurons (post-ReLU > 0) in the predicted top-K,
  mass@K    share of the neurons' contribution c_j = relu(fc1(LN(mlp_in)))_j * ||W2[:, j]||
            in the predicted top-K (what the masked MLP output loses),
at K = 0.1 F and 0.2 F (uniform), then WikiText-2 test perplexity of the masked-dense model
(MLP 0.1 and 0.2, heads dense, K spread by each variant's held-out recall curves, as
`dejavu-compile` does). Factors (one changed from `base` unless named as a combination):
  input     attn_in of l-1 (base) | mlp_in of l-1 | mlp_in of l (lookahead 0)
  labels    active (> 0, base) | contribution as the target, through the listwise loss
  loss      class-weighted BCE on active (base) | listwise (softmax cross-entropy to c / sum c)
  capacity  rank (budget rank; 2x) | hidden ReLU: relu(A x + c) at the same rank and bytes
  tokens    all calibration tokens | 1/4
  hot       base's predictor with the 5% most frequently active neurons always selected

    python benchmarks/predictor_study.py --calib-tokens 65536 --eval-tokens 4096 \
        --threads 2 --out docs/results/predictor_study.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from dejavu.compiler.calibrate import calibrate
from dejavu.compiler.config import CalibSettings, PredictorSettings
from dejavu.compiler.density import resolve_density
from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.predictors import _curve, _rrr_init, default_ranks
from dejavu.compiler.text import encode_text
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import write_json
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.metrics import perplexity

BASE = {"source": "attn_in", "lookahead": 1, "loss": "bce", "form": "linear",
        "rank_mult": 1, "tokens": 1.0, "hot": 0.0}
VARIANTS = {
    "base": {},
    "input mlp_in l-1": {"source": "mlp_in"},
    "input mlp_in l": {"source": "mlp_in", "lookahead": 0},
    "loss listwise": {"loss": "list"},
    "capacity rank x2": {"rank_mult": 2},
    "capacity hidden ReLU": {"form": "relu"},
    "tokens 1/4": {"tokens": 0.25},
    "hot 5% always on": {"hot": 0.05},
    "mlp_in l-1 + listwise": {"source": "mlp_in", "loss": "list"},
}


def contributions(layer, mlp_in: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """c [T, F] = relu(fc1(LN(mlp_in))) * ||fc2.weight[:, j]|| (fp32)."""
    w2n = layer.fc2.weight.float().norm(dim=0)  # [F]
    out = []
    with torch.no_grad():
        for i in range(0, len(mlp_in), chunk):
            h = F.relu(layer.fc1(layer.final_layer_norm(mlp_in[i:i + chunk].float())))
            out.append(h * w2n)
    return torch.cat(out)


def scores_of(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = x @ p["a"].T
    if "c" in p:
        h = F.relu(h + p["c"])
    return h @ p["b"].T + p["bias"]


def topk_share(s: torch.Tensor, w: torch.Tensor, k: int) -> float:
    return w.float().gather(-1, s.topk(k, -1).indices).sum().item() / max(1e-12, w.float().sum().item())


def fit(x_tr, y_tr, c_tr, x_va, c_va, v: dict, rank: int, k_eval: int, s: PredictorSettings, gen) -> dict:
    """One predictor per the variant v; early stop on held-out mass@k_eval. Raw-input params."""
    mu, sd = x_tr.mean(0), x_tr.std(0).clamp_min(1e-6)
    norm = lambda x: (x - mu) / sd  # noqa: E731
    p = y_tr.float().mean(0).clamp(1e-4, 1 - 1e-4)
    pos_weight = ((1 - p) / p).clamp(1.0 / s.max_pos_weight, s.max_pos_weight)
    a, b = _rrr_init(x_tr, y_tr, mu, sd, rank, s.ridge)
    bias = torch.log(p / (1 - p))
    params = {"a": a, "b": b, "bias": bias}
    if v["form"] == "relu":  # start as the linear map: c shifts h above 0 on 99% of the tokens
        h = norm(x_tr[:8192]) @ a.T
        c = (-h.quantile(0.01, dim=0)).clamp_min(0)
        params = {"a": a, "c": c, "b": b, "bias": bias - b @ c}
    params = {n: t.clone().requires_grad_() for n, t in params.items()}
    opt = torch.optim.Adam(list(params.values()), lr=s.lr)

    def loss_on(x, y, c):
        sc = scores_of(params, norm(x))
        if v["loss"] == "list":
            t = c / c.sum(-1, keepdim=True).clamp_min(1e-12)
            return -(t * F.log_softmax(sc, -1)).sum(-1).mean()
        return F.binary_cross_entropy_with_logits(sc, y.float(), pos_weight=pos_weight)

    def val() -> float:
        with torch.no_grad():
            return topk_share(scores_of(params, norm(x_va)), c_va, k_eval)

    snap = lambda: {n: t.detach().clone() for n, t in params.items()}  # noqa: E731
    best, best_p, bad, epochs = val(), snap(), 0, 0
    T = x_tr.shape[0]
    for _ in range(s.max_epochs):
        perm = torch.randperm(T, generator=gen)
        for i in range(0, T, s.batch_tokens):
            r = perm[i:i + s.batch_tokens]
            opt.zero_grad(set_to_none=True)
            loss_on(x_tr[r], y_tr[r], c_tr[r]).backward()
            opt.step()
        epochs += 1
        cur = val()
        if cur > best + 1e-5:
            best, best_p, bad = cur, snap(), 0
        else:
            bad += 1
            if bad >= s.patience:
                break
    # fold the standardisation into a (and c / bias for the linear form)
    out = {n: t.double() for n, t in best_p.items()}
    a_f = out["a"] / sd.double()
    shift = out["a"] @ (mu.double() / sd.double())  # [r]
    res = {"a": a_f, "b": out["b"]}
    if "c" in out:
        res["c"], res["bias"] = out["c"] - shift, out["bias"]
    else:
        res["bias"] = out["bias"] - out["b"] @ shift
    return {**{n: t.float() for n, t in res.items()}, "epochs": epochs}


class StudyPredictors:
    """What masked_sparsity needs: scores(kind, l, x) and predictor_input (MLP only here)."""

    def __init__(self, layers: list[dict], source: str, lookahead: int):
        self.layers, self.predictor_input = layers, {"source": source, "lookahead": lookahead}

    def scores(self, kind, l, x):
        return scores_of(self.layers[l], x)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-mini")
    ap.add_argument("--calib-tokens", type=int, default=CalibSettings.calib_tokens)
    ap.add_argument("--eval-tokens", type=int, default=4096, help="WikiText-2 test tokens (0: all)")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--epochs", type=int, default=PredictorSettings.max_epochs)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, cfg = load_model(args.model)
    model = model.float().eval()
    tok = load_tokenizer(args.model)
    cal = calibrate(model, tok, CalibSettings(calib_tokens=args.calib_tokens), model_id=args.model)
    s = PredictorSettings(max_epochs=args.epochs, dtype="float")  # the float rank rule this study measured
    L, Fd = cfg.num_hidden_layers, cfg.ffn_dim
    rank, _ = default_ranks(cfg, s)
    ks = [max(1, round(d * Fd)) for d in args.densities]
    split = (cal.n_windows - max(1, round(cal.n_windows * s.holdout))) * cal.window
    gen = torch.Generator().manual_seed(s.seed)
    vs = {name: {**BASE, **VARIANTS[name]} for name in args.variants}
    preds = {name: [] for name in vs}
    curves = {name: [] for name in vs}
    rows = []
    load = lambda kind, j: torch.from_numpy(np.array(cal.source(kind, j), dtype=np.float32))  # noqa: E731
    for l in range(L):
        y = torch.from_numpy(cal.mlp_labels(l))
        c = contributions(model.decoder.layers[l], load("mlp_in", l))
        freq = y[:split].float().mean(0)
        orow = {"layer": l, "variant": "oracle", "active_fraction": y[split:].float().mean().item()}
        for d, k in zip(args.densities, ks):
            orow[f"recall@{d}"] = topk_share(c[split:], y[split:], k)
            orow[f"mass@{d}"] = topk_share(c[split:], c[split:], k)
        rows.append(orow)
        for name, v in vs.items():
            t0 = time.time()
            j = l - v["lookahead"]
            x = load("attn_in", 0) if j < 0 else load(v["source"], j)
            n_tr = int(split * v["tokens"]) // cal.window * cal.window
            tr, va = slice(split - n_tr, split), slice(split, None)
            same = {**v, "hot": 0.0} == BASE and "base" in preds and len(preds["base"]) > l
            pv = dict(preds["base"][l], epochs=0) if same else \
                fit(x[tr], y[tr], c[tr], x[va], c[va], v, rank * v["rank_mult"], ks[0], s, gen)
            epochs = pv.pop("epochs")
            if v["hot"]:  # the most frequent neurons always win the top-K
                hot = freq.topk(max(1, round(v["hot"] * Fd))).indices
                pv["bias"] = pv["bias"].clone()
                pv["bias"][hot] += 1e4
            with torch.no_grad():
                sv = scores_of(pv, x[va])
            row = {"layer": l, "variant": name, "epochs": epochs, "train_tokens": n_tr,
                   "seconds": round(time.time() - t0, 1), "active_fraction": y[va].float().mean().item()}
            for d, k in zip(args.densities, ks):
                row[f"recall@{d}"] = topk_share(sv, y[va], k)
                row[f"mass@{d}"] = topk_share(sv, c[va], k)
            rows.append(row)
            curves[name].append(_curve(sv[:s.curve_tokens], y[va][:s.curve_tokens]))
            preds[name].append(pv)
            print(json.dumps(row), flush=True)
    ids = encode_text(tok, WIKITEXT2_TEST.read_text(encoding="utf-8"), cfg.bos_token_id,
                      max_tokens=args.eval_tokens or None)
    ids = torch.from_numpy(ids.astype(np.int64))
    window = min(512, cfg.max_position_embeddings)
    ppl = lambda: perplexity(lambda x: model(x), ids, window, batch=4)  # noqa: E731
    with torch.no_grad():
        dense = ppl()
        quality = {"dense": dense}
        for d in args.densities:
            uni, _ = resolve_density(cfg, 1.0, d, 1.0)
            with masked_sparsity(model, uni, [cfg.num_attention_heads] * L, "oracle"):
                quality[f"oracle@{d}"] = ppl()
        for name, v in vs.items():
            sp = StudyPredictors(preds[name], v["source"], v["lookahead"])
            for d in args.densities:
                mk, ak = resolve_density(cfg, 1.0, d, 1.0, recall_curves={"mlp": curves[name]})
                with masked_sparsity(model, mk, ak, "predicted", sp):
                    quality[f"{name}@{d}"] = {**ppl(), "mlp_k": mk}
                print(name, d, quality[f"{name}@{d}"]["perplexity"], flush=True)
    res = {"model": args.model, "calib_tokens": cal.n_tokens, "holdout_tokens": cal.n_tokens - split,
           "eval_tokens": dense["tokens"], "rank": rank, "densities": args.densities, "ks": ks,
           "variants": vs, "rows": rows, "quality": quality, "settings": {"max_epochs": s.max_epochs}}
    write_json(args.out, res, indent=1)
    print(table(res))
    return res


def table(res: dict) -> str:
    ds, q, dense = res["densities"], res["quality"], res["quality"]["dense"]["perplexity"]
    head = ["variant"] + [f"{m}@{d}" for d in ds for m in ("recall", "mass")] + [f"ppl MLP {d}" for d in ds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in res["variants"]:
        rs = [r for r in res["rows"] if r["variant"] == name]
        cells = [f"{np.mean([r[f'{m}@{d}'] for r in rs]):.3f}" for d in ds for m in ("recall", "mass")]
        cells += [f"{(q[f'{name}@{d}']['perplexity'] / dense - 1) * 100:+.2f}%" for d in ds]
        lines.append("| " + " | ".join([name] + cells) + " |")
    rs = [r for r in res["rows"] if r["variant"] == "oracle"]
    lines.append("| oracle | " + " | ".join(f"{np.mean([r[f'{m}@{d}'] for r in rs]):.3f}"
                                          for d in ds for m in ("recall", "mass")) + " | "
                 + " | ".join(f"{(q[f'oracle@{d}']['perplexity'] / dense - 1) * 100:+.2f}%" for d in ds) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

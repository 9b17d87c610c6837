"""fc2 by contribution: skip the rows whose |h_j|·‖W2[j]‖ is below tau_l, and count bytes as rows read.

Masked dense, heads dense, the build's predictors (pickled, `--predictors`), WikiText-2 test. Each
MLP row of W1 and of W2 costs the same bytes, so an MLP layer's measured cost is its mean fc1 rows
(the per-token K's kept rows) + its mean fc2 rows (kept rows with h_j != 0, or with the threshold,
|h_j| n_j > tau_l, n_j = ‖W2[j]‖_2). At MLP density d the budget of layer l is 2 K_l rows
(K_l the curves' K, `resolve_density`; 2 F is the dense layer). Variants:
  nominal   today's engine: theta_l fitted so the mean fc1 rows are K_l, k_max = 2 K_l, fc2 skips
            zeros (the bytes the headers record count K_l for fc1 and fc2 alike)
  nominal-drop-q  today's fc1 rows (equal nominal K), fc2 reads (1 - q) of the nonzero rows (tau_l)
  equal     today's rule at equal measured bytes: theta_l fitted so fc1 + nonzero fc2 rows = 2 K_l
  drop-q    fc2 reads (1 - q) of the kept rows with h != 0 (the largest |h| n; tau_l), fc1 keeps the
            rows the rest of 2 K_l pays for (q = 0 is `equal`)
  tau-f     fc1 keeps f · 2 K_l rows (theta_l), fc2 the rows with |h| n > tau_l, tau_l fitted so
            fc1 + fc2 rows = 2 K_l (tau_l = 0 where the nonzero rows already fit)
theta and tau are fitted layer by layer through the engine (earlier layers sparse) on the build's
first held-out set (WikiText-2 validation tokens [0, 2048)); every variant is scored on the second
([2048, 4096): the split f is chosen there) and on the test text.

    python benchmarks/fc2_threshold_study.py --predictors P.pkl --eval-tokens 4096 --densities 0.1 --out F
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
from pathlib import Path

import numpy as np
import torch

from dejavu.compiler.allocate import _nll, _Sources, heldout_windows, model_parts
from dejavu.compiler.density import resolve_density
from dejavu.compiler.text import encode_text
from dejavu.compiler.token_k import cap_rows
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.models.loader import load_model, load_tokenizer


def _bisect(count, target: float, lo: float, hi: float, steps: int = 40) -> float:
    """The smallest x in [lo, hi] (log scale) with count(exp(x)) <= target; count falls as x grows."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if count(math.exp(mid)) <= target else (mid, hi)
    return math.exp(hi)


def fit_layer(s, h, n, k, mode: str, f: float | None, F: int) -> dict:
    """theta, k_max, tau of one layer from its scores s [T, F] and dense h [T, F] (n: ‖W2[j]‖ [F])."""
    p = torch.softmax(s.float(), -1)

    def parts(k_max):
        idx = s.topk(k_max, -1).indices
        pk, hk, nk = p.gather(-1, idx), h.gather(-1, idx), n[idx]
        best = pk == p.amax(-1, keepdim=True)
        return pk, best, hk * nk

    def rows(pk, best, c, theta, tau):
        keep = (pk >= theta) | best
        return keep.sum(-1).float().mean().item(), (keep & (c > tau)).sum(-1).float().mean().item()

    if mode in ("nominal", "nominal-drop"):
        k_max = cap_rows(k, F)
        pk, best, c = parts(k_max)
        theta = _bisect(lambda t: rows(pk, best, c, t, 0.0)[0], k, -40.0, 0.0)
        nz = rows(pk, best, c, theta, 0.0)[1]
        tau = _bisect(lambda t: rows(pk, best, c, theta, t)[1], (1 - f) * nz, -30.0, 10.0) if f else 0.0
        return {"theta": theta, "k_max": k_max, "tau": tau}
    if mode == "equal":
        k_max = min(F, 4 * k)
        for _ in range(2):  # k_max = 2 x the fc1 rows the fit settles on
            pk, best, c = parts(k_max)
            theta = _bisect(lambda t: sum(rows(pk, best, c, t, 0.0)), 2 * k, -40.0, 0.0)
            k1 = rows(pk, best, c, theta, 0.0)[0]
            k_max = cap_rows(max(1, round(k1)), F)
        pk, best, c = parts(k_max)
        theta = _bisect(lambda t: sum(rows(pk, best, c, t, 0.0)), 2 * k, -40.0, 0.0)
        return {"theta": theta, "k_max": k_max, "tau": 0.0}
    if mode == "drop":  # fc2 reads (1 - f) of the nonzero rows, fc1 keeps what the rest of 2 K_l pays for
        k_max = min(F, 4 * k)
        for i in range(3):  # k_max = 2 x the fc1 rows the fit settles on
            pk, best, c = parts(k_max)
            theta = _bisect(lambda t: (lambda a, b: a + (1 - f) * b)(*rows(pk, best, c, t, 0.0)), 2 * k, -40.0, 0.0)
            r1, nz = rows(pk, best, c, theta, 0.0)
            if i < 2:
                k_max = cap_rows(max(1, round(r1)), F)
        tau = _bisect(lambda t: rows(pk, best, c, theta, t)[1], 2 * k - r1, -30.0, 10.0) if f > 0 else 0.0
        return {"theta": theta, "k_max": k_max, "tau": tau}
    k1 = min(F, round(f * 2 * k))
    k_max = cap_rows(k1, F)
    pk, best, c = parts(k_max)
    theta = _bisect(lambda t: rows(pk, best, c, t, 0.0)[0], k1, -40.0, 0.0) if k1 < F else 0.0
    r1, r2 = rows(pk, best, c, theta, 0.0)
    tau = 0.0
    if r1 + r2 > 2 * k:
        tau = _bisect(lambda t: rows(pk, best, c, theta, t)[1], 2 * k - r1, -30.0, 10.0)
    return {"theta": theta, "k_max": k_max, "tau": tau}


def engine(parts, preds, ids, mlp_k, plans, mode=None, f=None):
    """Layer by layer over ids [B, S]: (mean NLL, plans, fc1 rows [L], fc2 rows [L]). plans None: fit
    each sparse layer's plan on its own inputs as this engine feeds them."""
    layers, embed, head = parts
    x = embed(ids)
    srcs = _Sources(preds.predictor_input)
    fit = plans is None
    plans = [None] * len(mlp_k) if fit else plans
    r1, r2 = [], []
    for l, layer in enumerate(layers):
        F = layer.fc1.out_features
        srcs.enter(l, x)
        if mlp_k[l] >= F:
            x = srcs.run(l, layer, x)
            r1.append(float(F)), r2.append(float(F))
            continue
        s = preds.scores("mlp", l, srcs.predictor_input(l).float())  # [B, S, F]
        n = layer.fc2.weight.detach().float().norm(dim=0)  # [F]
        got = {}

        def hook(m, a, out, l=l, s=s, n=n, F=F):
            if fit:
                plans[l] = fit_layer(s.flatten(0, 1), out.flatten(0, 1).float(), n, mlp_k[l], mode, f, F)
            pl = plans[l]
            idx = s.topk(pl["k_max"], -1).indices
            p = torch.softmax(s.float(), -1)
            pk = p.gather(-1, idx)
            keep = (pk >= pl["theta"]) | (pk == p.amax(-1, keepdim=True))
            m1 = torch.zeros_like(out).scatter_(-1, idx, keep.to(out.dtype))
            hm = out * m1
            m2 = (hm.abs() * n > pl["tau"]).to(out.dtype)
            got["r1"] = m1.sum(-1).mean().item()
            got["r2"] = m2.sum(-1).mean().item()
            return hm * m2

        hd = layer.activation_fn.register_forward_hook(hook)
        try:
            x = srcs.run(l, layer, x)
        finally:
            hd.remove()
        r1.append(got["r1"]), r2.append(got["r2"])
    per_window = [_nll(head, x[b:b + 1], ids[b:b + 1]) for b in range(ids.shape[0])]
    return sum(per_window) / len(per_window), plans, r1, r2, per_window


def score(parts, preds, ids, mlp_k, plans, batch=4):
    """(perplexity, fc1 rows [L], fc2 rows [L], NLL per window [B]) over windows ids [B, S], `batch`
    windows a pass."""
    nlls, r1, r2, nb = [], 0.0, 0.0, 0
    for i in range(0, ids.shape[0], batch):
        b = ids[i:i + batch]
        _, _, a, c, w = engine(parts, preds, b, mlp_k, plans)
        nlls += w
        r1, r2 = np.asarray(a) * b.shape[0] + r1, np.asarray(c) * b.shape[0] + r2
        nb += b.shape[0]
    return math.exp(sum(nlls) / nb), (r1 / nb).tolist(), (r2 / nb).tolist(), nlls


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predictors", required=True)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1])
    ap.add_argument("--splits", type=float, nargs="+", default=[0.7, 0.75, 0.8, 0.85, 0.9])
    ap.add_argument("--drops", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--variants", nargs="+", default=["nominal", "nominal-drop", "equal", "drop", "tau"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, cfg = load_model("opt-mini")
    model = model.float().eval()
    tok = load_tokenizer("opt-mini")
    preds = pickle.loads(Path(args.predictors).read_bytes())
    parts = model_parts(model)
    fit_ids, fit_src = heldout_windows(tok, None, 0, args.heldout_tokens, 512, cfg.bos_token_id)
    sel_ids, sel_src = heldout_windows(tok, None, args.heldout_tokens, args.heldout_tokens, 512, cfg.bos_token_id)
    test = torch.from_numpy(encode_text(tok, WIKITEXT2_TEST.read_text(encoding="utf-8"), cfg.bos_token_id,
                                        max_tokens=args.eval_tokens).astype(np.int64))
    n_win = test.numel() // 512
    test = test[:n_win * 512].view(n_win, 512)
    dense_k = [cfg.ffn_dim] * cfg.num_hidden_layers
    res = {"fitted_on": fit_src, "split_on": sel_src, "test_tokens": n_win * 511, "runs": []}
    with torch.no_grad():
        dense = {"test": score(parts, preds, test, dense_k, None)[0], "sel": score(parts, preds, sel_ids, dense_k, None)[0]}
        res["dense"] = dense
        print("dense", dense, flush=True)
        for d in args.densities:
            mk, _ = resolve_density(cfg, 1.0, d, 1.0, recall_curves=preds.recall_curves)
            runs = [("nominal", None), ("nominal-drop", 0.1), ("equal", None)] + [("drop", q) for q in args.drops] + [("tau", f) for f in args.splits]
            for mode, f in runs:
                if mode not in args.variants:
                    continue
                _, plans, _, _, _ = engine(parts, preds, fit_ids, mk, None, mode, f)
                sel = score(parts, preds, sel_ids, mk, plans)
                t = score(parts, preds, test, mk, plans)
                row = {"density": d, "mode": mode, "f": f, "mlp_k": mk, "plans": plans,
                       "sel_pct": 100 * (sel[0] / dense["sel"] - 1), "sel_rows": [sum(sel[1]), sum(sel[2])],
                       "test_pct": 100 * (t[0] / dense["test"] - 1), "test_fc1": t[1], "test_fc2": t[2],
                       "test_rows": [sum(t[1]), sum(t[2])], "budget_rows": 2 * sum(mk), "test_window_nll": t[3]}
                res["runs"].append(row)
                print(d, mode, f, "held-out %+.3f%%" % row["sel_pct"], "rows", [round(v) for v in row["sel_rows"]],
                      "test %+.3f%%" % row["test_pct"], "rows", [round(v) for v in row["test_rows"]],
                      "budget", 2 * sum(mk), flush=True)
    with atomic_path(Path(args.out)) as tmp:
        tmp.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()

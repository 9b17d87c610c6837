"""R-Sparse (rank-aware activation sparsity, ICLR 2025) against TEAL at equal bytes, SmolLM2 (study).

    python benchmarks/scratch_llama36b/rsparse.py --fractions 0.025 0.05 --out benchmarks/results/llama_rsparse_2026-12-05.json

Per projection input (attn_in -> q, k, v fused; o_in; mlp_in -> gate, up fused; down_in), a token
reads the columns W[:, i] whose |x_i| is above the threshold (TEAL) and, for R-Sparse, adds the
skipped inputs' contribution through a rank-r factorization of that same fused weight,
A (B x_small), A = U_r S_r [M, r], B = V_r^T [r, N] (--forms svd: plain SVD, R-Sparse's form; whiten: the SVD
of W C^(1/2), C = E[x_small x_small^T] on the calibration tokens, the best rank r for those
inputs). Bytes per layer: kept fraction x M N + r (M + N), the factors read whole every token.
At equal bytes with TEAL at --skip: the low-rank part takes the fraction f of each projection's
bytes (r = f M N / (M + N), rounded) and the threshold skips --skip + r (M + N) / (M N).
Masked dense: each projection's output minus (x_small) @ (W - A B)^T (TEAL: minus x_small @ W^T).
Thresholds from --calib-tokens tokens of the calibration file; WikiText-2 test, first
--ppl-tokens tokens in windows of --window. The realized skip counts the factors' bytes as read.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from dejavu.compiler.gated_sparsity import KEYS, calibrate
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids


def fused(layer) -> dict:
    """{key: (weight [M, N], the projections that read it)}."""
    at, mlp = layer.self_attn, layer.mlp
    mods = {"attn_in": (at.q_proj, at.k_proj, at.v_proj), "o_in": (at.o_proj,),
            "mlp_in": (mlp.gate_proj, mlp.up_proj), "down_in": (mlp.down_proj,)}
    return {k: (torch.cat([m.weight for m in ms]).detach().double(), ms) for k, ms in mods.items()}


def small_covariances(model, ids, th) -> list[dict]:
    """Per layer and key: E[x_small x_small^T] [N, N] (float64) of the calibration inputs at thresholds th."""
    L = len(model.layers)
    cov = [{k: None for k in KEYS} for _ in range(L)]
    count = [{k: 0 for k in KEYS} for _ in range(L)]
    hs = []

    def rec(l, k):
        def f(m, a):
            x = a[0].detach().reshape(-1, a[0].shape[-1]).double()
            xs = x * (x.abs() <= th[k][l])
            c = xs.T @ xs
            cov[l][k] = c if cov[l][k] is None else cov[l][k] + c
            count[l][k] += x.shape[0]
        return f

    for l, layer in enumerate(model.layers):
        for k, (_, ms) in fused(layer).items():
            hs.append(ms[0].register_forward_pre_hook(rec(l, k)))
    with torch.no_grad():
        for w in ids:
            model(w[None])
    for h in hs:
        h.remove()
    return [{k: cov[l][k] / count[l][k] for k in KEYS} for l in range(L)]


def residuals(model, ranks: dict, covs=None) -> list[dict]:
    """Per layer and key: W - A B (float32), the part of W the skipped inputs lose."""
    out = []
    for l, layer in enumerate(model.layers):
        row = {}
        for k, (W, _) in fused(layer).items():
            r = ranks[k]
            if r == 0:
                row[k] = W.float()
                continue
            if covs is None:
                U, S, Vh = torch.linalg.svd(W, full_matrices=False)
                low = (U[:, :r] * S[:r]) @ Vh[:r]
            else:  # best rank r in E||(W - A B) x_small||^2: SVD of W C^(1/2)
                e, V = torch.linalg.eigh(covs[l][k])
                e = e.clamp_min(e.max() * 1e-10)
                half, ihalf = (V * e.sqrt()) @ V.T, (V / e.sqrt()) @ V.T
                U, S, Vh = torch.linalg.svd(W @ half, full_matrices=False)
                low = (U[:, :r] * S[:r]) @ (Vh[:r] @ ihalf)
            row[k] = (W - low).float()
        out.append(row)
    return out


@contextlib.contextmanager
def rank_sparse(model, th: dict, res: list[dict], ranks: dict, tally: dict):
    """Each projection's output minus x_small @ R^T (its rows of the residual R); tally the bytes read."""
    hs = []
    for l, layer in enumerate(model.layers):
        for k, (W, ms) in fused(layer).items():
            M, N = W.shape
            lo = 0
            for i, m in enumerate(ms):
                rows = res[l][k][lo:lo + m.weight.shape[0]]
                lo += m.weight.shape[0]

                def hook(mod, a, out, rows=rows, t=th[k][l], first=i == 0, M=M, N=N, r=ranks[k]):
                    x = a[0]
                    small = x.abs() <= t
                    if first:
                        tally["read"] += float((~small).float().mean(-1).sum()) * M * N + x.shape[0] * x.shape[1] * r * (M + N)
                        tally["dense"] += x.shape[0] * x.shape[1] * M * N
                    return out - (x * small) @ rows.T
                hs.append(m.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in hs:
            h.remove()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--skip", type=float, default=0.4)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.025, 0.05, 0.1])
    p.add_argument("--forms", nargs="+", default=["svd", "whiten", "teal"],
                   help="per fraction: svd (R-Sparse), whiten, teal (the same thresholds without the factors)")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sm = load_scoring_model("smollm2-135m")
    model = sm.info["model"]
    ids = text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens)
    n = ids.numel() // args.window * args.window
    with torch.no_grad():
        calib = calibrate(model, ids[:n].view(-1, args.window))
    text = read_text(WIKITEXT2_TEST)
    shapes = {k: tuple(W.shape) for k, (W, _) in fused(model.layers[0]).items()}
    out = {"argv": vars(args), "shapes": shapes, "runs": []}
    dense = eval_perplexity(sm, text, args.window, args.ppl_tokens, progress=False)
    out["dense"] = dense["perplexity"]
    print("dense", dense, flush=True)
    runs = [(0.0, "teal")] + [(f, form) for f in args.fractions for form in args.forms]
    for f, form in runs:
        t0 = time.perf_counter()
        lr = {k: round(f * M * N / (M + N)) for k, (M, N) in shapes.items()}
        skips = {k: args.skip + lr[k] * (M + N) / (M * N) for k, (M, N) in shapes.items()}
        ranks = lr if form != "teal" else {k: 0 for k in KEYS}  # teal: the same thresholds, no factors
        th = {k: [calib.threshold(k, l, skips[k]) for l in range(len(model.layers))] for k in KEYS}
        covs = small_covariances(model, ids[:n].view(-1, args.window)[:4], th) if form == "whiten" else None
        res = residuals(model, ranks, covs)
        tally = {"read": 0.0, "dense": 0.0}
        with torch.no_grad(), rank_sparse(model, th, res, ranks, tally):
            r = eval_perplexity(sm, text, args.window, args.ppl_tokens, progress=False)
        row = {"form": form, "lowrank_fraction": f, "ranks": ranks, "skips": {k: round(v, 4) for k, v in skips.items()},
               "perplexity": r["perplexity"], "tokens": r["tokens"],
               "vs_dense_pct": round(100 * (r["perplexity"] / out["dense"] - 1), 2),
               "realized_skip": round(1 - tally["read"] / tally["dense"], 4), "seconds": round(time.perf_counter() - t0, 1)}
        out["runs"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()

"""TEAL on a rotated Llama: does a function-preserving PCA rotation lower the loss at equal bytes?

    python benchmarks/llama_rotation_study.py --ppl-tokens 8192 --out F.json

Variants (--variants): base (the model as loaded), fold (RMSNorm weights folded into the
following weights, no rotation: TEAL then thresholds |x| without the norm's scale), rot (fold +
residual stream in the PCA basis of its normalised states), rot+heads (rot + each KV head's
o_proj input in the PCA basis of its attention outputs), rawrot (fold + the PCA basis of the
raw, unnormalised residual), sparseF (a rotation fitted to the thresholding at F dropped), partialK
(the K channels of largest mean square kept, the others PCA-rotated: compiler/rotate_llama.py's
form). benchmarks/rotate_llama_study.py (commit cb96df8's compiler/rotate_llama.py) does them. For each variant:
dense perplexity (and its max relative logit difference to the base model on one window), then
TEAL at each --levels uniform and at --kind-skips (attn_in o_in mlp_in down_in, percent;
default the refined 40% allocation 33 45 31.3 60). PCA statistics and TEAL thresholds from the
first --calib-tokens tokens of the calibration file (WikiText-2 train head); evaluation on the
first --ppl-tokens of WikiText-2 test.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from dejavu.compiler.allocate_llama import block_skip, input_bytes, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, GatedSparsity, calibrate, gated_sparsity
from rotate_llama_study import (fold_norms, head_moments, pca_basis, rotate_heads, rotate_residual,
                                residual_moment)
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.runtime.evaluation.evaluate import _wrap_logits, eval_perplexity, load_scoring_model, read_text, text_ids


@torch.no_grad()
def raw_moment(model, ids):
    d = model.config.hidden_size
    acc, n = torch.zeros(d, d, dtype=torch.float64), [0]

    def record(mod, args):
        x = args[0].double().reshape(-1, d)
        acc.add_(x.T @ x)
        n[0] += x.shape[0]

    norms = [nm for layer in model.layers for nm in (layer.input_layernorm, layer.post_attention_layernorm)]
    hs = [nm.register_forward_pre_hook(record) for nm in norms + [model.model.norm]]
    try:
        for w in ids:
            model(w[None])
    finally:
        for h in hs:
            h.remove()
    return acc / n[0]


@torch.no_grad()
def norm_samples(model, ids, every: int = 8):
    """Rows [N, D] (float64) of the RMS-normalised residual at every norm, every `every`-th token."""
    d = model.config.hidden_size
    rows = []

    def record(mod, args):
        x = args[0].double().reshape(-1, d)[::every]
        rows.append(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps))

    norms = [nm for layer in model.layers for nm in (layer.input_layernorm, layer.post_attention_layernorm)]
    hs = [nm.register_forward_pre_hook(record) for nm in norms]
    try:
        for w in ids:
            model(w[None])
    finally:
        for h in hs:
            h.remove()
    return torch.cat(rows)


def truncate(z, drop: float):
    """z [N, D] with each row's `drop` fraction of smallest |entries| zeroed."""
    k = int(round(drop * z.shape[1]))
    if k == 0:
        return z
    t = z.abs().kthvalue(k, dim=1, keepdim=True).values
    return z * (z.abs() > t)


def sparse_basis(x, drop: float, iters: int, start=None, log=None):
    """Orthogonal Q [D, D] minimising ||X - H(X Q) Q^T||_F (H: each row's smallest `drop` zeroed),
    by alternation: codes Z = H(X Q), then Q = U V^T from svd(X^T Z) (orthogonal Procrustes)."""
    q = torch.eye(x.shape[1], dtype=x.dtype) if start is None else start
    for i in range(iters):
        z = truncate(x @ q, drop)
        if log is not None and i % 5 == 0:
            log(i, float((x - z @ q.T).pow(2).sum() / x.pow(2).sum()))
        u, _, vh = torch.linalg.svd(x.T @ z)
        q = u @ vh
    return q


def make(base, variant: str, ids):
    m = copy.deepcopy(base)
    if variant == "base":
        return m
    fold_norms(m)
    if variant == "fold":
        return m
    if variant.startswith("sparse"):  # e.g. sparse0.4: fitted at 40% dropped
        x = norm_samples(m, ids)
        q = sparse_basis(x, float(variant[6:] or 0.4), 40, log=lambda i, e: print(f"{variant} iter {i}: {e:.5f}", flush=True))
    elif variant.startswith("partial"):  # keep the k channels of largest mean square, PCA of the rest
        k = int(variant[7:])
        mom = residual_moment(m, ids)
        top = mom.diagonal().argsort(descending=True)[:k]
        rest = torch.tensor([i for i in range(mom.shape[0]) if i not in set(top.tolist())])
        dg = mom.diagonal()
        print("sorted mean squares / mean", (dg.sort(descending=True).values[:24] / dg.mean()).tolist(), flush=True)
        print("kept channels", top.tolist(), "energy share", float(mom.diagonal()[top].sum() / mom.diagonal().sum()), flush=True)
        q = torch.zeros_like(mom)
        q[top, top] = 1.0
        q[rest[:, None], rest[None, :]] = pca_basis(mom[rest][:, rest])
    else:
        q = pca_basis(raw_moment(m, ids) if variant == "rawrot" else residual_moment(m, ids))
    rotate_residual(m, q)
    if variant == "rot+heads":
        rotate_heads(m, [torch.stack([pca_basis(mj) for mj in mom]) for mom in head_moments(m, ids)])
    return m


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", nargs="+", default=["base", "fold", "rot", "rot+heads"])
    p.add_argument("--levels", nargs="+", type=float, default=[0.25, 0.4, 0.5])
    p.add_argument("--kind-skips", nargs=4, type=float, default=[33, 45, 31.3, 60])
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sm = load_scoring_model(args.model)
    base = sm.info["model"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"model": args.model, "commit": commit, "machine": platform.node(), "argv": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    text = read_text(WIKITEXT2_TEST)
    cids = text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens)
    n = cids.numel() // args.window * args.window
    cids = cids[:n].view(-1, args.window)
    probe = cids[:1]
    ref = base(probe).double()

    def save():
        with atomic_path(Path(args.out)) as tmp:
            tmp.write_text(json.dumps(res, indent=2), encoding="utf-8")

    kind = dict(zip(KEYS, [s / 100 for s in args.kind_skips]))
    for variant in args.variants:
        t0 = time.perf_counter()
        with torch.no_grad():
            m = make(base, variant, cids)
            diff = float((m(probe).double() - ref).abs().max() / ref.abs().max())
            calib = calibrate(m, cids)
        s = copy.copy(sm)
        s.logits_fn = _wrap_logits(m, "cpu")
        runs = [("dense", None)] + [(f"teal@{lv:g}", lv) for lv in args.levels] + [("kind", kind)]
        for name, setting in runs:
            row = {"variant": variant, "run": name, "prep_seconds": round(time.perf_counter() - t0, 1)}
            t1 = time.perf_counter()
            if setting is None:
                r = eval_perplexity(s, text, args.window, args.ppl_tokens, batch=8, progress=False)
                row.update(max_rel_logit_diff=diff, realized_skip=0.0)
            else:
                if isinstance(setting, dict):
                    th = kind_thresholds(calib, setting)
                    row.update(skips=setting, target_skip=round(block_skip(setting, input_bytes(m.config)), 4))
                else:
                    th, row["target_skip"] = calib, setting
                gs = GatedSparsity("teal", row["target_skip"])
                with gated_sparsity(m, th, gs) as reads:
                    r = eval_perplexity(s, text, args.window, args.ppl_tokens, batch=8, progress=False)
                row["realized_skip"] = round(reads.skipped, 4)
            row.update(perplexity=r["perplexity"], ppl_tokens=r["tokens"], seconds=round(time.perf_counter() - t1, 1))
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            save()
        del m


if __name__ == "__main__":
    main()

"""Masked-input least-squares weight refit for TEAL on a Llama-family model (CPU study).

    nice -n 10 python benchmarks/llama_refit_study.py --out benchmarks/results/llama_refit_2026-12-05.json

TEAL's projection computes y = W m(x), m zeroing the inputs with |x_i| <= t. Here each
projection's weight (q/k/v fused, o, gate/up fused, down) is replaced by the ridge solution

    W' = argmin_W' sum_tokens ||W' m(x) - W x*||^2 + lam ||W' - W||^2
       = (W X*^T M + lam W) (M^T M + lam I)^-1,      M = m(X) [T, N], lam = alpha * mean diag(M^T M)

layer by layer and input by input in layer order (as GPTQ): X are the inputs of the model
whose earlier projections are already masked and refit; the target x* is that same input
(--target sparse: the refit corrects the mask's error only) or the dense model's input at
the same position (--target dense: it also corrects what the upstream sparsity changed).
Thresholds are the quantiles of |X| at each kind's skip on those same inputs (the refit
model's own), or the dense calibration's (--own-thresholds off). The runtime reads the
same bytes: the same mask, the same weight shapes.

Calibration: the first --calib-tokens tokens of the shipped calibration text; alpha chosen
per configuration on its tokens [calib, calib + heldout) (held-out NLL); then WikiText-2
test, the first --ppl-tokens tokens in windows of --window, with and without the refit.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, GatedSparsity, calibrate, gated_sparsity, quantiles
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids

REFINED_40 = {"attn_in": 0.33, "o_in": 0.45, "mlp_in": 0.3125, "down_in": 0.6}


class _Stop(Exception):
    pass


def _mods(layer) -> dict[str, tuple]:
    at, mlp = layer.self_attn, layer.mlp
    return {"attn_in": (at.q_proj, at.k_proj, at.v_proj), "o_in": (at.o_proj,),
            "mlp_in": (mlp.gate_proj, mlp.up_proj), "down_in": (mlp.down_proj,)}


def _run_layer(layer, x, rope, masks: dict[str, float], capture: str | None = None, chunk: int = 4):
    """Layer over x [B, S, D] in chunks of windows, inputs of `masks` kinds masked at their
    thresholds; with capture, the (unmasked) input of that kind [B*S, N] instead of the output."""
    mods, handles, got = _mods(layer), [], []
    for k, t in masks.items():
        for m in mods[k]:
            handles.append(m.register_forward_pre_hook(lambda m, a, t=t: (a[0] * (a[0].abs() > t),)))
    if capture is not None:
        def grab(m, a):
            got.append(a[0].reshape(-1, a[0].shape[-1]).clone())
            raise _Stop
        handles.append(mods[capture][0].register_forward_pre_hook(grab))
    outs = []
    try:
        for i in range(0, x.shape[0], chunk):
            xb = x[i:i + chunk]
            cos, sin = rope[0][: xb.shape[0]], rope[1][: xb.shape[0]]
            try:
                outs.append(layer(xb, cos, sin, None, None))
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    return torch.cat(got) if capture is not None else torch.cat(outs)


def _gram(a: torch.Tensor, b: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """a^T b in float64, accumulated over token chunks of float32 products."""
    out = torch.zeros(a.shape[1], b.shape[1], dtype=torch.float64)
    for i in range(0, a.shape[0], chunk):
        out += (a[i:i + chunk].T @ b[i:i + chunk]).double()
    return out


def refit_weight(w: torch.Tensor, m: torch.Tensor, y: torch.Tensor, alpha: float,
                 g: torch.Tensor | None = None) -> torch.Tensor:
    """W' [O, N] = (Y^T M + lam W)(M^T M + lam I)^-1 for w [O, N], masked inputs m [T, N],
    targets y [T, O]; lam = alpha * mean diag(M^T M) (g: M^T M given)."""
    g = _gram(m, m) if g is None else g
    lam = alpha * float(g.diagonal().mean())
    rhs = _gram(y, m) + lam * w.double()  # [O, N]
    a = g + lam * torch.eye(g.shape[0], dtype=torch.float64)
    return torch.linalg.solve(a, rhs.T).T.to(w.dtype)  # a symmetric


@torch.no_grad()
def refit_model(model, ids: torch.Tensor, skips: dict[str, float], alpha: float, target: str,
                dense_thr: dict | None = None, skip_first: int = 0, log=print) -> dict[str, list[float]]:
    """Refit every projection of model in place (see module doc) on ids [B, S]; returns the
    thresholds {key: [L]} the refit weights were fitted for."""
    B, S = ids.shape
    cos, sin = model._rope(torch.arange(S)[None].expand(B, S), torch.float32)
    rope = (cos, sin)
    hs = model.model.embed_tokens(ids)  # [B, S, D], the sparse, refit stream
    hd = hs.clone() if target == "dense" else None
    thr = {k: [] for k in KEYS}
    fit = (torch.arange(S) >= skip_first).repeat(B)  # [B*S]: the rows the least squares sees
    for l, layer in enumerate(model.layers):
        t0 = time.perf_counter()
        xd = {}
        if hd is not None:  # the dense layer's inputs, before its weights change
            for k in KEYS:
                xd[k] = _run_layer(layer, hd, rope, {}, capture=k)
            hd = _run_layer(layer, hd, rope, {})
        masks = {}
        for k in KEYS:
            x = _run_layer(layer, hs, rope, masks, capture=k)  # [T, N]
            if dense_thr is not None:
                t = dense_thr[k][l]
            elif skips[k] > 0:
                a = x.abs().flatten()
                a = a[:: a.numel() // 4_000_000 + 1]
                t = float(quantiles(a, torch.tensor([skips[k]]))[0])
            else:
                t = 0.0
            thr[k].append(t)
            if t > 0 and alpha != float("inf"):  # inf: the sequential thresholds alone, W kept
                xt = xd.get(k, x)[fit]
                x = x[fit]
                m = x * (x.abs() > t)
                g = _gram(m, m)
                for mod in _mods(layer)[k]:
                    y = xt @ mod.weight.T  # [T, O], no bias: W' m + b targets W x + b
                    mod.weight.copy_(refit_weight(mod.weight, m, y, alpha, g))
            if t > 0:
                masks[k] = t
        hs = _run_layer(layer, hs, rope, masks)
        log(f"layer {l}: {time.perf_counter() - t0:.1f}s")
    return thr


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--configs", nargs="+", default=["0.25", "0.4", "0.5", "refined40"],
                   help="uniform block skips, or refined40 (33 / 45 / 31.25 / 60)")
    p.add_argument("--alphas", nargs="+", type=float, default=[1e-2, 1e-1, 1.0],
                   help="ridge weights; inf: no refit, the sequential thresholds alone (a control)")
    p.add_argument("--target", choices=["sparse", "dense"], default="sparse")
    p.add_argument("--own-thresholds", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--heldout-tokens", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--no-base", action="store_true", help="skip the runs without the refit")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _skips(name: str) -> dict[str, float]:
    return dict(REFINED_40) if name == "refined40" else {k: float(name) for k in KEYS}


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sm = load_scoring_model(args.model)
    model = sm.info["model"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res = {"model": args.model, "commit": commit, "machine": platform.node(), "argv": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}

    def save():
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(res, indent=2), encoding="utf-8")

    w = args.window
    all_ids = text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens + args.heldout_tokens)
    calib_ids = all_ids[: args.calib_tokens // w * w].view(-1, w)
    held = all_ids[args.calib_tokens:]
    held = held[: held.numel() // w * w].view(-1, w)
    calib = calibrate(model, calib_ids)
    dense0 = _proj_state(model)
    text = read_text(WIKITEXT2_TEST)

    def test(thr):
        with gated_sparsity(model, thr, GatedSparsity()) if thr else _null() as reads:
            r = eval_perplexity(sm, text, w, args.ppl_tokens, batch=8, progress=False)
        return {"perplexity": r["perplexity"], "tokens": r["tokens"],
                "realized_skip": round(reads.skipped, 4) if thr else 0.0}

    t0 = time.perf_counter()
    res["dense"] = {**test(None), "heldout_nll": heldout_nll(model, held)}
    res["dense"]["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res["dense"]), flush=True)
    save()
    for name in args.configs:
        skips = _skips(name)
        base_thr = kind_thresholds(calib, skips)
        row = {"config": name, "skips": skips, "alphas": {}}
        res["runs"].append(row)
        if not args.no_base:
            t0 = time.perf_counter()
            row["base"] = {**test(base_thr), "heldout_nll": heldout_nll(model, held, base_thr),
                           "seconds": round(time.perf_counter() - t0, 1)}
            print(name, "base", json.dumps(row["base"]), flush=True)
            save()
        best = None
        for alpha in args.alphas:
            t0 = time.perf_counter()
            thr = refit_model(model, calib_ids, skips, alpha, args.target,
                              None if args.own_thresholds else base_thr, log=lambda s: None)
            nll = heldout_nll(model, held, thr)
            row["alphas"][f"{alpha:g}"] = {"heldout_nll": nll, "seconds": round(time.perf_counter() - t0, 1)}
            print(name, alpha, nll, row["alphas"][f"{alpha:g}"]["seconds"], flush=True)
            if best is None or nll < best[0]:
                best = (nll, alpha, _proj_state(model), thr)
            model.load_state_dict(dense0, strict=False)
            save()
        nll, alpha, state, thr = best
        model.load_state_dict(state, strict=False)
        t0 = time.perf_counter()
        row["refit"] = {"alpha": alpha, **test(thr), "heldout_nll": nll, "seconds": round(time.perf_counter() - t0, 1)}
        print(name, "refit", json.dumps(row["refit"]), flush=True)
        model.load_state_dict(dense0, strict=False)
        save()


def _proj_state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if "_proj." in k}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    main()

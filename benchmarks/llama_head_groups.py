"""Upper bound of attention head selection by KV group against TEAL on the attention inputs.

    python benchmarks/llama_head_groups.py --ppl-tokens 2048 --window 512 --calib-tokens 8192 \
        --threads 1 --out benchmarks/results/llama_head_groups_2026-12-05.json

Only attention is sparsified; the MLP stays dense in every run, so the runs differ only there.

oracle@G: per layer and token, keep the G of the KV groups (a KV head and the query heads that
read it) whose attention output contribution, o_proj applied to the group's heads' outputs,
has the largest L2 norm; the others' contributions are dropped (masked dense, a pre-hook on
o_proj). The oracle knows the true output, so no predictor can beat it. K and V are computed
for every token (the cache stays complete), so the bytes it skips are the dropped groups'
q rows and o columns; k and v are read whole. `attn_skip` is that fraction of the layer's
q, k, v, o bytes; `attn_skip_kv_free` also counts the dropped groups' k and v rows as
skipped (what a decoder that also leaves their K/V unwritten would read; an optimistic bound,
since later tokens would then attend to an incomplete cache that this oracle does not model).
heads@K: the same oracle over single query heads (keep K of them; K, V read whole), to tell the
coarseness of 3 groups from head selection as such. Dropping the smallest contributions is the
least per-layer output error for one dropped unit, not exactly for two (the norm of a sum).

teal@S: TEAL's input thresholds on attn_in (-> q, k, v) and o_in (-> o) at the fraction S
(compiler/gated_sparsity.py's calibration quantiles from --calib-tokens tokens of the shipped
calibration text, never the evaluation text); `attn_skip` is the realized fraction of q, k, v,
o bytes unread on the evaluated text.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from dejavu.compiler.gated_sparsity import calibrate, thresholds
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", nargs="+", default=["dense", "oracle@2", "oracle@1", "teal@0.25", "teal@0.3333",
                                                  "teal@0.5", "teal@0.6667", "heads@6", "heads@3"], metavar="RUN",
                   help="dense, oracle@G (keep G KV groups), heads@K (keep K query heads), teal@S (skip S of the attention inputs)")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--calib-cache", metavar="FILE", help="load the calibration from FILE if it exists, else save it there")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


class Count:
    """Attention weight elements read vs dense, summed over tokens and layers."""

    def __init__(self):
        self.read = self.dense = 0.0
        self.read_kv_free: float | None = None  # the oracle's optimistic count (see the module doc)

    def row(self) -> dict:
        out = {"attn_skip": round(1 - self.read / self.dense, 4)}
        if self.read_kv_free is not None:
            out["attn_skip_kv_free"] = round(1 - self.read_kv_free / self.dense, 4)
        return out


def _sizes(cfg) -> dict[str, int]:
    d, hd = cfg.hidden_size, cfg.head_dim
    return {"q": d * cfg.num_attention_heads * hd, "kv": 2 * d * cfg.num_key_value_heads * hd,
            "o": cfg.num_attention_heads * hd * d}


@contextlib.contextmanager
def oracle_groups(model, keep: int, per_head: bool = False):
    """Keep `keep` KV groups per layer and token by the norm of their o_proj contribution.

    per_head: keep `keep` single query heads instead (K/V read whole, no kv-free count)."""
    cfg = model.config
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    G = H if per_head else Hkv
    n = _sizes(cfg)
    count = Count()
    if not per_head:
        count.read_kv_free = 0.0

    def pre(m, a):
        y = a[0]  # [B, S, H * hd], query head h in KV group h // (H / Hkv)
        B, S, _ = y.shape
        w = m.weight.view(-1, G, H // G * hd)  # [D, G, group width]
        yg = y.view(B, S, G, H // G * hd)
        norms = torch.einsum("bsgc,dgc->bsgd", yg, w).norm(dim=-1)  # [B, S, G]
        kept = torch.zeros_like(norms, dtype=torch.bool)
        kept.scatter_(-1, norms.topk(keep, dim=-1).indices, True)
        frac = keep / G
        count.read += B * S * (frac * (n["q"] + n["o"]) + n["kv"])
        if not per_head:
            count.read_kv_free += B * S * frac * (n["q"] + n["o"] + n["kv"])
        count.dense += B * S * (n["q"] + n["o"] + n["kv"])
        return ((yg * kept[..., None]).view(B, S, -1),) + tuple(a[1:])

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(pre) for layer in model.layers]
    try:
        yield count
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def teal_attention(model, t: dict[str, list[float]]):
    """TEAL's masks on attn_in (q, k, v) and o_in (o) only, with thresholds t[key][layer]."""
    n = _sizes(model.config)
    count = Count()

    def masked(thr, nbytes):
        def pre(m, a):
            keep = a[0].abs() > thr
            if nbytes:
                count.read += float(keep.float().mean(-1).sum()) * nbytes
                count.dense += keep.shape[0] * keep.shape[1] * nbytes
            return (a[0] * keep,) + tuple(a[1:])
        return pre

    handles = []
    for l, layer in enumerate(model.layers):
        at = layer.self_attn
        ta, to = t["attn_in"][l], t["o_in"][l]
        handles += [at.q_proj.register_forward_pre_hook(masked(ta, n["q"] + n["kv"])),  # k, v: counted at q
                    at.k_proj.register_forward_pre_hook(masked(ta, 0)),
                    at.v_proj.register_forward_pre_hook(masked(ta, 0)),
                    at.o_proj.register_forward_pre_hook(masked(to, n["o"]))]
    try:
        yield count
    finally:
        for h in handles:
            h.remove()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sm = load_scoring_model(args.model)
    model = sm.info["model"]
    res = {"model": args.model, "commit": _commit(), "machine": platform.node(), "argv": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}

    def save():
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(res, indent=2), encoding="utf-8")

    calib = None
    if any(r.startswith("teal@") for r in args.runs):
        t0 = time.perf_counter()
        ids = text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens)
        n = ids.numel() // args.window * args.window
        cache = Path(args.calib_cache) if args.calib_cache else None
        if cache is not None and cache.is_file():
            calib = torch.load(cache, weights_only=False)
        else:
            calib = calibrate(model, ids[:n].view(-1, args.window))
            if cache is not None:
                torch.save(calib, cache)
        res["calib"] = {"file": "dejavu/data/calib/wikitext2-train-head.txt", "tokens": n,
                        "seconds": round(time.perf_counter() - t0, 1)}
    text = read_text(WIKITEXT2_TEST)
    for run in args.runs:
        kind, _, level = run.partition("@")
        if kind == "dense":
            ctx = contextlib.nullcontext(None)
        elif kind in ("oracle", "heads"):
            ctx = oracle_groups(model, int(level), per_head=kind == "heads")
        elif kind == "teal":
            ctx = teal_attention(model, thresholds(calib, float(level)))
        else:
            raise SystemExit(f"unknown run {run!r}")
        t0 = time.perf_counter()
        with ctx as count:
            r = eval_perplexity(sm, text, args.window, args.ppl_tokens, batch=8, progress=False)
        row = {"run": run, "perplexity": r["perplexity"], "ppl_tokens": r["tokens"], "window": args.window,
               **(count.row() if count is not None else {"attn_skip": 0.0}),
               "seconds": round(time.perf_counter() - t0, 1)}
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        save()


if __name__ == "__main__":
    main()

"""Kernel-level cost of leaving a LayerNorm to its consumer (plugins/layer_norm.PendingLN), on
the GPU, OPT-30B layer shapes, batch 1, fp16, random weights (speed only):

- fc1 (sparse_fc1 at the MLP density): plain input, PendingLN normalised in the loop (LN_IN 1),
  folded (LN_IN 2), centred product z with the block fold (LN_IN 3);
- the deferred-K/V attention op (Q/K/V, attention, projection) with a plain input and with a
  PendingLN (normalised in the shared-set Q/K/V kernel), and the Q/K/V kernels alone.

Each: 20 calls captured in a CUDA graph, the replay timed by triton.testing.do_bench (median,
per call; the same weights each call, so partly from L2 when they fit), and whether the
outputs are finite and agree with the plain path.

    python3 benchmarks/pending_ln.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--density", type=float, default=0.3)
    ap.add_argument("--width", type=int, default=256, help="stats block width (the projection reduction's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (TRITON_INTERPRET=1): a dry run")
    a = ap.parse_args()
    import triton.testing as tt

    import dejavu.plugins as P
    from dejavu.plugins.deferred_kv import sparse_attn_decode_deferred
    from dejavu.plugins.layer_norm import layer_norm, ln_fold, pending_ln
    DK = sys.modules["dejavu.plugins.deferred_kv"]
    dev, dt = torch.device("cpu" if a.tiny else "cuda"), torch.float16
    D, F, H, S = (64, 256, 4, 16) if a.tiny else (7168, 28672, 56, 256)
    hd = D // H
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    rows = {}

    def time_us(fn, n=20):
        """GPU time per call: n calls captured in one CUDA graph, replayed (no launch overhead)."""
        if a.tiny:
            return float("nan")
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
        return 1e3 * tt.do_bench(graph.replay, warmup=5, rep=100) / n
    x = rnd(1, D, scale=2.0) + 0.3
    ln = (1 + rnd(D, scale=0.1), rnd(D, scale=0.1))
    w1, b1 = rnd(F, D, scale=D ** -0.5), rnd(F)
    k = int(a.density * F)
    idx = torch.randperm(F, device=dev)[:k].sort().values.to(torch.int32)[None]
    p1 = pending_ln(x, *ln, width=a.width)
    pz = pending_ln(x, *ln, width=a.width, z=True)
    fold, fold_z = ln_fold(w1, b1, *ln), ln_fold(w1, b1, *ln, width=a.width)
    xl = layer_norm(x, *ln)
    ref = P.sparse_fc1(xl, w1, b1, idx)
    for name, fn in (("fc1 plain", lambda: P.sparse_fc1(xl, w1, b1, idx)),
                     ("fc1 LN_IN 1 (loop)", lambda: P.sparse_fc1(p1, w1, b1, idx)),
                     ("fc1 LN_IN 2 (fold)", lambda: P.sparse_fc1(p1, w1, b1, idx, ln_fold=fold)),
                     ("fc1 LN_IN 3 (z)", lambda: P.sparse_fc1(pz, w1, b1, idx, ln_fold=fold_z)),
                     # the stats through L2 only (.cg: every program's load goes to the same L2 lines)
                     ("fc1 LN_IN 2 (fold), stats .cg",
                      lambda: P.sparse_fc1(p1, w1, b1, idx, ln_fold=fold, config={"ST_CM": ".cg"})),
                     ("fc1 LN_IN 3 (z), stats .cg",
                      lambda: P.sparse_fc1(pz, w1, b1, idx, ln_fold=fold_z, config={"ST_CM": ".cg"})),
                     ("layer_norm", lambda: layer_norm(x, *ln))):
        out = fn()
        rows[name] = {"us": time_us(fn), "finite": bool(torch.isfinite(out).all()),
                      "rel_err": float((out.float() - ref.float()).norm() / ref.float().norm()) if "fc1" in name else None}
        print(name, rows[name])
    kh = max(1, int(a.density * H))
    heads = torch.randperm(H, device=dev)[:kh].sort().values.to(torch.int32)[None]
    wq, bq, wkv, bkv = rnd(D, D, scale=D ** -0.5), rnd(D), rnd(2 * D, D, scale=D ** -0.5), rnd(2 * D)
    wo_t, bo = rnd(D, D, scale=D ** -0.5), rnd(D)
    kc, vc = rnd(1, H, S, hd), rnd(1, H, S, hd)
    hist = rnd(1, S, D)
    pos = torch.tensor([S - 6], device=dev)
    vl0 = torch.full((1, H), S - 9, dtype=torch.int32, device=dev)  # 3 missing slots per head

    def attn(xin, cfg=None, qkv_only=False):
        vl = vl0.clone()
        if qkv_only:
            xt = xin.x if hasattr(xin, "x") else xin
            q = torch.empty(1, kh * hd, dtype=torch.float32, device=dev)
            DK._launch_qkv(xt, hist, wq, bq, wkv, bkv, heads, kc, vc, vl, pos, 0, q, cfg,
                           xin if hasattr(xin, "x") else None)
            return q
        return sparse_attn_decode_deferred(xin, wq, bq, wkv, bkv, wo_t, bo, heads, kc, vc, hist, vl, pos, x,
                                           config={"qkv": cfg} if cfg else None)

    ref = attn(xl)
    for name, fn in (("attn plain", lambda: attn(xl)), ("attn pending", lambda: attn(p1)),
                     ("qkv plain", lambda: attn(xl, qkv_only=True)), ("qkv pending", lambda: attn(p1, qkv_only=True)),
                     ("qkv pending, stats .cg", lambda: attn(p1, {"ST_CM": ".cg"}, qkv_only=True))):
        out = fn()
        rows[name] = {"us": time_us(fn), "finite": bool(torch.isfinite(out).all())}
        if name.startswith("attn"):
            rows[name]["rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
        print(name, rows[name])
    rows["decode"] = decode_check(a.tiny)
    json.dump({"device": "cpu" if a.tiny else torch.cuda.get_device_name(), "density": a.density, "width": a.width, "rows": rows},
              open(a.out, "w"), indent=1)


def decode_check(tiny: bool) -> dict:
    """A 4-layer engine of the OPT-30B shape (random weights, fp16): decode 8 tokens with each
    deferral on; are the logits finite, the index sets free of duplicates, equal to the plain
    step's? And the eager step time (no graph) of each."""
    import time

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import e2e

    from dejavu.runtime import Engine
    c = dict(e2e.TINY if tiny else {**e2e.SHAPES["opt-30b"], "num_hidden_layers": 4})
    dev = "cpu" if tiny else "cuda"
    t = e2e.random_tensors(c, torch.float16, dev, (64, 8) if tiny else (512, 56), seed=1)
    out = {}
    prompt = [list(range(5, 21))]
    base = None
    for name, attrs in (("plain", {}), ("lnqkv", {"defer_ln_attn": True}), ("deferln", {"defer_ln": True}),
                        ("deferlnz", {"defer_ln": True, "fold_ln": "z"})):
        eng = Engine.from_tensors(e2e.header_for(c, 0.3, "float16", (64, 8) if tiny else (512, 56)), t, dev,
                                  use_graphs=False, backend="ref" if tiny else "triton")
        for k, v in attrs.items():
            setattr(eng.decoder, k, v)
        got = []
        step = eng.decoder.decode_step
        eng.decoder.decode_step = lambda tok, pos: got.append(step(tok, pos).clone()) or got[-1]
        toks = eng.generate(prompt, 8, stop_at_eos=False)
        if not tiny:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate(prompt, 8, stop_at_eos=False)
        if not tiny:
            torch.cuda.synchronize()
        lg = torch.stack(got[:8]).float()
        dup = [int(i.numel() - torch.unique(i).numel()) for d in eng.decoder.pred.idx for i in d.values() if i is not None]
        row = {"finite": bool(torch.isfinite(lg).all()), "duplicates": sum(dup), "tokens": toks,
               "ms_16_steps_eager": 1e3 * (time.perf_counter() - t0)}
        if base is None:
            base, base_toks = lg, toks[0]
        else:
            row["logits_rel_err_vs_plain"] = float((lg - base).norm() / base.norm())
            # up to the first step whose token differs (later steps see different inputs)
            same = next((i for i, (u, v) in enumerate(zip(toks[0], base_toks)) if u != v), len(toks[0]))
            n = max(1, same)
            row["same_steps"] = same
            row["logits_rel_err_same_steps"] = float((lg[:n] - base[:n]).norm() / base[:n].norm())
        out[name] = row
        print("decode", name, row)
        del eng
    return out


if __name__ == "__main__":
    main()

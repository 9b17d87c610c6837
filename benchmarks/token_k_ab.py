"""Per-token MLP K on vs off at the same K: one layer's predictor + sparse MLP, batch 1, CUDA graph.

    python benchmarks/token_k_ab.py [--shape opt-30b] [--densities 0.1 0.2 0.3] [--out FILE]
    python benchmarks/token_k_ab.py --smoke     # CPU, Triton interpreter, tiny shape: runs, times nothing

Per density d (K = round(d F)) and layer, three systems, each the decode step's calls for one MLP
(predictor_topk -> sparse_fc1 -> sparse_fc2 with residual), on random weights of the shape:
  fixed        top-K, fc1 and fc2 over K rows (engines built with --token-k off)
  fixed_skip0  the same, fc2 skipping the rows whose h is 0 (ReLU zeros; SKIP_ZERO alone)
  token_k      top-2K with the kept count (share >= theta, theta fitted on these scores so that the mean
               kept rows are K; kept rows first), fc1 and fc2 stopping at the count, fc2 skipping zero rows
               (the default build)
  token_k_read the same calls, theta fitted so that the mean rows read, kept + kept with h != 0, are 2 K
               (`--token-k-rows read`; docs/predictors.md, "Per-token K fitted to rows read"): equal to
               fixed K's 2 K rows if fc2's skipped rows cost nothing (random weights: about half the rows
               fc1 computes are ReLU zeros; trained OPT layers 0.5-0.9)
and the breakdown of the difference (--no-breakdown skips it), each part alone on inputs made before capture:
  topk_K / topk_2K / topk_2K_keep   scores + top-K, + top-2K, + top-2K with the kept count (same launches)
  keep_torch    the rule by plugins.share_keep on the scores (torch: logsumexp, gather, compare, amax, sum: the
                launches 1abe2c2 ran per layer on the GPU, there with a softmax and without the sum)
  fc1_K / fc1_2K_keep               fc1 over the K rows of top-K; over top-2K stopping at the kept count
  fc2_K / fc2_K_skip0 / fc2_2K_skip0   fc2 over K rows (skip off / on); over top-2K stopping at the kept count
  pred_float / pred_int8   scores + top-K of one MLP predictor at the compiler's rank for the shape and storage
                (`default_ranks`: float at the budget rank, capped at 512; int8 rows with an fp16 scale a row at
                the rank the same bytes pay for, twice that): the predictor the engines carry, before and after
                int8 storage (docs/predictors.md, "int8 predictors at twice the rank")
Weights rotate over copies between calls (cold L2, as in benchmarks/kernels.py). Random predictors: the
kept count per token follows their score distribution, not a trained one; the rows kept on average are
K by construction, which is what the bytes depend on. Prints one JSON line per row; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {"opt-30b": (7168, 28672, 1144), "opt-66b": (9216, 36864, 512), "tiny": (64, 256, 16)}  # D, F, rank


def graph_time(calls) -> float | None:
    """Median ms per call of `calls` captured in one CUDA graph (benchmarks/kernels.py); off CUDA each
    call runs once (the smoke run) and None is returned."""
    if not torch.cuda.is_available():
        for c in calls:
            c()
        return None
    sys.path.insert(0, str(Path(__file__).parent))
    from kernels import bench_graph

    return bench_graph(calls, reps=50)


def breakdown(layers, xs, K, k_max, theta) -> dict:
    """{row name: calls}: the parts of fixed and token_k alone (module docstring); the inputs of each
    part (scores, indices, flags, h) are made here, before capture, from the same weights and x."""
    from dejavu.plugins import predictor_scores, predictor_topk, share_keep, sparse_fc1, sparse_fc2

    parts = {k: [] for k in ("topk_K", "topk_2K", "topk_2K_keep", "keep_torch", "fc1_K", "fc1_2K_keep",
                             "fc2_K", "fc2_K_skip0", "fc2_2K_skip0")}
    for w, x in zip(layers, xs):
        p = (x, w["a"], w["b"], w["bias"])
        scores = predictor_scores(*p)
        idx_k = predictor_topk(*p, K)
        idx_2k, n = predictor_topk(*p, k_max, min_share=theta)
        h_k = sparse_fc1(x, w["w1"], w["b1"], idx_k)
        h_2k = sparse_fc1(x, w["w1"], w["b1"], idx_2k, n)
        parts["topk_K"].append(lambda p=p: predictor_topk(*p, K))
        parts["topk_2K"].append(lambda p=p: predictor_topk(*p, k_max))
        parts["topk_2K_keep"].append(lambda p=p: predictor_topk(*p, k_max, min_share=theta))
        parts["keep_torch"].append(lambda s=scores, i=idx_2k: share_keep(s, i, theta).sum(-1, dtype=torch.int32))
        parts["fc1_K"].append(lambda x=x, w=w, i=idx_k: sparse_fc1(x, w["w1"], w["b1"], i))
        parts["fc1_2K_keep"].append(lambda x=x, w=w, i=idx_2k, n=n: sparse_fc1(x, w["w1"], w["b1"], i, n))
        for name, h, i, skip, nk in (("fc2_K", h_k, idx_k, False, None), ("fc2_K_skip0", h_k, idx_k, True, None),
                                     ("fc2_2K_skip0", h_2k, idx_2k, True, n)):
            parts[name].append(lambda x=x, w=w, h=h, i=i, skip=skip, nk=nk: sparse_fc2(h, w["w2_t"], w["b2"], i, x,
                                                                                       skip_zero=skip, n_kept=nk))
    return parts


def predictor_rows(D: int, F: int, K: int, copies: int, rn) -> dict:
    """{"pred_float" | "pred_int8": (rank, calls)}: predictor_topk at K with the compiler's MLP rank for D, F and
    each storage, the weights rotating over `copies` (random; int8 rows by compiler.predictors.quantize_rows)."""
    from types import SimpleNamespace

    from dejavu.compiler.config import PredictorSettings
    from dejavu.compiler.predictors import default_ranks, quantize_rows
    from dejavu.plugins import predictor_topk

    cfg = SimpleNamespace(hidden_size=D, ffn_dim=F, num_attention_heads=max(1, D // 128))
    out = {}
    for dtype in ("float", "int8"):
        r = default_ranks(cfg, PredictorSettings(dtype=dtype))[0]
        calls = []
        for _ in range(copies):
            x, a, b, bias = rn(1, D), rn(r, D, scale=D ** -0.5), rn(F, r, scale=3 * r ** -0.5), rn(F, scale=0.1)
            if dtype == "int8":
                (a, sa), (b, sb) = quantize_rows(a), quantize_rows(b)
                calls.append(lambda x=x, a=a, b=b, bias=bias, s=(sa, sb): predictor_topk(x, a, b, bias, K, scales=s))
            else:
                calls.append(lambda x=x, a=a, b=b, bias=bias: predictor_topk(x, a, b, bias, K))
        out[f"pred_{dtype}"] = (r, calls)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-30b", choices=sorted(SHAPES))
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    ap.add_argument("--copies", type=int, default=4, help="weight copies rotated between calls (cold L2)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one copy (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--no-breakdown", action="store_true", help="only the three systems")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.copies = "tiny", 1
    from dejavu.compiler.token_k import fit_theta, fit_theta_read, read_rows, share_counts, share_mask
    from dejavu.plugins import predictor_topk, sparse_fc1, sparse_fc2

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.float16 if dev == "cuda" else torch.float32
    D, F, r = SHAPES[args.shape]
    g = torch.Generator(device=dev).manual_seed(0)
    rn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(dt)  # noqa: E731
    layers = [dict(a=rn(r, D, scale=D ** -0.5), b=rn(F, r, scale=3 * r ** -0.5), bias=rn(F, scale=0.1),
                   w1=rn(F, D, scale=D ** -0.5), b1=rn(F, scale=0.1), w2_t=rn(F, D, scale=F ** -0.5),
                   b2=rn(D, scale=0.1)) for _ in range(args.copies)]
    xs = [rn(1, D) for _ in range(args.copies)]
    rows = []
    for d in args.densities:
        K = max(1, round(d * F))
        k_max = min(F, 2 * K)
        # theta: mean kept rows = K over 256 random inputs through the first copy's predictor
        p0 = layers[0]
        probe = rn(256, D)
        scores = ((probe.float() @ p0["a"].float().T) @ p0["b"].float().T + p0["bias"].float())
        theta = fit_theta(scores, K, k_max)
        mean_kept = float(share_counts(scores, theta, k_max).float().mean())
        # theta_read: mean kept + nonzero kept rows = 2 K over the same inputs (h through the first copy's fc1)
        h = torch.relu(probe.float() @ p0["w1"].float().T + p0["b1"].float())
        theta_read = fit_theta_read(scores, h, 2 * K, k_max)
        kept_read, nz_read = (float(v.float().mean()) for v in read_rows(share_mask(scores, theta_read, k_max), h))
        thetas = {"token_k": theta, "token_k_read": theta_read}

        def system(kind):
            calls = []
            for w, x in zip(layers, xs):
                def call(w=w, x=x):
                    if kind in thetas:
                        idx, n = predictor_topk(x, w["a"], w["b"], w["bias"], k_max, min_share=thetas[kind])
                        h = sparse_fc1(x, w["w1"], w["b1"], idx, n)
                    else:
                        idx, n = predictor_topk(x, w["a"], w["b"], w["bias"], K), None
                        h = sparse_fc1(x, w["w1"], w["b1"], idx)
                    return sparse_fc2(h, w["w2_t"], w["b2"], idx, x, skip_zero=kind != "fixed", n_kept=n)
                calls.append(call)
            return calls

        kinds = {kind: system(kind) for kind in ("fixed", "fixed_skip0", "token_k", "token_k_read")}
        ranks = {}
        if not args.no_breakdown:
            kinds.update(breakdown(layers, xs, K, k_max, theta))
            for kind, (r_kind, calls) in predictor_rows(D, F, K, args.copies, rn).items():
                kinds[kind], ranks[kind] = calls, r_kind
        for kind, calls in kinds.items():
            t0 = time.perf_counter()
            ms = graph_time(calls)
            wide = kind in ("token_k", "token_k_read", "keep_torch") or "2K" in kind
            read = kind == "token_k_read"
            row = {"shape": args.shape, "density": d, "K": K, "system": kind, "ms": ms,
                   "k_max": k_max if wide else K, "theta": thetas.get(kind, theta) if wide else None,
                   "mean_kept_probe": kept_read if read else mean_kept if wide else K,
                   **({"mean_fc2_rows_probe": nz_read} if read else {}),
                   **({"rank": ranks[kind]} if kind in ranks else {}),
                   "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                   "wall_s": round(time.perf_counter() - t0, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "triton_interpret": os.environ.get("TRITON_INTERPRET"),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

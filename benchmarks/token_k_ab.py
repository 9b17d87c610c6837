"""Per-token MLP K on vs off at the same K: one layer's predictor + sparse MLP, batch 1, CUDA graph.

    python benchmarks/token_k_ab.py [--shape opt-30b] [--densities 0.1 0.2 0.3] [--out FILE]
    python benchmarks/token_k_ab.py --smoke     # CPU, Triton interpreter, tiny shape: runs, times nothing
    python benchmarks/token_k_ab.py --rows compact   # only fc2 over the nonzero rows and fc2 over all K rows

Per density d (K = round(d F)) and layer, four systems, each the decode step's calls for one MLP
(predictor_topk -> sparse_fc1 -> sparse_fc2 with residual), on random weights of the shape:
  fixed          top-K, fc1 and fc2 over all K rows, zeros of h included
  fixed_compact  the same with fc2 over h's nonzero rows: compact_rows puts them first (one launch after fc1)
                 and fc2 stops at their count (the decode step's calls, runtime.ops.skips_zero)
  token_k_compact  top-2K with the kept count (share >= theta, theta fitted on these scores so that the mean
                 kept rows are K; kept rows first), fc1 stopping at the count, fc2 over the nonzero rows
                 (the default build)
  token_k_read_compact  the same calls, theta fitted so that the mean rows read, kept + kept with h != 0, are 2 K
                 (`--token-k-rows read`; docs/predictors.md, "Per-token K fitted to rows read"): equal to
                 fixed K's 2 K rows if fc2's skipped rows cost nothing (random weights: about half the rows
                 fc1 computes are ReLU zeros; trained OPT layers 0.5-0.9)
(fc2 skipping h's zeros in place, SKIP_ZERO, timed slower than compaction and deleted: BENCHMARKS.md)
and the breakdown of the difference (--no-breakdown skips it), each part alone on inputs made before capture:
  topk_K / topk_2K / topk_2K_keep   scores + top-K, + top-2K, + top-2K with the kept count (same launches)
  keep_torch    the rule by plugins.share_keep on the scores (torch: logsumexp, gather, compare, amax, sum: the
                launches 1abe2c2 ran per layer on the GPU, there with a softmax and without the sum)
  fc1_K / fc1_2K_keep               fc1 over the K rows of top-K; over top-2K stopping at the kept count
  fc2_K         fc2 over K rows
  pred_float / pred_int8   scores + top-K of one MLP predictor at the compiler's rank for the shape and storage
                (`default_ranks`: float at the budget rank, capped at 512; int8 rows with an fp16 scale a row at
                the rank the same bytes pay for, twice that): the predictor the engines carry, before and after
                int8 storage (docs/predictors.md, "int8 predictors at twice the rank")
  compact_K / fc2_K_compact / fc2_K_compacted   compact_rows over top-K's h alone; it and fc2 over the nonzero
                rows (the decode step's calls); that fc2 alone, on the compacted rows made before capture
  fc2_2K_read_compact   token_k_read_compact's fc2 over its nonzero rows (compact_rows + fc2)
--rows NAME... (or the set "compact": the rows of fc2 over the nonzero rows and what they are compared with;
"predictors": pred_float, pred_int8 and topk_K) runs only those rows.
Weights rotate over copies between calls (cold L2, as in benchmarks/kernels.py). Random predictors: the
kept count per token follows their score distribution, not a trained one; the rows kept on average are
K by construction, which is what the bytes depend on. mean_fc2_rows_probe: the rows fc2 must read (h != 0 among
those fc1 computes) on the probe's inputs. Prints one JSON line per row; asserts nothing.
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
SYSTEMS = ("fixed", "fixed_compact", "token_k_compact", "token_k_read_compact")
PARTS = ("topk_K", "topk_2K", "topk_2K_keep", "keep_torch", "fc1_K", "fc1_2K_keep", "fc2_K", "compact_K",
         "fc2_K_compact", "fc2_K_compacted", "fc2_2K_read_compact")
ROW_SETS = {"compact": ("fixed", "fixed_compact", "token_k_read_compact", "fc2_K", "compact_K", "fc2_K_compact",
                        "fc2_K_compacted", "fc2_2K_read_compact"),
            "predictors": ("topk_K", "pred_float", "pred_int8")}
PREDICTOR_ROWS = ("pred_float", "pred_int8")  # predictor_rows


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


def fc2_compact(h, w, idx, x):
    """fc2 over h's nonzero rows, as the decode step (runtime.ops.skips_zero): compact_rows, then
    sparse_fc2 stopping at their count."""
    from dejavu.plugins import compact_rows, sparse_fc2

    hc, ic, nz = compact_rows(h, idx)
    return sparse_fc2(hc, w["w2_t"], w["b2"], ic, x, n_kept=nz)


def breakdown(layers, xs, K, k_max, theta, theta_read) -> dict:
    """{row name: calls}: the parts of fixed and token_k alone (module docstring); the inputs of each
    part (scores, indices, flags, h) are made here, before capture, from the same weights and x."""
    from dejavu.plugins import compact_rows, predictor_scores, predictor_topk, share_keep, sparse_fc1, sparse_fc2

    parts = {k: [] for k in PARTS}
    for w, x in zip(layers, xs):
        p = (x, w["a"], w["b"], w["bias"])
        scores = predictor_scores(*p)
        idx_k = predictor_topk(*p, K)
        idx_2k, n = predictor_topk(*p, k_max, min_share=theta)
        idx_rd, n_rd = predictor_topk(*p, k_max, min_share=theta_read)
        h_k = sparse_fc1(x, w["w1"], w["b1"], idx_k)
        h_rd = sparse_fc1(x, w["w1"], w["b1"], idx_rd, n_rd)
        hc, ic, nz = compact_rows(h_k, idx_k)
        parts["compact_K"].append(lambda h=h_k, i=idx_k: compact_rows(h, i))
        parts["fc2_K_compact"].append(lambda x=x, w=w, h=h_k, i=idx_k: fc2_compact(h, w, i, x))
        parts["fc2_K_compacted"].append(lambda x=x, w=w, hc=hc, ic=ic, nz=nz: sparse_fc2(hc, w["w2_t"], w["b2"], ic, x,
                                                                                        n_kept=nz))
        parts["fc2_2K_read_compact"].append(lambda x=x, w=w, h=h_rd, i=idx_rd: fc2_compact(h, w, i, x))
        parts["topk_K"].append(lambda p=p: predictor_topk(*p, K))
        parts["topk_2K"].append(lambda p=p: predictor_topk(*p, k_max))
        parts["topk_2K_keep"].append(lambda p=p: predictor_topk(*p, k_max, min_share=theta))
        parts["keep_torch"].append(lambda s=scores, i=idx_2k: share_keep(s, i, theta).sum(-1, dtype=torch.int32))
        parts["fc1_K"].append(lambda x=x, w=w, i=idx_k: sparse_fc1(x, w["w1"], w["b1"], i))
        parts["fc1_2K_keep"].append(lambda x=x, w=w, i=idx_2k, n=n: sparse_fc1(x, w["w1"], w["b1"], i, n))
        parts["fc2_K"].append(lambda x=x, w=w, h=h_k, i=idx_k: sparse_fc2(h, w["w2_t"], w["b2"], i, x))
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
    ap.add_argument("--no-breakdown", action="store_true", help="only the systems (not the parts)")
    ap.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                    help=f"only these rows (systems, parts, or the set {', '.join(ROW_SETS)}); default all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.copies = "tiny", 1
    wanted = None if args.rows is None else {r for name in args.rows for r in ROW_SETS.get(name, (name,))}
    known = set(SYSTEMS) | set(PARTS) | set(PREDICTOR_ROWS)
    if wanted is not None and wanted - known:
        ap.error(f"--rows: unknown {sorted(wanted - known)} (known: {', '.join(SYSTEMS + PARTS + PREDICTOR_ROWS)}, "
                 f"or {', '.join(ROW_SETS)})")
    from dejavu.compiler.token_k import fit_theta, fit_theta_read, read_rows, share_counts, share_mask
    from dejavu.fileio import write_json
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
        nz_kept = float(read_rows(share_mask(scores, theta, k_max), h)[1].float().mean())
        nz_fixed = float((h.gather(1, scores.topk(K, dim=1).indices) != 0).sum(1).float().mean())
        thetas = {"token_k": theta, "token_k_read": theta_read}

        def system(kind):
            base, compact = kind.removesuffix("_compact"), kind.endswith("_compact")
            calls = []
            for w, x in zip(layers, xs):
                def call(w=w, x=x):
                    if base in thetas:
                        idx, n = predictor_topk(x, w["a"], w["b"], w["bias"], k_max, min_share=thetas[base])
                        h = sparse_fc1(x, w["w1"], w["b1"], idx, n)
                    else:
                        idx, n = predictor_topk(x, w["a"], w["b"], w["bias"], K), None
                        h = sparse_fc1(x, w["w1"], w["b1"], idx)
                    if compact:
                        return fc2_compact(h, w, idx, x)
                    return sparse_fc2(h, w["w2_t"], w["b2"], idx, x, n_kept=n)
                calls.append(call)
            return calls

        kinds = {kind: system(kind) for kind in SYSTEMS if wanted is None or kind in wanted}
        if not args.no_breakdown and (wanted is None or wanted & set(PARTS)):
            kinds.update({k: v for k, v in breakdown(layers, xs, K, k_max, theta, theta_read).items()
                          if wanted is None or k in wanted})
        ranks = {}
        if not args.no_breakdown and (wanted is None or wanted & set(PREDICTOR_ROWS)):
            for kind, (r_kind, calls) in predictor_rows(D, F, K, args.copies, rn).items():
                if wanted is None or kind in wanted:
                    kinds[kind], ranks[kind] = calls, r_kind
        for kind, calls in kinds.items():
            t0 = time.perf_counter()
            ms = graph_time(calls)
            read = "read" in kind
            wide = kind.startswith("token_k") or kind == "keep_torch" or "2K" in kind
            fc2_rows = nz_read if read else nz_kept if wide else nz_fixed  # the rows fc2 must read (h != 0)
            row = {"shape": args.shape, "density": d, "K": K, "system": kind, "ms": ms,
                   "k_max": k_max if wide else K,
                   "theta": (theta_read if read else theta) if wide else None,
                   "mean_kept_probe": kept_read if read else mean_kept if wide else K,
                   **({"mean_fc2_rows_probe": fc2_rows} if "fc2" in kind or kind in SYSTEMS else {}),
                   **({"rank": ranks[kind]} if kind in ranks else {}),
                   "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                   "wall_s": round(time.perf_counter() - t0, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # rewritten after every row (a run cut short by its timeout keeps what it measured)
                write_json(args.out, {"argv": sys.argv[1:], "triton_interpret": os.environ.get("TRITON_INTERPRET"),
                                      "rows": rows}, indent=1)


if __name__ == "__main__":
    main()

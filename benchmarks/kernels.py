"""Benchmark the dejavu.plugins kernels on OPT-30B/66B layer shapes.

    python benchmarks/kernels.py [--quick] [--sweep] [--out PATH]

(The GPU correctness checks on real shapes are tests: tests/plugins/test_plugin_real_shapes.py.)
--sections mlp_parts  batch 1: the pair piece by piece (fc1, fc2, the reduction) beside one-launch
          and cuBLAS readings of the same bytes (not in the default sections).
--mlp-variants NAMES  batch 1: the pair with fc2's batch-1 blocks changed (MLP_VARIANTS: fc2 configs
          passed as `config=`; section mlp_variants).
--sections pred_gemv  the predictors' two products at batch 1: cuBLAS vs Triton gather_gemv block
          configs (the best goes to the JSON's pred_gemv.best; e2e.py --tuned applies it).
--no-pdl  plain launches (default: programmatic dependent launch as plugins/_common.py's
          the kernel settings say, on sm_90+).
--sweep   try a few block configurations per kernel path and use the fastest for the run
          (the winners are printed and written to the JSON: copy them into plugins/settings.py
          (KernelSettings) so the runtime's choice stays deterministic).
Measures the copy and read bandwidth in the same run; times are medians of
triton.testing.do_bench (L2 flushed before each call), plus CUDA-graph replays for batch 1.
Writes JSON to --out (default $OUT/kernels.json when OUT is set) and prints markdown tables.
Asserts nothing (benchmarks/ never does).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn

SHAPES = {"opt-30b": (7168, 28672, 56), "opt-66b": (9216, 36864, 72)}
DENSITIES = [0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0]
BATCHES = [1, 2, 4, 8, 16, 32]
# "cpu" (with TRITON_INTERPRET=1): a dry run of the driver without a GPU
DEV = os.environ.get("DEJAVU_BENCH_DEVICE", "cuda")
DEADLINE = [float("inf")]  # time.time() after which loops stop early (--budget-s)


def late(what):
    if time.time() > DEADLINE[0]:
        print(f"  out of time budget: stopping {what}")
        return True
    return False


def _import_plugins():
    """dejavu.plugins, installed or straight from this checkout (the device has no install)."""
    try:
        import dejavu.plugins as plugins
        return plugins
    except ImportError:
        import importlib.util
        root = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(root))
        import dejavu  # noqa: F401  (the dejavu/ folder at the root)
        spec = importlib.util.spec_from_file_location(
            "dejavu.plugins", root / "plugins" / "__init__.py",
            submodule_search_locations=[str(root / "plugins")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dejavu.plugins"] = mod
        spec.loader.exec_module(mod)
        return mod


class Run:
    """This run's kernel settings (plugins.KernelSettings: --no-pdl, the sweeps' winners, one section's
    choice); the plugins' defaults are never changed."""
    settings = None


class Bound:
    """A plugin module whose launchers get `settings=Run.settings` on every call."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        fn = getattr(self._mod, name)
        if callable(fn) and not isinstance(fn, type) and "settings" in inspect.signature(fn).parameters:
            return lambda *a, **kw: fn(*a, **{"settings": Run.settings, **kw})
        return fn


def with_settings(**parts):
    """Run.settings with fields of its parts replaced: with_settings(topk=dict(block=2048)), or a
    top-level field (fc1_dot_min_batch=1)."""
    s = Run.settings
    return dataclasses.replace(s, **{k: dataclasses.replace(getattr(s, k), **v) if isinstance(v, dict) else v
                                     for k, v in parts.items()})


_PLUGINS = _import_plugins()
Run.settings = _PLUGINS.DEFAULT
P = Bound(_PLUGINS)
PR, FC1, FC2, QP, DK, SA = (Bound(importlib.import_module(f"dejavu.plugins.{m}")) for m in
                            ("predictor", "fc1", "fc2", "qkv_partial", "deferred_kv", "sparse_attention"))


def bench(fn, rep=40, warmup=10):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fns, reps=25):
    """Median time per call of the calls `fns` captured back to back in one CUDA graph.

    Launch gaps vanish (the runtime replays a graph too). The L2 is not flushed, so callers
    rotate weight copies / index sets between the calls to keep the working set cold."""
    if DEV != "cuda":
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile, cuBLAS workspaces) off the capture
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        t_first = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        t_first = time.perf_counter() - t_first
        times = []
        for _ in range(max(5, min(reps, int(0.15 / max(t_first, 1e-6))))):  # ~150 ms at most
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / len(fns))
        del g
        return statistics.median(times)
    except Exception as e:  # noqa: BLE001 - report, don't die
        print(f"  (cuda graph timing failed: {type(e).__name__}: {str(e)[:200]})")
        return None


def randn(*shape, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def rand_idx(B, F, K, shared):
    if shared:
        return torch.randperm(F, device=DEV)[:K].to(torch.int32)
    return torch.stack([torch.randperm(F, device=DEV)[:K] for _ in range(B)]).to(torch.int32)


# ------------------------------------------------------------------------------ bandwidth

def measure_bandwidth():
    n = 1 << 29  # 1 GiB of fp16
    x = torch.randn(n, device=DEV, dtype=torch.float16)
    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x), rep=100)
    t_read = bench(lambda: x.sum(dtype=torch.float32), rep=100)
    nbytes = x.numel() * 2
    out = {"copy_GBps": 2 * nbytes / t_copy / 1e6, "read_GBps": nbytes / t_read / 1e6,
           "copy_ms": t_copy, "read_ms": t_read, "bytes": nbytes}
    del x, y
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------ inputs

def _attn_inputs(B, H, hd, S, dtype):
    D = H * hd
    w = {"wq": randn(D, D, dtype=dtype, scale=D ** -0.5), "bq": randn(D, dtype=dtype, scale=0.1),
         "wkv": randn(2 * D, D, dtype=dtype, scale=D ** -0.5), "bkv": randn(2 * D, dtype=dtype, scale=0.1),
         "wo_t": randn(D, D, dtype=dtype, scale=D ** -0.5), "bo": randn(D, dtype=dtype, scale=0.1)}
    kc, vc = randn(B, H, S, hd, dtype=dtype), randn(B, H, S, hd, dtype=dtype)
    return randn(B, D, dtype=dtype), w, kc, vc


def _deferred_inputs(B, H, hd, S, pos, kh, dtype, shared, gap):
    """Inputs of sparse_attn_decode_deferred with every head missing up to `gap` slots before pos."""
    x, w, kc, vc = _attn_inputs(B, H, hd, S, dtype)
    hist = randn(B, S, H * hd, dtype=dtype)
    pos_t = torch.full((B,), pos, device=DEV, dtype=torch.int64)
    vl = (pos - torch.randint(0, gap + 1, (B, H), device=DEV)).clamp_min(0).to(torch.int32)
    wl = [w[k] for k in ("wq", "bq", "wkv", "bkv", "wo_t", "bo")]
    return x, wl, kc, vc, hist, vl, pos_t, rand_idx(B, H, kh, shared)


# ------------------------------------------------------------------------------ MLP

class MLP:
    """One layer's MLP weights, plus COPIES-1 extra copies for graph timing (rotating copies
    keeps consecutive calls from finding the previous call's rows in the 50 MB L2)."""
    COPIES = 4

    def __init__(self, D, F):
        self.D, self.F = D, F
        self.w1, self.b1 = randn(F, D, scale=0.02), randn(F, scale=0.02)
        self.w2_t, self.b2 = randn(F, D, scale=0.02), randn(D, scale=0.02)
        self.w2 = self.w2_t.t().contiguous()  # the dense model's fc2.weight [D, F]
        self.copies = [(self.w1, self.b1, self.w2_t, self.b2, self.w2)]
        for _ in range(self.COPIES - 1):
            w2_t = randn(F, D, scale=0.02)
            self.copies.append((randn(F, D, scale=0.02), randn(F, scale=0.02), w2_t,
                                randn(D, scale=0.02), w2_t.t().contiguous()))

    def dense(self, x, c=0):
        w1, b1, _, b2, w2 = self.copies[c]
        return Fn.linear(Fn.linear(x, w1, b1).relu_(), w2, b2)

    def sparse(self, x, idx, c1=None, c2=None, c=0):
        w1, b1, w2_t, b2, _ = self.copies[c]
        h = P.sparse_fc1(x, w1, b1, idx, validate=False, config=c1)
        return P.sparse_fc2(h, w2_t, b2, idx, validate=False, config=c2)

    def graph_times(self, x, idx_sets):
        """(sparse, dense) ms per call in a CUDA graph, rotating copies and index sets."""
        n = len(idx_sets)
        sp = [lambda i=i: self.sparse(x, idx_sets[i], c=i % self.COPIES) for i in range(n)]
        de = [lambda i=i: self.dense(x, c=i % self.COPIES) for i in range(n)]
        return bench_graph(sp), bench_graph(de)


FC1_SWEEP = {"gemv": [dict(BLOCK_R=r, BLOCK_D=d, num_warps=w, num_stages=s) for r, d, w, s in
                      [(2, 512, 4, 2), (4, 512, 4, 2), (8, 512, 4, 2), (4, 1024, 4, 2), (8, 1024, 8, 2),
                       (16, 512, 8, 2), (4, 256, 4, 2), (8, 256, 4, 3), (2, 1024, 4, 2),
                       (4, 512, 4, 4), (8, 512, 8, 3), (4, 2048, 8, 2), (2, 2048, 4, 2)]],
             "dot": [dict(BLOCK_R=r, BLOCK_D=d, num_warps=w, num_stages=s) for r, d, w, s in
                     [(32, 128, 4, 3), (64, 128, 4, 3), (16, 256, 4, 3), (32, 256, 8, 3),
                      (64, 64, 4, 4), (16, 128, 4, 4)]]}
FC2_SWEEP = {"gemv": [dict(BLOCK_K=k, BLOCK_D=d, num_warps=w, num_stages=s) for k, d, w, s in
                      [(16, 256, 4, 2), (32, 256, 4, 2), (8, 512, 4, 2), (16, 512, 8, 2), (32, 128, 4, 2),
                       (64, 128, 4, 2), (16, 1024, 8, 2), (8, 256, 4, 2), (32, 256, 8, 3)]]
             + [dict(BLOCK_K=16, BLOCK_D=256, num_warps=4, SPLIT=s) for s in (4, 8, 32)],
             "dot": [dict(BLOCK_K=k, BLOCK_D=d, num_warps=w, num_stages=s) for k, d, w, s in
                     [(64, 128, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3), (128, 64, 4, 3),
                      (32, 128, 4, 4)]],
             # batch 1 through the tl.dot kernel (settings.fc2_dot1)
             "dot1": [dict(BLOCK_K=k, BLOCK_D=d, num_warps=w, num_stages=s, TARGET_PROGRAMS=t)
                      for k, d, w, s, t in
                      [(128, 64, 4, 3, 528), (64, 128, 4, 3, 528), (32, 256, 4, 3, 528), (64, 256, 8, 3, 528),
                       (128, 128, 8, 3, 528), (64, 128, 4, 4, 528), (128, 64, 4, 3, 1056), (64, 128, 4, 3, 1056),
                       (32, 256, 4, 4, 1056), (16, 512, 4, 3, 528), (128, 64, 8, 4, 528), (64, 64, 4, 4, 1056)]]
                     # 2026-12-03: few programs, SPLIT 1 or 2 (one program per narrow D block walks all of
                     # K: no split-K reduction launch), for the small K of density 0.1
                     + [dict(BLOCK_K=k, BLOCK_D=d, num_warps=w, num_stages=s, TARGET_PROGRAMS=t)
                        for k, d, w, s, t in
                        [(128, 64, 4, 4, 112), (64, 64, 4, 4, 112), (128, 32, 4, 4, 224), (64, 128, 4, 4, 56),
                         (128, 64, 4, 4, 224), (64, 128, 4, 3, 112), (256, 32, 4, 4, 224), (128, 64, 8, 4, 112)]]}
# batch 1, the attention output projection (settings.proj1: rows in groups of hd)
FC2_SWEEP["proj1"] = [dict(BLOCK_K=k, BLOCK_D=d, num_warps=w, num_stages=s, TARGET_PROGRAMS=t)
                      for k in (32, 64, 128) for d in (64, 128, 256) for t in (264, 528, 1056) for s in (3, 4)
                      for w in (4,) if k * d <= 16384]


def pick_best(cfgs, total_ms, what, section):
    """(best, totals): each config's summed time total_ms(cfg) (inf when it raised, reported),
    in order until `section`'s time budget runs out (one config at least); best = (ms, cfg)."""
    totals = []
    for cfg in cfgs:
        if late(section) and totals:
            break
        try:
            total = total_ms(cfg)
        except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
            print(f"  sweep {what} {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            total = float("inf")
        totals.append((total, cfg))
    return min(totals, key=lambda tc: tc[0]), totals


def sweep(mlps, quick, paths=None):
    """Time each config; per path keep the one with the lowest summed time over the cases
    (`paths`: only these of gemv, dot, dot1, proj1)."""
    out = {"fc1": {}, "fc2": {}, "rows": []}
    # batch 1 runs fc1 as a GEMV and fc2 through the dot kernel ("dot1": fc2_dot_min_batch 1);
    # the per-sequence fc2 GEMV (batch > 1, one set per sequence) keeps its blocks
    for path, B, shared, dens in (("gemv", 1, False, (0.1, 0.5)), ("dot", 8, True, (0.3,)),
                                  ("dot1", 1, False, (0.1, 0.3)), ("proj1", 1, False, (0.1, 0.3))):
        if paths and path not in paths:
            continue
        for kernel, cfgs in (("fc1", FC1_SWEEP.get(path)), ("fc2", FC2_SWEEP[path] if path != "gemv" else None)):
            if cfgs is None:
                continue
            part = {"fc1": {"gemv": "fc1_gemv", "dot": "fc1_dot"},
                    "fc2": {"dot": "fc2_dot", "dot1": "fc2_dot1", "proj1": "proj1"}}[kernel].get(path)
            if part is None:
                continue
            table = dict(vars(getattr(Run.settings, part)))
            def total_ms(cfg):
                total = 0.0
                for name, mlp in mlps.items():
                    for d in dens:
                        K = int(d * mlp.F)
                        x = randn(B, mlp.D)
                        h = randn(B, K)
                        idxs = [rand_idx(B, mlp.F, K, shared) for _ in range(mlp.COPIES)]
                        # in a CUDA graph over rotating weight copies: do_bench on a
                        # ~30 us kernel times the Python launcher as much as the GPU
                        if path == "proj1":  # heads of hd rows out of the first D rows of w2_t
                            H = SHAPES[name][2]
                            hd, kh = mlp.D // H, max(1, round(d * H))
                            o = torch.randn(1, kh * hd, device=DEV)  # attention output: fp32
                            hs = [rand_idx(1, H, kh, False) for _ in range(mlp.COPIES)]
                            out1 = torch.empty(1, mlp.D, device=DEV, dtype=torch.float16)
                            fns = [lambda c=c: FC2.gather_gemv_t(o, mlp.copies[c][2], mlp.copies[c][3], hs[c], None,
                                                                out1, config=cfg, group=hd)
                                   for c in range(mlp.COPIES)]
                        elif kernel == "fc1":
                            fns = [lambda c=c: P.sparse_fc1(x, mlp.copies[c][0], mlp.copies[c][1], idxs[c],
                                                            validate=False, config=cfg)
                                   for c in range(mlp.COPIES)]
                        else:
                            fns = [lambda c=c: P.sparse_fc2(h, mlp.copies[c][2], mlp.copies[c][3], idxs[c],
                                                            validate=False, config=cfg)
                                   for c in range(mlp.COPIES)]
                        t = bench_graph(fns)
                        out["rows"].append({"kernel": kernel, "path": path, "shape": name, "density": d,
                                            "B": B, "config": cfg, "ms": t})
                        total += t
                return total

            best, totals = pick_best(cfgs[:3] if quick else cfgs, total_ms, f"{kernel}/{path}", "sweep")
            print(f"sweep {kernel}/{path}: best {best[1]} ({best[0]:.4f} ms summed); "
                  f"default {table} ({dict((str(c), t) for t, c in totals).get(str(table), 'n/a')})")
            if best[0] < float("inf"):  # the rest of this run uses it (keys the sweep does not set stay)
                Run.settings = with_settings(**{part: dict(best[1])})
            out[kernel][path] = dict(best[1])
    return out


def bench_mlp(mlps, bw, quick):
    rows = []
    dens = [0.1, 0.3, 1.0] if quick else DENSITIES
    batches = [1, 8] if quick else BATCHES
    for name, mlp in mlps.items():
        D, F = mlp.D, mlp.F
        dense_bytes = 2 * F * D * 2
        for B in batches:
            if late("mlp"):
                break
            x = randn(B, D)
            t_dense = bench(lambda: mlp.dense(x))
            for d in dens:
                K = max(1, int(round(d * F)))
                for shared in ((False, "dot") if B == 1 else (False, True)):
                    # B == 1, "dot": the batch-1 set through the tl.dot kernels (fc1_dot_min_batch 1)
                    base, Run.settings = Run.settings, with_settings(fc1_dot_min_batch=1) if shared == "dot" else Run.settings
                    idx = rand_idx(B, F, K, bool(shared) and B > 1)
                    uniq = K if shared else int(torch.unique(idx).numel())
                    t = bench(lambda: mlp.sparse(x, idx))
                    g_sparse, g_dense = mlp.graph_times(x, [idx] + [rand_idx(B, F, K, shared) for _ in range(7)])
                    row = {"shape": name, "B": B, "density": d, "K": K,
                           "policy": ("dot_b1" if shared == "dot" else "shared" if shared else "per_seq"),
                           "ms": t, "dense_ms": t_dense,
                           "speedup": t_dense / t, "bytes": 2 * uniq * D * 2,
                           "GBps": 2 * uniq * D * 2 / t / 1e6,
                           "dense_GBps": dense_bytes / t_dense / 1e6,
                           "graph_ms": g_sparse, "dense_graph_ms": g_dense}
                    row["bw_frac"] = row["GBps"] / bw["copy_GBps"]
                    if g_sparse and g_dense:
                        row["graph_speedup"] = g_dense / g_sparse
                        row["graph_GBps"] = row["bytes"] / g_sparse / 1e6
                        row["graph_bw_frac"] = row["graph_GBps"] / bw["copy_GBps"]
                    if B == 1:
                        h = torch.randn(B, K, device=DEV, dtype=torch.float16)
                        row["fc1_ms"] = bench(lambda: P.sparse_fc1(x, mlp.w1, mlp.b1, idx, validate=False))
                        row["fc2_ms"] = bench(lambda: P.sparse_fc2(h, mlp.w2_t, mlp.b2, idx, validate=False))
                        # per-kernel times in a graph (rotating copies), to attribute graph_ms
                        row["fc1_graph_ms"] = bench_graph([
                            lambda i=i: P.sparse_fc1(x, mlp.copies[i % 4][0], mlp.copies[i % 4][1], idx,
                                                     validate=False) for i in range(8)])
                        row["fc2_graph_ms"] = bench_graph([
                            lambda i=i: P.sparse_fc2(h, mlp.copies[i % 4][2], mlp.copies[i % 4][3], idx,
                                                     validate=False) for i in range(8)])
                    rows.append(row)
                    Run.settings = base
            print(f"  mlp {name} B={B} done")
    return rows


# --mlp-variants: the batch-1 pair (fc1 + fc2 + reduction) in CUDA graphs with fc2's batch-1 blocks
# (settings.fc2_dot1) changed by one `config=` override each
MLP_VARIANTS = {"default": {},
                "fc2t528": dict(TARGET_PROGRAMS=528), "fc2t792": dict(TARGET_PROGRAMS=792),
                # fc2 reading longer pieces of each gathered row (BLOCK_D 256 / 512 columns: 0.5-1 KB
                # against 256 B), more K splits to keep the program count
                "fc2w256": dict(BLOCK_K=32, BLOCK_D=256, num_stages=4),
                "fc2w512": dict(BLOCK_K=16, BLOCK_D=512, num_stages=4),
                # many waves of fc2 programs instead of one
                "fc2t1188": dict(TARGET_PROGRAMS=1188), "fc2t2376": dict(TARGET_PROGRAMS=2376)}
VARIANT_DENSITIES = (0.1, 0.2, 0.3)


def bench_mlp_variants(mlps, bw, names):
    """Batch 1 (per-sequence route), densities VARIANT_DENSITIES: the pair's time in a graph of 8
    calls (rotating weight copies and index sets) under each variant, and its bandwidth fraction."""
    rows = []
    for name, mlp in mlps.items():
        x = randn(1, mlp.D)
        for d in VARIANT_DENSITIES:
            K = max(1, int(round(d * mlp.F)))
            sets = [rand_idx(1, mlp.F, K, False) for _ in range(8)]
            nbytes = 2 * K * mlp.D * 2
            # one untimed graph first: the first timed one ran ~20% slow in 2026-12-03 runs
            bench_graph([lambda i=i: mlp.sparse(x, sets[i], c=i % mlp.COPIES) for i in range(8)], reps=5)
            for v in names:
                c2 = {**vars(Run.settings.fc2_dot1), **MLP_VARIANTS[v]}
                t = bench_graph([lambda i=i: mlp.sparse(x, sets[i], c2=c2, c=i % mlp.COPIES) for i in range(8)])
                rows.append({"shape": name, "density": d, "K": K, "variant": v, "graph_ms": t, "bytes": nbytes,
                             "graph_bw_frac": nbytes / t / 1e6 / bw["copy_GBps"] if t else None})
                print(f"  {name} d{d} {v}: {t * 1e3 if t else float('nan'):.1f} us", flush=True)
    return rows


PART_DENSITIES = (0.1, 0.3)
def _fc2_split(K, D):
    """The split count gather_gemv_t takes at batch 1 (settings.fc2_dot1) for K rows of width D."""
    return FC2.split_plan(K, D, dict(vars(Run.settings.fc2_dot1)))[1]


def bench_mlp_parts(mlps, bw, only=None):
    """Batch 1, where the pair's time goes (2026-12-03). Per shape and density, each in a CUDA
    graph of 8 calls over rotating weight copies and index sets: the pair, fc1 alone, fc2 alone
    (with its split reduction), the reduction alone (fc2's split count), fc1's kernel over 2K
    rows (the pair's bytes in one launch), and cuBLAS on contiguous weights of the same bytes
    (fc1 and fc2 as two GEMVs; one GEMV of 2K rows); `only`: the cases whose names start with one of these. bw_frac: bytes read / time /
    copy bandwidth."""
    rows = []
    for name, mlp in mlps.items():
        D, F, C = mlp.D, mlp.F, mlp.COPIES
        x = randn(1, D)
        for d in PART_DENSITIES:
            if late("mlp_parts"):
                return rows
            K = max(1, int(round(d * F)))
            sets = [rand_idx(1, F, K, False) for _ in range(8)]
            sets2 = [rand_idx(1, F, 2 * K, False) for _ in range(8)]
            h = randn(1, K)
            split = _fc2_split(K, D)
            parts = [torch.randn(split, 1, D, device=DEV) for _ in range(8)]
            y = torch.empty(1, D, device=DEV, dtype=torch.float16)
            cp = mlp.copies
            cases = {
                "pair": (2 * K, lambda i: mlp.sparse(x, sets[i], c=i % C)),
                "fc1": (K, lambda i: P.sparse_fc1(x, cp[i % C][0], cp[i % C][1], sets[i], validate=False)),
                "fc2": (K, lambda i: P.sparse_fc2(h, cp[i % C][2], cp[i % C][3], sets[i], validate=False)),
                "reduce": (0, lambda i: FC2.reduce_partials(parts[i], cp[i % C][3], None, y)),
                "fc1_2k_rows": (2 * K, lambda i: P.sparse_fc1(x, cp[i % C][0], cp[i % C][1], sets2[i],
                                                              validate=False)),
                "cublas_pair": (2 * K, lambda i: torch.mm(Fn.linear(x, cp[i % C][0][:K]).relu_(),
                                                          cp[i % C][2][:K])),
                "cublas_2k_rows": (2 * K, lambda i: Fn.linear(x, cp[i % C][0][:2 * K])),
            }
            # one untimed graph first: a section's first graph runs slow (2026-12-03)
            bench_graph([lambda i=i: mlp.sparse(x, sets[i], c=i % C) for i in range(8)], reps=5)
            for case, (n_rows, fn) in cases.items():
                if only and not case.startswith(tuple(only)):
                    continue
                t = bench_graph([lambda i=i, fn=fn: fn(i) for i in range(8)])
                nbytes = n_rows * D * 2
                rows.append({"shape": name, "density": d, "K": K, "case": case, "split": split, "graph_ms": t,
                             "bytes": nbytes, "bw_frac": nbytes / t / 1e6 / bw["copy_GBps"] if t and nbytes else None})
                print(f"  parts {name} d{d} {case}: {t * 1e3 if t else float('nan'):.2f} us", flush=True)
    return rows


# ------------------------------------------------------------------------------ attention

def bench_attn(quick):
    rows = []
    for name, (D, F, H) in SHAPES.items():
        hd = D // H
        for B in ((1,) if quick else (1, 8)):
            if late("attn"):
                break
            x, w, _, _ = _attn_inputs(1, H, hd, 1, torch.float16)
            x = randn(B, D)
            wl = [w[k] for k in ("wq", "bq", "wkv", "bkv", "wo_t", "bo")]
            for ctx in (128, 1024):
                S = ctx + 64
                kc, vc = randn(B, H, S, hd), randn(B, H, S, hd)
                pos_t = torch.tensor([ctx], device=DEV, dtype=torch.int32)

                def dense():
                    q = Fn.linear(x, w["wq"], w["bq"]).view(B, H, 1, hd)
                    kv = Fn.linear(x, w["wkv"], w["bkv"]).view(B, 2, H, 1, hd)
                    kc.index_copy_(2, pos_t.long(), kv[:, 0])
                    vc.index_copy_(2, pos_t.long(), kv[:, 1])
                    o = Fn.scaled_dot_product_attention(q, kc[:, :, :ctx + 1], vc[:, :, :ctx + 1], scale=1.0)
                    return Fn.linear(o.reshape(B, D), w["wo_t"].t(), w["bo"])
                t_dense = bench(dense)
                for d in ((0.3, 1.0) if quick else (0.2, 0.3, 0.5, 1.0)):
                    kh = max(1, int(round(d * H)))
                    for shared in ((False,) if B == 1 else (False, True)):
                        hidx = rand_idx(B, H, kh, shared)
                        t = bench(lambda: P.sparse_attn_decode(x, *wl, hidx, kc, vc, pos_t, validate=False))
                        nbytes = (2 * D * D + 2 * kh * hd * D * (1 if shared else B)
                                  + 2 * B * kh * (ctx + 1) * hd) * 2
                        rows.append({"shape": name, "B": B, "ctx": ctx, "density": d, "heads": kh,
                                     "policy": "shared" if shared else "per_seq", "ms": t,
                                     "dense_ms": t_dense, "speedup": t_dense / t,
                                     "GBps": nbytes / t / 1e6,
                                     "graph_ms": bench_graph([lambda h=h: P.sparse_attn_decode(
                                         x, *wl, h, kc, vc, pos_t, validate=False)
                                         for h in [hidx] + [rand_idx(B, H, kh, shared) for _ in range(3)]]),
                                     "dense_graph_ms": bench_graph([dense] * 4)})
                        rows[-1]["graph_speedup"] = ((rows[-1]["dense_graph_ms"] / rows[-1]["graph_ms"])
                                                     if rows[-1]["graph_ms"] and rows[-1]["dense_graph_ms"] else None)
            print(f"  attn {name} B={B} done")
    return rows


# ------------------------------------------------------------------------------ deferred attention

QKV_SWEEP = [dict(BLOCK_P=16, BLOCK_R=r, BLOCK_D=d, SPLIT=None, TARGET_PROGRAMS=t, FINISH_R=32, num_warps=w,
                  num_stages=st, SHARED_MIN_BATCH=None)
             for r in (32, 64) for d in (64, 128, 256) for t in (528, 1056, 2112) for w in (4, 8) for st in (2, 3)
             if r * d <= 8192]
# batch-1 shapes the first sweep did not try: 16-row blocks, and the shared-set kernel at batch 1
# (one tl.dot over x at pos and SHARED_P - 1 missing slots)
QKV_SWEEP += [dict(BLOCK_P=16, BLOCK_R=16, BLOCK_D=d, SPLIT=None, TARGET_PROGRAMS=t, FINISH_R=32, num_warps=4,
                   num_stages=st, SHARED_MIN_BATCH=None) for d in (128, 256, 512) for t in (528, 1056) for st in (2, 3)]
QKV_SWEEP += [dict(BLOCK_P=16, BLOCK_R=r, BLOCK_D=d, SPLIT=None, TARGET_PROGRAMS=t, FINISH_R=32, num_warps=4,
                   num_stages=st, SHARED_MIN_BATCH=1, SHARED_P=16)
              for r in (16, 32, 64) for d in (64, 128, 256) for t in (528, 1056) for st in (2, 3) if r * d <= 8192]
# --qkv-sweep finish: the batch-1 Q/K/V finishing kernel's rows per program and partial loads,
# on top of settings.qkv_b1 (the profile of 2026-12-02 put that kernel at ~10 us per layer)
QKV_FINISH_SWEEP = [dict(FINISH_R=r, FINISH_S=fs) for r in (16, 32, 64, 128) for fs in (1, 2, 4, 8)]
ATTN_SWEEP = [dict(CHUNK=c, BLOCK_S=bs, num_warps=4) for c in (32, 64, 128) for bs in (32, 64) if bs <= c]


def _deferred_call(args, cfg=None):
    """One steady-state decode call: valid_len restored first (every head misses its gap)."""
    x, wl, kc, vc, hist, vl, vl0, pos_t, hidx = args

    def f():
        vl.copy_(vl0)
        return DK.sparse_attn_decode_deferred(x, *wl, hidx, kc, vc, hist, vl, pos_t, x, validate=False, config=cfg)
    return f


def _deferred_args(D, H, B, ctx, kh, shared, gap, copies=4):
    """`copies` independent argument sets (weights too: consecutive calls find nothing in L2)."""
    hd = D // H
    out = []
    for _ in range(copies):
        x, wl, kc, vc, hist, vl, pos_t, hidx = _deferred_inputs(B, H, hd, ctx + 64, ctx, kh, torch.float16,
                                                               shared, gap)
        out.append((x, wl, kc, vc, hist, vl, vl.clone(), pos_t, hidx))
    return out


def sweep_attn(quick, which="wide"):
    """Q/K/V kernel configs (settings.qkv_b1: batch 1), then attention configs, on OPT-30B, B=1,
    head density 0.3, gap 3; the fastest (summed over contexts 128 and 1024) is kept for the
    run and reported."""
    D, F, H = SHAPES["opt-30b"]
    kh = round(0.3 * H)
    sets = {ctx: _deferred_args(D, H, 1, ctx, kh, False, 3) for ctx in (128, 1024)}
    out = {"rows": []}
    b1 = dict(vars(Run.settings.qkv_b1))
    lists = ((("qkv", "qkv_b1", QKV_SWEEP), ("attn", "attn", ATTN_SWEEP)) if which == "wide" else
             (("qkv", "qkv_b1", [{**b1, **c} for c in QKV_FINISH_SWEEP]),))
    for key, part, cfgs in lists:
        table = dict(vars(getattr(Run.settings, part)))
        def total_ms(cfg):
            total = 0.0
            for ctx, args in sets.items():
                t = bench_graph([_deferred_call(a, {key: cfg}) for a in args])
                out["rows"].append({"kernel": key, "ctx": ctx, "config": cfg, "graph_ms": t})
                total += t
            return total

        best, _ = pick_best(cfgs[:4] if quick else cfgs, total_ms, key, "sweep_attn")
        print(f"sweep {key}: best {best[1]} ({best[0]:.4f} ms summed); default {table}")
        if best[0] < float("inf"):  # the rest of this run uses it; keys the sweep does not vary (SHARED_*) stay
            Run.settings = with_settings(**{part: dict(best[1])})
        out[key] = dict(vars(getattr(Run.settings, part)))
    del sets
    torch.cuda.empty_cache()
    return out


def bench_deferred(quick):
    """The deferred-K/V decode attention (the runtime's default) per layer, in CUDA graphs:
    whole call, and the valid_len reset alone (subtracted). gap = missing slots per head."""
    rows = []
    for name, (D, F, H) in SHAPES.items():
        for B, shared in (((1, False),) if quick else ((1, False), (8, True))):
            for ctx in (128, 1024):
                if late("deferred"):
                    return rows
                x, w, kc, vc = _attn_inputs(B, H, D // H, ctx + 64, torch.float16)
                pos_t = torch.tensor([ctx], device=DEV, dtype=torch.int32)

                def dense():
                    q = Fn.linear(x, w["wq"], w["bq"]).view(B, H, 1, D // H)
                    kv = Fn.linear(x, w["wkv"], w["bkv"]).view(B, 2, H, 1, D // H)
                    kc.index_copy_(2, pos_t.long(), kv[:, 0])
                    vc.index_copy_(2, pos_t.long(), kv[:, 1])
                    o = Fn.scaled_dot_product_attention(q, kc[:, :, :ctx + 1], vc[:, :, :ctx + 1], scale=1.0)
                    return Fn.linear(o.reshape(B, D), w["wo_t"].t(), w["bo"])
                t_dense = bench_graph([dense] * 4)
                del x, w, kc, vc
                for d in ((0.3,) if quick else (0.1, 0.3, 0.5, 1.0)):
                    kh = max(1, round(d * H))
                    # batch 1: the shared-set kernel is the default (settings.qkv_b1), the per-sequence
                    # one forced; batches: the per-sequence kernel is the default, the shared one forced
                    for gap, kernel in [(g, "per_seq") for g in (0, 3, 16)] + (
                            [(g, "shared") for g in ((0, 3) if B > 1 else (0, 3, 16))] if shared or B == 1 else []):
                        args = _deferred_args(D, H, B, ctx, kh, shared, gap)
                        cfg = ({"qkv": {"SHARED_MIN_BATCH": 2}} if kernel == "shared" and B > 1 else
                               {"qkv": {"SHARED_MIN_BATCH": None}} if kernel == "per_seq" and B == 1 else None)
                        t = bench_graph([_deferred_call(a, cfg) for a in args])
                        t_reset = bench_graph([lambda a=a: a[5].copy_(a[6]) for a in args])
                        t = t - (t_reset or 0.0) if t else None
                        hd = D // H
                        heads_read = kh * (1 if shared else B)
                        nbytes = 2 * (4 * heads_read * hd * D + 2 * B * kh * (ctx + 1) * hd
                                      + B * kh * gap * D)
                        rows.append({"shape": name, "B": B, "ctx": ctx, "density": d, "heads": kh, "gap": gap,
                                     "policy": "shared" if shared else "per_seq", "qkv_kernel": kernel, "graph_ms": t,
                                     "reset_ms": t_reset, "dense_graph_ms": t_dense,
                                     "graph_speedup": t_dense / t if t and t_dense else None,
                                     "bytes": nbytes, "GBps": nbytes / t / 1e6 if t else None})
                        del args
            print(f"  deferred {name} B={B} done")
    torch.cuda.empty_cache()
    return rows


def bench_deferred_parts(quick):
    """The deferred call's pieces alone (graph, per call): Q/K/V (partial + finish), attention
    (+ commit, + combine), output projection (+ reduction); OPT-30B/66B, B=1, head density 0.3."""
    rows = []
    for name, (D, F, H) in SHAPES.items():
        hd, kh = D // H, round(0.3 * H)
        for ctx in (128, 1024):
            for gap in (0, 3):
                if late("deferred_parts"):
                    return rows
                args = _deferred_args(D, H, 1, ctx, kh, False, gap)
                qs = [torch.empty(1, kh * hd, device=DEV) for _ in args]
                outs = [torch.empty(1, D, device=DEV, dtype=torch.float16) for _ in args]

                def qkv(a, q):
                    x, wl, kc, vc, hist, vl, vl0, pos_t, hidx = a
                    vl.copy_(vl0)
                    QP.launch_qkv(x, hist, wl[0], wl[1], wl[2], wl[3], hidx, kc, vc, vl, pos_t, 1, q, None)

                def attn(a, q):
                    x, wl, kc, vc, hist, vl, vl0, pos_t, hidx = a
                    return SA.attend_heads(q, hidx, kc, vc, pos_t, 1, None, commit=(vl, x, hist))

                def proj(a, o, out):
                    return SA.project_out(o, a[1][4], a[1][5], a[8], a[0], out)

                # the same Q/K/V weight rows (one [wq; wkv] copy per argument set) streamed by fc1's GEMV
                # kernel (rows of hd per head and segment): what a plain stream of these bytes takes
                wqkv = [(torch.cat([a[1][0], a[1][2]]), torch.cat([a[1][1], a[1][3]])) for a in args]
                sel = [torch.cat([a[8].reshape(1, -1) + s * H for s in range(3)], dim=1).to(torch.int32).contiguous()
                       for a in args]
                g_out = torch.empty(1, 3 * kh * hd, device=DEV, dtype=torch.float16)
                t_gemv = bench_graph([lambda a=a, w=w, i=i: FC1.gather_gemv(a[0], w[0], w[1], i, g_out, relu=False,
                                                                            group=hd)
                                      for a, w, i in zip(args, wqkv, sel)])
                del wqkv
                reset = bench_graph([lambda a=a: a[5].copy_(a[6]) for a in args]) or 0.0
                t_qkv = bench_graph([lambda a=a, q=q: qkv(a, q) for a, q in zip(args, qs)])
                t_attn = bench_graph([lambda a=a, q=q: attn(a, q) for a, q in zip(args, qs)])
                t_proj = bench_graph([lambda a=a, q=q, o=o: proj(a, q, o) for a, q, o in zip(args, qs, outs)])
                t_all = bench_graph([_deferred_call(a) for a in args])
                rows.append({"shape": name, "ctx": ctx, "gap": gap, "heads": kh,
                             "qkv_ms": t_qkv - reset if t_qkv else None, "qkv_gemv_ms": t_gemv,
                             "attn_ms": t_attn, "proj_ms": t_proj,
                             "all_ms": t_all - reset if t_all else None,
                             "qkv_bytes": 2 * 3 * kh * hd * D, "proj_bytes": 2 * kh * hd * D})
                del args, qs, outs
    return rows


def bench_layer_norm():
    """torch LayerNorm vs the plugin's at decode shapes (graph, per call)."""
    rows = []
    ln = getattr(P, "layer_norm", None)
    for D in (7168, 9216):
        w, b = randn(D), randn(D)
        for B in (1, 8, 32):
            xs = [randn(B, D) for _ in range(4)]
            row = {"D": D, "B": B, "torch_graph_ms": bench_graph([lambda x=x: Fn.layer_norm(x, (D,), w, b) for x in xs])}
            if ln is not None:
                row["triton_graph_ms"] = bench_graph([lambda x=x: ln(x, w, b) for x in xs])
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------ predictor

def bench_predictor(mlps, mlp_rows, quick):
    rows = []
    for name, mlp in mlps.items():
        D, F, H = SHAPES[name]
        ah, bh, biash = randn(128, D, scale=0.02), randn(H, 128, scale=0.02), randn(H)
        for B in ((1,) if quick else (1, 8)):
            if late("predictor"):
                break
            x = randn(B, D)
            for r in ((512,) if quick else (256, 512)):
                a, b, bias = randn(r, D, scale=0.02), randn(F, r, scale=0.02), randn(F)
                extra = [(randn(r, D, scale=0.02), randn(F, r, scale=0.02), randn(F)) for _ in range(3)]
                wsets = [(a, b, bias)] + extra  # rotated in graph timing: cold L2 like a real step
                for d in (0.1, 0.3):
                    k = int(round(d * F))
                    for shared in ((False,) if B == 1 else (False, True)):
                        for method in ("torch", "triton"):
                            try:
                                t = bench(lambda: P.predictor_topk(x, a, b, bias, k, shared=shared, method=method))
                                t_heads = bench(lambda: P.predictor_topk(x, ah, bh, biash, int(0.3 * H),
                                                                         shared=shared, method=method))
                            except Exception as e:  # noqa: BLE001
                                print(f"  predictor {method} failed: {type(e).__name__}: {str(e)[:200]}")
                                continue
                            t_scores = bench(lambda: P.predictor_scores(x, a, b, bias))
                            t_graph = bench_graph([lambda w=w: P.predictor_topk(x, *w, k, shared=shared, method=method)
                                                   for w in wsets * 2])
                            t_sgraph = bench_graph([lambda w=w: P.predictor_scores(x, *w) for w in wsets * 2])
                            pol = "shared" if shared else "per_seq"
                            mlp_ms = next((m.get("graph_ms") for m in mlp_rows if m["shape"] == name and m["B"] == B
                                           and m["density"] == d and m["policy"] == pol), None)
                            rows.append({"shape": name, "B": B, "rank": r, "density": d, "k": k, "policy": pol,
                                         "method": method, "ms": t, "scores_ms": t_scores, "heads_ms": t_heads,
                                         "graph_ms": t_graph, "scores_graph_ms": t_sgraph,
                                         "bytes_frac_dense": r * (D + F) / (2 * D * F),
                                         "sparse_mlp_ms": mlp_ms,
                                         "frac_of_sparse_mlp": (t_graph / mlp_ms) if (mlp_ms and t_graph) else None})
    return rows


PRED_SWEEP = {"a": [dict(BLOCK_R=r, BLOCK_D=d, num_warps=w) for r in (1, 2, 4) for d in (512, 1024, 2048)
                      for w in (4, 8) if r * d <= 4096],
              "b": [dict(BLOCK_R=r, BLOCK_D=d, num_warps=w) for r in (2, 4, 8, 16) for d in (256, 512)
                    for w in (4, 8) if r * d <= 8192]
              # added in 2026-12-03, not run yet: larger tiles and deeper pipelines for the 512 -> N
              # product (best so far 11.8 us at OPT-30B against cuBLAS 10.7 and ~7 at copy bandwidth)
              + [dict(BLOCK_R=r, BLOCK_D=d, num_warps=w, num_stages=st) for r, d in ((16, 256), (32, 256), (16, 512),
                                                                                    (32, 512), (64, 256))
                 for w in (4, 8) for st in (3, 4)]}


def bench_pred_gemv(bw, quick):
    """Batch 1, fp16: the two products of a layer's predictors, cuBLAS (F.linear) against
    predictor_scores_triton's gather_gemv route. Each Triton block config of "a" (h = x @ a.T,
    r rows of D) and "b" (scores = h @ b.T + bias, N rows of r) is timed alone (graph, weights
    rotated over 4 copies: cold L2) on the MLP predictor (rank 512); then one layer's whole
    prediction (MLP and head predictors, both top-ks) with cuBLAS vs the best configs.
    Returns {"rows": [...], "best": {"a": cfg, "b": cfg}} (e2e.py --tuned reads "best")."""
    rows, totals = [], {"a": {}, "b": {}}
    copies = 4
    for name, (D, F, H) in SHAPES.items():
        if late("pred_gemv"):
            break
        r = 512
        x = randn(1, D)
        ws = [(randn(r, D, scale=0.02), randn(F, r, scale=0.02), randn(F)) for _ in range(copies)]
        heads = [(randn(H, D, scale=0.02), randn(H, H, scale=0.2), randn(H)) for _ in range(copies)]
        hs = [randn(1, r) for _ in range(copies)]
        zero_r, ident = torch.zeros(r, device=DEV, dtype=torch.float16), torch.arange(max(r, F), device=DEV,
                                                                                     dtype=torch.int32)
        want = Fn.linear(Fn.linear(x, ws[0][0]), ws[0][1], ws[0][2]).float()
        for part, nbytes in (("a", r * D * 2), ("b", F * r * 2 + F * 2)):
            if part == "a":
                fns_t = [lambda w=w: Fn.linear(x, w[0]) for w in ws]
            else:
                fns_t = [lambda w=w, h=h: Fn.linear(h, w[1], w[2]) for w, h in zip(ws, hs)]
            t = bench_graph(fns_t * 2)
            rows.append({"shape": name, "part": part, "method": "cublas", "graph_ms": t, "bytes": nbytes,
                         "bw_frac": nbytes / (t * 1e6) / bw["copy_GBps"] if t else None})
            for cfg in (PRED_SWEEP[part][:4] if quick else PRED_SWEEP[part]):
                if late("pred_gemv"):
                    break
                outs = [torch.empty(1, r if part == "a" else F, device=DEV, dtype=torch.float16) for _ in ws]
                if part == "a":
                    fns = [lambda w=w, o=o: FC1.gather_gemv(x, w[0], zero_r, ident[:r], o, relu=False, config=cfg,
                                                           kind="pred") for w, o in zip(ws, outs)]
                else:
                    fns = [lambda w=w, h=h, o=o: FC1.gather_gemv(h, w[1], w[2], ident[:F], o, relu=False, config=cfg,
                                                                kind="pred") for w, h, o in zip(ws, hs, outs)]
                try:
                    fns[0]()
                    ref = Fn.linear(x, ws[0][0]) if part == "a" else Fn.linear(hs[0], ws[0][1], ws[0][2])
                    err = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
                    tc = bench_graph(fns * 2) if err < 1e-2 else None
                except Exception as e:  # noqa: BLE001
                    print(f"  pred_gemv {part} {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                    err, tc = None, None
                rows.append({"shape": name, "part": part, "method": "triton", "config": cfg, "graph_ms": tc,
                             "rel_err": err, "bytes": nbytes, "vs_cublas": (t / tc) if t and tc else None,
                             "bw_frac": nbytes / (tc * 1e6) / bw["copy_GBps"] if tc else None})
                key = json.dumps(cfg, sort_keys=True)
                totals[part][key] = totals[part].get(key, 0.0) + (tc if tc else float("inf"))
                print(f"  pred_gemv {name} {part} {cfg}: {tc * 1e3 if tc else float('nan'):.1f} us "
                      f"(cuBLAS {t * 1e3 if t else float('nan'):.1f})", flush=True)
        best = {part: json.loads(min(tt, key=tt.get)) for part, tt in totals.items() if tt}
        # one layer's prediction, both predictors and both top-ks, at density 0.3
        km, kh = int(0.3 * F), max(1, int(0.3 * H))
        for scoring in ("torch", "triton"):
            old = Run.settings
            Run.settings = dataclasses.replace(old, scoring=dataclasses.replace(
                old.scoring, **{k: dataclasses.replace(getattr(old.scoring, k), **v) for k, v in best.items()}))
            try:
                fns = [lambda w=w, hw=hw: (P.predictor_topk(x, *w, km, scoring=scoring),
                                           P.predictor_topk(x, *hw, kh, scoring=scoring)) for w, hw in zip(ws, heads)]
                got = P.predictor_topk(x, *ws[0], km, scoring=scoring).long()
                picked = Fn.linear(Fn.linear(x, ws[0][0]), ws[0][1], ws[0][2]).float().gather(-1, got)
                margin = (picked.min() - want.topk(km).values[0, -1]).item()
                tl_ = bench_graph(fns * 2)
            finally:
                Run.settings = old
            nbytes = (r * (D + F) + F + H * (D + H) + H) * 2
            rows.append({"shape": name, "part": "layer", "method": scoring, "config": best if scoring == "triton"
                         else None, "graph_ms": tl_, "bytes": nbytes, "topk_margin": margin,
                         "bw_frac": nbytes / (tl_ * 1e6) / bw["copy_GBps"] if tl_ else None})
            print(f"  pred_gemv {name} layer ({scoring}): {tl_ * 1e3 if tl_ else float('nan'):.1f} us", flush=True)
        del ws, heads
        torch.cuda.empty_cache()
    best = {part: json.loads(min(tt, key=tt.get)) for part, tt in totals.items() if tt}
    return {"rows": rows, "best": best}


TOPK_SWEEP = [dict(block=b, warps=w) for b in (1024, 2048) for w in (4, 8)]


def bench_topk(quick):
    """Top-k alone on predictor-score rows [B, N] fp16, k = 30%: torch.topk against
    topk_triton configs. Each config is checked (a valid top-k set) before timing."""
    rows = []
    for N, B in ((28672, 1), (36864, 1), (56, 1), (28672, 8), (28672, 32)):
        k = int(0.3 * N)
        ss = [randn(B, N) for _ in range(4)]
        want = [s.float().topk(k, -1).values[:, -1:] for s in ss]
        t_torch = bench_graph([lambda s=s: torch.topk(s, k, -1, sorted=False) for s in ss])
        rows.append({"N": N, "B": B, "k": k, "method": "torch", "graph_ms": t_torch, "ok": True})
        print(f"  topk N={N} B={B} torch {t_torch * 1e3:.1f} us", flush=True)
        for cfg in (TOPK_SWEEP[:2] if quick else TOPK_SWEEP):
            if late("topk"):
                return rows
            try:
                ok = True
                for s, kth in zip(ss, want):
                    idx = PR.topk_triton(s, k, config=cfg).long()
                    picked = s.float().gather(-1, idx)
                    ok &= bool((picked >= kth).all()) and all(r.unique().numel() == k for r in idx)
                torch.cuda.synchronize()
                t = bench_graph([lambda s=s: PR.topk_triton(s, k, config=cfg) for s in ss]) if ok else None
            except Exception as e:  # noqa: BLE001
                print(f"  topk {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                ok, t = False, None
            rows.append({"N": N, "B": B, "k": k, "method": "triton", "config": cfg, "graph_ms": t, "ok": ok,
                         "vs_torch": (t_torch / t) if t and t_torch else None})
            print(f"  topk N={N} B={B} {cfg}: ok={ok} {t * 1e3 if t else float('nan'):.1f} us", flush=True)
    return rows


# ------------------------------------------------------------------------------ report

def table(rows, cols):
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-paths", default=None,
                    help="--sweep only these MLP paths (comma list of gemv, dot, dot1, proj1)")
    ap.add_argument("--sweep-attn", action="store_true",
                    help="sweep the deferred Q/K/V and attention kernel configs first (keeps the best)")
    ap.add_argument("--qkv-sweep", default="wide", choices=["wide", "finish"],
                    help="--sweep-attn: every Q/K/V and attention config, or only the batch-1 finish blocks")
    ap.add_argument("--sections", default="mlp,predictor,pred_gemv,attn,deferred,deferred_parts,layer_norm,topk",
                    help="benchmark sections to run, in this order")
    ap.add_argument("--no-bench", action="store_true", help="only --sweep")
    ap.add_argument("--no-pdl", action="store_true",
                    help="plain launches (default: programmatic dependent launch as the kernel settings say)")
    ap.add_argument("--mlp-variants", default=None,
                    help="comma list of MLP_VARIANTS names: the batch-1 pair under each (section mlp_variants)")
    ap.add_argument("--parts", default=None,
                    help="section mlp_parts: only the cases whose names start with one of these (comma list)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the remaining sections once this many seconds have passed")
    args = ap.parse_args(argv)
    out = args.out or (os.path.join(os.environ["OUT"], "kernels.json") if os.environ.get("OUT") else "kernels.json")
    if DEV == "cuda" and not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from dejavu.fileio import write_json  # importable: _import_plugins() ran at import

    if args.no_pdl:
        Run.settings = with_settings(pdl=dict(ENABLED=False))
    t0 = time.time()
    if args.budget_s is not None:
        DEADLINE[0] = t0 + args.budget_s
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__,
           "triton": triton.__version__, "quick": args.quick, "pdl": dataclasses.asdict(Run.settings.pdl)}
    Path(out).parent.mkdir(parents=True, exist_ok=True)

    def save(section):  # partial results survive a timeout
        res["wall_s"] = time.time() - t0
        write_json(out, res, indent=1, default=str)
        print(f"[{res['wall_s']:.0f}s] {section} done", flush=True)

    def in_budget(section):
        if args.budget_s is not None and time.time() - t0 > args.budget_s:
            print(f"skipping {section}: over --budget-s")
            res.setdefault("skipped", []).append(section)
            return False
        return True

    if not args.no_bench or args.sweep:
        res["bandwidth"] = bw = measure_bandwidth()
        print(f"copy {bw['copy_GBps']:.0f} GB/s, read {bw['read_GBps']:.0f} GB/s")
        mlps = {name: MLP(D, F) for name, (D, F, H) in SHAPES.items()}
        sections = args.sections.split(",")
        if args.sweep and in_budget("sweep"):
            res["sweep"] = sweep(mlps, args.quick, args.sweep_paths.split(",") if args.sweep_paths else None)
            save("sweep")
        if args.sweep_attn and in_budget("sweep_attn"):
            res["sweep_attn"] = sweep_attn(args.quick, args.qkv_sweep)
            save("sweep_attn")
        res["kernel_settings"] = Run.settings.to_dict()
        if not args.no_bench:
            if args.mlp_variants and in_budget("mlp_variants"):
                names = args.mlp_variants.split(",")
                bad = [v for v in names if v not in MLP_VARIANTS]
                if bad:
                    raise SystemExit(f"--mlp-variants: unknown {bad} (known: {', '.join(MLP_VARIANTS)})")
                res["mlp_variants"] = bench_mlp_variants(mlps, bw, names)
                save("mlp_variants")
            if "mlp" in sections and in_budget("mlp"):
                res["mlp"] = bench_mlp(mlps, bw, args.quick)
                save("mlp")
            if "mlp_parts" in sections and in_budget("mlp_parts"):  # after mlp: a warm GPU
                res["mlp_parts"] = bench_mlp_parts(mlps, bw, args.parts.split(",") if args.parts else None)
                save("mlp_parts")
            if "predictor" in sections and in_budget("predictor"):
                res["predictor"] = bench_predictor(mlps, res.get("mlp", []), args.quick)
                save("predictor")
            if "pred_gemv" in sections and in_budget("pred_gemv"):
                res["pred_gemv"] = bench_pred_gemv(bw, args.quick)
                save("pred_gemv")
            del mlps
            torch.cuda.empty_cache()
            for sec, fn in (("attn", bench_attn), ("deferred", bench_deferred), ("deferred_parts", bench_deferred_parts),
                            ("layer_norm", lambda q: bench_layer_norm()), ("topk", bench_topk)):
                if sec in sections and in_budget(sec):
                    res[sec] = fn(args.quick)
                    save(sec)
    save("all")
    if "mlp" in res:
        b1 = [r for r in res["mlp"] if r["B"] == 1]
        print("\n## Sparse MLP, batch 1 (fp16)\n")
        print(table(b1, ["shape", "density", "policy", "graph_ms", "fc1_graph_ms", "fc2_graph_ms",
                         "dense_graph_ms", "graph_speedup", "graph_bw_frac", "speedup"]))
        print("\n## Sparse MLP, batches (speedup vs dense cuBLAS)\n")
        bt = [r for r in res["mlp"] if r["B"] > 1 and r["density"] in (0.1, 0.3, 0.5)]
        print(table(bt, ["shape", "B", "density", "policy", "ms", "graph_ms", "dense_graph_ms",
                         "graph_speedup", "graph_bw_frac"]))
    if "mlp_variants" in res:
        print("\n## Sparse MLP variants, batch 1 (graph, per call)\n")
        print(table(res["mlp_variants"], ["shape", "density", "variant", "graph_ms", "graph_bw_frac"]))
    if "mlp_parts" in res:
        print("\n## Sparse MLP at batch 1, piece by piece (graph, per call)\n")
        print(table(res["mlp_parts"], ["shape", "density", "K", "case", "split", "graph_ms", "bw_frac"]))
    if "predictor" in res:
        print("\n## Predictor + top-k\n")
        print(table(res["predictor"], ["shape", "B", "rank", "density", "policy", "method", "ms", "graph_ms",
                                       "scores_graph_ms", "sparse_mlp_ms", "frac_of_sparse_mlp"]))
    if "pred_gemv" in res:
        print("\n## Predictor products, batch 1 (graph, per call, fp16): cuBLAS vs Triton gather_gemv\n")
        print(table(res["pred_gemv"]["rows"], ["shape", "part", "method", "config", "graph_ms", "bw_frac",
                                               "vs_cublas"]))
        print(f"\nbest: {res['pred_gemv']['best']}")
    if "attn" in res:
        print("\n## Sparse attention decode\n")
        print(table(res["attn"], ["shape", "B", "ctx", "density", "policy", "ms", "graph_ms",
                                  "dense_ms", "dense_graph_ms", "speedup", "graph_speedup"]))
    if "deferred" in res:
        print("\n## Sparse attention decode, deferred K/V (graph, per layer)\n")
        print(table(res["deferred"], ["shape", "B", "ctx", "density", "heads", "gap", "policy", "qkv_kernel", "graph_ms",
                                      "dense_graph_ms", "graph_speedup", "GBps"]))
    if "deferred_parts" in res:
        print("\n## Deferred attention pieces (graph, per call, B=1, head density 0.3)\n")
        print(table(res["deferred_parts"], ["shape", "ctx", "gap", "heads", "qkv_ms", "qkv_gemv_ms", "attn_ms", "proj_ms",
                                            "all_ms"]))
    if "topk" in res:
        print("\n## Top-k alone (graph, per call, fp16 scores, k = 30%)\n")
        print(table(res["topk"], ["N", "B", "method", "config", "ok", "graph_ms", "vs_torch"]))
    if "layer_norm" in res:
        print("\n## LayerNorm (graph, per call)\n")
        print(table(res["layer_norm"], ["D", "B", "torch_graph_ms", "triton_graph_ms"]))
    print(f"\nwrote {out} ({res['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

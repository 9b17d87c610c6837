"""Warm the L2 cache with gathered weight rows before the kernel that needs them (Triton).

    prefetch_rows(w[R,D], idx[...], group, *, max_bytes=None, out=None) -> sums[programs] fp32

Reads the rows `idx[i] * group + g` (g < group) of w, in idx's flattened order, up to
`max_bytes` (whole rows), and returns one fp32 sum per program of what it read (the sums
keep the loads from being optimised away and let tests check which bytes were read).

Why: a decode step alternates bandwidth-bound kernels (Q/K/V, fc1, fc2) with latency-bound
ones (the Q/K/V finish, attention, split-K reductions, LayerNorms: ~35 us per OPT-30B
layer on the H200) during which the HBM is mostly idle. Launched on a side stream at the
start of such a window, this kernel pulls the next bandwidth-bound kernel's rows (e.g. the
output projection's rows of the selected heads, known before attention) into L2, where
that kernel then finds them. The loads carry `eviction_policy="evict_last"` by default
(`PREFETCH_CONFIG["EVICT"]`; on sm_90 an L2 evict_last cache-policy hint), so the side
stream's other traffic does not push them out first. The decoder's switch is
`SparseDecoder.l2_prefetch` (off). Measured on the H200 (BENCHMARKS.md, 2026-12-02): alone,
a warmed 30 MB output projection saves 3.4-3.8 of its 14.6 us, but this kernel reads at
only ~1.9 TB/s and, next to the side-stream predictors, costs more than it saves; the
decode step got slower in every variant (8.1-8.8 vs 7.7 ms/token).

Limits: w 2-D contiguous rows (stride D), any float dtype; idx int32/int64, trusted (rows
out of range read out of bounds; validate=True checks). No host sync; graph-capturable.
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, INDEX_DTYPES, check_tensor, default_validate, jit)

tl = None  # triton.language, bound on first launch (see _common.jit)

# BLOCK_R rows x BLOCK_D columns per load (fc1's gather-GEMV shape: ~3.7 TB/s on the H200).
PREFETCH_CONFIG = {"BLOCK_R": 4, "BLOCK_D": 1024, "num_warps": 4, "EVICT": "evict_last"}


def _prefetch_rows_kernel(w_ptr, idx_ptr, out_ptr, n_rows, D, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    # grid (cdiv(n_rows, BLOCK_R),): rows i of the gathered list are w[idx[i // GROUP] * GROUP + i % GROUP]
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    ent = tl.load(idx_ptr + r // GROUP, mask=rmask, other=0).to(tl.int64)
    rows = w_ptr + (ent * GROUP + r % GROUP)[:, None] * D
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        w = tl.load(rows + offs[None, :], mask=rmask[:, None] & (offs < D)[None, :], other=0.0,
                    eviction_policy=EVICT)
        acc += w.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def prefetch_plan(n_idx: int, group: int, D: int, esize: int, max_bytes=None, config=None):
    """(rows to read, programs) for n_idx entries of `group` rows of D elements."""
    cfg = {**PREFETCH_CONFIG, **(config or {})}
    n_rows = n_idx * group
    if max_bytes is not None:
        n_rows = min(n_rows, int(max_bytes) // max(1, D * esize))
    return n_rows, -(-n_rows // cfg["BLOCK_R"])


def prefetch_rows(w, idx, group: int = 1, *, max_bytes=None, out=None, validate=None, config=None):
    """Read rows idx * group + [0, group) of w[R, D] (at most max_bytes) through L2; the
    per-program fp32 sums of what was read. `out`: a preallocated fp32 buffer with at least
    as many elements as programs (a CUDA graph then allocates nothing)."""
    check_tensor("w", w, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("idx", idx, dtypes=INDEX_DTYPES, device=w.device)
    if group < 1 or w.shape[0] % group:
        raise DejavuError(f"prefetch_rows: group {group} must divide the {w.shape[0]} rows of w")
    cfg = {**PREFETCH_CONFIG, **(config or {})}
    R, D = w.shape
    if default_validate(validate, w.device) and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= R // group:
            raise DejavuError(f"idx: out of range [0, {R // group}) (min {lo}, max {hi})")
    n_rows, progs = prefetch_plan(idx.numel(), group, D, w.element_size(), max_bytes, cfg)
    if out is None:
        out = torch.empty(max(progs, 1), dtype=torch.float32, device=w.device)
    elif out.dtype != torch.float32 or out.device != w.device or out.numel() < progs:
        raise DejavuError(f"out: need fp32 on {w.device} with >= {progs} elements")
    if progs == 0:
        return out[:0]
    kernel = jit(_prefetch_rows_kernel, w.device)
    kernel[(progs,)](w, idx.reshape(-1), out, n_rows, D, GROUP=group, BLOCK_R=cfg["BLOCK_R"],
                     BLOCK_D=cfg["BLOCK_D"], EVICT=cfg["EVICT"], num_warps=cfg["num_warps"])
    return out[:progs]


def prefetch_rows_ref(w, idx, group: int = 1, *, max_bytes=None, config=None):
    """The same per-program sums in float64 (what the kernel read, summed per program)."""
    cfg = {**PREFETCH_CONFIG, **(config or {})}
    D = w.shape[1]
    n_rows, progs = prefetch_plan(idx.numel(), group, D, w.element_size(), max_bytes, cfg)
    i = torch.arange(n_rows, device=w.device)
    rows = idx.reshape(-1).long()[i // group] * group + i % group
    per_row = w[rows].double().sum(1)
    return torch.zeros(progs, dtype=torch.float64, device=w.device).index_add_(0, i // cfg["BLOCK_R"], per_row)

"""Low-rank predictor + top-k: which neurons / heads to compute for the next token.

    predictor_topk(x[B,D], a[r,D], b[N,r], bias[N], k, *, shared=False) -> idx[B,k] | [k] int32

scores = (x @ a.T) @ b.T + bias (ARCHITECTURE.md, "Predictor"), then top-k per row
(`shared=False`, per-sequence sets) or top-k of the batch's max score per column
(`shared=True`, one set for the batch: the union policy of the MLP kernels' fast batch
path). Scoring is two cuBLAS GEMVs (torch.nn.functional.linear; fp32 accumulation, scores
in the input dtype, as the reference). Top-k (`method`): "torch" = torch.topk(sorted=False);
"triton" = `_topk_kernel`, an exact radix select in one program per row (4 passes of 8-bit
digit histograms over the order-preserving integer keys of the fp32 scores, then a prefix-sum
compaction; N <= 65536). Neither returns sorted indices (the kernels do not need order).
Everything stays on the device: no host sync, CUDA-graph capturable. Ties at the k-th
score: torch breaks them its own way, the Triton kernel takes the lowest indices.
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import FLOAT_DTYPES, check_tensor, jit, next_pow2

tl = None  # triton.language, bound on first launch (see _common.jit)

TOPK_METHOD = "torch"  # default top-k implementation (benchmarks/kernels.py compares both)


def _topk_kernel(s_ptr, out_ptr, N, K, stride_s, stride_o, BLOCK_N: tl.constexpr):
    # out[row, :K] = indices of the K largest s[row, :N] (unordered); grid (rows,).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    s = tl.load(s_ptr + row * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    # order-preserving key in [0, 2^32): flip negatives, set the sign bit of positives
    u = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    key = tl.where(u >= 0x80000000, 0xFFFFFFFF - u, u + 0x80000000)
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.int64)
    remaining = tl.full([], 0, tl.int32) + K
    for p in tl.static_range(4):
        # digit p covers bits [24 - 8p, 32 - 8p) of the key
        if p == 0:
            cand = mask
        else:
            cand = mask & ((key >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
        digit = ((key >> (24 - 8 * p)) & 0xFF).to(tl.int32)
        hist = tl.histogram(digit, 256, mask=cand)
        at_or_above = tl.cumsum(hist, 0, reverse=True)  # candidates with digit >= bin
        d = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)
        remaining -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.int64) << (24 - 8 * p))
    # prefix is the k-th largest key; take all keys above it and `remaining` ties (lowest first)
    gt = mask & (key > prefix)
    eq = mask & (key == prefix)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= remaining))
    dst = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out_ptr + row * stride_o + dst, offs, mask=sel)


def topk_triton(scores, k):
    """Indices of the k largest entries of each row of scores[R,N] (N <= 65536): [R,k] int32."""
    R, N = scores.shape
    out = torch.empty((R, k), dtype=torch.int32, device=scores.device)
    if k == 0 or R == 0:
        return out
    if N > 65536:
        raise DejavuError(f"topk_triton: N={N} > 65536")
    block = max(256, next_pow2(N))
    kernel = jit(_topk_kernel, scores.device)
    kernel[(R,)](scores, out, N, k, scores.stride(0), out.stride(0), BLOCK_N=block,
                 num_warps=32 if block >= 32768 else 16)
    return out


def _check(x, a, b, bias, k):
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    D = x.shape[1]
    check_tensor("a", a, ndim=2, dtype=x.dtype, device=x.device)
    r = a.shape[0]
    if a.shape[1] != D:
        raise DejavuError(f"a: shape {tuple(a.shape)} does not match x's D={D}")
    check_tensor("b", b, ndim=2, dtype=x.dtype, device=x.device)
    n = b.shape[0]
    if b.shape[1] != r:
        raise DejavuError(f"b: shape {tuple(b.shape)} does not match rank {r}")
    check_tensor("bias", bias, shape=(n,), dtype=x.dtype, device=x.device)
    if not isinstance(k, int) or not 0 <= k <= n:
        raise DejavuError(f"k: expected an int in [0, {n}], got {k!r}")


def predictor_scores(x, a, b, bias):
    """scores[B,N] = (x @ a.T) @ b.T + bias."""
    return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b, bias)


def predictor_topk(x, a, b, bias, k, *, shared=False, method=None):
    """Indices of the k highest predictor scores: idx[B,k] int32 ([k] when shared)."""
    _check(x, a, b, bias, k)
    method = method or TOPK_METHOD
    scores = predictor_scores(x, a, b, bias)
    if shared:
        scores = scores.amax(dim=0, keepdim=True)
    if method == "triton":
        idx = topk_triton(scores.contiguous(), k)
    elif method == "torch":
        idx = torch.topk(scores, k, dim=-1, sorted=False).indices.to(torch.int32)
    else:
        raise DejavuError(f"predictor_topk: unknown method {method!r} (torch, triton)")
    return idx[0] if shared else idx


def predictor_topk_shared(x, a, b, bias, k):
    """One index set for the whole batch: top-k of the max score over the batch; idx[k]."""
    return predictor_topk(x, a, b, bias, k, shared=True)


def predictor_topk_ref(x, a, b, bias, k, *, shared=False):
    """Reference: the same in the caller's dtype (upcast for float64); sorted by score."""
    scores = (x @ a.T) @ b.T + bias
    if shared:
        scores = scores.amax(dim=0)
    return torch.topk(scores, k, dim=-1, sorted=True).indices.to(torch.int32)

"""Low-rank predictor + top-k: which neurons / heads to compute for the next token.

    predictor_topk(x[B,D], a[r,D], b[N,r], bias[N], k, *, shared=False) -> idx[B,k] | [k] int32

scores = (x @ a.T) @ b.T + bias (ARCHITECTURE.md, "Predictor"), then top-k per row
(`shared=False`, per-sequence sets) or top-k of the batch's max score per column
(`shared=True`, one set for the batch: the union policy of the MLP kernels' fast batch
path). Scoring is two cuBLAS GEMVs (torch.nn.functional.linear; fp32 accumulation, scores
in the input dtype, as the reference); top-k is torch.topk with sorted=False (the kernels do
not need order). Everything stays on the device: no host sync, CUDA-graph capturable.
Ties are broken however torch.topk breaks them (not specified); the kernels do not care.
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import FLOAT_DTYPES, check_tensor


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


def predictor_topk(x, a, b, bias, k, *, shared=False):
    """Indices of the k highest predictor scores: idx[B,k] int32 ([k] when shared)."""
    _check(x, a, b, bias, k)
    scores = predictor_scores(x, a, b, bias)
    if shared:
        scores = scores.amax(dim=0)
    return torch.topk(scores, k, dim=-1, sorted=False).indices.to(torch.int32)


def predictor_topk_shared(x, a, b, bias, k):
    """One index set for the whole batch: top-k of the max score over the batch; idx[k]."""
    return predictor_topk(x, a, b, bias, k, shared=True)


def predictor_topk_ref(x, a, b, bias, k, *, shared=False):
    """Reference: the same in the caller's dtype (upcast for float64); sorted by score."""
    scores = (x @ a.T) @ b.T + bias
    if shared:
        scores = scores.amax(dim=0)
    return torch.topk(scores, k, dim=-1, sorted=True).indices.to(torch.int32)

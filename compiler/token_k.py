"""A per-token MLP K from the predicted mass, capped (docs/predictors.md, "Per-token K").

The MLP predictors are trained with a listwise loss, so softmax(scores) over a layer's F
neurons is each token's predicted share of the neurons' contribution. A token keeps the
smallest k whose predicted top-k share reaches tau_l, in [1, k_max_l]: tokens whose
contribution is spread keep more rows, concentrated ones fewer. k_max is static (the shapes of
a CUDA graph); tau_l is fitted so the mean k over held-out tokens equals the layer's budget K_l.

This is the reference of the selection (masked dense: `masking.masked_sparsity(token_k=)`).
The engine path does not carry it yet: its predictor top-k would return the top-k_max rows in
score order plus a count per token, and the sparse fc1 / fc2 kernels would skip the rows at
positions >= count (their bytes are not read).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenK:
    """Per layer [L]: k_max (the static cap), tau (the predicted-mass threshold) and k_mean (the
    budget K the threshold was fitted to)."""

    k_max: tuple[int, ...]
    tau: tuple[float, ...]
    k_mean: tuple[int, ...]


def token_counts(scores: torch.Tensor, tau: float, k_max: int) -> torch.Tensor:
    """k per token [...] for MLP scores [..., F]: the smallest k whose share of softmax(scores)
    in the top-k reaches tau, clamped to [1, k_max]."""
    p = torch.softmax(scores.float(), -1).sort(-1, descending=True).values  # [..., F]
    return ((p.cumsum(-1) < tau).sum(-1) + 1).clamp(1, k_max)


def token_mask(scores: torch.Tensor, tau: float, k_max: int) -> torch.Tensor:
    """0/1 mask [..., F] (scores' dtype): each token's top-k rows by score, k = token_counts."""
    k = token_counts(scores, tau, k_max)  # [...]
    idx = scores.topk(k_max, dim=-1).indices  # [..., k_max], best first
    keep = (torch.arange(k_max, device=scores.device) < k[..., None]).to(scores.dtype)
    return torch.zeros_like(scores).scatter_(-1, idx, keep)


def fit_tau(scores: torch.Tensor, k_mean: int, k_max: int, steps: int = 40) -> float:
    """The largest tau whose mean count over the tokens of scores [T, F] is <= k_mean (the
    count grows with tau; bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if token_counts(scores, mid, k_max).float().mean().item() <= k_mean else (lo, mid)
    return lo


def fit_token_k(scores_of, mlp_k: list[int], cap: float = 2.0, n: int | None = None) -> TokenK:
    """TokenK for per-layer budgets mlp_k [L]: k_max = min(F, cap * K_l), tau fitted on the
    held-out scores `scores_of(l)` -> [T, F] of each layer (n: F; default from the scores)."""
    k_max, taus = [], []
    for l, k in enumerate(mlp_k):
        s = scores_of(l)
        f = n or s.shape[-1]
        k_max.append(min(f, max(k, int(cap * k))))
        taus.append(fit_tau(s, k, k_max[-1]) if k < f else 1.0)
    return TokenK(tuple(k_max), tuple(taus), tuple(int(k) for k in mlp_k))

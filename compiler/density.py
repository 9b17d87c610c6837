"""Density (a fraction at the interface) → per-layer K, resolved once at build time.

Uniform by default: K = round(density * N) in every layer. With measured recall curves
(`Predictors.recall_curves`: per layer, the fraction of true activity captured by the
predicted top-k for k = 1..N) the same total is spread where it buys the most recall:
each layer first gets `min_share` of the uniform K, then the remaining budget goes to the
largest marginal recall gains over all layers (curves made concave, so a layer's picks
form a prefix). The total stays round(density * N * L), each K in [1, N].
"""
from __future__ import annotations

import math

import numpy as np

from dejavu.errors import DejavuError
from dejavu.models.opt import OPTConfig


def check_density(value, name: str = "density") -> float:
    """A density in (0, 1], else DejavuError naming the option."""
    try:
        d = float(value)
    except (TypeError, ValueError):
        raise DejavuError(f"--{name.replace('_', '-')} must be a number in (0, 1], got {value!r}") from None
    if not (0.0 < d <= 1.0) or math.isnan(d):
        raise DejavuError(f"--{name.replace('_', '-')} must be in (0, 1], got {value!r}")
    return d


def allocate(density: float, n: int, layers: int, curves=None, min_share: float = 0.5) -> list[int]:
    """Per-layer K for one kind (n outputs per layer); see the module docstring."""
    total = min(n * layers, max(layers, round(density * n * layers)))
    if density >= 1.0:
        return [n] * layers
    if curves is None:
        base, extra = divmod(total, layers)
        return [base + (1 if l < extra else 0) for l in range(layers)]
    if len(curves) != layers or any(len(c) != n for c in curves):
        raise DejavuError(f"recall curves must be {layers} arrays of {n} values")
    floor = max(1, min(n, int(min_share * total / layers)))
    gains = []
    for c in curves:
        c = np.asarray(c, dtype=np.float64)
        g = np.diff(np.concatenate([[0.0], c]))[floor:]  # gain of going from k to k+1, k >= floor
        gains.append(np.minimum.accumulate(np.maximum(g, 0.0)))  # non-increasing: picks are prefixes
    flat = np.concatenate(gains)
    owner = np.repeat(np.arange(layers), [len(g) for g in gains])
    pos = np.concatenate([np.arange(len(g)) for g in gains])
    rest = total - floor * layers
    # largest gain first; ties: earlier layer, then lower k (stable and prefix-preserving)
    order = np.lexsort((pos, owner, -flat))[:rest]
    k = np.full(layers, floor) + np.bincount(owner[order], minlength=layers)
    return [int(v) for v in k]


def resolve_density(cfg: OPTConfig, density: float, mlp_density: float | None = None,
                    attn_density: float | None = None, recall_curves: dict | None = None,
                    min_share: float = 0.5) -> tuple[list[int], list[int]]:
    """(mlp_k [L], attn_k [L]) for an overall density; mlp_/attn_density override each kind.

    `recall_curves` is {"mlp": [L arrays of F], "attn": [L arrays of H]} (either optional).
    """
    d = check_density(density)
    dm = check_density(mlp_density, "mlp_density") if mlp_density is not None else d
    da = check_density(attn_density, "attn_density") if attn_density is not None else d
    L = cfg.num_hidden_layers
    curves = recall_curves or {}
    mlp_k = allocate(dm, cfg.ffn_dim, L, curves.get("mlp"), min_share)
    attn_k = allocate(da, cfg.num_attention_heads, L, curves.get("attn"), min_share)
    return mlp_k, attn_k

"""The four sparse operations the decoder calls, with two backends.

- "ref": pure PyTorch (gather the selected rows / heads, then compute). The CPU path and
  the fallback for any kernel that is missing. `dejavu.plugins`' own `*_ref` functions are
  the kernel colleague's references; these are the runtime's, written against the contract
  in docs/ARCHITECTURE.md so the runtime runs before (and independently of) the plugins.
- "triton": `dejavu.plugins` launchers on CUDA tensors (per op, when present and when a
  trial call at activation succeeds; otherwise that op stays on "ref" with a warning).

Index tensors are [B, K] (per sequence) or [K] (one set shared by the batch).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def _rows(idx: torch.Tensor, B: int) -> torch.Tensor:
    """[B, K] int64 index rows from [B, K] or shared [K]."""
    idx = idx.long()
    return idx.expand(B, -1) if idx.dim() == 1 else idx


def predictor_topk_ref(x, a, b, bias, k: int, shared: bool = False) -> torch.Tensor:
    """idx [B, k] (or [k] when shared) = top-k of (x @ a.T) @ b.T + bias; x: [B, D]."""
    s = F.linear(F.linear(x, a), b, bias)  # [B, N]
    if shared:  # one set for the whole batch: top-k of the summed scores
        s = s.float().sum(0)
    return torch.topk(s, k, dim=-1, sorted=False).indices


def sparse_fc1_ref(x, w1, b1, idx) -> torch.Tensor:
    """h [B, K] = relu(w1[idx] @ x + b1[idx]); x: [B, D]."""
    idx = _rows(idx, x.shape[0])
    h = torch.einsum("bkd,bd->bk", w1[idx], x) + b1[idx]
    return torch.relu(h)


def sparse_fc2_ref(h, w2_t, b2, idx, residual=None) -> torch.Tensor:
    """y [B, D] = w2_t[idx].T @ h + b2 (+ residual); h: [B, K]."""
    idx = _rows(idx, h.shape[0])
    y = torch.einsum("bk,bkd->bd", h, w2_t[idx]) + b2
    return y if residual is None else y + residual


def attend(q, k_cache, v_cache, valid) -> torch.Tensor:
    """o [B, h, hd] for one query per sequence; q: [B, h, hd] (scale folded in),
    caches [B, h, T, hd], valid [B, T] bool (keys a query may see)."""
    o = F.scaled_dot_product_attention(q[:, :, None], k_cache, v_cache,
                                       attn_mask=valid[:, None, None, :], scale=1.0)
    return o[:, :, 0]


def sparse_attn_ref(h, wq, bq, wo_t, bo, k_cache, v_cache, valid, idx, residual=None):
    """Selected heads only: y [B, D] = sum over heads j in idx of attn_j(h) @ wo_t[rows of j] + bo.

    h: [B, D] (attention input after LayerNorm); the caches already hold this token's K/V;
    idx: [B, Kh] or [Kh] head ids."""
    B, D = h.shape
    H, hd, _ = k_cache.shape[1], k_cache.shape[3], None
    idx = _rows(idx, B)  # [B, Kh]
    rows = torch.arange(B, device=h.device)[:, None]
    q = torch.einsum("bkjd,bd->bkj", wq.view(H, hd, D)[idx], h) + bq.view(H, hd)[idx]  # [B, Kh, hd]
    o = attend(q, k_cache[rows, idx], v_cache[rows, idx], valid)  # [B, Kh, hd]
    y = torch.einsum("bkj,bkjd->bd", o, wo_t.view(H, hd, D)[idx]) + bo
    return y if residual is None else y + residual


class Ops:
    """The sparse ops of one engine: `backend` "ref" or "triton" (CUDA only)."""

    def __init__(self, backend: str = "ref"):
        self.backend = backend
        self.predictor_topk = predictor_topk_ref
        self.sparse_fc1 = sparse_fc1_ref
        self.sparse_fc2 = sparse_fc2_ref
        self.sparse_attn = sparse_attn_ref
        self.kernels: dict[str, str] = {n: "ref" for n in ("predictor_topk", "sparse_fc1", "sparse_fc2", "sparse_attn")}
        if backend == "triton":
            self._bind_plugins()

    def _bind_plugins(self) -> None:
        try:
            import dejavu.plugins as P
        except Exception as e:  # noqa: BLE001 - any import failure: stay on the reference ops
            warnings.warn(f"dejavu.plugins unavailable ({e}); using PyTorch reference ops on GPU")
            return
        from dejavu.runtime import plugin_adapters as A

        for name in self.kernels:
            fn = A.bind(name, P)
            if fn is not None:
                setattr(self, name, fn)
                self.kernels[name] = "triton"

    def demote(self, name: str, why: str) -> None:
        """Fall back to the reference op for `name` (a kernel failed its trial call)."""
        warnings.warn(f"kernel {name} failed its trial call ({why}); using the PyTorch reference")
        setattr(self, name, globals()[f"{name}_ref"])
        self.kernels[name] = "ref"

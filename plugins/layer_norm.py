"""LayerNorm over decode rows (Triton) + reference.

    layer_norm(x[R,D], weight[D], bias[D], eps=1e-5, *, out=None) -> y[R,D]
              = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, per row

Why a kernel, and the deferred form (`PendingLN`): docs/kernels.md, "LayerNorm". Limits and choices:
- dtypes fp16, bf16, fp32; x, weight, bias and out share dtype and device, all contiguous;
  y has x's dtype. Statistics in fp32: the mean first, then the variance of (x - mean)
  (biased, as PyTorch), not E[x^2] - E[x]^2, which cancels badly when |mean| >> std.
- One program per row, held in registers (padded to a power of two): one read of x. Rows up to
  settings.layer_norm.MAX_BLOCK (16384: every OPT and Llama width); longer ones are a DejavuError.
- num_warps by D from settings.layer_norm.WARPS (the rule of thumb: ~8-16 fp32 elements per
  thread; not swept); `config=` overrides any of its fields, including "num_warps".
- No host sync; launches are CUDA-graph capturable. eps is a launch argument (fp32).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_out, check_tensor, gdc_enter, helper, jit, next_pow2,
                                    pdl_args)
from dejavu.plugins.settings import DEFAULT, table

tl = None  # triton.language, bound on first launch (see _common.jit)

LN_EPS = 1e-5

# ---------------------------------------------------------------------------------------
# kernel

def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, D, eps, BLOCK: tl.constexpr, GDC: tl.constexpr = 0):
    # out[r] = (x[r] - mean) * rstd * w + b; grid (R,), a row in registers (BLOCK >= D). Rows are
    # contiguous (stride D). w and b are loaded before the PDL wait (weights, never written in decode).
    offs = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    gdc_enter(GDC)
    row = tl.program_id(0).to(tl.int64) * D
    mask = offs < D
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
    tl.store(out_ptr + row + offs, (xc * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)


@helper
def _block_stats(y, mask, rmask, st_ptr, pid_d, D, BLOCK_D: tl.constexpr):
    # (mean, M2) of each row of y [R, BLOCK_D] (the rounded values, fp32) over D block pid_d,
    # stored at st_ptr [R] (pointers to the rows' slots): LayerNorm merges the blocks' pairs
    n_b = tl.minimum(D - pid_d * BLOCK_D, BLOCK_D).to(tl.float32)
    mean_b = tl.sum(tl.where(mask, y, 0.0), axis=1) / n_b
    yc = tl.where(mask, y - mean_b[:, None], 0.0)
    tl.store(st_ptr, mean_b, mask=rmask)
    tl.store(st_ptr + 1, tl.sum(yc * yc, axis=1), mask=rmask)


@helper
def store_row(y, out_ptr, offs, mask, st_ptr, pid_d, D, BLOCK_D: tl.constexpr, STATS: tl.constexpr):
    # out[offs] = y rounded to out's dtype (one row's D block pid_d); STATS: also that block's
    # (mean, M2) of the stored values at st_ptr (one pair), for the LayerNorm that follows
    yo = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, yo, mask=mask)
    if STATS:
        one = tl.arange(0, 1)
        _block_stats(yo.to(tl.float32)[None, :], mask[None, :], one < 1, st_ptr + one, pid_d, D, BLOCK_D)


@helper
def ln_merge(st_ptr, N_D, D, eps, BLOCK_D, BLOCK_N: tl.constexpr):
    # (mean, rstd) of one row from its N_D blocks' (mean, M2) at st_ptr [N_D, 2] (blocks of BLOCK_D
    # columns, the last one short), merged in fp32: the parallel form of mean-then-squared-deviations
    # (Chan et al.'s pairwise update, as stable as two passes). Plain loads: an earlier kernel wrote them and thousands of programs
    # read the same few lines (L1 then serves all but the first warp of each SM; after the PDL wait no
    # stale copy can be in L1; ".cg" there ran 3.6x slower). Computed as a [1] row (the form the
    # kernels' PTX was checked with).
    one = tl.arange(0, 1)
    st_rows = st_ptr + one * 0
    rmask = one < 1
    offs_n = tl.arange(0, BLOCK_N)
    m = rmask[:, None] & (offs_n < N_D)[None, :]
    n_b = tl.minimum(D - offs_n * BLOCK_D, BLOCK_D).to(tl.float32)[None, :]
    st = st_rows[:, None] + offs_n[None, :] * 2
    mean_b = tl.load(st, mask=m, other=0.0)
    m2_b = tl.load(st + 1, mask=m, other=0.0)
    mean = tl.sum(tl.where(m, n_b * mean_b, 0.0), axis=1) / D
    delta = mean_b - mean[:, None]
    m2 = tl.sum(tl.where(m, m2_b + n_b * delta * delta, 0.0), axis=1)
    return tl.sum(mean, axis=0), tl.sum(1.0 / tl.sqrt(m2 / D + eps), axis=0)


# ---------------------------------------------------------------------------------------
# launcher

def _plan(D, cfg):
    """(BLOCK, num_warps) for rows of D elements."""
    if D > cfg["MAX_BLOCK"]:
        raise DejavuError(f"layer_norm: rows of {D} elements, more than MAX_BLOCK={cfg['MAX_BLOCK']}")
    num_warps = cfg.get("num_warps") or next(w for d, w in cfg["WARPS"] if d is None or D <= d)
    return next_pow2(D), num_warps


def layer_norm(x, weight, bias, eps=1e-5, *, out=None, config=None, settings=None):
    """y[R,D] = LayerNorm over the last dim of x[R,D] with weight[D], bias[D] (fp32 stats)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    R, D = x.shape
    check_tensor("weight", weight, shape=(D,), dtype=x.dtype, device=x.device)
    check_tensor("bias", bias, shape=(D,), dtype=x.dtype, device=x.device)
    out = check_out(out, (R, D), x.dtype, x.device)
    if R == 0 or D == 0:
        return out
    s = settings or DEFAULT
    cfg = table(s.layer_norm, config)
    block, num_warps = _plan(D, cfg)
    kernel = jit(_layer_norm_kernel, x.device)
    kernel[(R,)](x, weight, bias, out, D, float(eps), BLOCK=block,
                 num_warps=num_warps, **pdl_args(x.device, "layer_norm", s.pdl))
    return out


# ---------------------------------------------------------------------------------------
# LayerNorm left to the consumer

class PendingLN(NamedTuple):
    """LayerNorm(x) (eps 1e-5) not computed yet. stats [B, N, 2] fp32: per row of x, each
    block of `width` columns' (mean, M2) of x's stored values (N = cdiv(D, width)); the last
    block may be short."""
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    stats: torch.Tensor
    width: int


def block_stats(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, N, 2] fp32: (mean, sum of squared deviations) of each block of `width` columns of
    x [B, D] (PyTorch; what the reduction kernel stores with ln_defer)."""
    B, D = x.shape
    n = -(-D // width)
    xf = torch.nn.functional.pad(x.float(), (0, n * width - D)).view(B, n, width)
    cnt = torch.clamp(D - torch.arange(n, device=x.device) * width, max=width).float()  # [N]
    mean = xf.sum(-1) / cnt
    valid = (torch.arange(n * width, device=x.device) < D).view(n, width)
    m2 = torch.where(valid, xf - mean[..., None], 0.0).square().sum(-1)
    return torch.stack([mean, m2], -1).contiguous()


def pending_ln(x, weight, bias, width: int = 256) -> PendingLN:
    """A PendingLN of x with its block stats from PyTorch."""
    return PendingLN(x, weight, bias, block_stats(x, width), int(width))


def check_pending(p: PendingLN, dtypes=FLOAT_DTYPES) -> None:
    """Raise DejavuError unless p is a consistent PendingLN."""
    check_tensor("PendingLN.x", p.x, ndim=2, dtypes=dtypes)
    B, D = p.x.shape
    check_tensor("PendingLN.weight", p.weight, shape=(D,), dtype=p.x.dtype, device=p.x.device)
    check_tensor("PendingLN.bias", p.bias, shape=(D,), dtype=p.x.dtype, device=p.x.device)
    if not isinstance(p.width, int) or p.width < 1:
        raise DejavuError(f"PendingLN.width: expected a positive int, got {p.width!r}")
    check_tensor("PendingLN.stats", p.stats, shape=(B, -(-D // p.width), 2), dtype=torch.float32,
                 device=p.x.device)


def from_stats_ref(p: PendingLN, eps=1e-5) -> torch.Tensor:
    """LayerNorm(p.x) with the mean and variance merged from p.stats (PyTorch, fp32, in x's
    dtype): what a consumer kernel computes, so checking it checks the stored stats."""
    B, D = p.x.shape
    n = p.stats.shape[1]
    cnt = torch.clamp(D - torch.arange(n, device=p.x.device) * p.width, max=p.width).float()
    mean_b, m2_b = p.stats[..., 0], p.stats[..., 1]
    mean = (cnt * mean_b).sum(-1, keepdim=True) / D
    var = (m2_b + cnt * (mean_b - mean).square()).sum(-1, keepdim=True) / D
    y = (p.x.float() - mean) * torch.rsqrt(var + eps) * p.weight.float() + p.bias.float()
    return y.to(p.x.dtype)


def materialize(x, eps=1e-5, settings=None):
    """x itself, or a PendingLN's LayerNorm computed now by the layer_norm kernel (launchers
    of consumers that cannot fold it)."""
    return layer_norm(x.x, x.weight, x.bias, eps, settings=settings) if isinstance(x, PendingLN) else x


def materialize_ref(x, eps=1e-5):
    """materialize for the references: F.layer_norm in x's dtype (the dense model's own
    function, as the references' ln= outputs)."""
    if not isinstance(x, PendingLN):
        return x
    return torch.nn.functional.layer_norm(x.x, (x.x.shape[-1],), x.weight, x.bias, eps)


# ---------------------------------------------------------------------------------------
# reference

def layer_norm_ref(x, weight, bias, eps=1e-5):
    """F.layer_norm over the last dim, computed in fp32 (fp64 for fp64 inputs), in x's dtype."""
    ct = torch.promote_types(x.dtype, torch.float32)
    y = torch.nn.functional.layer_norm(x.to(ct), (x.shape[-1],), weight.to(ct), bias.to(ct), eps)
    return y.to(x.dtype)

"""fc1 of the sparse MLP: a gathered GEMV over the selected neurons (Triton) + reference.

    sparse_fc1(x[B,D], w1[F,D], b1[F], idx[B,K]|[K], n_kept[B]|None, *, out=None, validate=None, config=None)
        -> h[B,K] = relu(w1[idx] @ x + b1[idx]), 0 in rows j >= n_kept[b] (those rows' weights are not read)

- dtypes fp16, bf16, fp32 (weights in the activation dtype); fp32 accumulation; h in x's dtype.
- idx int32 or int64, `[B, K]` (`_gather_gemv_kernel`) or `[K]` (`_gather_dot_kernel` from fc1_dot_min_batch;
  blocks fc1_gemv / fc1_dot, `config=` overrides a field): docs/kernels.md, "Batches", "Gathered rows".
  `gather_gemv` is also Q's launcher in the full K/V policy (GROUP = hd) and the predictors' products.
- Index values are trusted in the kernel; `validate` checks the range (a host sync; default: CPU
  yes, GPU no). No host sync on the GPU path; launches are CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, cdiv, check_index, check_out, check_tensor, check_weight,
                                    default_validate, dot_fp32, expand_idx, gdc_enter, gdc_release, group_rows, jit, next_pow2, pdl_args)
from dejavu.plugins.settings import DEFAULT, table

tl = None  # triton.language, bound on first launch (see _common.jit)

def _gather_gemv_kernel(x_ptr, w_ptr, b_ptr, idx_ptr, out_ptr, D, K, stride_xb, stride_ib, stride_ob, nkept_ptr,
                        scale_ptr, RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                        EVEN_D: tl.constexpr, GROUP: tl.constexpr, W_EV: tl.constexpr = "",
                        GDC: tl.constexpr = 0, KEEP: tl.constexpr = 0, SCALE: tl.constexpr = 0):
    # out[b, r] = act(w[row(b, r)] @ x[b] + bias[row(b, r)]); grid (B, cdiv(K, BLOCK_R)).
    # SCALE (int8 rows, the predictors): the row's sum times scale[row(b, r)] (fp16), before the bias.
    # W_EV: eviction policy of the weight loads ("evict_first": the streamed rows do not push the
    # input vector, which every program re-reads, out of L1).
    # row(b, r) = idx[b, r // GROUP] * GROUP + r % GROUP (GROUP 1: rows; head dim: heads).
    # stride_ib = 0 for a shared index set: batch is the fastest grid axis, so the programs
    # reading the same rows run together and share them through L2.
    # KEEP (a per-token K; nkept [B] int32, else None): rows >= nkept[b] read nothing, are 0 (no loop if all are).
    pid_b = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < K
    gdc_enter(GDC)
    # masked rows gather row 0 (in bounds) and are never stored: the weight loads need no mask
    rows = group_rows(idx_ptr + pid_b * stride_ib, offs_r, rmask, GROUP)
    w_rows = w_ptr + rows[:, None] * D
    x_row = x_ptr + pid_b.to(tl.int64) * stride_xb
    d_end = D
    if KEEP:
        n = tl.load(nkept_ptr + pid_b)
        kept, d_end = offs_r < n, tl.where(pid_r * BLOCK_R < n, D, 0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, d_end, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        if KEEP:
            dmask = offs_d < D
            xv = tl.load(x_row + offs_d, mask=dmask, other=0.0)
            wv = tl.load(w_rows + offs_d[None, :], mask=kept[:, None] & dmask[None, :], other=0.0,
                         eviction_policy=W_EV).to(tl.float32)
        elif EVEN_D:
            xv = tl.load(x_row + offs_d)
            wv = tl.load(w_rows + offs_d[None, :], eviction_policy=W_EV).to(tl.float32)
        else:
            dmask = offs_d < D
            xv = tl.load(x_row + offs_d, mask=dmask, other=0.0)
            wv = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0,
                         eviction_policy=W_EV).to(tl.float32)
        acc += wv * xv.to(tl.float32)[None, :]
    gdc_release(GDC)
    h = tl.sum(acc, axis=1)
    if SCALE:
        h = h * tl.load(scale_ptr + rows).to(tl.float32)
    h = h + tl.load(b_ptr + rows).to(tl.float32)
    if RELU:
        h = tl.maximum(h, 0.0)
    if KEEP:
        h = tl.where(kept, h, 0.0)
    tl.store(out_ptr + pid_b.to(tl.int64) * stride_ob + offs_r,
             h.to(out_ptr.dtype.element_ty), mask=rmask)


def _gather_dot_kernel(x_ptr, w_ptr, b_ptr, idx_ptr, out_ptr, B, D, K, stride_xb, stride_ob,
                       RELU: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                       GROUP: tl.constexpr, GDC: tl.constexpr = 0):
    # Shared index set: out[b, r] = act(w[row(r)] @ x[b] + bias[row(r)]) for all b at once;
    # grid (cdiv(K, BLOCK_R),). Each gathered row is read once for the whole batch.
    pid_r = tl.program_id(0)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < K
    gdc_enter(GDC)
    rows = group_rows(idx_ptr, offs_r, rmask, GROUP)
    offs_b = tl.arange(0, BLOCK_B)
    bmask = offs_b < B
    w_rows = w_ptr + rows[:, None] * D
    x_cols = x_ptr + offs_b[None, :].to(tl.int64) * stride_xb
    acc = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        if EVEN_D:
            wv = tl.load(w_rows + offs_d[None, :])
            xt = tl.load(x_cols + offs_d[:, None], mask=bmask[None, :], other=0.0)
        else:
            dmask = offs_d < D
            wv = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0)
            xt = tl.load(x_cols + offs_d[:, None], mask=bmask[None, :] & dmask[:, None], other=0.0)
        if DOT_FP32:
            acc = tl.dot(wv.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(wv, xt.to(wv.dtype), acc)
    gdc_release(GDC)
    h = acc + tl.load(b_ptr + rows).to(tl.float32)[:, None]
    if RELU:
        h = tl.maximum(h, 0.0)
    out = out_ptr + offs_b[None, :].to(tl.int64) * stride_ob + offs_r[:, None]
    tl.store(out, h.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & bmask[None, :])


def gather_gemv(x, w, bias, idx, out, *, relu, config=None, group=1, kind=None, settings=None, n_kept=None,
                scale=None):
    """out[B,K] = act(w[rows] @ x + bias[rows]) (checked inputs; out may be wider than x);
    rows = idx (group 1) or the `group` consecutive rows of each index (K = idx's K * group).
    kind: the PDL kind of the launch (default fc1, or qkv_full with group > 1). n_kept: [B] int32, group 1,
    per-sequence idx (or B == 1; the GEMV kernel): rows j >= n_kept[b] are 0 and read no weights.
    scale: [rows of w] fp16, w int8 (the predictors, B == 1, the GEMV kernel): (w[row] @ x) * scale[row] + bias."""
    B, D = x.shape
    K = idx.shape[-1] * group
    if K == 0 or B == 0:
        return out
    shared = idx.dim() == 1
    kind = kind or ("qkv_full" if group > 1 else "fc1")
    s = settings or DEFAULT
    # B == 1: [1, K] is the same set as [K]; a per-token K takes the GEMV kernel (batch 1's default)
    dot = (shared or B == 1) and B >= s.fc1_dot_min_batch and n_kept is None and scale is None
    cfg = table(s.fc1_dot if dot else s.fc1_gemv, config)
    common = dict(RELU=relu, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"],
                  EVEN_D=D % cfg["BLOCK_D"] == 0, GROUP=group, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], **pdl_args(x.device, kind, s.pdl))
    if dot:
        kernel = jit(_gather_dot_kernel, x.device)
        kernel[(cdiv(K, cfg["BLOCK_R"]),)](x, w, bias, idx, out, B, D, K, x.stride(0), out.stride(0),
                                           DOT_FP32=dot_fp32(w.dtype, x.device), BLOCK_B=max(16, next_pow2(B)),
                                           **common)
    else:
        kernel = jit(_gather_gemv_kernel, x.device)
        kernel[(B, cdiv(K, cfg["BLOCK_R"]))](x, w, bias, idx, out, D, K, x.stride(0),
                                             0 if shared else idx.stride(0), out.stride(0), n_kept, scale,
                                             W_EV=cfg["W_EV"], KEEP=int(n_kept is not None),
                                             SCALE=int(scale is not None), **common)
    return out

def sparse_fc1(x, w1, b1, idx, n_kept=None, *, out=None, validate=None, config=None, settings=None):
    """h[B,K] = relu(w1[idx] @ x + b1[idx]); x [B,D], w1 [F,D], b1 [F], idx [B,K] or [K].
    n_kept [B] int32 in [0, K] (a per-token K, per-sequence idx): rows j >= n_kept[b] are 0, not read (trusted)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x.shape
    F = check_weight("w1", w1, D, x)
    check_tensor("b1", b1, shape=(F,), dtype=x.dtype, device=x.device)
    K, _ = check_index("idx", idx, batch=B, upper=F, device=x.device,
                       validate=default_validate(validate, x.device))
    out = check_out(out, (B, K), x.dtype, x.device)
    if n_kept is not None:
        if idx.dim() == 1 and B > 1:
            raise DejavuError("sparse_fc1: n_kept (a per-token K) needs one index set per sequence")
        check_tensor("n_kept", n_kept, shape=(B,), dtype=torch.int32, device=x.device)
    return gather_gemv(x, w1, b1, idx, out, relu=True, config=config, settings=settings, n_kept=n_kept)


def sparse_fc1_ref(x, w1, b1, idx, n_kept=None):
    """relu(w1[idx] @ x + b1[idx]) per row: h[B,K]; n_kept[B] (a per-token K, predictor_topk_ref(min_share=)):
    rows j >= n_kept[b] are 0 (fc2 then adds nothing for them)."""
    rows = expand_idx(idx, x.shape[0])
    h = torch.relu(torch.einsum("bkd,bd->bk", w1[rows], x) + b1[rows])
    return h if n_kept is None else h * (torch.arange(h.shape[1], device=h.device) < n_kept[:, None]).to(h.dtype)

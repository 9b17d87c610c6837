"""Deferred K/V recompute (DejaVu-style): K and V only for the heads that attend.

    sparse_attn_decode_deferred(x_ln[B,D] | PendingLN, wq, bq, wkv, bkv, wo_t, bo, head_idx,
                                k_cache[B,H,S,hd], v_cache, x_hist[B,S,D], valid_len[B,H] int32, pos,
                                residual=None, *, out=None, validate=None, config=None, refresh=None, settings=None) -> y[B,D]
    (and its _ref in PyTorch; recompute_kv_ref: the K/V part of that reference)

Policy: instead of projecting K/V of every head at every step (sparse_attention.py), keep per
layer the history of the attention input `x_hist[b, p] = x_ln` and per (sequence, head) the
number of cache slots already filled, `valid_len[b, h]`. When head h is selected at position pos,
its K/V for the missing slots `min(valid_len[b,h], pos) .. pos` are computed from the stored
inputs (one read of the head's 2*hd rows of wkv), then the selected heads attend as before. K/V
of position p depend only on x_ln(p), which never changes, so the output equals the masked-dense
semantics (ARCHITECTURE.md) in exact arithmetic; attention reads 4*d*D^2 weight bytes instead of
(2 + 2d)*D^2 at head density d. A decode layer: Q/K/V (qkv_partial.py + qkv_finish.py), attention
(sparse_attention.py, committing valid_len and x_hist[:, pos]), output projection (fc2.py's
kernel); `_commit_kernel` commits when nothing attends. Slots of unselected heads and slots outside
the range are not touched. Limits: hd <= 256; no duplicate head indices (top-k never makes them).
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (check_out, check_pos, check_tensor, default_validate, expand_idx, gdc_enter, jit,
                                    next_pow2, pdl_args, pos_rows)
from dejavu.plugins.layer_norm import PendingLN, check_pending, materialize, materialize_ref
from dejavu.plugins.qkv_partial import launch_qkv, qkv_table, shared_qkv
from dejavu.plugins.refresh_heads import refresh_route
from dejavu.plugins.settings import DEFAULT
from dejavu.plugins.sparse_attention import attend_project, check_attn, folds_finish

tl = None  # triton.language, bound on first launch (see _common.jit)


def _commit_kernel(xnew_ptr, x_ptr, head_ptr, vl_ptr, pos_ptr, KH, H, D, stride_nb, stride_xb, stride_xs,
                   stride_hb, stride_pb, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr = 0):
    # When no head attends (nothing else commits): valid_len[b, head_idx[b, j]] = pos[b] + 1 and
    # x_hist[b, pos[b]] = x_new[b]; grid (B,).
    gdc_enter(GDC)
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b * stride_pb).to(tl.int32)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < KH
    heads = tl.load(head_ptr + b * stride_hb + offs_k, mask=kmask, other=0).to(tl.int64)
    tl.store(vl_ptr + b * H + heads, tl.zeros([BLOCK_K], dtype=tl.int32) + pos + 1, mask=kmask)
    dst = x_ptr + b * stride_xb + pos.to(tl.int64) * stride_xs
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        tl.store(dst + offs_d, tl.load(xnew_ptr + b * stride_nb + offs_d, mask=dmask), mask=dmask)


def _mark_valid(valid_len, head_idx, pos_t):
    """valid_len[b, head_idx[b, j]] = pos[b] + 1 (scatter_: static shapes, no sync)."""
    B = valid_len.shape[0]
    heads = expand_idx(head_idx, B)
    val = (pos_t.reshape(-1, 1).to(torch.int32) + 1).expand(B, heads.shape[1])
    valid_len.scatter_(1, heads, val)


def _commit(x_new, x_hist, head_idx, valid_len, pos_t, stride_pb, pdl=None):
    """valid_len[b, heads] = pos + 1 and x_hist[b, pos] = x_new[b]: one launch."""
    B, S, D = x_hist.shape
    H = valid_len.shape[1]
    kh = head_idx.shape[-1]
    commit = jit(_commit_kernel, x_hist.device)
    commit[(B,)](x_new, x_hist, head_idx, valid_len, pos_t, kh, H, D, x_new.stride(0), x_hist.stride(0),
                 x_hist.stride(1), 0 if head_idx.dim() == 1 else head_idx.stride(0), stride_pb,
                 BLOCK_K=max(16, next_pow2(kh)), BLOCK_D=1024, num_warps=4,
                 **pdl_args(x_hist.device, "commit", pdl))


def recompute_kv_ref(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos) -> None:
    """K/V of the selected heads at slots min(valid_len, pos)..pos from x_hist, valid_len = pos + 1 (in
    place; PyTorch, any device/dtype): what sparse_attn_decode_deferred computes for them."""
    B = x_hist.shape[0]
    p = pos_rows(pos, B, x_hist.device)
    heads = expand_idx(head_idx, B)  # [B, Kh]
    if heads.shape[1] == 0:
        return
    start = torch.minimum(valid_len.long().gather(1, heads), p[:, None])  # [B, Kh]
    _fill_kv_ref(x_hist, wkv, bkv, heads, k_cache, v_cache, start, p)
    _mark_valid(valid_len, head_idx, p)


def _fill_kv_ref(x_hist, wkv, bkv, heads, k_cache, v_cache, first, last) -> None:
    """K/V of heads [B, Kh] at slots first[b, j] .. last[b] (inclusive) from x_hist."""
    B, S, D = x_hist.shape
    H, hd = k_cache.shape[1], k_cache.shape[3]
    lo, hi = 0, S  # on the GPU every slot (static shapes, graph-safe); on CPU only the window needed
    if x_hist.device.type == "cpu":
        lo, hi = min(int(first.min()), S), min(max(int(last.max()) + 1, 0), S)
        if lo >= hi:
            return
    w = wkv.view(2, H, hd, D)[:, heads].permute(1, 2, 0, 3, 4)  # [B, Kh, 2, hd, D]
    bias = bkv.view(2, H, hd)[:, heads].permute(1, 2, 0, 3)  # [B, Kh, 2, hd]
    kv = torch.einsum("bsd,bkcjd->bkcsj", x_hist[:, lo:hi], w) + bias[:, :, :, None, :]  # [B, Kh, 2, W, hd]
    s = torch.arange(lo, hi, device=x_hist.device)
    fill = (s[None, None, :] >= first[:, :, None]) & (s[None, None, :] <= last[:, None, None])  # [B, Kh, W]
    rows = torch.arange(B, device=x_hist.device)[:, None]
    for cache, c in ((k_cache, 0), (v_cache, 1)):
        cur = cache[rows, heads, lo:hi]  # [B, Kh, W, hd] (a copy)
        cache[rows, heads, lo:hi] = torch.where(fill[..., None], kv[:, :, c].to(cache.dtype), cur)


def _write_hist(x_hist, x_ln, pos_t):
    """x_hist[b, pos[b]] = x_ln[b] (index_put_: graph-capturable)."""
    B = x_ln.shape[0]
    b_idx = torch.arange(B, device=x_ln.device)
    x_hist[b_idx, pos_t.long().reshape(-1).expand(B)] = x_ln


def sparse_attn_decode_deferred(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache, x_hist,
                                valid_len, pos, residual=None, *, out=None, validate=None, config=None,
                                refresh=None, settings=None):
    """sparse_attn_decode with deferred K/V: only the selected heads' K/V are computed; y[B,D].

    Stores x_ln at x_hist[:, pos], recomputes the selected heads' missing slots, then Q,
    attention and the output projection of the selected heads (sparse_attention's pieces).
    x_ln as a PendingLN and refresh heads: docs/kernels.md, "API"; refresh is taken where
    `refresh_route` holds and left out elsewhere (a hint: the outputs are the same either way)."""
    pending = x_ln if isinstance(x_ln, PendingLN) else None
    if pending is not None:
        check_pending(pending)
        x_ln = pending.x
    validate = default_validate(validate, x_ln.device)
    B, D, H, S, hd, kh = check_attn(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache,
                                     v_cache, residual, validate)
    check_tensor("x_hist", x_hist, shape=(B, S, D), dtype=x_ln.dtype, device=x_ln.device)
    check_tensor("valid_len", valid_len, shape=(B, H), dtype=torch.int32, device=x_ln.device)
    pos_t, stride_pb = check_pos(pos, B, x_ln.device, S, validate)
    out = check_out(out, (B, D), x_ln.dtype, x_ln.device)
    cfg, s = config or {}, settings or DEFAULT
    qcfg = qkv_table(B, cfg.get("qkv"), s)
    if pending is not None and (kh == 0 or B != 1 or not shared_qkv(B, head_idx, qcfg)):
        x_ln, pending = materialize(pending, settings=s), None
    if kh == 0:  # nothing attends: store the input for later steps, y = bias (+ residual)
        _commit(x_ln, x_hist, head_idx, valid_len, pos_t, stride_pb, s.pdl)
        out.copy_(bo.expand(B, D) if residual is None else bo + residual)
        return out
    if refresh is not None:
        check_tensor("refresh", refresh, ndim=1, dtype=torch.int32, device=x_ln.device)
        if validate and refresh.numel():
            sel = set(head_idx.reshape(-1).tolist())
            bad = [h for h in refresh.tolist() if h >= H or h < -1 or h in sel]
            if bad or len(set(h for h in refresh.tolist() if h >= 0)) != sum(h >= 0 for h in refresh.tolist()):
                raise DejavuError(f"refresh: heads must be distinct, in [0, {H}) or -1, and not selected; got "
                                  f"{refresh.tolist()}")
        if not refresh.numel() or not refresh_route(B, S, D, hd, head_idx, cfg, s):
            refresh = None
    # 1. Q, and K/V at pos and at the missing slots, of the selected heads (one launch, or two)
    q = torch.empty((B, kh * hd), dtype=torch.float32, device=x_ln.device)
    fold = qcfg["FOLD_FINISH"] and B == 1 and shared_qkv(B, head_idx, qcfg) and folds_finish(B, S, cfg.get("attn"), s)
    parts = launch_qkv(x_ln, x_hist, wq, bq, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb, q,
                        cfg.get("qkv"), pending, fold=fold, refresh=refresh, settings=s)
    # 2. attention over 0..pos, committing valid_len and x_hist[:, pos] (the Q/K/V kernel stored
    # that slot when it normalised a PendingLN); 3. output projection
    y = attend_project(q, head_idx, k_cache, v_cache, pos_t, stride_pb, wo_t, bo, residual, out, cfg.get("attn"),
                       commit=(valid_len, None if pending is not None else x_ln, x_hist), finish=parts,
                       refresh=refresh, settings=s)
    return y


def sparse_attn_decode_deferred_ref(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache,
                                    x_hist, valid_len, pos, residual=None, *, refresh=None):
    """PyTorch reference: history write, recompute_kv_ref, masked attention of selected heads;
    y[B,D]. x_ln may be a PendingLN (F.layer_norm of its tensor). refresh: those heads (-1 skipped)
    are brought up to pos too."""
    x_ln = materialize_ref(x_ln)
    B, D = x_ln.shape
    H, S, hd = k_cache.shape[1:]
    p = pos_rows(pos, B, x_ln.device)
    _write_hist(x_hist, x_ln, p)
    recompute_kv_ref(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, p)
    if refresh is not None:
        recompute_kv_ref(x_hist, wkv, bkv, refresh[refresh >= 0], k_cache, v_cache, valid_len, p)
    heads = expand_idx(head_idx, B)  # [B, Kh]
    rows = torch.arange(B, device=x_ln.device)[:, None]
    q = torch.einsum("bkjd,bd->bkj", wq.view(H, hd, D)[heads], x_ln) + bq.view(H, hd)[heads]
    visible = torch.arange(S, device=x_ln.device)[None, :] <= p[:, None]  # [B, S]
    seen = visible[:, None, :, None]  # slots past pos may hold anything (NaN): never read them
    kc = torch.where(seen, k_cache[rows, heads], 0.0)  # [B, Kh, S, hd]
    vc = torch.where(seen, v_cache[rows, heads], 0.0)
    scores = torch.einsum("bkj,bksj->bks", q, kc)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    o = torch.einsum("bks,bksj->bkj", torch.softmax(scores, dim=-1), vc)  # [B, Kh, hd]
    y = torch.einsum("bkj,bkjd->bd", o, wo_t.view(H, hd, D)[heads]) + bo
    return y if residual is None else y + residual

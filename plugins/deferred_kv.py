"""Deferred K/V recompute (DejaVu-style): K and V only for the heads that attend.

    recompute_kv(x_hist[B,S,D], wkv[2D,D], bkv[2D], head_idx[B,Kh]|[Kh],
                 k_cache[B,H,S,hd], v_cache[B,H,S,hd], valid_len[B,H] int32, pos) -> None
    sparse_attn_decode_deferred(x_ln[B,D], wq, bq, wkv, bkv, wo_t, bo, head_idx,
                                k_cache, v_cache, x_hist, valid_len, pos, residual=None,
                                *, out=None, validate=None, config=None) -> y[B,D]

Policy: instead of projecting K/V of every head at every step (sparse_attention.py), keep
per layer the history of the attention input `x_hist[b, p] = x_ln` (LayerNorm'd, [B,S,D])
and per (sequence, head) the number of cache slots already filled, `valid_len[b, h]`.
When head h is selected at position pos, its K/V for the missing slots
`min(valid_len[b,h], pos) .. pos` are computed from the stored inputs (one read of the
head's 2*hd rows of wkv), then the selected heads attend as before. K/V of position p
depend only on x_ln(p), which never changes, so the output equals the masked-dense
semantics (ARCHITECTURE.md) in exact arithmetic; only the bytes read change: attention
reads 4*d*D^2 weight bytes instead of (2 + 2d)*D^2 at head density d.

Kernel `_recompute_kv_kernel`: grid (B*Kh, cdiv(2*hd, BLOCK_R)); a program owns BLOCK_R of
its head's 2*hd output rows (K rows then V rows) and loops over the missing positions in
blocks of BLOCK_P (tl.dot, both >= 16) and over D in BLOCK_D chunks, fp32 accumulation.
The bounds (valid_len, pos) are read from device memory: CUDA-graph safe, no host sync.
valid_len is updated by a separate small kernel after it (`_commit_kernel`, grid (B,)):
programs of one head would race if the recompute kernel wrote it. In the decode function
slot pos is read from x_ln directly and the same commit kernel stores x_ln into x_hist
afterwards, so a layer adds two launches. Slots of unselected heads and slots outside the range are
not touched. Limits: hd <= 256; duplicate head indices not allowed (top-k never makes them).
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_index, check_out, check_tensor,
                                    default_validate, jit, next_pow2)
from dejavu.plugins.sparse_attention import _attend_selected, _check_attn, _positions
from dejavu.plugins.sparse_mlp import _dot_fp32

tl = None  # triton.language, bound on first launch (see _common.jit)

# Untuned on the H200: BLOCK_D / warps / stages of sparse_mlp's swept tl.dot path; BLOCK_R 16
# gives B*Kh*16 programs (272 at OPT-30B, density 0.3, batch 1: about 2 per SM).
RECOMPUTE_CONFIG = {"BLOCK_P": 16, "BLOCK_R": 16, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3}


def _recompute_kv_kernel(x_ptr, xnew_ptr, w_ptr, b_ptr, head_ptr, k_ptr, v_ptr, vl_ptr, pos_ptr,
                         KH, H, D, HD, stride_xb, stride_xs, stride_nb, stride_hb, stride_pb,
                         stride_cb, stride_ch, stride_cs,
                         HAS_NEW: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # kv[p, r] = x_hist[b, p] . wkv[row(r)] + bkv[row(r)] for p in [min(valid_len, pos), pos],
    # r in this program's block of the head's 2*HD rows (r < HD: K row r, else V row r - HD).
    # HAS_NEW: position pos reads x_new[b] (this step's input; _commit_kernel stores it into
    # x_hist afterwards, so no program reads a row another one writes).
    pid = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = pid // KH
    j = pid % KH
    head = tl.load(head_ptr + b * stride_hb + j).to(tl.int64)
    pos = tl.load(pos_ptr + b * stride_pb).to(tl.int32)
    start = tl.minimum(tl.load(vl_ptr + b * H + head).to(tl.int32), pos)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < 2 * HD
    is_k = offs_r < HD
    col = tl.where(is_k, offs_r, offs_r - HD)  # channel within the head
    rows = tl.where(is_k, 0, H * HD) + head * HD + col  # row of wkv (V rows follow the H*HD K rows)
    rows = tl.where(rmask, rows, 0).to(tl.int64)
    bias = tl.load(b_ptr + rows).to(tl.float32)
    x_base = x_ptr + b.to(tl.int64) * stride_xb
    n_base = xnew_ptr + b.to(tl.int64) * stride_nb
    c_base = b.to(tl.int64) * stride_cb + head * stride_ch
    for p0 in range(start, pos + 1, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        pmask = offs_p <= pos
        acc = tl.zeros([BLOCK_P, BLOCK_R], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            if HAS_NEW:
                xt = tl.load(x_base + offs_p[:, None].to(tl.int64) * stride_xs + offs_d[None, :],
                             mask=(offs_p < pos)[:, None] & dmask[None, :], other=0.0)
                xn = tl.load(n_base + offs_d, mask=dmask, other=0.0)
                xt = tl.where((offs_p == pos)[:, None], xn[None, :], xt)
            else:
                xt = tl.load(x_base + offs_p[:, None].to(tl.int64) * stride_xs + offs_d[None, :],
                             mask=pmask[:, None] & dmask[None, :], other=0.0)
            wt = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :], mask=dmask[None, :], other=0.0)
            if DOT_FP32:
                acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
        kv = acc + bias[None, :]
        dst = c_base + offs_p[:, None].to(tl.int64) * stride_cs + col[None, :]
        m = pmask[:, None] & rmask[None, :]
        tl.store(k_ptr + dst, kv.to(k_ptr.dtype.element_ty), mask=m & is_k[None, :])
        tl.store(v_ptr + dst, kv.to(v_ptr.dtype.element_ty), mask=m & (offs_r >= HD)[None, :])


def _commit_kernel(xnew_ptr, x_ptr, head_ptr, vl_ptr, pos_ptr, KH, H, D, stride_nb, stride_xb, stride_xs,
                   stride_hb, stride_pb, HAS_NEW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    # After _recompute_kv_kernel: valid_len[b, head_idx[b, j]] = pos[b] + 1 and (HAS_NEW)
    # x_hist[b, pos[b]] = x_new[b]; grid (B,).
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b * stride_pb).to(tl.int32)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < KH
    heads = tl.load(head_ptr + b * stride_hb + offs_k, mask=kmask, other=0).to(tl.int64)
    tl.store(vl_ptr + b * H + heads, tl.zeros([BLOCK_K], dtype=tl.int32) + pos + 1, mask=kmask)
    if HAS_NEW:
        dst = x_ptr + b * stride_xb + pos.to(tl.int64) * stride_xs
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            tl.store(dst + offs_d, tl.load(xnew_ptr + b * stride_nb + offs_d, mask=dmask), mask=dmask)


def _check_recompute(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, validate):
    check_tensor("x_hist", x_hist, ndim=3, dtypes=FLOAT_DTYPES)
    B, S, D = x_hist.shape
    dt, dev = x_hist.dtype, x_hist.device
    check_tensor("k_cache", k_cache, ndim=4, dtype=dt, device=dev)
    H, hd = k_cache.shape[1], k_cache.shape[3]  # H*hd < D on a tensor-parallel shard
    check_tensor("wkv", wkv, shape=(2 * H * hd, D), dtype=dt, device=dev)
    check_tensor("bkv", bkv, shape=(2 * H * hd,), dtype=dt, device=dev)
    if k_cache.shape[0] != B or k_cache.shape[2] != S or H * hd > D:
        raise DejavuError(f"k_cache: shape {tuple(k_cache.shape)} does not fit x_hist {tuple(x_hist.shape)}")
    if hd > 256:
        raise DejavuError(f"head dim {hd} > 256 is not supported")
    check_tensor("v_cache", v_cache, shape=k_cache.shape, dtype=dt, device=dev)
    check_tensor("valid_len", valid_len, shape=(B, H), dtype=torch.int32, device=dev)
    kh, _ = check_index("head_idx", head_idx, batch=B, upper=H, device=dev, validate=validate)
    return B, S, D, H, hd, kh


def _mark_valid(valid_len, head_idx, pos_t):
    """valid_len[b, head_idx[b, j]] = pos[b] + 1 (scatter_: static shapes, no sync)."""
    B = valid_len.shape[0]
    heads = head_idx.long().expand(B, -1) if head_idx.dim() == 1 else head_idx.long()
    val = (pos_t.reshape(-1, 1).to(torch.int32) + 1).expand(B, heads.shape[1])
    valid_len.scatter_(1, heads, val)


def _launch(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb, x_new, config):
    """The recompute kernel (if any head), then the commit kernel (checked inputs; 2 launches)."""
    B, S, D = x_hist.shape
    H, hd = k_cache.shape[1], k_cache.shape[3]
    kh = head_idx.shape[-1]
    stride_hb = 0 if head_idx.dim() == 1 else head_idx.stride(0)
    new = x_new if x_new is not None else x_hist  # never read when HAS_NEW is false
    cfg = {**RECOMPUTE_CONFIG, **(config or {})}
    if kh > 0:
        kernel = jit(_recompute_kv_kernel, x_hist.device)
        grid = (B * kh, -(-2 * hd // cfg["BLOCK_R"]))
        kernel[grid](x_hist, new, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t,
                     kh, H, D, hd, x_hist.stride(0), x_hist.stride(1), new.stride(0), stride_hb, stride_pb,
                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     HAS_NEW=x_new is not None, DOT_FP32=_dot_fp32(x_hist.dtype, x_hist.device),
                     BLOCK_P=cfg["BLOCK_P"], BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"],
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if kh > 0 or x_new is not None:
        commit = jit(_commit_kernel, x_hist.device)
        commit[(B,)](new, x_hist, head_idx, valid_len, pos_t, kh, H, D, new.stride(0), x_hist.stride(0),
                     x_hist.stride(1), stride_hb, stride_pb, HAS_NEW=x_new is not None,
                     BLOCK_K=max(16, next_pow2(kh)), BLOCK_D=1024, num_warps=4)


def recompute_kv(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos, *, validate=None,
                 config=None) -> None:
    """Fill K/V of the selected heads at slots min(valid_len, pos)..pos from x_hist; mark them valid."""
    validate = default_validate(validate, x_hist.device)
    B, S, D, H, hd, kh = _check_recompute(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, validate)
    pos_t, stride_pb = _positions(pos, B, x_hist.device)
    if validate:
        lo, hi = int(pos_t.min()), int(pos_t.max())
        if lo < 0 or hi >= S:
            raise DejavuError(f"pos: out of range [0, {S}) (min {lo}, max {hi})")
        if valid_len.numel() and int(valid_len.min()) < 0:
            raise DejavuError("valid_len: negative entries")
    if kh == 0 or B == 0:
        return
    _launch(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb, None, config)


def recompute_kv_ref(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos) -> None:
    """PyTorch reference of recompute_kv (same in-place updates); any device/dtype."""
    B, S, D = x_hist.shape
    H, hd = k_cache.shape[1], k_cache.shape[3]
    if isinstance(pos, int):
        pos = torch.tensor(pos)
    p = pos.to(x_hist.device).long().reshape(-1).expand(B)  # [B]
    heads = head_idx.long().expand(B, -1) if head_idx.dim() == 1 else head_idx.long()  # [B, Kh]
    if heads.shape[1] == 0:
        return
    start = torch.minimum(valid_len.long().gather(1, heads), p[:, None])  # [B, Kh]
    lo, hi = 0, S  # on the GPU every slot (static shapes, graph-safe); on CPU only the window needed
    if x_hist.device.type == "cpu":
        lo, hi = int(start.min()), int(p.max()) + 1
    w = wkv.view(2, H, hd, D)[:, heads].permute(1, 2, 0, 3, 4)  # [B, Kh, 2, hd, D]
    bias = bkv.view(2, H, hd)[:, heads].permute(1, 2, 0, 3)  # [B, Kh, 2, hd]
    kv = torch.einsum("bsd,bkcjd->bkcsj", x_hist[:, lo:hi], w) + bias[:, :, :, None, :]  # [B, Kh, 2, W, hd]
    s = torch.arange(lo, hi, device=x_hist.device)
    fill = (s[None, None, :] >= start[:, :, None]) & (s[None, None, :] <= p[:, None, None])  # [B, Kh, W]
    rows = torch.arange(B, device=x_hist.device)[:, None]
    for cache, c in ((k_cache, 0), (v_cache, 1)):
        cur = cache[rows, heads, lo:hi]  # [B, Kh, W, hd] (a copy)
        cache[rows, heads, lo:hi] = torch.where(fill[..., None], kv[:, :, c].to(cache.dtype), cur)
    _mark_valid(valid_len, head_idx, p)


def _write_hist(x_hist, x_ln, pos_t):
    """x_hist[b, pos[b]] = x_ln[b] (index_put_: graph-capturable)."""
    B = x_ln.shape[0]
    b_idx = torch.arange(B, device=x_ln.device)
    x_hist[b_idx, pos_t.long().reshape(-1).expand(B)] = x_ln


def sparse_attn_decode_deferred(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache, x_hist,
                                valid_len, pos, residual=None, *, out=None, validate=None, config=None):
    """sparse_attn_decode with deferred K/V: only the selected heads' K/V are computed; y[B,D].

    Stores x_ln at x_hist[:, pos], recomputes the selected heads' missing slots, then Q,
    attention and the output projection of the selected heads (sparse_attention's pieces)."""
    validate = default_validate(validate, x_ln.device)
    B, D, H, S, hd, kh = _check_attn(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache,
                                     v_cache, residual, validate)
    check_tensor("x_hist", x_hist, shape=(B, S, D), dtype=x_ln.dtype, device=x_ln.device)
    check_tensor("valid_len", valid_len, shape=(B, H), dtype=torch.int32, device=x_ln.device)
    pos_t, stride_pb = _positions(pos, B, x_ln.device)
    if validate:
        lo, hi = int(pos_t.min()), int(pos_t.max())
        if lo < 0 or hi >= S:
            raise DejavuError(f"pos: out of range [0, {S}) (min {lo}, max {hi})")
    out = check_out(out, (B, D), x_ln.dtype, x_ln.device)
    # K/V of the selected heads' missing slots (slot pos from x_ln), then x_hist[:, pos] = x_ln
    # and valid_len = pos + 1 for them: two launches
    _launch(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb, x_ln,
            (config or {}).get("recompute"))
    if kh == 0:
        out.copy_(bo.expand(B, D) if residual is None else bo + residual)
        return out
    # Q, attention and output projection of the selected heads: sparse_attention's steps 2-4
    return _attend_selected(x_ln, wq, bq, wo_t, bo, head_idx, k_cache, v_cache, pos_t, stride_pb,
                            residual, out, {k: v for k, v in (config or {}).items() if k != "recompute"})


def sparse_attn_decode_deferred_ref(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache,
                                    x_hist, valid_len, pos, residual=None):
    """PyTorch reference: history write, recompute_kv_ref, masked attention of selected heads."""
    B, D = x_ln.shape
    H, S, hd = k_cache.shape[1:]
    if isinstance(pos, int):
        pos = torch.tensor(pos)
    p = pos.to(x_ln.device).long().reshape(-1).expand(B)
    _write_hist(x_hist, x_ln, p)
    recompute_kv_ref(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, p)
    heads = head_idx.long().expand(B, -1) if head_idx.dim() == 1 else head_idx.long()  # [B, Kh]
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

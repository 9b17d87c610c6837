"""Refresh heads (deferred K/V, batch 1): which non-attending heads a decode step brings up to pos.

    refresh_heads(head_idx[1,Kh]|[Kh], valid_len[1,H] int32, pos, r, *, lag=None, max_lag=None) -> [r] int32
    refresh_heads_ref(...)                                    (the same in PyTorch)
    refresh_route(B, S, D, hd, head_idx, config=None, settings=None) -> bool  (whether the kernels take them)

Heads that do not attend but have fallen hist_slots behind get their K/V in the same two Q/K/V
launches (extra head slots without Q rows, qkv_partial's REFRESH), valid_len committed by the
attention kernel, so no head reaches the slow path when it is selected again. One small launch on
the predictors' side stream (no host sync, CUDA-graph capturable).
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (check_index, check_out, check_pos, check_tensor, default_validate, jit, next_pow2,
                                    pos_rows)
from dejavu.plugins.qkv_partial import hist_slots, qkv_split, qkv_table, shared_qkv
from dejavu.plugins.sparse_attention import folds_finish

tl = None  # triton.language, bound on first launch (see _common.jit)


def _refresh_kernel(head_ptr, vl_ptr, pos_ptr, out_ptr, KH, H, LAG, MAX_LAG, R: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # refresh_heads: grid (1,). out[r] = the r-th most lagging head (lag = pos - min(valid_len, pos) in
    # [LAG, MAX_LAG], ties: the lower head) among those head_idx leaves out; -1 past the last such head.
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    pos = tl.load(pos_ptr).to(tl.int64)
    vl = tl.load(vl_ptr + offs_h, mask=hmask, other=0).to(tl.int64)
    lag = pos - tl.minimum(vl, pos)
    offs_k = tl.arange(0, BLOCK_K)
    sel = tl.load(head_ptr + offs_k, mask=offs_k < KH, other=-1).to(tl.int64)
    chosen = tl.sum((sel[None, :] == offs_h[:, None]).to(tl.int32), axis=1) > 0
    # one key per head: lag first, then the lower head index; -1 for heads that are not candidates
    key = tl.where(hmask & (chosen == 0) & (lag >= LAG) & (lag <= MAX_LAG), lag * BLOCK_H + (BLOCK_H - 1 - offs_h),
                   -1)
    for r in tl.static_range(R):
        m = tl.max(key, axis=0)
        h = BLOCK_H - 1 - m % BLOCK_H
        tl.store(out_ptr + r, tl.where(m >= 0, h, -1).to(tl.int32))
        key = tl.where(offs_h == h, -1, key)


def refresh_heads(head_idx, valid_len, pos, r: int, *, lag: int | None = None, max_lag: int | None = None,
                  out=None, config=None, validate=None, settings=None) -> torch.Tensor:
    """Batch 1: the heads whose K/V a deferred decode step should compute although they do not
    attend (`sparse_attn_decode_deferred(..., refresh=)`), so that no head falls further behind
    than the Q/K/V kernels' partials reach: [r] int32, the r most lagging heads (lag = pos -
    min(valid_len, pos) missing slots, ties: the lower head) of those head_idx leaves out, with lag
    >= `lag` (default hist_slots: a head that would need the slow path if it were selected a step
    later) and <= `max_lag` (default: any; hist_slots keeps heads already past the partials out:
    refreshing those takes the slow path), -1 after the last. One small launch (no host sync, CUDA-graph capturable); the
    runtime runs it on the predictors' side stream right after the head top-k."""
    validate = default_validate(validate, valid_len.device)
    dev = valid_len.device
    check_tensor("valid_len", valid_len, ndim=2, dtype=torch.int32, device=dev)
    B, H = valid_len.shape
    if B != 1:
        raise DejavuError(f"refresh_heads: batch 1 only, got valid_len of shape {tuple(valid_len.shape)}")
    kh, _ = check_index("head_idx", head_idx, batch=1, upper=H, device=dev, validate=validate)
    if r < 1:
        raise DejavuError(f"refresh_heads: r must be >= 1, got {r}")
    pos_t, _ = check_pos(pos, 1, dev)
    lag = hist_slots(1, head_idx, config, settings) if lag is None else int(lag)
    max_lag = (1 << 30) if max_lag is None else int(max_lag)
    if lag < 1 or max_lag < lag:
        raise DejavuError(f"refresh_heads: need 1 <= lag <= max_lag, got lag {lag}, max_lag {max_lag}")
    out = check_out(out, (r,), torch.int32, dev)
    kernel = jit(_refresh_kernel, dev)
    kernel[(1,)](head_idx, valid_len, pos_t, out, kh, H, lag, max_lag, R=r, BLOCK_H=max(16, next_pow2(H)),
                 BLOCK_K=max(16, next_pow2(kh)), num_warps=4)
    return out


def refresh_heads_ref(head_idx, valid_len, pos, r: int, *, lag: int | None = None, max_lag: int | None = None,
                      out=None, config=None, validate=None, settings=None) -> torch.Tensor:
    """PyTorch reference of refresh_heads."""
    H = valid_len.shape[1]
    lag = hist_slots(1, head_idx, config, settings) if lag is None else int(lag)
    p = pos_rows(pos, 1, valid_len.device)[0]
    miss = p - torch.minimum(valid_len[0].long(), p)  # [H]
    cand = (miss >= lag) & (miss <= (1 << 30 if max_lag is None else int(max_lag)))
    cand[head_idx.reshape(-1).long()] = False
    key = torch.where(cand, miss * H + (H - 1 - torch.arange(H, device=valid_len.device)), -1)
    top = key.sort(descending=True).values[:r]
    res = torch.full((r,), -1, dtype=torch.int32, device=valid_len.device)
    n = min(r, H)
    res[:n] = torch.where(top >= 0, H - 1 - top % H, -1).to(torch.int32)
    return res if out is None else out.copy_(res)


def refresh_route(B: int, S: int, D: int, hd: int, head_idx, config=None, settings=None) -> bool:
    """Whether sparse_attn_decode_deferred with this shape, head set and config takes refresh heads
    (batch 1 on the shared-set Q/K/V kernel with its finishing kernel, not folded into attention;
    attention commits them); elsewhere it leaves them out (they catch up when
    selected: same outputs)."""
    cfg = config or {}
    qcfg = qkv_table(B, cfg.get("qkv"), settings)
    kh = head_idx.shape[-1]
    if not (B == 1 and kh > 0 and shared_qkv(B, head_idx, qcfg)):
        return False
    fold = bool(qcfg["FOLD_FINISH"]) and folds_finish(B, S, cfg.get("attn"), settings)
    groups = kh * 3 * -(-hd // qcfg["BLOCK_R"])
    return not qkv_split(qcfg, D, groups, fold)[2]

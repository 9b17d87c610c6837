"""Sparse attention heads for decode (one new token per sequence) over a static KV cache.

    sparse_attn_decode(x_ln[B,D], wq[D,D], bq[D], wkv[2D,D], bkv[2D], wo_t[D,D], bo[D],
                       head_idx[B,Kh]|[Kh], k_cache[B,H,S_max,hd], v_cache[B,H,S_max,hd],
                       pos, residual[B,D]|None, *, out=None, validate=None) -> y[B,D]

Policy (K/V of every head into the caches at `pos`, Q and the output projection of the selected heads
only; 1/sqrt(hd) folded into wq/bq), its four launches and `pos` (an int or a device tensor, [] / [1] /
[B]; a tensor for CUDA graphs): docs/kernels.md, "Sparse attention (full K/V policy)". The
caches are updated in place (the reference does the same). Limits: hd <= 256 (any value,
masked); one program per (sequence, selected head, chunk of CHUNK positions of S_max), a
second small kernel combines the chunks' softmax partials when S_max > CHUNK (programs of
chunks past pos exit at once); duplicate head indices are not allowed (top-k never makes
them; the output projection would count such a head twice).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_index, check_out, check_pos, check_tensor,
                                    default_validate, expand_idx, gdc_enter, helper, jit, next_pow2, pdl_args, pos_rows)
from dejavu.plugins.fc1 import gather_gemv
from dejavu.plugins.fc2 import gather_gemv_t
from dejavu.plugins.settings import DEFAULT, table

tl = None  # triton.language, bound on first launch (see _common.jit)

# CHUNK (settings.AttnSettings): positions per program; each chunk's partial softmax is combined by a
# second kernel, flash-decoding style. 32 won `benchmarks/kernels.py --sweep-attn` on the H200 (OPT-30B,
# head density 0.3, contexts 128 and 1024; benchmarks/results/kernels-2026-12-02-sweep-attn.json).


class QKVPartials(NamedTuple):
    """qkv_partial.py's Q/K/V partial sums at batch 1 with the finishing kernel folded into attention
    (qkv_b1 FOLD_FINISH): the attention kernel finishes them (`_fold_rows`)."""
    pnew: torch.Tensor  # [SPLIT, 1, Kh, 3*hd] fp32: Q, K, V rows at pos, per slice of D
    phist: torch.Tensor  # [SPLIT, 1, Kh, block_p, 2*hd] fp32: K, V rows at the first missing slots
    split: int
    hist_len: int  # missing slots the partials hold (from min(valid_len, pos))
    block_p: int  # phist's slot stride
    bq: torch.Tensor
    bkv: torch.Tensor


def folds_finish(B: int, S: int, config=None, settings=None) -> bool:
    """Whether attend_project can take the Q/K/V partials (QKVPartials) at batch 1 with S_max S:
    the chunked kernel with its separate combine launch (which commits valid_len after every
    chunk program has read it) over chunks of one tile (BLOCK_S >= CHUNK)."""
    cfg = table((settings or DEFAULT).attn, config)
    return B == 1 and S > cfg["CHUNK"] and cfg["BLOCK_S"] >= cfg["CHUNK"]


@helper
def _fold_rows(pnew_ptr, phist_ptr, bkv_ptr, head, offs_f, fm2, offs_d, dmask, slot0, KH, H, HD, BLOCK_PH,
               seg: tl.constexpr, SPLIT: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_HD: tl.constexpr):
    # K (seg 1) or V (seg 2) of head slot slot0 at the fresh slots [BLOCK_F] (row 0: pos, from pnew;
    # row f >= 1: the (f-1)-th missing slot, from phist; fm2 masks the rest) in fp32: the SPLIT
    # partials summed in order (unrolled: the loads go out together), + the bias, as qkv_finish's
    # finishing kernel computes them (the caller rounds them to the cache's dtype).
    acc = tl.zeros([BLOCK_F, BLOCK_HD], dtype=tl.float32)
    for sp in tl.static_range(SPLIT):
        slot = sp * KH + slot0
        p_new = pnew_ptr + slot * 3 * HD + seg * HD + offs_d[None, :]
        p_hist = phist_ptr + ((slot * BLOCK_PH + offs_f[:, None] - 1) * 2 * HD + (seg - 1) * HD + offs_d[None, :])
        acc += tl.load(tl.where(offs_f[:, None] == 0, p_new, p_hist), mask=fm2, other=0.0, cache_modifier=".cg")
    bias = tl.load(bkv_ptr + (seg - 1) * H * HD + head * HD + offs_d, mask=dmask, other=0.0).to(tl.float32)
    return acc + bias[None, :]


@helper
def _combine_row(part_ptr, ml_ptr, o_ptr, row, HD, NCHUNK, BLOCK_C: tl.constexpr, BLOCK_HD: tl.constexpr):
    # o[row] = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c over the row's NCHUNK chunk
    # partials (.cg: from L2, where the attention kernel just put them).
    # Chunks past pos have m = -inf, l = 0, acc = 0 and weigh nothing.
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < NCHUNK
    offs_d = tl.arange(0, BLOCK_HD)
    dmask = offs_d < HD
    slots = row * NCHUNK + offs_c
    m_c = tl.load(ml_ptr + slots * 2, mask=cmask, other=float("-inf"), cache_modifier=".cg")
    l_c = tl.load(ml_ptr + slots * 2 + 1, mask=cmask, other=0.0, cache_modifier=".cg")
    w = tl.exp(m_c - tl.max(m_c, axis=0))
    w = tl.where(cmask & (m_c > float("-inf")), w, 0.0)
    accs = tl.load(part_ptr + slots[:, None] * HD + offs_d[None, :],
                   mask=cmask[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")
    o = tl.sum(accs * w[:, None], axis=0) / tl.sum(w * l_c, axis=0)
    tl.store(o_ptr + row * HD + offs_d, o, mask=dmask)


@helper
def _fold_chunk(k_ptr, v_ptr, pnew_ptr, phist_ptr, bq_ptr, bkv_ptr, pid_b, pid_j, pid_c, head, pos, fstart, start, end,
                base, offs_d, dmask, KH, H, HD, CHUNK, HIST_LEN, BLOCK_PH, stride_cs, BLOCK_S: tl.constexpr,
                BLOCK_HD: tl.constexpr, FOLD_SPLIT: tl.constexpr, BLOCK_F: tl.constexpr):
    # _attn_decode_kernel's FOLD chunk (one tile): Q and the fresh K/V slots summed from the Q/K/V
    # partials (_fold_rows; pos's chunk program stores those slots into the caches), the chunk's
    # cached slots and the fresh ones attended; returns (m_i, l_i, acc) as the loop would.
    slot0 = pid_b.to(tl.int64) * KH + pid_j
    q = tl.zeros([BLOCK_HD], dtype=tl.float32)
    for sp in tl.static_range(FOLD_SPLIT):  # Q partials summed in order, as the finishing kernel does
        q += tl.load(pnew_ptr + (sp * KH + slot0) * 3 * HD + offs_d, mask=dmask, other=0.0, cache_modifier=".cg")
    q = q + tl.load(bq_ptr + head * HD + offs_d, mask=dmask, other=0.0).to(tl.float32)
    fend = tl.minimum(fstart + HIST_LEN, pos)
    offs_f = tl.arange(0, BLOCK_F)
    slot_f = tl.where(offs_f == 0, pos, fstart + offs_f - 1)
    # pos's chunk program only (a vector comparison: the interpreter wants vector masks)
    fmask = ((offs_f == 0) | (slot_f < fend)) & (offs_f * 0 + pid_c == pos // CHUNK)
    fm2 = fmask[:, None] & dmask[None, :]
    kf = _fold_rows(pnew_ptr, phist_ptr, bkv_ptr, head, offs_f, fm2, offs_d, dmask, slot0, KH, H, HD, BLOCK_PH,
                    1, FOLD_SPLIT, BLOCK_F, BLOCK_HD).to(k_ptr.dtype.element_ty)
    vf = _fold_rows(pnew_ptr, phist_ptr, bkv_ptr, head, offs_f, fm2, offs_d, dmask, slot0, KH, H, HD, BLOCK_PH,
                    2, FOLD_SPLIT, BLOCK_F, BLOCK_HD).to(v_ptr.dtype.element_ty)
    offs_s = start + tl.arange(0, BLOCK_S)  # the chunk's cached slots (the fresh ones are not there yet)
    cached = (offs_s < end) & ((offs_s < fstart) | (offs_s >= fend)) & (offs_s != pos)
    tile = base + offs_s[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
    mask = cached[:, None] & dmask[None, :]
    k = tl.load(k_ptr + tile, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + tile, mask=mask, other=0.0).to(tl.float32)
    s = tl.where(cached, tl.sum(k * q[None, :], axis=1), float("-inf"))
    sf = tl.where(fmask, tl.sum(kf.to(tl.float32) * q[None, :], axis=1), float("-inf"))
    m = tl.maximum(tl.max(s, axis=0), tl.max(sf, axis=0))
    m = tl.where(m == float("-inf"), 0.0, m)  # nothing here (a chunk past pos): exp(-inf) = 0, no NaN
    p = tl.exp(s - m)
    pf = tl.exp(sf - m)
    l_i = tl.zeros([1], dtype=tl.float32) + (tl.sum(p, axis=0) + tl.sum(pf, axis=0))
    acc = tl.sum(p[:, None] * v, axis=0) + tl.sum(pf[:, None] * vf.to(tl.float32), axis=0)
    m_i = tl.where(l_i == 0.0, float("-inf"), m)
    # the finished slots into the caches (K, V)
    tl.store(k_ptr + base + slot_f[:, None].to(tl.int64) * stride_cs + offs_d[None, :], kf, mask=fm2)
    tl.store(v_ptr + base + slot_f[:, None].to(tl.int64) * stride_cs + offs_d[None, :], vf, mask=fm2)
    return m_i, l_i, acc


@helper
def _commit_chunk0(vl_ptr, ref_ptr, xnew_ptr, xh_ptr, pid_b, pid_j, head, pos, H, D, N_REF, stride_nb, stride_xb,
                   stride_xs, COMMIT: tl.constexpr, FOLD: tl.constexpr, BLOCK_REF: tl.constexpr,
                   BLOCK_X: tl.constexpr):
    # _attn_decode_kernel's COMMIT by a chunk-0 program: valid_len (not FOLD: the combine kernel
    # commits then), the refresh heads' (BLOCK_REF, head slot 0) and, COMMIT 1, x_hist[b, pos]
    if not FOLD:
        tl.store(vl_ptr + pid_b * H + head, pos + 1)
        if BLOCK_REF > 0:
            if pid_j == 0:
                offs_r = tl.arange(0, BLOCK_REF)
                ref = tl.load(ref_ptr + offs_r, mask=offs_r < N_REF, other=-1).to(tl.int64)
                tl.store(vl_ptr + pid_b * H + ref, tl.zeros([BLOCK_REF], dtype=tl.int32) + pos + 1, mask=ref >= 0)
    if COMMIT == 1 and pid_j == 0:  # the whole row at once (BLOCK_X >= D): one memory round trip
        src = xnew_ptr + pid_b.to(tl.int64) * stride_nb
        dst = xh_ptr + pid_b.to(tl.int64) * stride_xb + pos.to(tl.int64) * stride_xs
        offs_x = tl.arange(0, BLOCK_X)
        xm = offs_x < D
        tl.store(dst + offs_x, tl.load(src + offs_x, mask=xm), mask=xm)


def _attn_decode_kernel(q_ptr, k_ptr, v_ptr, head_ptr, pos_ptr, o_ptr, part_ptr, ml_ptr,
                        vl_ptr, xnew_ptr, xh_ptr, KH, H, HD, D, CHUNK, NCHUNK, stride_hb, stride_pb,
                        stride_cb, stride_ch, stride_cs, stride_nb, stride_xb, stride_xs,
                        pnew_ptr, phist_ptr, bq_ptr, bkv_ptr, HIST_LEN, BLOCK_PH,
                        PARTIAL: tl.constexpr, COMMIT: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_HD: tl.constexpr, BLOCK_X: tl.constexpr,
                        FOLD: tl.constexpr = 0, FOLD_SPLIT: tl.constexpr = 1, BLOCK_F: tl.constexpr = 16,
                        ref_ptr=None, N_REF=0, BLOCK_REF: tl.constexpr = 0, GDC: tl.constexpr = 0):
    # softmax_s(q[b, j] . k[b, head, s]) v[b, head, s] over s in this program's chunk of
    # [0, pos[b]], head = head_idx[b, j]; grid (B, Kh, NCHUNK). Online softmax in fp32.
    # PARTIAL: store the unnormalised acc and (max, sum) per chunk for _attn_combine_kernel;
    # else (one chunk) store o directly.
    # COMMIT (deferred K/V, after the deferred Q/K/V kernels): valid_len[b, head] = pos + 1 and
    # (COMMIT 1) x_hist[b, pos] = x_new[b] (no program here reads either); COMMIT 2: valid_len
    # only (the Q/K/V kernel stored x_hist[b, pos] itself). BLOCK_REF > 0 (COMMIT, not FOLD, batch 1):
    # valid_len[0, ref[r]] = pos + 1 too for the N_REF refresh heads at ref_ptr (-1: none), whose K/V the
    # Q/K/V kernels computed (refresh_heads.py).
    # The head index and pos are read before the PDL wait (neither is written by the kernel
    # before this one: the heads come from the side stream, whose event the main stream waited
    # for before the Q/K/V kernels; pos is the step's input), saving a round trip after it.
    # FOLD (batch 1, PARTIAL, after qkv_partial's kernel with no finishing kernel): q is the
    # sum of the SPLIT Q partials at pnew + bq; the fresh slots (pos and the missing slots
    # start .. min(start + HIST_LEN, pos) - 1 from start = min(valid_len, pos), whose K/V only
    # the partials hold) are left out of the cache tiles and attended by the program of pos's
    # chunk, which finishes them (_fold_rows) and stores them into the caches. Straight-line code
    # (one tile per program, BLOCK_S >= CHUNK; the FOLD_SPLIT partial loads unrolled), so the loads
    # go out together. valid_len (read here by every chunk program) is committed by the combine
    # kernel, not here.
    pid_b = tl.program_id(0)
    pid_j = tl.program_id(1)
    pid_c = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_HD)
    dmask = offs_d < HD
    head = tl.load(head_ptr + pid_b * stride_hb + pid_j).to(tl.int64)
    pos = tl.load(pos_ptr + pid_b * stride_pb).to(tl.int32)
    if FOLD:
        fstart = tl.minimum(tl.load(vl_ptr + pid_b * H + head).to(tl.int32), pos)
    gdc_enter(GDC)
    if COMMIT:
        if pid_c == 0:
            _commit_chunk0(vl_ptr, ref_ptr, xnew_ptr, xh_ptr, pid_b, pid_j, head, pos, H, D, N_REF, stride_nb,
                           stride_xb, stride_xs, COMMIT, FOLD, BLOCK_REF, BLOCK_X)
    start = pid_c * CHUNK
    end = tl.minimum(start + CHUNK, pos + 1)
    qo = (pid_b.to(tl.int64) * KH + pid_j) * HD
    base = pid_b.to(tl.int64) * stride_cb + head * stride_ch
    if FOLD:  # straight-line (one tile: BLOCK_S >= CHUNK), so every load can be issued at once
        m_i, l_i, acc = _fold_chunk(k_ptr, v_ptr, pnew_ptr, phist_ptr, bq_ptr, bkv_ptr, pid_b, pid_j, pid_c, head, pos,
                                    fstart, start, end, base, offs_d, dmask, KH, H, HD, CHUNK, HIST_LEN, BLOCK_PH,
                                    stride_cs, BLOCK_S, BLOCK_HD, FOLD_SPLIT, BLOCK_F)
    else:
        q = tl.load(q_ptr + qo + offs_d, mask=dmask, other=0.0).to(tl.float32)
        m_i = tl.full([1], float("-inf"), tl.float32)
        l_i = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_HD], dtype=tl.float32)
        for s0 in range(start, end, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            smask = offs_s < end
            tile = base + offs_s[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
            mask = smask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + tile, mask=mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1)
            s = tl.where(smask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + tile, mask=mask, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
    if PARTIAL:
        slot = (pid_b.to(tl.int64) * KH + pid_j) * NCHUNK + pid_c
        tl.store(part_ptr + slot * HD + offs_d, acc, mask=dmask)
        one = tl.arange(0, 1)
        tl.store(ml_ptr + slot * 2 + one, m_i)
        tl.store(ml_ptr + slot * 2 + 1 + one, l_i)
    else:
        tl.store(o_ptr + qo + offs_d, acc / l_i, mask=dmask)


def _attn_combine_kernel(part_ptr, ml_ptr, o_ptr, HD, NCHUNK, vl_ptr, head_ptr, pos_ptr, KH, H, stride_hb,
                         stride_pb, BLOCK_C: tl.constexpr, BLOCK_HD: tl.constexpr, COMMIT: tl.constexpr = 0,
                         ref_ptr=None, N_REF=0, BLOCK_REF: tl.constexpr = 0, GDC: tl.constexpr = 0):
    # o = the chunks' partials combined (_combine_row); grid (B * Kh,). COMMIT (the attention
    # kernel's FOLD, whose chunk programs read valid_len): valid_len[b, head] = pos + 1,
    # and (BLOCK_REF > 0, batch 1, by row 0) for the N_REF refresh heads at ref_ptr (-1: none).
    gdc_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    if COMMIT:
        b = row // KH
        head = tl.load(head_ptr + b * stride_hb + row % KH).to(tl.int64)
        pos1 = tl.load(pos_ptr + b * stride_pb).to(tl.int32) + 1
        tl.store(vl_ptr + b * H + head, pos1)
        if BLOCK_REF > 0:
            if row == 0:
                offs_r = tl.arange(0, BLOCK_REF)
                ref = tl.load(ref_ptr + offs_r, mask=offs_r < N_REF, other=-1).to(tl.int64)
                tl.store(vl_ptr + ref, tl.zeros([BLOCK_REF], dtype=tl.int32) + pos1, mask=ref >= 0)
    _combine_row(part_ptr, ml_ptr, o_ptr, row, HD, NCHUNK, BLOCK_C, BLOCK_HD)


def check_attn(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache, residual, validate):
    """The attention launchers' checks: (B, D, H, S, hd, Kh)."""
    check_tensor("x_ln", x_ln, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x_ln.shape
    dt, dev = x_ln.dtype, x_ln.device
    check_tensor("k_cache", k_cache, ndim=4, dtype=dt, device=dev)
    H, S, hd = k_cache.shape[1:]
    if k_cache.shape[0] != B or H * hd > D:  # H*hd < D: a tensor-parallel shard holds H/tp heads
        raise DejavuError(f"k_cache: shape {tuple(k_cache.shape)} does not fit B={B}, D={D}")
    if hd > 256:
        raise DejavuError(f"head dim {hd} > 256 is not supported")
    check_tensor("v_cache", v_cache, shape=k_cache.shape, dtype=dt, device=dev)
    HH = H * hd
    check_tensor("wq", wq, shape=(HH, D), dtype=dt, device=dev)
    check_tensor("bq", bq, shape=(HH,), dtype=dt, device=dev)
    check_tensor("wkv", wkv, shape=(2 * HH, D), dtype=dt, device=dev)
    check_tensor("bkv", bkv, shape=(2 * HH,), dtype=dt, device=dev)
    check_tensor("wo_t", wo_t, shape=(HH, D), dtype=dt, device=dev)
    check_tensor("bo", bo, shape=(D,), dtype=dt, device=dev)
    if residual is not None:
        check_tensor("residual", residual, shape=(B, D), dtype=dt, device=dev)
    kh, _ = check_index("head_idx", head_idx, batch=B, upper=H, device=dev, validate=validate)
    return B, D, H, S, hd, kh


def sparse_attn_decode(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache, pos,
                       residual=None, *, out=None, validate=None, config=None, settings=None):
    """Decode one token through the selected heads; updates the caches at pos; y[B,D]."""
    validate = default_validate(validate, x_ln.device)
    B, D, H, S, hd, kh = check_attn(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache,
                                     v_cache, residual, validate)
    pos_t, stride_pb = check_pos(pos, B, x_ln.device, S, validate)
    out = check_out(out, (B, D), x_ln.dtype, x_ln.device)

    # 1. K/V for all heads, written at pos (index_put_: graph-capturable, no sync)
    kv = torch.nn.functional.linear(x_ln, wkv, bkv).view(B, 2, H, hd)
    b_idx = torch.arange(B, device=x_ln.device)
    p_idx = pos_t.long().expand(B)
    k_cache[b_idx, :, p_idx] = kv[:, 0]
    v_cache[b_idx, :, p_idx] = kv[:, 1]
    if kh == 0:
        out.copy_(bo.expand(B, D) if residual is None else bo + residual)
        return out
    # 2. Q for the selected heads: rows head*hd + c of wq
    q = torch.empty((B, kh * hd), dtype=torch.float32, device=x_ln.device)
    gather_gemv(x_ln, wq, bq, head_idx, q, relu=False, group=hd, settings=settings)
    # 3. attention; 4. output projection
    return attend_project(q, head_idx, k_cache, v_cache, pos_t, stride_pb, wo_t, bo, residual, out, config,
                          settings=settings)


def attend_heads(q, head_idx, k_cache, v_cache, pos_t, stride_pb, config=None, commit=None, finish=None,
                 refresh=None, settings=None):
    """o[B, Kh*hd] (fp32) = attention of the selected heads' queries q [B, Kh*hd] (fp32) over
    cache slots 0..pos (checked inputs, Kh > 0). commit = (valid_len, x_new, x_hist): also
    store valid_len[b, heads] = pos + 1 and x_hist[b, pos] = x_new[b] (deferred K/V; x_new
    None: valid_len only).
    finish: QKVPartials (batch 1, `folds_finish`, with commit): q is not read; the kernel sums
    Q and the fresh K/V slots from the partials and stores those slots into the caches.
    refresh: [R] int32 refresh heads (refresh_heads.py; batch 1, with commit, no finish):
    their valid_len is committed too."""
    B, H, S, hd = k_cache.shape
    kh = head_idx.shape[-1]
    s = settings or DEFAULT
    cfg = table(s.attn, config)
    nchunk = -(-S // cfg["CHUNK"])  # from S_max, not pos: no sync, graph-safe
    if finish is not None and (commit is None or not folds_finish(B, S, config, s)):
        raise DejavuError("attend_heads: Q/K/V partials need batch 1, a commit and the chunked attention "
                          "with its combine launch (sparse_attention.folds_finish)")
    if refresh is not None and (B != 1 or commit is None or finish is not None):
        raise DejavuError("attend_heads: refresh heads need batch 1 and a commit, without Q/K/V partials")
    ref_args = ({"ref_ptr": refresh, "N_REF": refresh.shape[0], "BLOCK_REF": max(16, next_pow2(refresh.shape[0]))}
                if refresh is not None and refresh.shape[0] else {})
    o = torch.empty_like(q)
    part = ml = o  # unused unless split
    if nchunk > 1:
        part = torch.empty((B * kh * nchunk, hd), dtype=torch.float32, device=q.device)
        ml = torch.empty((B * kh * nchunk, 2), dtype=torch.float32, device=q.device)
    block_hd = max(16, next_pow2(hd))
    vl, xn, xh = commit if commit is not None else (head_idx, q, q)  # never touched without COMMIT
    commit_mode = 0 if commit is None else 1 if xn is not None else 2
    xn = q if xn is None else xn  # never touched unless COMMIT == 1
    D = xh.shape[-1]
    block_c = max(2, next_pow2(nchunk))
    stride_hb = 0 if head_idx.dim() == 1 else head_idx.stride(0)
    # Q/K/V partials (finish): never touched without FOLD; with them the combine launch commits valid_len
    f = finish or QKVPartials(q, q, 0, 0, 0, q, q)
    late_commit = finish is not None
    kernel = jit(_attn_decode_kernel, q.device)
    kernel[(B, kh, nchunk)](q, k_cache, v_cache, head_idx, pos_t, o, part, ml, vl, xn, xh, kh, H, hd, D,
                            cfg["CHUNK"], nchunk, stride_hb,
                            stride_pb, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                            xn.stride(0), xh.stride(0), xh.stride(1) if xh.dim() == 3 else 0,
                            f.pnew, f.phist, f.bq, f.bkv, f.hist_len, f.block_p,
                            PARTIAL=nchunk > 1, COMMIT=commit_mode, BLOCK_S=cfg["BLOCK_S"],
                            BLOCK_HD=block_hd, BLOCK_X=next_pow2(D) if commit_mode == 1 else 16,
                            FOLD=finish is not None,
                            FOLD_SPLIT=max(1, f.split), BLOCK_F=next_pow2(f.hist_len + 1),
                            num_warps=cfg["num_warps"], **(ref_args if not late_commit else {}),
                            **pdl_args(q.device, "attn", s.pdl))
    if nchunk > 1:
        combine = jit(_attn_combine_kernel, q.device)
        combine[(B * kh,)](part, ml, o, hd, nchunk, vl, head_idx, pos_t, kh, H, stride_hb, stride_pb,
                           BLOCK_C=block_c, BLOCK_HD=block_hd, COMMIT=late_commit, num_warps=4,
                           **(ref_args if late_commit else {}), **pdl_args(q.device, "attn_combine", s.pdl))
    return o


def attend_project(q, head_idx, k_cache, v_cache, pos_t, stride_pb, wo_t, bo, residual, out, config=None,
                   commit=None, finish=None, refresh=None, settings=None):
    """attend_heads(q, head_idx, ..., commit, finish, refresh) then project_out: y[B,D]."""
    o = attend_heads(q, head_idx, k_cache, v_cache, pos_t, stride_pb, config, commit=commit, finish=finish,
                     refresh=refresh, settings=settings)
    return project_out(o, wo_t, bo, head_idx, residual, out, settings)


def project_out(o, wo_t, bo, head_idx, residual, out, settings=None):
    """y[B,D] = o [B, Kh*hd] @ wo_t[rows of the selected heads] + bo (+ residual) (gather_gemv_t)."""
    hd = o.shape[1] // head_idx.shape[-1]
    return gather_gemv_t(o, wo_t, bo, head_idx, residual, out, group=hd, settings=settings)


def sparse_attn_decode_ref(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache, pos,
                           residual=None):
    """PyTorch reference (masked dense): same signature and cache update; y[B,D]."""
    B, D = x_ln.shape
    H, S, hd = k_cache.shape[1:]
    q = (x_ln @ wq.T + bq).view(B, H, hd)
    kv = (x_ln @ wkv.T + bkv).view(B, 2, H, hd)
    p_idx = pos_rows(pos, B, x_ln.device)
    b_idx = torch.arange(B, device=x_ln.device)
    k_cache[b_idx, :, p_idx] = kv[:, 0]
    v_cache[b_idx, :, p_idx] = kv[:, 1]
    scores = torch.einsum("bhd,bhsd->bhs", q, k_cache)
    visible = torch.arange(S, device=x_ln.device)[None, :] <= p_idx[:, None]  # [B, S]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    o = torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), v_cache)
    heads = expand_idx(head_idx, B)
    keep = torch.zeros(B, H, dtype=o.dtype, device=o.device).scatter_(1, heads, 1.0)
    y = (o * keep[:, :, None]).reshape(B, -1) @ wo_t + bo
    return y if residual is None else y + residual

"""Q/K/V partial kernels of the deferred K/V policy (deferred_kv.py), and the launch of both Q/K/V kernels.

    launch_qkv(x_new, x_hist, wq, bq, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb,
               q, config, pending=None, fold=False, refresh=None, settings=None) -> QKVPartials | None

Q/K/V of the selected heads: grid (heads, row blocks, slices of D). A program owns BLOCK_R rows of
one of its head's three hd-row segments (Q, K or V) and one of SPLIT slices of D, and reads that
weight block once, in BLOCK_D chunks. `_qkv_partial_shared_kernel` (one index set for the batch;
batch 1): one tl.dot over [batch x (the input at pos + SHARED_P - 1 missing slots from
min(valid_len, pos))] rows; `_qkv_partial_kernel` (per-sequence sets): a GEMV at pos plus a tl.dot
over BLOCK_P missing slots. fp32 partials [SPLIT, ...]; `qkv_finish._qkv_finish_kernel` finishes
them, or (batch 1, FOLD_FINISH) the attention kernel does and this launch's extra z-slices take the
slow path (`_fold_slow_program`). Splitting D keeps ~1000 programs in flight at any head count. At
batch 1 the shared-set kernel also applies the LayerNorm before attention (a PendingLN, LN_IN) and
takes refresh heads (REFRESH, refresh_heads.py). The bounds are read from device memory: CUDA-graph
safe, no host sync. Checked inputs come from deferred_kv.py's launchers; measurements behind the
settings: docs/kernels.md. Limits: hd <= 256; no duplicate head indices.
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import dot_fp32, gdc_enter, gdc_release, helper, jit, next_pow2, pdl_args, reg_cap
from dejavu.plugins.layer_norm import LN_EPS, ln_merge
from dejavu.plugins.qkv_finish import launch_finish, qkv_rows, slow_slots
from dejavu.plugins.settings import DEFAULT, table
from dejavu.plugins.sparse_attention import QKVPartials

tl = None  # triton.language, bound on first launch (see _common.jit)

@helper
def _weight_rows(wq_ptr, wkv_ptr, rows, seg, D):
    # [BLOCK_R, 1] pointers to the rows' starts: wq for Q (segment 0), wkv for K/V
    if seg == 0:
        w_rows = wq_ptr + rows[:, None] * D
    else:
        w_rows = wkv_ptr + rows[:, None] * D
    return w_rows


def _qkv_partial_kernel(xnew_ptr, xh_ptr, wq_ptr, wkv_ptr, bq_ptr, bkv_ptr, head_ptr, vl_ptr, pos_ptr,
                        pnew_ptr, phist_ptr, q_ptr, k_ptr, v_ptr, B, KH, H, D, HD, NB, D_PER_SPLIT,
                        stride_nb, stride_xb, stride_xs, stride_hb, stride_pb, stride_cb, stride_ch, stride_cs,
                        DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, GDC: tl.constexpr = 0):
    # grid (B*KH, 3 * NB, SPLIT). Partial dot products over D slice pid_s:
    # pnew[s, b, j, seg*HD + c] (value at pos) and, for K/V rows with missing slots,
    # phist[s, b, j, p, (seg-1)*HD + c] for the first BLOCK_P slots p from min(valid_len, pos).
    # Partials only: _qkv_finish_kernel follows.
    pid = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid // KH
    j = pid % KH
    b64 = b.to(tl.int64)
    gdc_enter(GDC)
    head, pos, seg, offs_c, cmask, rows, start = qkv_rows(
        head_ptr, pos_ptr, vl_ptr, b, j, pid_r, H, HD, NB, stride_hb, stride_pb, BLOCK_R)
    w_rows = _weight_rows(wq_ptr, wkv_ptr, rows, seg, D)
    xn_row = xnew_ptr + b64 * stride_nb
    xh_row = xh_ptr + b64 * stride_xb
    offs_p = start + tl.arange(0, BLOCK_P)
    pmask = offs_p < pos  # the first block of missing slots before pos
    hist = start < pos
    d_lo = pid_s * D_PER_SPLIT
    d_hi = tl.minimum(d_lo + D_PER_SPLIT, D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    acc_h = tl.zeros([BLOCK_P, BLOCK_R], dtype=tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < d_hi
        if EVEN_D:
            w = tl.load(w_rows + offs_d[None, :])
            xn = tl.load(xn_row + offs_d)
        else:
            w = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0)
            xn = tl.load(xn_row + offs_d, mask=dmask, other=0.0)
        acc += w.to(tl.float32) * xn.to(tl.float32)[None, :]
        if hist:  # the same weight chunk for the missing slots
            xt = tl.load(xh_row + offs_p[:, None].to(tl.int64) * stride_xs + offs_d[None, :],
                         mask=pmask[:, None] & dmask[None, :], other=0.0)
            if DOT_FP32:
                acc_h = tl.dot(xt.to(tl.float32), tl.trans(w.to(tl.float32)), acc_h, input_precision="ieee")
            else:
                acc_h = tl.dot(xt, tl.trans(w), acc_h)
    gdc_release(GDC)
    slot = (pid_s.to(tl.int64) * B + b) * KH + j
    tl.store(pnew_ptr + slot * 3 * HD + seg * HD + offs_c, tl.sum(acc, axis=1), mask=cmask)
    if seg > 0:
        dst = (phist_ptr + (slot * BLOCK_P + tl.arange(0, BLOCK_P)[:, None]) * 2 * HD + (seg - 1) * HD
               + offs_c[None, :])
        tl.store(dst, acc_h, mask=pmask[:, None] & cmask[None, :])


def _qkv_partial_shared_kernel(xnew_ptr, xh_ptr, wq_ptr, wkv_ptr, bq_ptr, bkv_ptr, head_ptr, vl_ptr, pos_ptr,
                               pnew_ptr, phist_ptr, q_ptr, k_ptr, v_ptr, B, KH, H, D, HD, NB, D_PER_SPLIT,
                               stride_nb, stride_xb, stride_xs, stride_pb, stride_cb, stride_ch, stride_cs,
                               lnw_ptr, lnb_ptr, st_ptr, N_ST, ST_W, eps,
                               DOT_FP32: tl.constexpr,
                               P: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                               EVEN_D: tl.constexpr, LN_IN: tl.constexpr = 0, BLOCK_N: tl.constexpr = 2,
                               SLOW: tl.constexpr = 0, SLOW_R: tl.constexpr = 16,
                               ref_ptr=None, KH_Q=0, REFRESH: tl.constexpr = 0, GDC: tl.constexpr = 0):
    # One index set for the batch: grid (KH, 3 * NB, SPLIT + SLOW); a program reads its
    # weight block once for every sequence. Its tl.dot has M = BLOCK_M = (batch padded) * P
    # rows: row m is sequence m // P at slot pos (m % P == 0) or at the (m % P)-th missing
    # slot from min(valid_len, pos) (K/V rows; P - 1 of them, the finishing kernel does the rest).
    # Partials go where _qkv_partial_kernel puts them (pnew, phist[..., p, ...] with p < P - 1).
    # LN_IN (batch 1): the input at pos is LayerNorm(x_new) (a PendingLN): its mean and
    # rstd merged from the N_ST blocks' stats at st (blocks of ST_W columns; plain loads, an
    # earlier kernel wrote them), each chunk of x_new normalised as it is loaded and
    # rounded to x_hist's dtype (the values the layer_norm kernel would store); the programs of
    # head slot 0's first row block (together they cover D once) store it at x_hist[0, pos] (no
    # program of this launch reads that slot; the attention kernel then commits valid_len only).
    # (A per-row form for batches, stats merged into [BLOCK_M] vectors and the tile normalised,
    # ran ~3x slower on the H200: BENCHMARKS.md, 2026-12-03.)
    # SLOW > 0 (batch 1, the finishing kernel folded into attention: qkv_b1
    # FOLD_FINISH): z-slice s < SPLIT is D slice s, the last SLOW z-slices are _fold_slow_program's
    # (the slots no partial holds).
    # The slow path's whole-D passes take 16 slots each (their tl.dot's M; 32 to 128 measured no faster).
    # REFRESH (batch 1, SLOW 0): head slots KH_Q.. are refresh heads (ref_ptr; -1: none): K/V rows only,
    # like a selected head's (no Q); the programs of a -1 slot or of a refresh head's Q rows do nothing.
    j = tl.program_id(0)
    pid_r = tl.program_id(1)
    slow = False
    if SLOW:  # batch 1, the attention kernel finishing the rows: the last SLOW z-slices are the slow path
        slow = tl.program_id(2) >= tl.num_programs(2) - SLOW
    if slow:
        z_slow = tl.program_id(2) + SLOW - tl.num_programs(2)
        _fold_slow_program(xh_ptr, wkv_ptr, bkv_ptr, head_ptr, vl_ptr, pos_ptr, k_ptr, v_ptr, j, pid_r, z_slow,
                           H, D, HD, NB, stride_xb, stride_xs, stride_ch, stride_cs, DOT_FP32, P, 16,
                           BLOCK_R, BLOCK_D, SLOW, SLOW_R, GDC)
    else:
        pid_s = tl.program_id(2)
        gdc_enter(GDC)
        head, pos0, seg, offs_c, cmask, rows, start0 = qkv_rows(
            head_ptr, pos_ptr, vl_ptr, 0, j, pid_r, H, HD, NB, 0, stride_pb, BLOCK_R, ref_ptr, KH_Q,
            REFRESH)
        if REFRESH:  # a real head (not -1); a refresh head (slot >= KH_Q) has no Q rows
            live = (head >= 0) & ((j < KH_Q) | (seg > 0))
        else:
            live = True
        if live:
            _shared_partial_body(xnew_ptr, xh_ptr, wq_ptr, wkv_ptr, head_ptr, vl_ptr, pos_ptr, pnew_ptr, phist_ptr,
                                 B, KH, H, D, HD, D_PER_SPLIT, stride_nb, stride_xb, stride_xs, stride_pb,
                                 lnw_ptr, lnb_ptr, st_ptr, N_ST, ST_W, eps, j, pid_r, pid_s, head, pos0,
                                 seg, offs_c, cmask, rows, DOT_FP32, P, BLOCK_M, BLOCK_P, BLOCK_R, BLOCK_D,
                                 EVEN_D, LN_IN, BLOCK_N, GDC)


@helper
def _ln_chunk(xnew_ptr, lnw_ptr, lnb_ptr, offs_d, dmask):
    # LN_IN: a chunk of the input at pos and of the LayerNorm's weight and bias, as fp32
    xv = tl.load(xnew_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    g = tl.load(lnw_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    gb = tl.load(lnb_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    return xv, g, gb


@helper
def _shared_partial_body(xnew_ptr, xh_ptr, wq_ptr, wkv_ptr, head_ptr, vl_ptr, pos_ptr, pnew_ptr, phist_ptr,
                         B, KH, H, D, HD, D_PER_SPLIT, stride_nb, stride_xb, stride_xs, stride_pb,
                         lnw_ptr, lnb_ptr, st_ptr, N_ST, ST_W, eps, j, pid_r, pid_s, head, pos0, seg, offs_c, cmask,
                         rows, DOT_FP32: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                         LN_IN: tl.constexpr, BLOCK_N: tl.constexpr, GDC: tl.constexpr):
    # _qkv_partial_shared_kernel's D-slice program (one with work: REFRESH's live)
    w_rows = _weight_rows(wq_ptr, wkv_ptr, rows, seg, D)
    offs_m = tl.arange(0, BLOCK_M)
    mb = offs_m // P
    mp = offs_m % P
    bmask = mb < B
    mb64 = mb.to(tl.int64)
    pos_m = tl.load(pos_ptr + mb * stride_pb, mask=bmask, other=0).to(tl.int32)
    if seg == 0:
        start_m = pos_m
    else:
        start_m = tl.minimum(tl.load(vl_ptr + mb * H + head, mask=bmask, other=0).to(tl.int32), pos_m)
    slot_m = tl.where(mp == 0, pos_m, start_m + mp - 1)
    is_new = bmask & (mp == 0)
    is_hist = bmask & (mp > 0) & (slot_m < pos_m)
    new_rows = xnew_ptr + mb64 * stride_nb
    hist_rows = xh_ptr + mb64 * stride_xb + slot_m.to(tl.int64) * stride_xs
    if LN_IN:  # batch 1: the sequence's mean and rstd (scalars); its row is normalised as a vector
        mean, rstd = ln_merge(st_ptr, N_ST, D, eps, ST_W, BLOCK_N)
        new_hist = xh_ptr + pos0.to(tl.int64) * stride_xs  # x_hist[0, pos]
        row0 = offs_m == 0  # the tile's row of the input at pos
    d_lo = pid_s * D_PER_SPLIT
    d_hi = tl.minimum(d_lo + D_PER_SPLIT, D)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < d_hi
        if EVEN_D:
            w = tl.load(w_rows + offs_d[None, :])
        else:
            w = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0)
        x = tl.load(hist_rows[:, None] + offs_d[None, :], mask=is_hist[:, None] & dmask[None, :], other=0.0)
        if LN_IN:
            xv, g, gb = _ln_chunk(xnew_ptr, lnw_ptr, lnb_ptr, offs_d, dmask)
            xn = ((xv - mean) * rstd * g + gb).to(x.dtype)
            # by head slot 0's first row block (a vector mask: the interpreter wants one)
            tl.store(new_hist + offs_d, xn, mask=dmask & (offs_d * 0 + j + pid_r == 0))
            x += tl.where(row0[:, None], xn[None, :], tl.zeros_like(xn)[None, :])
        else:
            x += tl.load(new_rows[:, None] + offs_d[None, :], mask=is_new[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    gdc_release(GDC)
    slot = (pid_s.to(tl.int64) * B + mb64) * KH + j  # [BLOCK_M]
    tl.store(pnew_ptr + slot[:, None] * 3 * HD + seg * HD + offs_c[None, :], acc,
             mask=is_new[:, None] & cmask[None, :])
    if seg > 0:
        dst = phist_ptr + ((slot * BLOCK_P + mp - 1)[:, None] * 2 * HD + (seg - 1) * HD + offs_c[None, :])
        tl.store(dst, acc, mask=is_hist[:, None] & cmask[None, :])


@helper
def _fold_slow_program(xh_ptr, wkv_ptr, bkv_ptr, head_ptr, vl_ptr, pos_ptr, k_ptr, v_ptr, j, pid_r, z, H, D, HD, NB,
                       stride_xb, stride_xs, stride_ch, stride_cs, DOT_FP32: tl.constexpr,
                       P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       SLOW: tl.constexpr, SLOW_R: tl.constexpr, GDC: tl.constexpr):
    # Batch 1, the finishing kernel folded into attention (slow z-slice z of the SLOW of
    # _qkv_partial_shared_kernel): K or V of head slot j's rows at the missing slots past the P - 1
    # the partials hold (start + P - 1 .. pos - 1; a head unselected for long), bias added, into the cache,
    # from whole-D tl.dot passes (slow_slots). Slice z takes sub-block z % (BLOCK_R // SLOW_R)
    # of SLOW_R rows of row block pid_r and BLOCK_P-slot chunks z // that, + SLOW // that, ...
    # Q rows and heads without such slots exit at once (before the PDL wait: the reads are of
    # what this layer's kernels of earlier steps wrote, or the side stream's heads, complete
    # before this launch); a program with work waits first (its stores after the wait).
    seg = pid_r // NB
    if seg > 0:
        n_sub: tl.constexpr = BLOCK_R // SLOW_R
        head = tl.load(head_ptr + j).to(tl.int64)
        pos = tl.load(pos_ptr).to(tl.int32)
        first = tl.minimum(tl.load(vl_ptr + head).to(tl.int32), pos) + P - 1
        if first + (z // n_sub) * BLOCK_P < pos:
            gdc_enter(GDC)
            offs_c = (pid_r % NB) * BLOCK_R + (z % n_sub) * SLOW_R + tl.arange(0, SLOW_R)
            cmask = offs_c < HD
            rows = (seg - 1).to(tl.int64) * H * HD + head * HD + tl.where(cmask, offs_c, 0)
            bias = tl.load(bkv_ptr + rows).to(tl.float32)
            if seg == 1:
                cache = k_ptr + head * stride_ch
            else:
                cache = v_ptr + head * stride_ch
            slow_slots(xh_ptr, wkv_ptr, cache, bias, 0, pos, offs_c, cmask, rows, first, z // n_sub,
                        SLOW // n_sub, D, stride_xb, stride_xs, stride_cs, DOT_FP32, BLOCK_P, SLOW_R, BLOCK_D)


def qkv_table(B, config, settings=None):
    s = settings or DEFAULT
    return table(s.qkv_b1 if B == 1 else s.qkv, config)


def shared_qkv(B, head_idx, cfg) -> bool:
    """The Q/K/V work of one index set for the batch (a [Kh] set, or batch 1, whose [1, Kh] set
    is the batch's only one) takes _qkv_partial_shared_kernel (from SHARED_MIN_BATCH)."""
    smin = cfg["SHARED_MIN_BATCH"]
    return (head_idx.dim() == 1 or B == 1) and smin is not None and B >= smin


def _unfolded_cfg(cfg: dict, unfolded: bool, n_ref: int) -> dict:
    """cfg with SHARED_P_UNFOLDED as SHARED_P (BLOCK_P at least that, UNFOLDED_MAXNREG as the register cap,
    reg_cap's "maxnreg") where it applies: the unfolded batch-1 route without refresh heads."""
    sp = cfg.get("SHARED_P_UNFOLDED") or 0
    if not (unfolded and not n_ref and sp > cfg["SHARED_P"]):
        return cfg
    return {**cfg, "SHARED_P": sp, "BLOCK_P": max(cfg["BLOCK_P"], sp), "maxnreg": cfg["UNFOLDED_MAXNREG"]}


def hist_slots(B: int, head_idx, config=None, settings=None) -> int:
    """How many missing slots of a selected head (from min(valid_len, pos)) the Q/K/V kernels of a
    deferred decode step with this Q/K/V config compute from their partial products; the slow path
    does the slots past them. On the unfolded batch-1 route SHARED_P_UNFOLDED (without refresh heads)
    reaches further: this is the reach every selected head has."""
    cfg = qkv_table(B, config, settings)
    return cfg["SHARED_P"] - 1 if shared_qkv(B, head_idx, cfg) else cfg["BLOCK_P"]


def qkv_split(cfg: dict, D: int, groups: int, fold: bool) -> tuple[int, int, bool]:
    """(slices of D, columns per slice, whether the finish is folded into attention) of the Q/K/V
    partial kernel with `groups` row blocks per slice, `fold` asked for (checked by the caller)."""
    bd = cfg["BLOCK_D"]
    d_blocks = -(-D // bd)
    split = cfg["SPLIT"] or max(1, min(d_blocks, cfg["TARGET_PROGRAMS"] // groups))
    d_per = -(-d_blocks // split) * bd
    split = -(-D // d_per)
    if fold and split > cfg["FOLD_MAX_SPLIT"]:  # the attention kernel unrolls the partial loads: fewer, longer programs
        d_per = -(-d_blocks // cfg["FOLD_MAX_SPLIT"]) * bd
        split = -(-D // d_per)
    elif cfg["FOLD_FINISH"] == "wide":  # fold only where the finishing kernel would sum many slices
        fold = False
    return split, d_per, fold


def launch_qkv(x_new, x_hist, wq, bq, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb,
               q, config, pending=None, fold=False, refresh=None, settings=None):
    """The Q/K/V kernels (checked inputs, Kh > 0): partial + finish (qkv_finish.launch_finish).
    q [B, Kh*hd] fp32 gets Q. pending: x_new's PendingLN (batch 1 on the shared-set kernel only),
    normalised in the kernel, which also stores it at x_hist[:, pos].
    fold (batch 1 on the shared-set kernel): no finishing kernel; the partial kernel's last z-slices
    fill the slots no partial holds (_fold_slow_program) and the QKVPartials returned go to the
    attention kernel, which finishes the rest (q stays unwritten); with more than FOLD_MAX_SPLIT
    slices of D the finishing kernel runs instead (None returned).
    refresh: [R] int32 refresh heads (`refresh_route` holds; -1: none): head slots Kh.. of both
    kernels, K/V only; the split of D stays the one of the selected heads."""
    B, S, D = x_hist.shape
    H, hd = k_cache.shape[1], k_cache.shape[3]
    kh = head_idx.shape[-1]
    pdl = (settings or DEFAULT).pdl
    cfg = qkv_table(B, config, settings)
    nb = -(-hd // cfg["BLOCK_R"])
    shared = shared_qkv(B, head_idx, cfg)
    batch1 = shared and B == 1
    if pending is not None and not batch1:
        raise DejavuError("launch_qkv: a PendingLN input needs batch 1 on the shared-set kernel")
    if fold and not batch1:
        raise DejavuError("launch_qkv: folding the finish needs batch 1 on the shared-set kernel")
    split, d_per, fold = qkv_split(cfg, D, (1 if shared else B) * kh * 3 * nb, fold)  # row blocks per slice of D
    dev = x_hist.device
    n_ref = 0 if refresh is None else refresh.shape[0]
    if n_ref and (fold or not batch1):
        raise DejavuError("launch_qkv: refresh heads need batch 1 on the shared-set kernel and no fold")
    ref_args = dict(ref_ptr=refresh, KH_Q=kh, REFRESH=1) if n_ref else {}
    kh_q, kh = kh, kh + n_ref  # head slots: the selected heads, then the refresh heads
    cfg = _unfolded_cfg(cfg, batch1 and not fold, n_ref)  # unfolded: with its finishing kernel
    bp = cfg["BLOCK_P"]
    pnew = torch.empty((split, B, kh, 3 * hd), dtype=torch.float32, device=dev)
    phist = torch.empty((split, B, kh, bp, 2 * hd), dtype=torch.float32, device=dev)
    args = (x_new, x_hist, wq, wkv, bq, bkv, head_idx, valid_len, pos_t, pnew, phist, q, k_cache, v_cache,
            B, kh, H, D, hd, nb, d_per, x_new.stride(0), x_hist.stride(0), x_hist.stride(1))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    common = dict(DOT_FP32=dot_fp32(x_hist.dtype, dev), BLOCK_P=bp, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"],
                  EVEN_D=D % d_per == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  **reg_cap(cfg, dev), **pdl_args(dev, "qkv", pdl))
    if shared:  # one program set for the batch, M = batch * P rows in its tl.dot
        sp = cfg["SHARED_P"]
        if not 1 <= sp - 1 <= bp or sp & (sp - 1):
            raise DejavuError(f"config: SHARED_P must be a power of 2 with SHARED_P - 1 in [1, BLOCK_P={bp}], "
                              f"got SHARED_P={sp}")
        hist_len = sp - 1
        if pending is not None:
            n_st = pending.stats.shape[1]
            ln_args = (pending.weight, pending.bias, pending.stats, n_st, pending.width, LN_EPS)
        else:
            n_st, ln_args = 1, (x_new, x_new, pnew, 1, 1, LN_EPS)  # never read without LN_IN
        slow_r = min(cfg["BLOCK_R"], cfg["FOLD_SLOW_R"])
        # folded: the slow path in the partial kernel's z-slices (no finishing kernel)
        n_slow = (cfg["BLOCK_R"] // slow_r) * cfg["FOLD_SLOW_Z"] if fold else 0
        part = jit(_qkv_partial_shared_kernel, dev)
        part[(kh, 3 * nb, n_slow + split)](*args, stride_pb, *cache_strides, *ln_args, P=sp,
                                           BLOCK_M=max(16, next_pow2(B) * sp), LN_IN=pending is not None,
                                           BLOCK_N=max(2, next_pow2(n_st)), SLOW=n_slow, SLOW_R=slow_r,
                                           **ref_args, **common)
        if fold:
            return QKVPartials(pnew, phist, split, hist_len, bp, bq, bkv)
    else:
        hist_len = bp
        part = jit(_qkv_partial_kernel, dev)
        part[(B * kh, 3 * nb, split)](*args, 0 if head_idx.dim() == 1 else head_idx.stride(0), stride_pb,
                                      *cache_strides, **common)
    launch_finish(cfg, x_hist, wkv, bq, bkv, head_idx, valid_len, pos_t, stride_pb, pnew, phist, q, k_cache, v_cache,
                  kh_q, hist_len, common["DOT_FP32"], refresh, pdl)
    return None

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

Q/K/V of the selected heads take one launch. `_qkv_partial_kernel`: grid (B*Kh, rows, SPLIT):
a program owns BLOCK_R rows of one of its head's three hd-row segments (Q, K or V) and one
of SPLIT slices of D, and reads that weight block once, in BLOCK_D chunks: a GEMV with this
step's input gives the rows' partial value at pos and, for K/V rows, a tl.dot with the
history inputs the partial values at the first BLOCK_P missing slots
min(valid_len, pos)..pos-1, from the same weight chunk (fp32 partials, [SPLIT, ...]).
Splitting D keeps ~1000 programs in flight at any head count (a whole-D program per row
block ran at ~1.5 TB/s on the H200). A second launch, `_qkv_finish_kernel`, grid (B*Kh, rows of
FINISH_R), finishes the rows (`_finish_rows`): sums the partials (.cg loads: L2, not L1), adds
the bias, writes Q (fp32 buffer) and K/V into the cache at pos and at those slots; a head
unselected for more than BLOCK_P steps gets its further slots there, from whole-D tl.dot
passes over its rows (the slow path: ~20% of selections with random sets at head density
0.1, ~1% with opt-mini's trained predictors; shared out over SLOW_Z programs per row block).
The bounds are read from device memory: CUDA-graph safe, no host sync. valid_len and x_hist[:, pos] are updated after the Q/K/V launch, by the
attention kernel that follows (programs of one head would race if these kernels wrote
them), or by `_commit_kernel` when nothing attends. A decode layer is then: Q/K/V,
attention (+ commit), output projection (+ its reduction). At batch 1 the finishing kernel can be
folded into attention (QKV_CONFIG_B1 FOLD_FINISH, docs/kernels.md): the attention kernel sums the
partials, the combine kernel commits valid_len.
A shared index set (one [Kh] set for the batch) can take `_qkv_partial_shared_kernel`
instead, which reads each weight block once for the whole batch (tl.dot over batch x
(new slot + SHARED_P - 1 missing slots) rows; its finishing program does every sequence of
its rows). It is the default for shared sets from batch 2 (QKV_CONFIG["SHARED_MIN_BATCH"])
and at batch 1 (QKV_CONFIG_B1: one tl.dot over [x at pos, 15 missing slots], 64-row
blocks): on the H200 (OPT-30B shape, head density 0.3, gap 3) the whole deferred attention
call took 53-57 us at batch 1 against 69-72 with the per-sequence kernel, and 83 against
259 us at batch 8; the decode step 7.28 against 7.74 ms at batch 1, 10.4 against 16.8 at
batch 8 (BENCHMARKS.md, 2026-12-02). Per-sequence sets (batch > 1) keep
`_qkv_partial_kernel`.
Refresh heads (batch 1, `refresh_heads` then `sparse_attn_decode_deferred(..., refresh=)`): heads that
do not attend but have fallen hist_slots behind get their K/V in the same two Q/K/V launches (extra
head slots without Q rows, constexpr REFRESH), valid_len committed by the attention kernel, so no
head reaches the slow path when it is selected again (`refresh_route` says where the kernels take
them; the runtime's default uses them from 40% of the heads attending: BENCHMARKS.md, 2026-12-04).
Slots of unselected heads and slots outside the range are not touched. Limits: hd <= 256;
duplicate head indices not allowed (top-k never makes them).
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_index, check_out, check_tensor, default_validate,
                                    gdc_enter, gdc_release, helper, jit, next_pow2, pdl_args, reg_cap)
from dejavu.plugins.sparse_attention import (ATTN_CONFIG, QKVPartials, _check_attn, _positions, attend_project,
                                             folds_finish)
from dejavu.plugins.layer_norm import PendingLN, check_pending, materialize, materialize_ref
from dejavu.plugins.sparse_mlp import LN_EPS, _dot_fp32, _ln_merge

tl = None  # triton.language, bound on first launch (see _common.jit)

# BLOCK_P: missing slots per tl.dot block (>= 16); BLOCK_R: rows per program (>= 16, the
# dot's N); SPLIT: slices of D (None: enough for ~TARGET_PROGRAMS programs). Picked by
# `benchmarks/kernels.py --sweep-attn` on an H200. _qkv_finish_kernel takes FINISH_R rows per program
# (SLOW_Z programs share the slow path's chunks of a head unselected for more than SHARED_P - 1 steps). FINISH_S: slices of D summed per load
# when finishing (a power of 2; more splits take more loads, fewer registers).
# SHARED_*: a shared index set with B >= SHARED_MIN_BATCH takes _qkv_partial_shared_kernel
# (weights read once for the batch; SHARED_P - 1 missing slots per sequence in its tl.dot).
# SHARED_MIN_BATCH 1 takes it at batch 1 too: one tl.dot over [x at pos, SHARED_P - 1 missing
# slots] instead of a GEMV plus a tl.dot over BLOCK_P missing slots.
# QKV_CONFIG serves batches >= 2; batch 1 starts from QKV_CONFIG_B1 (both overridden by
# `config=`). Batches with a shared set take the shared-set kernel (SHARED_MIN_BATCH 2): on
# the H200 (OPT-30B, head density 0.3, batch 8, gap 3) the deferred attention call took 83
# against 259 us with the per-sequence kernel, the decode step 10.4 against 16.8 ms.
QKV_CONFIG = {"BLOCK_P": 16, "BLOCK_R": 32, "BLOCK_D": 128, "SPLIT": None, "TARGET_PROGRAMS": 1056,
              "FINISH_R": 32, "num_warps": 4, "num_stages": 2, "SHARED_MIN_BATCH": 2, "SHARED_P": 4,
              "FINISH_S": 8, "SLOW_Z": 1, "SLOW_TARGET": 640, "EARLY_READS": True,
              "FOLD_FINISH": False, "FOLD_SLOW_R": 16, "FOLD_SLOW_Z": 1, "FOLD_MAX_SPLIT": 8, "FOLD_CAP": False,
              "FOLD_SLOW_LAST": False, "SHARED_P_UNFOLDED": None, "UNFOLDED_MAXNREG": None}
# Batch 1: the shared-set kernel with 15 missing slots per tl.dot, the fastest of 120 configs
# of `kernels.py --sweep-attn` on the H200 (2026-12-02; OPT-30B, head density 0.3, gap 3), and
# the finishing kernel's blocks from `--qkv-sweep finish` (16 rows, one partial per load:
# 111.6 vs 116.0 us per two calls; decode step 6.93 vs 7.03 ms). A copy made at import:
# later edits of QKV_CONFIG do not reach batch 1.
# SLOW_Z None: as many programs per row block as fill ~SLOW_TARGET finishing programs (at most
# 8): OPT-30B shape, batch 1, d0.1 (6 heads, 144 row blocks): 4, 4.20 vs 4.39 ms/token with 1;
# d0.3 (17 heads, 408 row blocks): 1 (4 there: 6.70 vs 6.59; BENCHMARKS.md, 2026-12-03).
# FOLD_FINISH (batch 1, shared-set kernel, attention with a combine launch:
# `sparse_attention.folds_finish`): no finishing kernel; the attention kernel sums the partials
# itself (Q in every chunk program; K/V at pos and at the P - 1 slots the partials hold in the
# program of pos's chunk, which stores them into the caches), the combine kernel commits
# valid_len, and the partial kernel's first z-slices (FOLD_SLOW_Z chunk sets x sub-blocks of
# FOLD_SLOW_R rows) fill any further missing slots from whole-D passes. One launch fewer in
# each layer's latency-bound chain. Up to FOLD_MAX_SPLIT slices of D (the attention kernel
# unrolls their loads); more: the finishing kernel runs (FOLD_CAP: the partial kernel takes
# FOLD_MAX_SPLIT slices instead). FOLD_SLOW_LAST: the slow z-slices after the D slices in the grid.
# FOLD_FINISH "wide" (batch 1's default): fold only where the partial kernel would take more than
# FOLD_MAX_SPLIT slices (few heads: OPT-30B d0.1, 14 slices, capped to 8), where the finishing
# kernel is at its slowest (one load per slice, and the slow path of frequent long gaps). On the
# H200 (OPT-30B shape, batch 1, 2026-12-03): d0.1 3.49 vs 3.77-3.78 ms/token (capped, slow z-slices
# last, FOLD_SLOW_Z 4; Z 2 3.52-3.54, Z 8 3.50, Z 1 3.69); at d0.3 (5 slices) every folded form was
# slower, 6.36-6.52 vs 6.28-6.35. OPT-1.3B shape (16 slices at d0.3): 0.870 vs 0.950 ms/token.
# SHARED_P_UNFOLDED (batch 1, the same unfolded route, no refresh heads in the launch; None off): the
# SHARED_P of every program there (BLOCK_P raised to match), with UNFOLDED_MAXNREG as the partial kernel's
# register cap (126 registers uncapped at P 32). On the H200 (OPT-30B shape, batch 1; 2026-12-04) P 32
# with a 128-register cap took d0.3 to 6.222 / 6.295 ms/token against 6.287-6.288 / 6.351-6.355 (runs 3,
# 10), d0.2 to 5.030 vs 5.134: the partial kernel gets 8.6% slower, the slow path (a quarter of the
# layers) is gone. With refresh heads (d0.5 by default) 8.936 vs 8.898-8.902, so they keep P 16; the
# folded route (d0.1) too (its attention kernel sums the partials' slots: 3.72 vs 3.48 with P 32).
# TARGET_PROGRAMS (batch 1) 512, not 528 = 4 x 132 SMs: the partial kernel's programs fill the register file
# 4 to an SM (126-128 registers), so a launch of 528 (OPT-30B d0.2: 8 slices x 66 row blocks) leaves no slot
# for the predictors' stream, whose first GEMV then starts only as the partial kernel drains (16.8 vs 1.5 us
# into the layer) and whose chain runs into fc1 / fc2. 512 takes 7 slices (462 programs) there: d0.2 4.828-
# 4.832 against 4.985-4.990 ms/token on the H200 (2026-12-04); d0.1 / d0.3 / d0.5 launch the same programs
# either way (504 / 510 / 504); 480 (d0.3: 4 slices, 408 programs) 6.432 against 6.236-6.238 at d0.3.
QKV_CONFIG_B1 = {**QKV_CONFIG, "BLOCK_R": 64, "TARGET_PROGRAMS": 512, "num_stages": 3,
                 "SHARED_P_UNFOLDED": 32, "UNFOLDED_MAXNREG": 128,
                 "SHARED_MIN_BATCH": 1, "SHARED_P": 16, "FINISH_R": 16, "FINISH_S": 1,
                 "SLOW_Z": None, "SLOW_TARGET": 640,
                 "FOLD_FINISH": "wide", "FOLD_SLOW_Z": 4, "FOLD_SLOW_LAST": True}


@helper
def _qkv_rows(head_ptr, pos_ptr, vl_ptr, b, j, pid_r, H, HD, NB, stride_hb, stride_pb,
              FIRST_SEG: tl.constexpr, BLOCK_R: tl.constexpr, ref_ptr=None, KH_Q=0, REFRESH: tl.constexpr = 0):
    # This program's head, pos, segment (0 Q, 1 K, 2 V), channels, weight rows (row of wq for
    # Q, of wkv for K/V; masked channels map to channel 0) and first missing slot (pos for Q).
    # REFRESH (batch 1): head slots j >= KH_Q are the refresh heads ref[j - KH_Q] (-1: none; the
    # rows and start are then head 0's, and the caller does nothing).
    if REFRESH:
        if j < KH_Q:
            head = tl.load(head_ptr + b * stride_hb + j).to(tl.int64)
        else:
            head = tl.load(ref_ptr + (j - KH_Q)).to(tl.int64)
        h = tl.maximum(head, 0)
    else:
        head = tl.load(head_ptr + b * stride_hb + j).to(tl.int64)
        h = head
    pos = tl.load(pos_ptr + b * stride_pb).to(tl.int32)
    seg = FIRST_SEG + pid_r // NB
    offs_c = (pid_r % NB) * BLOCK_R + tl.arange(0, BLOCK_R)
    cmask = offs_c < HD
    c = tl.where(cmask, offs_c, 0)
    if seg == 0:
        rows = h * HD + c
        start = pos
    else:
        rows = (seg - 1).to(tl.int64) * H * HD + h * HD + c
        start = tl.minimum(tl.load(vl_ptr + b * H + h).to(tl.int32), pos)
    return head, pos, seg, offs_c, cmask, rows, start


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
                        HAS_NEW: tl.constexpr, FIRST_SEG: tl.constexpr, DOT_FP32: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                        GDC: tl.constexpr = 0):
    # grid (B*KH, (3 - FIRST_SEG) * NB, SPLIT). Partial dot products over D slice pid_s:
    # pnew[s, b, j, seg*HD + c] (value at pos) and, for K/V rows with missing slots,
    # phist[s, b, j, p, (seg-1)*HD + c] for the first BLOCK_P slots p from min(valid_len, pos).
    # HAS_NEW false: the input at pos is x_hist[b, pos] (recompute_kv).
    # Partials only: _qkv_finish_kernel follows.
    pid = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid // KH
    j = pid % KH
    b64 = b.to(tl.int64)
    gdc_enter(GDC)
    head, pos, seg, offs_c, cmask, rows, start = _qkv_rows(
        head_ptr, pos_ptr, vl_ptr, b, j, pid_r, H, HD, NB, stride_hb, stride_pb, FIRST_SEG, BLOCK_R)
    w_rows = _weight_rows(wq_ptr, wkv_ptr, rows, seg, D)
    if HAS_NEW:
        xn_row = xnew_ptr + b64 * stride_nb
    else:
        xn_row = xh_ptr + b64 * stride_xb + pos.to(tl.int64) * stride_xs
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
                               HAS_NEW: tl.constexpr, FIRST_SEG: tl.constexpr, DOT_FP32: tl.constexpr,
                               P: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                               EVEN_D: tl.constexpr, W_EV: tl.constexpr = "",
                               LN_IN: tl.constexpr = 0, BLOCK_N: tl.constexpr = 2, ST_CM: tl.constexpr = "",
                               SLOW: tl.constexpr = 0, SLOW_R: tl.constexpr = 16, SLOW_LAST: tl.constexpr = 0,
                               ref_ptr=None, KH_Q=0, REFRESH: tl.constexpr = 0, GDC: tl.constexpr = 0):
    # One index set for the batch: grid (KH, (3 - FIRST_SEG) * NB, SLOW + SPLIT); a program reads its
    # (W_EV: eviction policy of the weight loads)
    # weight block once for every sequence. Its tl.dot has M = BLOCK_M = (batch padded) * P
    # rows: row m is sequence m // P at slot pos (m % P == 0) or at the (m % P)-th missing
    # slot from min(valid_len, pos) (K/V rows; P - 1 of them, the finishing kernel does the rest).
    # Partials go where _qkv_partial_kernel puts them (pnew, phist[..., p, ...] with p < P - 1).
    # LN_IN (HAS_NEW, batch 1): the input at pos is LayerNorm(x_new) (a PendingLN): its mean and
    # rstd merged from the N_ST blocks' stats at st (blocks of ST_W columns; ST_CM "": plain
    # loads, an earlier kernel wrote them), each chunk of x_new normalised as it is loaded and
    # rounded to x_hist's dtype (the values the layer_norm kernel would store); the programs of
    # head slot 0's first row block (together they cover D once) store it at x_hist[0, pos] (no
    # program of this launch reads that slot; the attention kernel then commits valid_len only).
    # (A per-row form for batches, stats merged into [BLOCK_M] vectors and the tile normalised,
    # ran ~3x slower on the H200: BENCHMARKS.md, 2026-12-03.)
    # SLOW > 0 (batch 1, the finishing kernel folded into attention: QKV_CONFIG_B1
    # FOLD_FINISH): z-slices 0 .. SLOW-1 are _fold_slow_program's (the slots no partial holds),
    # slice SLOW + s is D slice s; SLOW_LAST: the last SLOW z-slices are, after the D slices.
    # The slow path's whole-D passes take 16 slots each (their tl.dot's M; 32 to 128 measured no faster).
    # REFRESH (batch 1, SLOW 0): head slots KH_Q.. are refresh heads (ref_ptr; -1: none): K/V rows only,
    # like a selected head's (no Q); the programs of a -1 slot or of a refresh head's Q rows do nothing.
    j = tl.program_id(0)
    pid_r = tl.program_id(1)
    slow = False
    z_lo = 0  # the first z-slice of the D slices
    if SLOW:  # batch 1, the attention kernel finishing the rows: SLOW z-slices are the slow path
        if SLOW_LAST:
            slow = tl.program_id(2) >= tl.num_programs(2) - SLOW
        else:
            slow = tl.program_id(2) < SLOW
            z_lo = SLOW
    if slow:
        if SLOW_LAST:
            z_slow = tl.program_id(2) + SLOW - tl.num_programs(2)
        else:
            z_slow = tl.program_id(2)
        _fold_slow_program(xh_ptr, wkv_ptr, bkv_ptr, head_ptr, vl_ptr, pos_ptr, k_ptr, v_ptr, j, pid_r, z_slow,
                           H, D, HD, NB, stride_xb, stride_xs, stride_ch, stride_cs, FIRST_SEG, DOT_FP32, P, 16,
                           BLOCK_R, BLOCK_D, SLOW, SLOW_R, GDC)
    else:
        pid_s = tl.program_id(2) - z_lo
        gdc_enter(GDC)
        head, pos0, seg, offs_c, cmask, rows, start0 = _qkv_rows(
            head_ptr, pos_ptr, vl_ptr, 0, j, pid_r, H, HD, NB, 0, stride_pb, FIRST_SEG, BLOCK_R, ref_ptr, KH_Q,
            REFRESH)
        if REFRESH:  # a real head (not -1); a refresh head (slot >= KH_Q) has no Q rows
            live = (head >= 0) & ((j < KH_Q) | (seg > 0))
        else:
            live = True
        if live:
            _shared_partial_body(xnew_ptr, xh_ptr, wq_ptr, wkv_ptr, head_ptr, vl_ptr, pos_ptr, pnew_ptr, phist_ptr,
                                 B, KH, H, D, HD, D_PER_SPLIT, stride_nb, stride_xb, stride_xs, stride_pb,
                                 lnw_ptr, lnb_ptr, st_ptr, N_ST, ST_W, eps, j, pid_r, pid_s, head, pos0,
                                 seg, offs_c, cmask, rows, HAS_NEW, DOT_FP32, P, BLOCK_M, BLOCK_P, BLOCK_R, BLOCK_D,
                                 EVEN_D, W_EV, LN_IN, BLOCK_N, ST_CM, GDC)


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
                         rows, HAS_NEW: tl.constexpr, DOT_FP32: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                         W_EV: tl.constexpr, LN_IN: tl.constexpr, BLOCK_N: tl.constexpr, ST_CM: tl.constexpr,
                         GDC: tl.constexpr):
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
    if HAS_NEW:
        new_rows = xnew_ptr + mb64 * stride_nb
        hist_rows = xh_ptr + mb64 * stride_xb + slot_m.to(tl.int64) * stride_xs
        take_hist = is_hist
    else:  # the input at pos is x_hist[b, pos] too
        new_rows = xh_ptr  # never read (take_new is all false)
        hist_rows = xh_ptr + mb64 * stride_xb + slot_m.to(tl.int64) * stride_xs
        take_hist = is_hist | is_new
    take_new = is_new & HAS_NEW
    if LN_IN:  # batch 1: the sequence's mean and rstd (scalars); its row is normalised as a vector
        mean, rstd = _ln_merge(st_ptr, N_ST, D, eps, ST_W, BLOCK_N, ST_CM)
        new_hist = xh_ptr + pos0.to(tl.int64) * stride_xs  # x_hist[0, pos]
        row0 = offs_m == 0  # the tile's row of the input at pos
    d_lo = pid_s * D_PER_SPLIT
    d_hi = tl.minimum(d_lo + D_PER_SPLIT, D)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < d_hi
        if EVEN_D:
            w = tl.load(w_rows + offs_d[None, :], eviction_policy=W_EV)
        else:
            w = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0, eviction_policy=W_EV)
        x = tl.load(hist_rows[:, None] + offs_d[None, :], mask=take_hist[:, None] & dmask[None, :], other=0.0)
        if LN_IN:
            xv, g, gb = _ln_chunk(xnew_ptr, lnw_ptr, lnb_ptr, offs_d, dmask)
            xn = ((xv - mean) * rstd * g + gb).to(x.dtype)
            # by head slot 0's first row block (a vector mask: the interpreter wants one)
            tl.store(new_hist + offs_d, xn, mask=dmask & (offs_d * 0 + j + pid_r == 0))
            x += tl.where(row0[:, None], xn[None, :], tl.zeros_like(xn)[None, :])
        elif HAS_NEW:
            x += tl.load(new_rows[:, None] + offs_d[None, :], mask=take_new[:, None] & dmask[None, :], other=0.0)
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
                       stride_xb, stride_xs, stride_ch, stride_cs, FIRST_SEG: tl.constexpr, DOT_FP32: tl.constexpr,
                       P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       SLOW: tl.constexpr, SLOW_R: tl.constexpr, GDC: tl.constexpr):
    # Batch 1, the finishing kernel folded into attention (slow z-slice z of the SLOW of
    # _qkv_partial_shared_kernel): K or V of head slot j's rows at the missing slots past the P - 1
    # the partials hold (start + P - 1 .. pos - 1; a head unselected for long), bias added, into the cache,
    # from whole-D tl.dot passes (_slow_slots). Slice z takes sub-block z % (BLOCK_R // SLOW_R)
    # of SLOW_R rows of row block pid_r and BLOCK_P-slot chunks z // that, + SLOW // that, ...
    # Q rows and heads without such slots exit at once (before the PDL wait: the reads are of
    # what this layer's kernels of earlier steps wrote, or the side stream's heads, complete
    # before this launch); a program with work waits first (its stores after the wait).
    seg = FIRST_SEG + pid_r // NB
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
            _slow_slots(xh_ptr, wkv_ptr, cache, bias, 0, pos, offs_c, cmask, rows, first, z // n_sub,
                        SLOW // n_sub, D, stride_xb, stride_xs, stride_cs, DOT_FP32, BLOCK_P, SLOW_R, BLOCK_D)


@helper
def _sum_partials(pnew_ptr, phist_ptr, b64, j, seg, offs_c, cmask, start, pos, B, KH, HD, SPLIT, HIST_LEN,
                  BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    # The rows' sums over the SPLIT slices of D: value at pos [BLOCK_R] and, for K/V rows, at the
    # first HIST_LEN missing slots [BLOCK_P, BLOCK_R]. BLOCK_S splits per load (few memory round
    # trips, not SPLIT); .cg: another kernel wrote them, in L2.
    new = tl.zeros([BLOCK_R], dtype=tl.float32)
    hist = tl.zeros([BLOCK_P, BLOCK_R], dtype=tl.float32)
    offs_p = tl.arange(0, BLOCK_P)
    pmask = (start + offs_p < pos) & (offs_p < HIST_LEN)
    for s0 in range(0, SPLIT, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        smask = offs_s < SPLIT
        slot = (offs_s.to(tl.int64) * B + b64) * KH + j  # [BLOCK_S]
        new += tl.sum(tl.load(pnew_ptr + slot[:, None] * 3 * HD + seg * HD + offs_c[None, :],
                              mask=smask[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg"), axis=0)
        if seg > 0:
            if start < pos:
                src = (phist_ptr + ((slot[:, None, None] * BLOCK_P + offs_p[None, :, None]) * 2 * HD
                                    + (seg - 1) * HD + offs_c[None, None, :]))
                m = smask[:, None, None] & pmask[None, :, None] & cmask[None, None, :]
                hist += tl.sum(tl.load(src, mask=m, other=0.0, cache_modifier=".cg"), axis=0)
    return new, hist


@helper
def _store_qkv(new, hist, xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, q_ptr, k_ptr, v_ptr, b64, j, head, pos, seg, offs_c,
               cmask, rows, start, KH, D, HD, HIST_LEN, stride_xb, stride_xs, stride_cb, stride_ch, stride_cs,
               DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
               SLOW: tl.constexpr = 1, SLOW_P: tl.constexpr = 16, SLOW_D: tl.constexpr = 128):
    # Add the bias to the rows' whole sums and store Q (fp32 buffer) or K/V at pos and at the
    # first HIST_LEN (<= BLOCK_P) missing slots; then (SLOW) any further missing slots of K/V
    # rows (a head unselected for long: whole-D tl.dot passes over these rows, the slow path).
    if seg == 0:
        bias = tl.load(bq_ptr + rows).to(tl.float32)
        tl.store(q_ptr + (b64 * KH + j) * HD + offs_c, new + bias, mask=cmask)
    else:
        bias = tl.load(bkv_ptr + rows).to(tl.float32)
        if seg == 1:
            cache = k_ptr + b64 * stride_cb + head * stride_ch
        else:
            cache = v_ptr + b64 * stride_cb + head * stride_ch
        dt = k_ptr.dtype.element_ty
        offs_p = start + tl.arange(0, BLOCK_P)
        pmask = (offs_p < pos) & (tl.arange(0, BLOCK_P) < HIST_LEN)
        tl.store(cache + pos.to(tl.int64) * stride_cs + offs_c, (new + bias).to(dt), mask=cmask)
        tl.store(cache + offs_p[:, None].to(tl.int64) * stride_cs + offs_c[None, :], (hist + bias[None, :]).to(dt),
                 mask=pmask[:, None] & cmask[None, :])
        if SLOW:
            _slow_slots(xh_ptr, wkv_ptr, cache, bias, b64, pos, offs_c, cmask, rows, start + HIST_LEN, 0, 1, D,
                        stride_xb, stride_xs, stride_cs, DOT_FP32, SLOW_P, BLOCK_R, SLOW_D)


@helper
def _slow_slots(xh_ptr, wkv_ptr, cache, bias, b64, pos, offs_c, cmask, rows, first, z, Z, D, stride_xb, stride_xs,
                stride_cs, DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr):
    # K or V of the rows (bias added) at the missing slots first..pos-1 that no partial holds,
    # from whole-D tl.dot passes over the rows and x_hist: chunks z, z + Z, ... of BLOCK_P slots
    # (a head unselected for long; Z programs share the chunks, SLOW_Z of the finishing kernel).
    dt = cache.dtype.element_ty
    w_rows = wkv_ptr + rows[:, None] * D
    xh_row = xh_ptr + b64 * stride_xb
    for p0 in range(first + z * BLOCK_P, pos, Z * BLOCK_P):
        offs_q = p0 + tl.arange(0, BLOCK_P)
        qmask = offs_q < pos
        acc_q = tl.zeros([BLOCK_P, BLOCK_R], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            w = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0)
            xt = tl.load(xh_row + offs_q[:, None].to(tl.int64) * stride_xs + offs_d[None, :],
                         mask=qmask[:, None] & dmask[None, :], other=0.0)
            if DOT_FP32:
                acc_q = tl.dot(xt.to(tl.float32), tl.trans(w.to(tl.float32)), acc_q, input_precision="ieee")
            else:
                acc_q = tl.dot(xt, tl.trans(w), acc_q)
        tl.store(cache + offs_q[:, None].to(tl.int64) * stride_cs + offs_c[None, :],
                 (acc_q + bias[None, :]).to(dt), mask=qmask[:, None] & cmask[None, :])


@helper
def _finish_rows(xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, pnew_ptr, phist_ptr, q_ptr, k_ptr, v_ptr, b64, j, head, pos,
                 seg, offs_c, cmask, rows, start, B, KH, D, HD, SPLIT, HIST_LEN, stride_xb, stride_xs, stride_cb,
                 stride_ch, stride_cs, DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SLOW: tl.constexpr = 1, SLOW_P: tl.constexpr = 16,
                 SLOW_D: tl.constexpr = 128):
    # What finishes a row block: the SPLIT partials summed, then _store_qkv (SLOW: its slow path too).
    new, hist = _sum_partials(pnew_ptr, phist_ptr, b64, j, seg, offs_c, cmask, start, pos, B, KH, HD, SPLIT,
                              HIST_LEN, BLOCK_P, BLOCK_R, BLOCK_S)
    _store_qkv(new, hist, xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, q_ptr, k_ptr, v_ptr, b64, j, head, pos, seg, offs_c,
               cmask, rows, start, KH, D, HD, HIST_LEN, stride_xb, stride_xs, stride_cb, stride_ch, stride_cs,
               DOT_FP32, BLOCK_P, BLOCK_R, BLOCK_D, SLOW, SLOW_P, SLOW_D)


def _qkv_finish_kernel(xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, head_ptr, vl_ptr, pos_ptr, pnew_ptr, phist_ptr,
                       q_ptr, k_ptr, v_ptr, B, KH, H, D, HD, NB, SPLIT, HIST_LEN, stride_xb, stride_xs, stride_hb,
                       stride_pb, stride_cb, stride_ch, stride_cs,
                       FIRST_SEG: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                       SLOW_Z: tl.constexpr = 1, EARLY_READS: tl.constexpr = 0, ref_ptr=None, KH_Q=0,
                       REFRESH: tl.constexpr = 0, GDC: tl.constexpr = 0):
    # Grid (B*KH, (3 - FIRST_SEG) * NB,
    # SLOW_Z), after a partial kernel; _finish_rows for this program's BLOCK_R
    # rows (z = 0). SLOW_Z > 1: the slots beyond the partials (the slow path) are shared out in
    # 16-slot chunks (the slow path's whole-D passes) over the SLOW_Z programs of the rows (z > 0 do
    # only those).
    # EARLY_READS: the head index, pos and valid_len before the PDL wait (none is written by the
    # partial kernel before this one: the heads come from the side stream, waited for before it;
    # valid_len is written by the attention kernel after this one), saving a round trip after it.
    # REFRESH: head slots KH_Q.. are refresh heads, as in _qkv_partial_shared_kernel.
    pid = tl.program_id(0)
    pid_r = tl.program_id(1)
    z = tl.program_id(2)
    b = pid // KH
    j = pid % KH
    if not EARLY_READS:
        gdc_enter(GDC)
    head, pos, seg, offs_c, cmask, rows, start = _qkv_rows(
        head_ptr, pos_ptr, vl_ptr, b, j, pid_r, H, HD, NB, stride_hb, stride_pb, FIRST_SEG, BLOCK_R, ref_ptr,
        KH_Q, REFRESH)
    if EARLY_READS:
        gdc_enter(GDC)
    if REFRESH:  # a real head (not -1); a refresh head (slot >= KH_Q) has no Q rows
        live = (head >= 0) & ((j < KH_Q) | (seg > 0))
    else:
        live = True
    if live:
        _finish_program(xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, pnew_ptr, phist_ptr, q_ptr, k_ptr, v_ptr, B, KH, D, HD,
                        SPLIT, HIST_LEN, stride_xb, stride_xs, stride_cb, stride_ch, stride_cs, b, j, z, head, pos,
                        seg, offs_c, cmask, rows, start, DOT_FP32, BLOCK_P, BLOCK_R, BLOCK_D, BLOCK_S, SLOW_Z,
                        16, BLOCK_D)


@helper
def _finish_program(xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, pnew_ptr, phist_ptr, q_ptr, k_ptr, v_ptr, B, KH, D, HD, SPLIT,
                    HIST_LEN, stride_xb, stride_xs, stride_cb, stride_ch, stride_cs, b, j, z, head, pos, seg, offs_c,
                    cmask, rows, start, DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SLOW_Z: tl.constexpr, SLOW_P: tl.constexpr,
                    SLOW_D: tl.constexpr):
    # _qkv_finish_kernel's work for its rows (z: its share of the slow path)
    if SLOW_Z == 1:
        _finish_rows(xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, pnew_ptr, phist_ptr, q_ptr, k_ptr, v_ptr, b.to(tl.int64), j,
                     head, pos, seg, offs_c, cmask, rows, start, B, KH, D, HD, SPLIT, HIST_LEN, stride_xb,
                     stride_xs, stride_cb, stride_ch, stride_cs, DOT_FP32, BLOCK_P, BLOCK_R, BLOCK_D, BLOCK_S,
                     1, SLOW_P, SLOW_D)
    else:
        b64 = b.to(tl.int64)
        if z == 0:  # the slots the partials hold (SLOW 0: _store_qkv leaves the slow path to the loop below)
            new, hist = _sum_partials(pnew_ptr, phist_ptr, b64, j, seg, offs_c, cmask, start, pos, B, KH, HD,
                                      SPLIT, HIST_LEN, BLOCK_P, BLOCK_R, BLOCK_S)
            _store_qkv(new, hist, xh_ptr, wkv_ptr, bq_ptr, bkv_ptr, q_ptr, k_ptr, v_ptr, b64, j, head, pos, seg,
                       offs_c, cmask, rows, start, KH, D, HD, HIST_LEN, stride_xb, stride_xs, stride_cb, stride_ch,
                       stride_cs, DOT_FP32, BLOCK_P, BLOCK_R, BLOCK_D, 0)
        if seg > 0:
            if start + HIST_LEN + z * SLOW_P < pos:
                cache = (k_ptr if seg == 1 else v_ptr) + b64 * stride_cb + head * stride_ch
                bias = tl.load(bkv_ptr + rows).to(tl.float32)
                _slow_slots(xh_ptr, wkv_ptr, cache, bias, b64, pos, offs_c, cmask, rows, start + HIST_LEN, z,
                            SLOW_Z, D, stride_xb, stride_xs, stride_cs, DOT_FP32, SLOW_P, BLOCK_R, SLOW_D)


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


def _commit_kernel(xnew_ptr, x_ptr, head_ptr, vl_ptr, pos_ptr, KH, H, D, stride_nb, stride_xb, stride_xs,
                   stride_hb, stride_pb, HAS_NEW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                   GDC: tl.constexpr = 0):
    # After the Q/K/V kernels when nothing else commits (recompute_kv, or no head attends):
    # valid_len[b, head_idx[b, j]] = pos[b] + 1 and (HAS_NEW)
    # x_hist[b, pos[b]] = x_new[b]; grid (B,).
    gdc_enter(GDC)
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


def slow_z(cfg: dict, row_blocks: int) -> int:
    """Programs per row block of the finishing kernel: cfg's SLOW_Z, or (None) as many as fill
    ~SLOW_TARGET programs, 1 to 8."""
    z = cfg.get("SLOW_Z", 1)
    if z is None:
        z = max(1, min(8, cfg["SLOW_TARGET"] // max(1, row_blocks)))
    return z


def _mark_valid(valid_len, head_idx, pos_t):
    """valid_len[b, head_idx[b, j]] = pos[b] + 1 (scatter_: static shapes, no sync)."""
    B = valid_len.shape[0]
    heads = head_idx.long().expand(B, -1) if head_idx.dim() == 1 else head_idx.long()
    val = (pos_t.reshape(-1, 1).to(torch.int32) + 1).expand(B, heads.shape[1])
    valid_len.scatter_(1, heads, val)


def _qkv_cfg(B, config):
    return {**(QKV_CONFIG_B1 if B == 1 else QKV_CONFIG), **(config or {})}


def _shared_qkv(B, head_idx, cfg) -> bool:
    """The Q/K/V work of one index set for the batch (a [Kh] set, or batch 1, whose [1, Kh] set
    is the batch's only one) takes _qkv_partial_shared_kernel (from SHARED_MIN_BATCH)."""
    smin = cfg["SHARED_MIN_BATCH"]
    return (head_idx.dim() == 1 or B == 1) and smin is not None and B >= smin


def _batch1_unfolded(cfg: dict, B: int, shared: bool, has_new: bool, fold: bool) -> bool:
    """Batch 1 on the shared-set kernel with x_new and its finishing kernel (not folded): where
    SHARED_P_UNFOLDED applies."""
    return shared and B == 1 and has_new and not fold


def _unfolded_cfg(cfg: dict, unfolded: bool, n_ref: int) -> dict:
    """cfg with SHARED_P_UNFOLDED as SHARED_P (BLOCK_P at least that, UNFOLDED_MAXNREG as the register cap
    unless cfg sets one) where it applies: the unfolded batch-1 route without refresh heads."""
    sp = cfg.get("SHARED_P_UNFOLDED") or 0
    if not (unfolded and not n_ref and sp > cfg["SHARED_P"]):
        return cfg
    cap = cfg.get("maxnreg") or cfg.get("UNFOLDED_MAXNREG")
    return {**cfg, "SHARED_P": sp, "BLOCK_P": max(cfg["BLOCK_P"], sp), **({"maxnreg": cap} if cap else {})}


def hist_slots(B: int, head_idx, config=None) -> int:
    """How many missing slots of a selected head (from min(valid_len, pos)) the Q/K/V kernels of a
    deferred decode step with this Q/K/V config compute from their partial products; the slow path
    does the slots past them. On the unfolded batch-1 route SHARED_P_UNFOLDED (without refresh heads)
    reaches further: this is the reach every selected head has."""
    cfg = _qkv_cfg(B, config)
    return cfg["SHARED_P"] - 1 if _shared_qkv(B, head_idx, cfg) else cfg["BLOCK_P"]


def _qkv_split(cfg: dict, D: int, groups: int, fold: bool) -> tuple[int, int, bool]:
    """(slices of D, columns per slice, whether the finish is folded into attention) of the Q/K/V
    partial kernel with `groups` row blocks per slice, `fold` asked for (checked by the caller)."""
    bd = cfg["BLOCK_D"]
    d_blocks = -(-D // bd)
    split = cfg["SPLIT"] or max(1, min(d_blocks, cfg["TARGET_PROGRAMS"] // groups))
    d_per = -(-d_blocks // split) * bd
    split = -(-D // d_per)
    wide = cfg["FOLD_FINISH"] == "wide"  # fold only where the finishing kernel would sum many slices
    if fold and split > cfg["FOLD_MAX_SPLIT"]:  # the attention kernel unrolls the partial loads
        if cfg["FOLD_CAP"] or wide:  # fewer, longer programs
            d_per = -(-d_blocks // cfg["FOLD_MAX_SPLIT"]) * bd
            split = -(-D // d_per)
        else:  # the finishing kernel runs
            fold = False
    elif wide:
        fold = False
    return split, d_per, fold


def _launch_qkv(x_new, x_hist, wq, bq, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb,
                q, config, pending=None, fold=False, refresh=None):
    """The Q/K/V kernels (checked inputs, Kh > 0): partial + finish.
    q [B, Kh*hd] fp32 gets Q (x_new given), or None: K/V only, the input at pos read from
    x_hist (recompute_kv). pending: x_new's PendingLN (batch 1 on the shared-set kernel only),
    normalised in the kernel, which also stores it at x_hist[:, pos].
    fold (batch 1 on the shared-set kernel, x_new given): no finishing kernel;
    the partial kernel's first z-slices fill the slots no partial holds (_fold_slow_program) and
    the QKVPartials returned go to the attention kernel, which finishes the rest (q stays unwritten);
    with more than FOLD_MAX_SPLIT slices of D the finishing kernel runs instead (None returned).
    refresh: [R] int32 refresh heads (`refresh_route` holds; -1: none): head slots Kh.. of both
    kernels, K/V only; the split of D stays the one of the selected heads."""
    B, S, D = x_hist.shape
    H, hd = k_cache.shape[1], k_cache.shape[3]
    kh = head_idx.shape[-1]
    cfg = _qkv_cfg(B, config)
    bd, bp = cfg["BLOCK_D"], cfg["BLOCK_P"]
    first = 0 if q is not None else 1
    nb = -(-hd // cfg["BLOCK_R"])
    shared = _shared_qkv(B, head_idx, cfg)
    if pending is not None and not (shared and B == 1 and x_new is not None):
        raise DejavuError("_launch_qkv: a PendingLN input needs batch 1 on the shared-set kernel and x_new")
    if fold and not (shared and B == 1 and x_new is not None):
        raise DejavuError("_launch_qkv: folding the finish needs batch 1 on the shared-set kernel and x_new")
    groups = (1 if shared else B) * kh * (3 - first) * nb  # row blocks: programs per slice of D
    split, d_per, fold = _qkv_split(cfg, D, groups, fold)
    dev = x_hist.device
    n_ref = 0 if refresh is None else refresh.shape[0]
    if n_ref and (fold or not shared or B != 1 or x_new is None):
        raise DejavuError("_launch_qkv: refresh heads need batch 1 on the shared-set kernel, x_new and no fold")
    ref_args = dict(ref_ptr=refresh, KH_Q=kh, REFRESH=1) if n_ref else {}
    kh_q, kh = kh, kh + n_ref  # head slots: the selected heads, then the refresh heads
    unfolded = _batch1_unfolded(cfg, B, shared, x_new is not None, fold)
    cfg = _unfolded_cfg(cfg, unfolded, n_ref)
    bp = cfg["BLOCK_P"]
    pnew = torch.empty((split, B, kh, 3 * hd), dtype=torch.float32, device=dev)
    phist = torch.empty((split, B, kh, bp, 2 * hd), dtype=torch.float32, device=dev)
    new = x_new if x_new is not None else x_hist  # never read when HAS_NEW is false
    qbuf = q if q is not None else pnew  # never written without Q rows
    stride_hb = 0 if head_idx.dim() == 1 else head_idx.stride(0)
    dot32 = _dot_fp32(x_hist.dtype, dev)
    args = (new, x_hist, wq, wkv, bq, bkv, head_idx, valid_len, pos_t, pnew, phist, qbuf, k_cache, v_cache,
            B, kh, H, D, hd, nb, d_per, new.stride(0), x_hist.stride(0), x_hist.stride(1))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    bs = min(cfg["FINISH_S"], next_pow2(split))
    common = dict(HAS_NEW=x_new is not None, FIRST_SEG=first, DOT_FP32=dot32, BLOCK_P=bp,
                  BLOCK_R=cfg["BLOCK_R"], BLOCK_D=bd, EVEN_D=D % d_per == 0,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **reg_cap(cfg, dev), **pdl_args(dev, "qkv"))
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
            n_st, ln_args = 1, (new, new, pnew, 1, 1, LN_EPS)  # never read without LN_IN
        slow_r = min(cfg["BLOCK_R"], cfg["FOLD_SLOW_R"])
        # folded: the slow path in the partial kernel's z-slices (no finishing kernel)
        n_slow = (cfg["BLOCK_R"] // slow_r) * cfg["FOLD_SLOW_Z"] if fold else 0
        part = jit(_qkv_partial_shared_kernel, dev)
        part[(kh, (3 - first) * nb, n_slow + split)](*args, stride_pb, *cache_strides, *ln_args, P=sp,
                                                     BLOCK_M=max(16, next_pow2(B) * sp), W_EV=cfg.get("W_EV", ""),
                                                     LN_IN=pending is not None, BLOCK_N=max(2, next_pow2(n_st)),
                                                     ST_CM=cfg.get("ST_CM", ""), SLOW=n_slow, SLOW_R=slow_r,
                                                     SLOW_LAST=bool(cfg["FOLD_SLOW_LAST"]), **ref_args, **common)
        if fold:
            return QKVPartials(pnew, phist, split, hist_len, bp, bq, bkv)
    else:
        hist_len = bp
        part = jit(_qkv_partial_kernel, dev)
        part[(B * kh, (3 - first) * nb, split)](*args, stride_hb, stride_pb, *cache_strides, **common)
    fr, z = cfg["FINISH_R"], cfg.get("SLOW_Z", 1)
    nbf = -(-hd // fr)
    z = slow_z(cfg, B * kh_q * (3 - first) * nbf)
    finish = jit(_qkv_finish_kernel, dev)
    finish[(B * kh, (3 - first) * nbf, z)](
        x_hist, wkv, bq, bkv, head_idx, valid_len, pos_t, pnew, phist, qbuf, k_cache, v_cache, B, kh, H, D, hd, nbf,
        split, hist_len, x_hist.stride(0), x_hist.stride(1), stride_hb, stride_pb, *cache_strides,
        FIRST_SEG=first, DOT_FP32=dot32, BLOCK_P=bp, BLOCK_R=fr, BLOCK_D=bd, BLOCK_S=bs, SLOW_Z=z,
        EARLY_READS=bool(cfg["EARLY_READS"]), num_warps=4, **ref_args, **pdl_args(dev, "qkv_finish"))


def _commit(x_new, x_hist, head_idx, valid_len, pos_t, stride_pb):
    """valid_len[b, heads] = pos + 1 and (x_new given) x_hist[b, pos] = x_new[b]: one launch."""
    B, S, D = x_hist.shape
    H = valid_len.shape[1]
    kh = head_idx.shape[-1]
    new = x_new if x_new is not None else x_hist
    commit = jit(_commit_kernel, x_hist.device)
    commit[(B,)](new, x_hist, head_idx, valid_len, pos_t, kh, H, D, new.stride(0), x_hist.stride(0),
                 x_hist.stride(1), 0 if head_idx.dim() == 1 else head_idx.stride(0), stride_pb,
                 HAS_NEW=x_new is not None, BLOCK_K=max(16, next_pow2(kh)), BLOCK_D=1024, num_warps=4,
                 **pdl_args(x_hist.device, "commit"))


def _recompute_inputs(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos, validate):
    """recompute_kv's checks: (B, S, D, H, hd, Kh, pos tensor, its batch stride)."""
    validate = default_validate(validate, x_hist.device)
    B, S, D, H, hd, kh = _check_recompute(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, validate)
    pos_t, stride_pb = _positions(pos, B, x_hist.device)
    if validate:
        lo, hi = int(pos_t.min()), int(pos_t.max())
        if lo < 0 or hi >= S:
            raise DejavuError(f"pos: out of range [0, {S}) (min {lo}, max {hi})")
        if valid_len.numel() and int(valid_len.min()) < 0:
            raise DejavuError("valid_len: negative entries")
    return B, S, D, H, hd, kh, pos_t, stride_pb


def recompute_kv(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos, *, validate=None,
                 config=None) -> None:
    """Fill K/V of the selected heads at slots min(valid_len, pos)..pos from x_hist; mark them valid."""
    B, S, D, H, hd, kh, pos_t, stride_pb = _recompute_inputs(x_hist, wkv, bkv, head_idx, k_cache, v_cache,
                                                             valid_len, pos, validate)
    if kh == 0 or B == 0:
        return
    # wq / bq are never read without Q rows: pass wkv's first rows in their place
    _launch_qkv(None, x_hist, wkv, bkv, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb,
                None, config)
    _commit(None, x_hist, head_idx, valid_len, pos_t, stride_pb)


def refresh_heads(head_idx, valid_len, pos, r: int, *, lag: int | None = None, max_lag: int | None = None,
                  out=None, config=None, validate=None) -> torch.Tensor:
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
    pos_t, _ = _positions(pos, 1, dev)
    lag = hist_slots(1, head_idx, config) if lag is None else int(lag)
    max_lag = (1 << 30) if max_lag is None else int(max_lag)
    if lag < 1 or max_lag < lag:
        raise DejavuError(f"refresh_heads: need 1 <= lag <= max_lag, got lag {lag}, max_lag {max_lag}")
    out = check_out(out, (r,), torch.int32, dev)
    kernel = jit(_refresh_kernel, dev)
    kernel[(1,)](head_idx, valid_len, pos_t, out, kh, H, lag, max_lag, R=r, BLOCK_H=max(16, next_pow2(H)),
                 BLOCK_K=max(16, next_pow2(kh)), num_warps=4)
    return out


def refresh_heads_ref(head_idx, valid_len, pos, r: int, *, lag: int | None = None, max_lag: int | None = None,
                      out=None, config=None, validate=None) -> torch.Tensor:
    """PyTorch reference of refresh_heads."""
    H = valid_len.shape[1]
    lag = hist_slots(1, head_idx, config) if lag is None else int(lag)
    p = _pos_rows(pos, 1, valid_len.device)[0]
    miss = p - torch.minimum(valid_len[0].long(), p)  # [H]
    cand = (miss >= lag) & (miss <= (1 << 30 if max_lag is None else int(max_lag)))
    cand[head_idx.reshape(-1).long()] = False
    key = torch.where(cand, miss * H + (H - 1 - torch.arange(H, device=valid_len.device)), -1)
    top = key.sort(descending=True).values[:r]
    res = torch.full((r,), -1, dtype=torch.int32, device=valid_len.device)
    n = min(r, H)
    res[:n] = torch.where(top >= 0, H - 1 - top % H, -1).to(torch.int32)
    if out is not None:
        out.copy_(res)
        return out
    return res


def refresh_route(B: int, S: int, D: int, hd: int, head_idx, config=None) -> bool:
    """Whether sparse_attn_decode_deferred with this shape, head set and config takes refresh heads
    (batch 1 on the shared-set Q/K/V kernel with its finishing kernel, not folded into attention;
    attention commits them); elsewhere it leaves them out (they catch up when
    selected: same outputs)."""
    cfg = config or {}
    qcfg = _qkv_cfg(B, cfg.get("qkv"))
    kh = head_idx.shape[-1]
    if not (B == 1 and kh > 0 and _shared_qkv(B, head_idx, qcfg)):
        return False
    fold = bool(qcfg["FOLD_FINISH"]) and folds_finish(B, S, cfg.get("attn"))
    groups = kh * 3 * -(-hd // qcfg["BLOCK_R"])
    return not _qkv_split(qcfg, D, groups, fold)[2]


def _pos_rows(pos, B, device) -> torch.Tensor:
    if isinstance(pos, int):
        pos = torch.tensor(pos)
    return pos.to(device).long().reshape(-1).expand(B)  # [B]


def recompute_kv_ref(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos) -> None:
    """PyTorch reference of recompute_kv (same in-place updates); any device/dtype."""
    B = x_hist.shape[0]
    p = _pos_rows(pos, B, x_hist.device)
    heads = head_idx.long().expand(B, -1) if head_idx.dim() == 1 else head_idx.long()  # [B, Kh]
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
                                refresh=None):
    """sparse_attn_decode with deferred K/V: only the selected heads' K/V are computed; y[B,D].

    Stores x_ln at x_hist[:, pos], recomputes the selected heads' missing slots, then Q,
    attention and the output projection of the selected heads (sparse_attention's pieces).
    x_ln may be a PendingLN (the LayerNorm before attention, not computed yet): at batch 1 the
    shared-set Q/K/V kernel normalises it as it loads it and stores it at x_hist[:, pos] (no
    LayerNorm launch); other routes and batches compute it first (layer_norm kernel).
    refresh: batch 1, [R] int32 heads not in head_idx (-1: none; refresh_heads picks them) whose
    K/V at pos and at their missing slots are computed in the same Q/K/V launches (no Q, no
    attention) and valid_len set to pos + 1, where `refresh_route` holds; elsewhere they are left
    out (a hint: the outputs are the same either way)."""
    pending = x_ln if isinstance(x_ln, PendingLN) else None
    if pending is not None:
        check_pending(pending)
        x_ln = pending.x
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
    cfg = config or {}
    qcfg = _qkv_cfg(B, cfg.get("qkv"))
    if pending is not None and (kh == 0 or B != 1 or not _shared_qkv(B, head_idx, qcfg)):
        x_ln, pending = materialize(pending), None
    if kh == 0:  # nothing attends: store the input for later steps, y = bias (+ residual)
        _commit(x_ln, x_hist, head_idx, valid_len, pos_t, stride_pb)
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
        if not refresh.numel() or not refresh_route(B, S, D, hd, head_idx, cfg):
            refresh = None
    # 1. Q, and K/V at pos and at the missing slots, of the selected heads (one launch, or two)
    q = torch.empty((B, kh * hd), dtype=torch.float32, device=x_ln.device)
    fold = qcfg["FOLD_FINISH"] and B == 1 and _shared_qkv(B, head_idx, qcfg) and folds_finish(B, S, cfg.get("attn"))
    parts = _launch_qkv(x_ln, x_hist, wq, bq, wkv, bkv, head_idx, k_cache, v_cache, valid_len, pos_t, stride_pb, q,
                        cfg.get("qkv"), pending, fold=fold, refresh=refresh)
    # 2. attention over 0..pos, committing valid_len and x_hist[:, pos] (the Q/K/V kernel stored
    # that slot when it normalised a PendingLN); 3. output projection
    y = attend_project(q, head_idx, k_cache, v_cache, pos_t, stride_pb, wo_t, bo, residual, out, cfg.get("attn"),
                       commit=(valid_len, None if pending is not None else x_ln, x_hist), finish=parts,
                       refresh=refresh)
    return y


def sparse_attn_decode_deferred_ref(x_ln, wq, bq, wkv, bkv, wo_t, bo, head_idx, k_cache, v_cache,
                                    x_hist, valid_len, pos, residual=None, *, refresh=None):
    """PyTorch reference: history write, recompute_kv_ref, masked attention of selected heads;
    y[B,D]. x_ln may be a PendingLN (F.layer_norm of its tensor). refresh: those heads (-1 skipped)
    are brought up to pos too."""
    x_ln = materialize_ref(x_ln)
    B, D = x_ln.shape
    H, S, hd = k_cache.shape[1:]
    if isinstance(pos, int):
        pos = torch.tensor(pos)
    p = pos.to(x_ln.device).long().reshape(-1).expand(B)
    _write_hist(x_hist, x_ln, p)
    recompute_kv_ref(x_hist, wkv, bkv, head_idx, k_cache, v_cache, valid_len, p)
    if refresh is not None:
        recompute_kv_ref(x_hist, wkv, bkv, refresh[refresh >= 0], k_cache, v_cache, valid_len, p)
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

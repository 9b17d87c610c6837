"""Q/K/V finishing kernel of the deferred K/V policy (deferred_kv.py), after `qkv_partial.py`'s launch.

`_qkv_finish_kernel`, grid (B*Kh, rows of FINISH_R, SLOW_Z): sums the SPLIT slices' fp32 partials
of its rows (.cg loads: L2, not L1), adds the bias, writes Q (fp32 buffer) and K/V into the caches
at pos and at the first hist_len missing slots; a head unselected for longer gets its further slots
from whole-D tl.dot passes over its rows (the slow path, `slow_slots`, shared over SLOW_Z programs
per row block). Also the row addressing both Q/K/V kernels share (`qkv_rows`). Launched by
`launch_finish` (from `qkv_partial.launch_qkv`); its reference is deferred_kv's (`recompute_kv_ref`, the Q einsum of
`sparse_attn_decode_deferred_ref`). Limits: hd <= 256.
"""
from __future__ import annotations

from dejavu.plugins._common import gdc_enter, helper, jit, next_pow2, pdl_args

tl = None  # triton.language, bound on first launch (see _common.jit)


@helper
def qkv_rows(head_ptr, pos_ptr, vl_ptr, b, j, pid_r, H, HD, NB, stride_hb, stride_pb, BLOCK_R: tl.constexpr, ref_ptr=None, KH_Q=0, REFRESH: tl.constexpr = 0):
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
    seg = pid_r // NB
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
            slow_slots(xh_ptr, wkv_ptr, cache, bias, b64, pos, offs_c, cmask, rows, start + HIST_LEN, 0, 1, D,
                        stride_xb, stride_xs, stride_cs, DOT_FP32, SLOW_P, BLOCK_R, SLOW_D)


@helper
def slow_slots(xh_ptr, wkv_ptr, cache, bias, b64, pos, offs_c, cmask, rows, first, z, Z, D, stride_xb, stride_xs,
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
                       DOT_FP32: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                       SLOW_Z: tl.constexpr = 1, ref_ptr=None, KH_Q=0,
                       REFRESH: tl.constexpr = 0, GDC: tl.constexpr = 0):
    # Grid (B*KH, 3 * NB, SLOW_Z), after a partial kernel; _finish_rows for this program's BLOCK_R
    # rows (z = 0). SLOW_Z > 1: the slots beyond the partials (the slow path) are shared out in
    # 16-slot chunks (the slow path's whole-D passes) over the SLOW_Z programs of the rows (z > 0 do
    # only those).
    # The head index, pos and valid_len are read before the PDL wait (none is written by the
    # partial kernel before this one: the heads come from the side stream, waited for before it;
    # valid_len is written by the attention kernel after this one), saving a round trip after it.
    # REFRESH: head slots KH_Q.. are refresh heads, as in _qkv_partial_shared_kernel.
    pid = tl.program_id(0)
    pid_r = tl.program_id(1)
    z = tl.program_id(2)
    b = pid // KH
    j = pid % KH
    head, pos, seg, offs_c, cmask, rows, start = qkv_rows(
        head_ptr, pos_ptr, vl_ptr, b, j, pid_r, H, HD, NB, stride_hb, stride_pb, BLOCK_R, ref_ptr,
        KH_Q, REFRESH)
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
                slow_slots(xh_ptr, wkv_ptr, cache, bias, b64, pos, offs_c, cmask, rows, start + HIST_LEN, z,
                            SLOW_Z, D, stride_xb, stride_xs, stride_cs, DOT_FP32, SLOW_P, BLOCK_R, SLOW_D)


def slow_z(cfg: dict, row_blocks: int) -> int:
    """Programs per row block of the finishing kernel: cfg's SLOW_Z, or (None) as many as fill
    ~SLOW_TARGET programs, 1 to 8."""
    z = cfg.get("SLOW_Z", 1)
    if z is None:
        z = max(1, min(8, cfg["SLOW_TARGET"] // max(1, row_blocks)))
    return z


def launch_finish(cfg, x_hist, wkv, bq, bkv, head_idx, valid_len, pos_t, stride_pb, pnew, phist, q, k_cache, v_cache,
                  kh_q, hist_len, dot32, refresh=None, pdl=None):
    """The finishing kernel after a partial launch (qkv_partial.launch_qkv; checked inputs): the
    partials pnew [SPLIT, B, Kh, 3*hd] / phist summed, biases added, Q into q [B, kh_q*hd] and K/V
    into the caches; Kh - kh_q refresh heads (refresh, K/V only) after the kh_q selected ones."""
    B, _, D = x_hist.shape
    H, hd = k_cache.shape[1], k_cache.shape[3]
    split, kh = pnew.shape[0], pnew.shape[2]
    nb = -(-hd // cfg["FINISH_R"])
    z = slow_z(cfg, B * kh_q * 3 * nb)
    ref_args = dict(ref_ptr=refresh, KH_Q=kh_q, REFRESH=1) if kh > kh_q else {}
    finish = jit(_qkv_finish_kernel, x_hist.device)
    finish[(B * kh, 3 * nb, z)](
        x_hist, wkv, bq, bkv, head_idx, valid_len, pos_t, pnew, phist, q, k_cache, v_cache, B, kh, H, D, hd, nb,
        split, hist_len, x_hist.stride(0), x_hist.stride(1), 0 if head_idx.dim() == 1 else head_idx.stride(0),
        stride_pb, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        DOT_FP32=dot32, BLOCK_P=phist.shape[3], BLOCK_R=cfg["FINISH_R"], BLOCK_D=cfg["BLOCK_D"],
        BLOCK_S=min(cfg["FINISH_S"], next_pow2(split)), SLOW_Z=z, num_warps=4, **ref_args,
        **pdl_args(x_hist.device, "qkv_finish", pdl))

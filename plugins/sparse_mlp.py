"""Sparse MLP for decode: gathered GEMVs over the selected neurons (Triton) + references.

    sparse_fc1(x[B,D], w1[F,D], b1[F], idx[B,K]|[K]) -> h[B,K] = relu(w1[idx] @ x + b1[idx])
    sparse_fc2(h[B,K], w2_t[F,D], b2[D], idx, residual[B,D]|None) -> y[B,D]
                                                   = sum_k h[:,k] * w2_t[idx[k]] + b2 (+ residual)
    sparse_fc2(..., ln=(weight[D], bias[D])) -> (y[B,D], LayerNorm(y)[B,D])   (eps 1e-5)

Limits and choices (see docs/kernels.md for the measurements behind them):
- dtypes fp16, bf16, fp32 (weights in the activation dtype); accumulation in fp32; the
  output has the activation dtype. fp32 dots run in IEEE fp32 (no tf32).
- idx int32 or int64, `[B, K]` (one set per sequence) or `[K]` (one set for the batch).
  Per-sequence sets run one GEMV per sequence (each sequence reads its own rows); a shared
  set with B >= DOT_MIN_BATCH (fc1) / FC2_DOT_MIN_BATCH (fc2) reads each gathered row once and
  multiplies it against the whole batch with `tl.dot` (batch padded to >= 16), which is what
  makes batches cheap (and fc2 faster at batch 1 too).
- Index values are trusted in the kernel (gathering a bad row reads out of bounds); the
  launcher checks the range only when `validate` is true (default: CPU yes, GPU no, since
  the check syncs with the host). Duplicated indices are allowed (fc2 sums them).
- fc2 splits K across programs: fp32 partials [SPLIT, B, D], summed in a fixed order with
  bias and residual (deterministic). FUSED_FINISH (B <= FUSED_MAX_BATCH): in the same
  launch, the last program of each D block to arrive (`_common.last_arrival`, int32 counters
  from `_common.counters`, back to 0 afterwards) sums that block's partials for all rows;
  with `ln=`, the programs that store y also store each D block's mean and sum of squared
  deviations of the stored (rounded) y, and the last of them merges those per row (fp32,
  as stable as mean-then-variance) and normalises y into `ln_out` in one pass: LayerNorm
  of the rounded residual stream, as the model computes it. Otherwise (the default: switch
  off; or larger batches, where one program per D block or one program for every row's
  LayerNorm would be slow) a second small kernel reduces the partials and
  `layer_norm.layer_norm` follows. The fused finish is opt-in: on the H200 it did not pay
  (OPT-30B shape, density 0.3: batch 1 within 1%, batch 8 per-sequence 44.5 vs 34.2
  ms/step; BENCHMARKS.md).
- No host sync on the GPU path; launches are CUDA-graph capturable.
- Block sizes are fixed per path (FC1_CONFIG / FC2_CONFIG, picked on an H200, recorded by
  `kernel_settings()`); `config=` overrides them (the benchmark's sweep).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_index, check_out, check_tensor, counters,
                                    default_validate, gdc_enter, gdc_release, helper, jit, last_arrival, next_pow2,
                                    pdl_args, prefetch_rows_l2, reg_cap)
from dejavu.plugins.layer_norm import PendingLN, check_pending, layer_norm, materialize, materialize_ref

tl = None  # triton.language, bound on first launch (see _common.jit)

# Chosen by `benchmarks/kernels.py --sweep` on an H200, timed in CUDA graphs (2026-12-02,
# 2026-12-02, benchmarks/results/kernels-h200-s4-sweep.json; summed time over OPT-30B/66B at
# density 0.1 and 0.5 (fc1 GEMV), 0.1 and 0.3 (batch-1 dot paths), 0.3 at batch 8 shared).
# The decode step with these blocks: 7.04 against 7.27 ms/token (OPT-30B d0.3, BENCHMARKS.md).
# W_EV "evict_first" (2026-12-03): the streamed weight rows leave L1 first, so the input vector
# every program re-reads stays there; OPT-30B shape, batch 1: 3.940 vs 4.054 ms/token at density
# 0.1, 6.569 vs 6.593 at 0.3 (".cg", L2 only: no gain). The predictors' GEMVs inherit it (their
# SCORE_CONFIG sets only block sizes). BENCHMARKS.md, 2026-12-03.
FC1_CONFIG = {
    "gemv": {"BLOCK_R": 2, "BLOCK_D": 1024, "num_warps": 4, "num_stages": 2, "W_EV": "evict_first"},
    "dot": {"BLOCK_R": 64, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3},
}
FC2_CONFIG = {
    # SPLIT 32 (~900 programs at D 7168) beat the 528-program target by 16% in the sweep
    # (2026-12-02; the per-sequence path, not swept since)
    "gemv": {"BLOCK_K": 16, "BLOCK_D": 256, "num_warps": 4, "SPLIT": 32},
    "dot": {"BLOCK_K": 64, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3},
    # batch 1 through the tl.dot kernel (FC2_DOT_MIN_BATCH): its own blocks (swept at B=1)
    # (TARGET_PROGRAMS 396, three per SM: one wave; OPT-30B shape batch 1 in the decode step:
    # 6.336-6.343 vs 6.368-6.378 ms/token at density 0.3, 3.770 vs 3.814-3.818 at 0.1 with 528;
    # BENCHMARKS.md, 2026-12-03)
    "dot1": {"BLOCK_K": 64, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3, "TARGET_PROGRAMS": 396},
    # batch 1, rows gathered in groups (the attention output projection: hd rows per head;
    # K = heads * hd, a few thousand rows against fc2's ~10^4): 14.0 vs 16.5 us (30B, d0.3)
    "proj1": {"BLOCK_K": 64, "BLOCK_D": 128, "num_warps": 4, "num_stages": 4, "TARGET_PROGRAMS": 528},
}
# "ROWS_AHEAD" (any tl.dot route, opt-in): _gather_dot_t_kernel loads each K block's row indices one
# iteration ahead, so its weight tiles are multi-buffered (with the indices loaded in the iteration
# Triton gives them one buffer). No faster on the H200 (2026-12-04: OPT-30B batch 1 d0.3 6.340 / 6.246
# ms/token with it on fc2 / the projection against 6.235-6.241; the pair alone 28.4-29.9 vs 28.2 us at
# d0.1); BENCHMARKS.md.
# Batch 1, fc1 and fc2 in one launch (`sparse_mlp_chain`, `_mlp_chain_kernel`): fc1's programs (its
# GEMV blocks) first, then fc2's tl.dot tiles (its dot1 blocks and split), each tile waiting on a
# counter for the fc1 programs of its K split only. CHAIN_COUNTERS: the offset of its counters in
# `_common.counters` (2 per split), away from the ones other kernels take from 0.
# Measured on the H200 (2026-12-03, kernels.py --sections mlp_parts; BENCHMARKS.md): not faster
# than the pair in any config (the tl.dot tiles' 124 registers leave fc1's programs 4 per SM instead
# of 10; with 64 x 64 tiles, 56 registers, it only ties); kept opt-in with its tests, not used by the
# runtime. 8 rows x 1024 columns summed per chunk (ROW_ACC) was the best fc1 block: OPT-30B d0.1
# 28.8-29.6 us against the pair's 28.5-29.3 in the same runs.
CHAIN_CONFIG = {"fc1": {"BLOCK_R": 8, "BLOCK_D": 1024, "num_stages": 3, "W_EV": "evict_first", "ROW_ACC": True},
                "fc2": {"BLOCK_K": 64, "BLOCK_D": 128, "num_stages": 3, "TARGET_PROGRAMS": 396},
                "num_warps": 4}
CHAIN_COUNTERS = 1 << 15
# Batch 1, fc2 started while fc1 still runs (`fc2_overlap`, sparse_fc1 / sparse_fc2 `overlap=`): two
# launches, fc1 letting fc2 launch at its start (PDL early trigger) and counting its programs per
# K split of fc2, fc2's tiles waiting on their split's count instead of on fc1's completion. Its
# counters (2 per split) from OVERLAP_COUNTERS in `_common.counters`, away from the chain's.
OVERLAP_COUNTERS = CHAIN_COUNTERS + (1 << 12)
DOT_MIN_BATCH = 2       # fc1: shared index sets from this batch size use the tl.dot kernel
# fc2 (and the attention output projection): from batch 1. On the H200 at batch 1, OPT-30B,
# the tl.dot fc2 took 37.5 us at density 0.3 and 17.2 at 0.1, the split-K GEMV 50.5 and 27.9;
# fc1 is faster as a GEMV (33.6 vs 37.5 us; H200, 2026-12-02).
FC2_DOT_MIN_BATCH = 1
TARGET_PROGRAMS = 528   # fc2 split-K without a fixed SPLIT: ~4 programs per SM (132 SMs)
REDUCE_BLOCK = 1024
# Fused split-K finish (module docstring). The finishing programs read B * SPLIT * BLOCK_D
# partials each and the LayerNorm program B * D values three times: cheap at decode batches,
# not at large B, which keeps the separate reduction (parallel over rows and D blocks).
# Off by default: measured no gain at batch 1 and a loss at batch 8 on the H200 (docstring).
FUSED_FINISH = False
FUSED_MAX_BATCH = 8
# The separate split-K reduction with `ln=`: batches up to REDUCE_LN_MAX_BATCH take one
# launch (_split_reduce_ln_kernel: the reduction's programs store y and their block's
# LayerNorm stats, the last to finish normalises the rows) instead of reduce + layer_norm.
REDUCE_LN_MAX_BATCH = 1
FIN_PARTIALS = 4096     # partials per load in a finishing program (SPLIT rows of BLOCK_D)
LN_BLOCK = 2048         # LayerNorm of the fused finish: elements per load (one pass over y)
LN_EPS = 1e-5
LN_BLOCK_ROW = 8192     # _split_reduce_ln_kernel's LayerNorm: a row of D <= 8192 in one load


def kernel_settings() -> dict:
    """The block choices in force, for the engine header's target.kernel_settings."""
    return {"fc1": {k: dict(v) for k, v in FC1_CONFIG.items()},
            "fc2": {k: dict(v) for k, v in FC2_CONFIG.items()},
            "dot_min_batch": DOT_MIN_BATCH, "fc2_dot_min_batch": FC2_DOT_MIN_BATCH,
            "fc2_target_programs": TARGET_PROGRAMS, "fused_finish": FUSED_FINISH,
            "fused_max_batch": FUSED_MAX_BATCH,
            "chain": {k: dict(v) if isinstance(v, dict) else v for k, v in CHAIN_CONFIG.items()}}


# ---------------------------------------------------------------------------------------
# kernels

@helper
def _group_rows(idx_row, offs, mask, GROUP: tl.constexpr):
    # Weight rows of positions offs: idx[offs // GROUP] * GROUP + offs % GROUP, int64; masked
    # positions give row 0 (in bounds; what is computed from them is never stored).
    if GROUP == 1:
        rows = tl.load(idx_row + offs, mask=mask, other=0).to(tl.int64)
    else:
        g = tl.load(idx_row + offs // GROUP, mask=mask, other=0).to(tl.int64)
        rows = tl.where(mask, g * GROUP + offs % GROUP, 0)
    return rows


@helper
def _prefetch_tile(w_ptr, idx_row, offs, mask, col0, N_ROWS, D, GROUP: tl.constexpr, BLOCK_D: tl.constexpr):
    # Before gdc_enter (PDL): an L2 prefetch of columns col0.. of the weight rows of positions
    # offs, from index values clamped into [0, N_ROWS) (they may be stale: only a hint).
    rows = tl.minimum(tl.maximum(_group_rows(idx_row, offs, mask, GROUP), 0), N_ROWS - 1)
    prefetch_rows_l2(w_ptr + rows * D, col0, D, BLOCK_D)


def _gather_gemv_kernel(x_ptr, w_ptr, b_ptr, idx_ptr, out_ptr, lnw_ptr, lnb_ptr, st_ptr, wg_ptr, D, K,
                        stride_xb, stride_ib, stride_ob, N_ROWS, N_ST, ST_W, eps, cnt_ptr, K_PER_SPLIT,
                        RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                        EVEN_D: tl.constexpr, GROUP: tl.constexpr, LN_IN: tl.constexpr = 0,
                        BLOCK_N: tl.constexpr = 2, W_CM: tl.constexpr = "", W_EV: tl.constexpr = "",
                        ST_CM: tl.constexpr = "", SIGNAL: tl.constexpr = 0, GDC: tl.constexpr = 0,
                        PF: tl.constexpr = 0):
    # out[b, r] = act(w[row(b, r)] @ x[b] + bias[row(b, r)]); grid (B, cdiv(K, BLOCK_R)).
    # W_CM / W_EV: cache modifier / eviction policy of the weight loads (".cg": L2 only, so the
    # streamed rows do not push the input vector, which every program re-reads, out of L1).
    # row(b, r) = idx[b, r // GROUP] * GROUP + r % GROUP (GROUP 1: rows; head dim: heads).
    # stride_ib = 0 for a shared index set: batch is the fastest grid axis, so the programs
    # reading the same rows run together and share them through L2.
    # x is LayerNorm(x) (a PendingLN) when LN_IN: the row's mean and rstd merged from the N_ST
    # blocks' stats at st[b] (blocks of ST_W columns), and
    #   LN_IN 1: each x chunk normalised as it is loaded and rounded to x's dtype (the values
    #            the layer_norm kernel would have stored);
    #   LN_IN 2: the LayerNorm folded into the rows (layer_norm.LNFold): the loop sums
    #            w * (g * x) (a product of two 16-bit values: exact in fp32), the epilogue
    #            applies rstd * acc - rstd * mean * wg[row] + wb[row] (wb holds the bias; b_ptr
    #            is wb then): mean and rstd are needed only after the loop.
    #   LN_IN 3: x is PendingLN.z = g * (x - block mean) (the loop is LN_IN 0's), the epilogue
    #            applies rstd * (acc + sum_n (m_n - mean) * wgb[row, n]) + wb[row] (wg_ptr is
    #            LNFold.wgb [rows, N_ST] then, b_ptr wb): no extra load in the loop.
    # SIGNAL (batch 1, fc2 overlapped: Fc2Overlap): after storing its rows, the program counts
    # itself on cnt[its rows' K split] (release; K_PER_SPLIT a multiple of BLOCK_R), where fc2's
    # tiles of that split wait (_gather_dot_t_kernel WAIT).
    pid_b = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < K
    if GDC:
        for t in tl.static_range(PF):
            _prefetch_tile(w_ptr, idx_ptr + pid_b * stride_ib, offs_r, rmask, t * BLOCK_D, N_ROWS, D, GROUP,
                           BLOCK_D)
    gdc_enter(GDC)
    # masked rows gather row 0 (in bounds) and are never stored: the weight loads need no mask
    rows = _group_rows(idx_ptr + pid_b * stride_ib, offs_r, rmask, GROUP)
    w_rows = w_ptr + rows[:, None] * D
    x_row = x_ptr + pid_b.to(tl.int64) * stride_xb
    st_row = st_ptr + pid_b.to(tl.int64) * N_ST * 2
    if LN_IN == 1:  # the loop normalises: the stats first (an earlier kernel's: plain loads)
        mean, rstd = _ln_merge(st_row, N_ST, D, eps, ST_W, BLOCK_N, ST_CM)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        if EVEN_D:
            xv = tl.load(x_row + offs_d)
            wv = tl.load(w_rows + offs_d[None, :], cache_modifier=W_CM, eviction_policy=W_EV).to(tl.float32)
            if LN_IN == 1 or LN_IN == 2:
                g = tl.load(lnw_ptr + offs_d).to(tl.float32)
            if LN_IN == 1:
                gb = tl.load(lnb_ptr + offs_d).to(tl.float32)
        else:
            dmask = offs_d < D
            xv = tl.load(x_row + offs_d, mask=dmask, other=0.0)
            wv = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0, cache_modifier=W_CM,
                         eviction_policy=W_EV).to(tl.float32)
            if LN_IN == 1 or LN_IN == 2:
                g = tl.load(lnw_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
            if LN_IN == 1:
                gb = tl.load(lnb_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
        if LN_IN == 1:
            xv = ((xv.to(tl.float32) - mean) * rstd * g + gb).to(x_ptr.dtype.element_ty)
        if LN_IN == 2:
            acc += wv * (xv.to(tl.float32) * g)[None, :]
        else:
            acc += wv * xv.to(tl.float32)[None, :]
    gdc_release(GDC)
    if LN_IN >= 2:  # folded: the stats only now
        mean, rstd = _ln_merge(st_row, N_ST, D, eps, ST_W, BLOCK_N, ST_CM)
    if LN_IN == 2:
        h = rstd * tl.sum(acc, axis=1) - (rstd * mean) * tl.load(wg_ptr + rows) + tl.load(b_ptr + rows)
    elif LN_IN == 3:
        offs_n = tl.arange(0, BLOCK_N)
        nmask = offs_n < N_ST
        m_b = tl.load(st_row + offs_n * 2, mask=nmask, other=0.0, cache_modifier=ST_CM)
        wgb = tl.load(wg_ptr + rows[:, None] * N_ST + offs_n[None, :], mask=nmask[None, :], other=0.0)
        corr = tl.sum(wgb * (m_b - mean)[None, :], axis=1)
        h = rstd * (tl.sum(acc, axis=1) + corr) + tl.load(b_ptr + rows)
    else:
        h = tl.sum(acc, axis=1) + tl.load(b_ptr + rows).to(tl.float32)
    if RELU:
        h = tl.maximum(h, 0.0)
    tl.store(out_ptr + pid_b.to(tl.int64) * stride_ob + offs_r,
             h.to(out_ptr.dtype.element_ty), mask=rmask)
    if SIGNAL:
        tl.debug_barrier()  # every thread's h stored before thread 0's release
        tl.atomic_add(cnt_ptr + (pid_r * BLOCK_R) // K_PER_SPLIT, 1, sem="release")


def _gather_dot_kernel(x_ptr, w_ptr, b_ptr, idx_ptr, out_ptr, B, D, K, stride_xb, stride_ob, N_ROWS,
                       RELU: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                       GROUP: tl.constexpr, GDC: tl.constexpr = 0, PF: tl.constexpr = 0):
    # Shared index set: out[b, r] = act(w[row(r)] @ x[b] + bias[row(r)]) for all b at once;
    # grid (cdiv(K, BLOCK_R),). Each gathered row is read once for the whole batch.
    pid_r = tl.program_id(0)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < K
    if GDC:
        for t in tl.static_range(PF):
            _prefetch_tile(w_ptr, idx_ptr, offs_r, rmask, t * BLOCK_D, N_ROWS, D, GROUP, BLOCK_D)
    gdc_enter(GDC)
    rows = _group_rows(idx_ptr, offs_r, rmask, GROUP)
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
def _store_row(y, out_ptr, offs, mask, st_ptr, pid_d, D, BLOCK_D: tl.constexpr, STATS: tl.constexpr):
    # out[offs] = y rounded to out's dtype (one row's D block pid_d); STATS: also that block's
    # (mean, M2) of the stored values at st_ptr (one pair), for the LayerNorm that follows
    yo = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, yo, mask=mask)
    if STATS:
        one = tl.arange(0, 1)
        _block_stats(yo.to(tl.float32)[None, :], mask[None, :], one < 1, st_ptr + one, pid_d, D, BLOCK_D)


@helper
def _sum_partials(part_ptr, b_ptr, res_ptr, out_ptr, st_ptr, pid_d, B, D, SPLIT, N_D,
                  HAS_RES: tl.constexpr, LN: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    # y[b, block pid_d] = sum_s part[s, b, block] + bias (+ residual) for every row b, the
    # partials in order of s; .cg: other programs wrote them (L2). LN: the block's stats too.
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    bias = tl.load(b_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    for b in range(0, B):
        y = bias
        for s0 in range(0, SPLIT, BLOCK_S):
            s = s0 + offs_s
            parts = tl.load(part_ptr + (s[:, None].to(tl.int64) * B + b) * D + offs_d[None, :],
                            mask=(s < SPLIT)[:, None] & dmask[None, :], other=0.0,
                            cache_modifier=".cg")
            y += tl.sum(parts, axis=0)
        if HAS_RES:
            y += tl.load(res_ptr + b * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
        _store_row(y, out_ptr, b * D + offs_d, dmask, st_ptr + (b * N_D + pid_d) * 2, pid_d, D, BLOCK_D, LN)


@helper
def _ln_merge(st_ptr, N_D, D, eps, BLOCK_D, BLOCK_N: tl.constexpr, CM: tl.constexpr):
    # (mean, rstd) of one row from its N_D blocks' (mean, M2) at st_ptr [N_D, 2] (_ln_merge_rows)
    one = tl.arange(0, 1)
    mean, rstd = _ln_merge_rows(st_ptr + one * 0, one < 1, N_D, D, eps, BLOCK_D, BLOCK_N, CM)
    return tl.sum(mean, axis=0), tl.sum(rstd, axis=0)


@helper
def _ln_merge_rows(st_rows, rmask, N_D, D, eps, BLOCK_D, BLOCK_N: tl.constexpr, CM: tl.constexpr):
    # (mean, rstd) [R] of rows whose N_D blocks' (mean, M2) are at st_rows [R] (pointers to
    # [N_D, 2] each; blocks of BLOCK_D columns, the last one short), merged in fp32: the
    # parallel form of mean-then-squared-deviations (as layer_norm.py's chunked path). Masked
    # rows read nothing. CM ".cg" (L2, not L1) where another program of this launch wrote them
    # (a last-arrival finish); "" where an earlier kernel did and thousands of programs read the
    # same few lines (L1 then serves all but the first warp of each SM; after the PDL wait no
    # stale copy can be in L1).
    offs_n = tl.arange(0, BLOCK_N)
    m = rmask[:, None] & (offs_n < N_D)[None, :]
    n_b = tl.minimum(D - offs_n * BLOCK_D, BLOCK_D).to(tl.float32)[None, :]
    st = st_rows[:, None] + offs_n[None, :] * 2
    mean_b = tl.load(st, mask=m, other=0.0, cache_modifier=CM)
    m2_b = tl.load(st + 1, mask=m, other=0.0, cache_modifier=CM)
    mean = tl.sum(tl.where(m, n_b * mean_b, 0.0), axis=1) / D
    delta = mean_b - mean[:, None]
    m2 = tl.sum(tl.where(m, m2_b + n_b * delta * delta, 0.0), axis=1)
    return mean, 1.0 / tl.sqrt(m2 / D + eps)


@helper
def _ln_rows(y_ptr, w_ptr, b_ptr, out_ptr, st_ptr, B, D, N_D, eps, BLOCK_D: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    # out[b] = LayerNorm(y[b]) for every row: the N_D blocks' stats merged (_ln_merge), then
    # one pass over y (the stored, rounded rows; other programs wrote them: .cg) to normalise.
    offs = tl.arange(0, BLOCK)
    for b in range(0, B):
        mean, rstd = _ln_merge(st_ptr + b * N_D * 2, N_D, D, eps, BLOCK_D, BLOCK_N, ".cg")
        for d0 in range(0, D, BLOCK):
            m = d0 + offs < D
            x = tl.load(y_ptr + b * D + d0 + offs, mask=m, other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + d0 + offs, mask=m, other=0.0).to(tl.float32)
            bb = tl.load(b_ptr + d0 + offs, mask=m, other=0.0).to(tl.float32)
            y = (x.to(tl.float32) - mean) * rstd * w + bb
            tl.store(out_ptr + b * D + d0 + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@helper
def _finish(part_ptr, b_ptr, res_ptr, out_ptr, cnt_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr, pid_d,
            B, D, SPLIT, N_D, N_COL, N_LN, eps, FINAL: tl.constexpr, HAS_RES: tl.constexpr,
            LN: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
            BLOCK_N: tl.constexpr, LN_BLOCK: tl.constexpr):
    # The fused finish, after this program stored its partials (FINAL: its part of y and,
    # LN, that part's stats). Counters: cnt[1 + pid_d] for the N_COL programs of D block
    # pid_d (the last sums the block's partials into y and its stats), cnt[0] for the N_LN
    # programs that store y (the last normalises every row into ln). Each last_arrival
    # orders the writes before it.
    if FINAL:
        if LN:
            if last_arrival(cnt_ptr, N_LN):
                _ln_rows(out_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr, B, D, N_D, eps, BLOCK_D,
                         BLOCK_N, LN_BLOCK)
    else:
        if last_arrival(cnt_ptr + 1 + pid_d, N_COL):
            _sum_partials(part_ptr, b_ptr, res_ptr, out_ptr, st_ptr, pid_d, B, D, SPLIT, N_D,
                          HAS_RES, LN, BLOCK_D, BLOCK_S)
            if LN:
                if last_arrival(cnt_ptr, N_LN):
                    _ln_rows(out_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr, B, D, N_D, eps, BLOCK_D,
                             BLOCK_N, LN_BLOCK)


def _gather_gemv_t_kernel(h_ptr, w_ptr, idx_ptr, part_ptr, b_ptr, res_ptr, out_ptr,
                          cnt_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr,
                          B, D, K, K_PER_SPLIT, stride_hb, stride_ib, SPLIT, N_D, N_COL, N_LN, eps, N_ROWS,
                          FINAL: tl.constexpr, HAS_RES: tl.constexpr, FUSED: tl.constexpr,
                          LN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                          EVEN_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_N: tl.constexpr, LN_BLOCK: tl.constexpr, GDC: tl.constexpr = 0,
                          PF: tl.constexpr = 0):
    # y[b, d] = sum_k h[b, k] * w_t[row(b, k), d]; grid (B, SPLIT, cdiv(D, BLOCK_D));
    # row(b, k) = idx[b, k // GROUP] * GROUP + k % GROUP.
    # FINAL (SPLIT == 1): add bias (+ residual) and store y; else store fp32 partials.
    # FUSED: finish in this launch (_finish: partial sums, LayerNorm when LN).
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    idx_row = idx_ptr + pid_b * stride_ib
    if GDC:
        for t in tl.static_range(PF):
            offs_k = k_start + t * BLOCK_K + tl.arange(0, BLOCK_K)
            _prefetch_tile(w_ptr, idx_row, offs_k, offs_k < k_end, pid_d * BLOCK_D, N_ROWS, D, GROUP, BLOCK_D)
    gdc_enter(GDC)
    h_row = h_ptr + pid_b * stride_hb
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    # the row indices of the next block are loaded one iteration ahead, so the gathered
    # weight loads do not wait on a dependent index load each iteration
    offs_k = k_start + tl.arange(0, BLOCK_K)
    kmask = offs_k < k_end
    rows = _group_rows(idx_row, offs_k, kmask, GROUP)
    hv = tl.load(h_row + offs_k, mask=kmask, other=0.0).to(tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_D:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :]).to(tl.float32)
        else:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :], mask=dmask[None, :],
                         other=0.0).to(tl.float32)
        offs_k = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        rows_next = _group_rows(idx_row, offs_k, kmask, GROUP)
        h_next = tl.load(h_row + offs_k, mask=kmask, other=0.0).to(tl.float32)
        acc += wv * hv[:, None]
        rows = rows_next
        hv = h_next
    gdc_release(GDC)
    y = tl.sum(acc, axis=0)
    row = pid_b.to(tl.int64) * D
    if FINAL:
        y += tl.load(b_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
        if HAS_RES:
            y += tl.load(res_ptr + row + offs_d, mask=dmask, other=0.0).to(tl.float32)
        _store_row(y, out_ptr, row + offs_d, dmask, st_ptr + (pid_b * N_D + pid_d) * 2, pid_d, D, BLOCK_D, LN)
    else:
        tl.store(part_ptr + pid_s.to(tl.int64) * B * D + row + offs_d, y, mask=dmask)
    if FUSED:
        _finish(part_ptr, b_ptr, res_ptr, out_ptr, cnt_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr, pid_d,
                B, D, SPLIT, N_D, N_COL, N_LN, eps, FINAL, HAS_RES, LN, BLOCK_D, BLOCK_S, BLOCK_N,
                LN_BLOCK)


def _gather_dot_t_kernel(h_ptr, w_ptr, idx_ptr, part_ptr, b_ptr, res_ptr, out_ptr,
                         cnt_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr,
                         B, D, K, K_PER_SPLIT, stride_hb, SPLIT, N_D, N_COL, N_LN, eps, N_ROWS,
                         apart_ptr, ml_ptr, NCHUNK, R1,
                         FINAL: tl.constexpr, HAS_RES: tl.constexpr, FUSED: tl.constexpr,
                         LN: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                         LN_BLOCK: tl.constexpr, COMBINE: tl.constexpr = 0, BLOCK_C: tl.constexpr = 2,
                         W_EV: tl.constexpr = "", WAIT: tl.constexpr = 0, H_CM: tl.constexpr = "",
                         SPIN_NS: tl.constexpr = 0, ROWS_AHEAD: tl.constexpr = 0, GDC: tl.constexpr = 0,
                         PF: tl.constexpr = 0):
    # Shared index set: y[b, :] = h[b, :] @ w_t[rows] for all b; grid (cdiv(D, BLOCK_D), SPLIT).
    # FINAL, FUSED, LN as in _gather_gemv_t_kernel; W_EV: eviction policy of the weight loads.
    # COMBINE (B == 1, the attention output projection): h is not read; its values come from the
    # attention kernel's per-chunk partials (sparse_attention._attn_decode_kernel, PARTIAL):
    # h[k] = sum_c exp(m_c - M) acc_c[k % GROUP] / sum_c exp(m_c - M) l_c over the NCHUNK chunks
    # of head slot k // GROUP (what _attn_combine_kernel computes, here per k-block: no launch).
    # WAIT (batch 1, not FUSED: Fc2Overlap): h comes from an fc1 launch that may still be running
    # (it triggers this launch at its start, SIGNAL): the tile waits (acquire) until cnt[its split]
    # counts the split's fc1 programs of R1 rows each, reads h with H_CM ".cg" (L2: no stale L1
    # line), and passes the PDL wait only after its loop, before any store (fc1 has completed by
    # then, so everything older has too); the last of the split's N_D tiles (cnt[SPLIT + split])
    # puts cnt[split] back to 0.
    # ROWS_AHEAD: the row indices of the next K block are loaded one iteration ahead (carried by
    # the loop), so the weight tile's address does not hang on a load of the same iteration and
    # Triton's pipeliner multi-buffers the tile (cp.async, num_stages - 1 tiles in flight); with
    # the index load in the iteration it issues one tile and waits for it (one smem buffer).
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_b = tl.arange(0, BLOCK_B)
    bmask = offs_b < B
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if GDC:
        for t in tl.static_range(PF):
            offs_k = k_start + t * BLOCK_K + tl.arange(0, BLOCK_K)
            _prefetch_tile(w_ptr, idx_ptr, offs_k, offs_k < k_end, pid_d * BLOCK_D, N_ROWS, D, GROUP, BLOCK_D)
    if WAIT:
        need = (k_end - k_start + R1 - 1) // R1
        seen = tl.atomic_add(cnt_ptr + pid_s, 0, sem="acquire")
        while seen < need:
            seen = tl.atomic_add(_backoff(cnt_ptr + pid_s, SPIN_NS), 0, sem="acquire")
        tl.debug_barrier()
    else:
        gdc_enter(GDC)
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    if ROWS_AHEAD:
        offs_k = k_start + tl.arange(0, BLOCK_K)
        rows_next = _group_rows(idx_ptr, offs_k, offs_k < k_end, GROUP)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        if ROWS_AHEAD:
            rows = rows_next
            offs_n = offs_k + BLOCK_K
            rows_next = _group_rows(idx_ptr, offs_n, offs_n < k_end, GROUP)
        else:
            rows = _group_rows(idx_ptr, offs_k, kmask, GROUP)
        if COMBINE:
            ov = _combined_heads(apart_ptr, ml_ptr, offs_k, kmask, NCHUNK, GROUP, BLOCK_C)
            hv = tl.where((offs_b == 0)[:, None], ov[None, :], 0.0)
        else:
            hv = tl.load(h_ptr + offs_b[:, None] * stride_hb + offs_k[None, :],
                         mask=bmask[:, None] & kmask[None, :], other=0.0, cache_modifier=H_CM)
        if EVEN_D:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :], eviction_policy=W_EV)
        else:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :], mask=dmask[None, :],
                         other=0.0, eviction_policy=W_EV)
        if DOT_FP32:
            acc = tl.dot(hv.to(tl.float32), wv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(hv.to(wv.dtype), wv, acc)
    if WAIT:
        gdc_enter(GDC)
    gdc_release(GDC)
    rows_b = offs_b[:, None].to(tl.int64) * D
    mask = bmask[:, None] & dmask[None, :]
    if FINAL:
        y = acc + tl.load(b_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            y += tl.load(res_ptr + rows_b + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        yo = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows_b + offs_d[None, :], yo, mask=mask)
        if LN:
            _block_stats(yo.to(tl.float32), mask, bmask, st_ptr + (offs_b * N_D + pid_d) * 2, pid_d, D,
                         BLOCK_D)
    else:
        tl.store(part_ptr + pid_s.to(tl.int64) * B * D + rows_b + offs_d[None, :], acc, mask=mask)
    if FUSED:
        _finish(part_ptr, b_ptr, res_ptr, out_ptr, cnt_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr, pid_d,
                B, D, SPLIT, N_D, N_COL, N_LN, eps, FINAL, HAS_RES, LN, BLOCK_D, BLOCK_S, BLOCK_N,
                LN_BLOCK)
    if WAIT:
        if last_arrival(cnt_ptr + SPLIT + pid_s, N_D):  # every tile of the split is past its wait
            tl.atomic_xchg(cnt_ptr + pid_s, 0, sem="relaxed")


@helper
def _backoff(ptr, NS: tl.constexpr):
    # ptr, after sleeping about NS nanoseconds (0: at once; 128, 512 or 2048): a waiting tile polls
    # its counter less often, so the atomics of hundreds of waiting tiles do not crowd L2
    if NS == 128:
        ptr = tl.inline_asm_elementwise("nanosleep.u32 128;\n\tmov.b64 $0, $1;", "=l,l", [ptr],
                                        dtype=ptr.dtype, is_pure=False, pack=1)
    elif NS == 512:
        ptr = tl.inline_asm_elementwise("nanosleep.u32 512;\n\tmov.b64 $0, $1;", "=l,l", [ptr],
                                        dtype=ptr.dtype, is_pure=False, pack=1)
    elif NS == 2048:
        ptr = tl.inline_asm_elementwise("nanosleep.u32 2048;\n\tmov.b64 $0, $1;", "=l,l", [ptr],
                                        dtype=ptr.dtype, is_pure=False, pack=1)
    return ptr


@helper
def _combined_heads(apart_ptr, ml_ptr, offs_k, kmask, NCHUNK, GROUP: tl.constexpr, BLOCK_C: tl.constexpr):
    # Attention output o[k] (fp32, batch 1) of positions offs_k from the per-chunk partials:
    # acc [slot * NCHUNK + c, GROUP], (m, l) [slot * NCHUNK + c, 2], slot = k // GROUP; chunks
    # past pos have m = -inf, l = 0 and weigh nothing (as in _attn_combine_kernel).
    offs_c = tl.arange(0, BLOCK_C)
    cm = kmask[:, None] & (offs_c < NCHUNK)[None, :]
    row = ((offs_k // GROUP).to(tl.int64) * NCHUNK)[:, None] + offs_c[None, :]  # [BLOCK_K, BLOCK_C]
    m = tl.load(ml_ptr + row * 2, mask=cm, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=cm, other=0.0)
    top = tl.max(m, axis=1)
    w = tl.where(cm & (m > float("-inf")), tl.exp(m - top[:, None]), 0.0)
    acc = tl.load(apart_ptr + row * GROUP + (offs_k % GROUP)[:, None], mask=cm, other=0.0)
    return tl.where(kmask, tl.sum(acc * w, axis=1) / tl.where(kmask, tl.sum(w * l, axis=1), 1.0), 0.0)


def _split_reduce_kernel(part_ptr, b_ptr, res_ptr, out_ptr, st_ptr, g_ptr, z_ptr, B, D, SPLIT, N_BLK,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                         STATS: tl.constexpr = 0, GDC: tl.constexpr = 0, PF: tl.constexpr = 0):
    # out[b, d] = sum_s part[s, b, d] + bias[d] (+ residual[b, d]); grid (B, cdiv(D, BLOCK)).
    # All SPLIT partials in one [BLOCK_S, BLOCK] load (one memory round trip, not SPLIT).
    # STATS: also the block's (mean, M2) of the stored (rounded) out at st[b, block] (N_BLK
    # blocks per row), for a consumer that applies the next LayerNorm itself (PendingLN);
    # STATS 2: and z[b, d] = g[d] * (out[b, d] - the block's mean), rounded (PendingLN.z).
    gdc_enter(GDC)
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs = pid_d * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    row = pid_b.to(tl.int64) * D
    y = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    parts = tl.load(part_ptr + offs_s[:, None].to(tl.int64) * B * D + row + offs[None, :],
                    mask=(offs_s < SPLIT)[:, None] & mask[None, :], other=0.0)
    y += tl.sum(parts, axis=0)
    if HAS_RES:
        y += tl.load(res_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    _store_row(y, out_ptr, row + offs, mask, st_ptr + (pid_b * N_BLK + pid_d) * 2, pid_d, D, BLOCK, STATS)
    if STATS == 2:
        yo = tl.where(mask, y.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
        mean_b = tl.sum(yo, axis=0) / tl.minimum(D - pid_d * BLOCK, BLOCK).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(z_ptr + row + offs, ((yo - mean_b) * g).to(z_ptr.dtype.element_ty), mask=mask)


def _split_reduce_ln_kernel(part_ptr, b_ptr, res_ptr, out_ptr, cnt_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr,
                            B, D, SPLIT, N_D, eps, HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, LN_BLOCK: tl.constexpr,
                            GDC: tl.constexpr = 0, PF: tl.constexpr = 0):
    # grid (N_D,): program pid_d sums D block pid_d of every row's partials (+ bias, residual)
    # into y and stores the block's (mean, M2) of the rounded y; the last program to arrive
    # (cnt[0]) merges them per row and writes ln = LayerNorm(y): reduction and LayerNorm in
    # one launch (the fused finish's helpers, in a kernel of its own).
    gdc_enter(GDC)
    pid_d = tl.program_id(0)
    _sum_partials(part_ptr, b_ptr, res_ptr, out_ptr, st_ptr, pid_d, B, D, SPLIT, N_D, HAS_RES, True,
                  BLOCK_D, BLOCK_S)
    if last_arrival(cnt_ptr, N_D):
        _ln_rows(out_ptr, lnw_ptr, lnb_ptr, ln_ptr, st_ptr, B, D, N_D, eps, BLOCK_D, BLOCK_N, LN_BLOCK)


def _mlp_chain_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, idx_ptr, h_ptr, part_ptr, cnt_ptr, D, K, N1,
                      K_PER_SPLIT, SPLIT, N_D,
                      BLOCK_R: tl.constexpr, BLOCK_D1: tl.constexpr, EVEN_D1: tl.constexpr,
                      STAGES1: tl.constexpr, W_EV: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                      STAGES2: tl.constexpr, DOT_FP32: tl.constexpr, ROW_ACC: tl.constexpr = 1,
                      FC2_DOT: tl.constexpr = True,
                      GDC: tl.constexpr = 0, PF: tl.constexpr = 0):
    # Batch 1: fc1 and fc2 of the selected rows in one launch; grid (N1 + SPLIT * N_D,).
    # Programs [0, N1): fc1, BLOCK_R rows each (_gather_gemv_kernel's loop): h = relu(w1[rows] @ x
    #   + b1[rows]), stored (activation dtype) to h, then counted on cnt[s], s the K split of the
    #   rows (K_PER_SPLIT is a multiple of BLOCK_R: a program's rows lie in one split). ROW_ACC 1:
    #   a [BLOCK_R, BLOCK_D1] accumulator, summed after the loop (as fc1's kernel: the same h bit for
    #   bit); ROW_ACC = BLOCK_D1: each chunk summed as it comes, so longer tiles fit the registers.
    # Programs N1 + s * N_D + j: fc2's tile (D block j, split s) (_gather_dot_t_kernel's loop):
    #   waits until cnt[s] counts the split's fc1 programs, then part[s, j block] = h[split] @
    #   w2_t[rows] (tl.dot, or with FC2_DOT off a multiply-and-sum tile: fewer registers); the last
    #   of the split's N_D tiles to arrive (cnt[SPLIT + s]) puts cnt[s] back to 0.
    # The tiles of split s start as soon as that split's h is stored, while later fc1 programs still
    # stream: no drain between fc1 and fc2. A waiting tile needs the fc1 programs it waits for to
    # run: they have lower program ids, which the GPU dispatches first (as CUTLASS's serial split-K
    # assumes); under the interpreter programs run in id order, so no tile ever waits.
    pid = tl.program_id(0)
    gdc_enter(GDC)
    if pid < N1:
        offs_r1 = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask1 = offs_r1 < K
        rows1 = tl.load(idx_ptr + offs_r1, mask=rmask1, other=0).to(tl.int64)
        w_rows = w1_ptr + rows1[:, None] * D
        acc1 = tl.zeros([BLOCK_R, BLOCK_D1 // ROW_ACC], dtype=tl.float32)
        for d0 in tl.range(0, D, BLOCK_D1, num_stages=STAGES1):
            offs_d1 = d0 + tl.arange(0, BLOCK_D1)
            if EVEN_D1:
                xv1 = tl.load(x_ptr + offs_d1)
                wv1 = tl.load(w_rows + offs_d1[None, :], eviction_policy=W_EV).to(tl.float32)
            else:
                dmask1 = offs_d1 < D
                xv1 = tl.load(x_ptr + offs_d1, mask=dmask1, other=0.0)
                wv1 = tl.load(w_rows + offs_d1[None, :], mask=dmask1[None, :], other=0.0,
                              eviction_policy=W_EV).to(tl.float32)
            if ROW_ACC == 1:
                acc1 += wv1 * xv1.to(tl.float32)[None, :]
            else:  # summed per chunk: a [BLOCK_R, 1] accumulator (registers for longer tiles)
                acc1 += tl.sum(wv1 * xv1.to(tl.float32)[None, :], axis=1, keep_dims=True)
        gdc_release(GDC)
        h = tl.maximum(tl.sum(acc1, axis=1) + tl.load(b1_ptr + rows1).to(tl.float32), 0.0)
        tl.store(h_ptr + offs_r1, h.to(h_ptr.dtype.element_ty), mask=rmask1)
        tl.debug_barrier()  # every thread's h stored before thread 0's release
        tl.atomic_add(cnt_ptr + (pid * BLOCK_R) // K_PER_SPLIT, 1, sem="release")
    else:
        t = pid - N1
        pid_s = t // N_D
        pid_d = t % N_D
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        need = (k_end - k_start + BLOCK_R - 1) // BLOCK_R
        seen = tl.atomic_add(cnt_ptr + pid_s, 0, sem="acquire")
        while seen < need:
            seen = tl.atomic_add(cnt_ptr + pid_s, 0, sem="acquire")
        tl.debug_barrier()
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        if FC2_DOT:
            offs_b = tl.arange(0, BLOCK_B)
            acc2 = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
            for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES2):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = offs_k < k_end
                rows2 = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
                # h: other programs of this launch stored it; .cg reads L2, never a stale L1 line
                hv = tl.load(h_ptr + offs_b[:, None] * 0 + offs_k[None, :],
                             mask=(offs_b == 0)[:, None] & kmask[None, :], other=0.0, cache_modifier=".cg")
                if EVEN_D:
                    wv2 = tl.load(w2_ptr + rows2[:, None] * D + offs_d[None, :])
                else:
                    wv2 = tl.load(w2_ptr + rows2[:, None] * D + offs_d[None, :], mask=dmask[None, :], other=0.0)
                if DOT_FP32:
                    acc2 = tl.dot(hv.to(tl.float32), wv2.to(tl.float32), acc2, input_precision="ieee")
                else:
                    acc2 = tl.dot(hv.to(wv2.dtype), wv2, acc2)
            gdc_release(GDC)
            tl.store(part_ptr + pid_s.to(tl.int64) * D + offs_b[:, None] * 0 + offs_d[None, :], acc2,
                     mask=(offs_b == 0)[:, None] & dmask[None, :])
        else:  # multiply and sum (batch 1 needs no tl.dot): fewer registers, more programs per SM
            acc3 = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
            for k1 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES2):
                offs_k3 = k1 + tl.arange(0, BLOCK_K)
                kmask3 = offs_k3 < k_end
                rows3 = tl.load(idx_ptr + offs_k3, mask=kmask3, other=0).to(tl.int64)
                hv3 = tl.load(h_ptr + offs_k3, mask=kmask3, other=0.0, cache_modifier=".cg").to(tl.float32)
                if EVEN_D:
                    wv3 = tl.load(w2_ptr + rows3[:, None] * D + offs_d[None, :])
                else:
                    wv3 = tl.load(w2_ptr + rows3[:, None] * D + offs_d[None, :], mask=dmask[None, :], other=0.0)
                acc3 += wv3.to(tl.float32) * hv3[:, None]
            gdc_release(GDC)
            tl.store(part_ptr + pid_s.to(tl.int64) * D + offs_d, tl.sum(acc3, axis=0), mask=dmask)
        if last_arrival(cnt_ptr + SPLIT + pid_s, N_D):  # every tile of the split is past its wait
            tl.atomic_xchg(cnt_ptr + pid_s, 0, sem="relaxed")


# ---------------------------------------------------------------------------------------
# launchers (internal: no checks; the public functions below check)

def _dot_fp32(dtype, device) -> bool:
    # fp32 dots in IEEE fp32 (Triton's default would be tf32). Triton 3.6's interpreter
    # computes bf16 dots wrongly (garbage), so on CPU bf16 operands are upcast first.
    return dtype == torch.float32 or (device.type == "cpu" and dtype == torch.bfloat16)


def _cdiv(a, b):
    return (a + b - 1) // b


def _split_plan(K, D, cfg, programs_per_split=1):
    """fc2's split-K plan: (n_d D blocks, split, k_per_split rows, a multiple of BLOCK_K)."""
    n_d = _cdiv(D, cfg["BLOCK_D"])
    k_blocks = max(1, _cdiv(K, cfg["BLOCK_K"]))
    target = cfg.get("TARGET_PROGRAMS", TARGET_PROGRAMS)
    split = cfg.get("SPLIT") or max(1, min(k_blocks, target // (n_d * programs_per_split)))
    k_per_split = _cdiv(k_blocks, split) * cfg["BLOCK_K"]
    return n_d, max(1, _cdiv(K, k_per_split)), k_per_split


class Fc2Overlap(NamedTuple):
    """One batch-1 MLP's fc1 -> fc2 hand-over by K split (`fc2_overlap`): pass the same object as
    `overlap=` to sparse_fc1 and then to sparse_fc2 (both with the configs it was made for)."""
    cnt: torch.Tensor  # int32 [2 * split]: fc1 programs stored per split, then fc2 tiles past their wait
    k_per_split: int   # fc2's rows per split (a multiple of rows)
    rows: int          # fc1's rows per program (FC1_CONFIG["gemv"]["BLOCK_R"] or its override)


def fc2_overlap(K, D, device, *, fc1_config=None, fc2_config=None) -> Fc2Overlap:
    """The hand-over for a batch-1 MLP of K selected neurons and width D (GPU only: on CPU the
    launches run one after the other anyway, and so does this). Counters must exist before a
    CUDA-graph capture, as for `_common.counters`."""
    rows = {**FC1_CONFIG["gemv"], **(fc1_config or {})}["BLOCK_R"]
    _, split, k_per_split = _split_plan(K, D, {**FC2_CONFIG["dot1"], **(fc2_config or {})})
    if k_per_split % rows:
        raise DejavuError(f"fc2_overlap: fc2's {k_per_split} rows per split are not a multiple of fc1's "
                          f"{rows} rows per program")
    cnt = counters(torch.device(device), OVERLAP_COUNTERS + 2 * split)[OVERLAP_COUNTERS:OVERLAP_COUNTERS + 2 * split]
    return Fc2Overlap(cnt, k_per_split, rows)


def gather_gemv(x, w, bias, idx, out, *, relu, config=None, group=1, kind=None, ln_fold=None, overlap=None):
    """out[B,K] = act(w[rows] @ x + bias[rows]) (checked inputs; out may be wider than x);
    rows = idx (group 1) or the `group` consecutive rows of each index (K = idx's K * group).
    x may be a PendingLN (its LayerNorm): the GEMV route normalises x as it loads it, or with
    ln_fold (a layer_norm.LNFold of w, bias and the LayerNorm; group 1) takes it folded into
    the rows; the tl.dot route (shared sets from DOT_MIN_BATCH) runs the layer_norm kernel first.
    kind: the PDL kind of the launch (default fc1, or qkv_full with group > 1).
    overlap: a Fc2Overlap (batch 1, group 1, the GEMV route): each program counts its stored
    rows for fc2, and on PDL GPUs the next launch (that fc2) may start at once."""
    pending = x if isinstance(x, PendingLN) else None
    xt = x.x if pending is not None else x
    B, D = xt.shape
    K = idx.shape[-1] * group
    if K == 0 or B == 0:
        return out
    shared = idx.dim() == 1
    kind = kind or ("qkv_full" if group > 1 else "fc1")
    if (shared or B == 1) and B >= DOT_MIN_BATCH:  # B == 1: [1, K] is the same set as [K]
        if overlap is not None:
            raise DejavuError("gather_gemv: overlap= needs batch 1 (the GEMV route)")
        x = materialize(x)
        cfg = {**FC1_CONFIG["dot"], **(config or {})}
        kernel = jit(_gather_dot_kernel, x.device)
        kernel[(_cdiv(K, cfg["BLOCK_R"]),)](
            x, w, bias, idx, out, B, D, K, x.stride(0), out.stride(0), w.shape[0],
            RELU=relu, DOT_FP32=_dot_fp32(w.dtype, x.device), BLOCK_R=cfg["BLOCK_R"],
            BLOCK_B=max(16, next_pow2(B)), BLOCK_D=cfg["BLOCK_D"],
            EVEN_D=D % cfg["BLOCK_D"] == 0, GROUP=group, num_warps=cfg["num_warps"],
            num_stages=cfg.get("num_stages", 3), **pdl_args(x.device, kind))
    else:
        cfg = {**FC1_CONFIG["gemv"], **(config or {})}
        if overlap is not None and (B != 1 or group != 1 or overlap.rows != cfg["BLOCK_R"]):
            raise DejavuError(f"gather_gemv: overlap= needs batch 1, group 1 and {overlap.rows} rows per "
                              f"program (got batch {B}, group {group}, BLOCK_R {cfg['BLOCK_R']})")
        kernel = jit(_gather_gemv_kernel, xt.device)
        fold = pending is not None and ln_fold is not None and group == 1
        if pending is not None:
            lnw, lnb, st, n_st, st_w = pending.weight, pending.bias, pending.stats, pending.stats.shape[1], pending.width
        else:
            lnw, lnb, st, n_st, st_w = xt, xt, xt, 1, 1  # never read without LN_IN
        # the block fold: the centred product z instead of x (its stats' blocks and the fold's match)
        centred = fold and pending.z is not None and ln_fold.wgb is not None and ln_fold.width == st_w
        ln_in = 0 if pending is None else 3 if centred else 2 if fold else 1
        b_in, wg = (ln_fold.wb, ln_fold.wgb if centred else ln_fold.wg) if fold else (bias, xt)  # wg: folds only
        xt = pending.z if centred else xt
        pdl = pdl_args(xt.device, kind)
        if overlap is not None and pdl:
            pdl["GDC"] = 2  # early trigger: fc2's tiles wait on the counts, not on this launch's end
        kernel[(B, _cdiv(K, cfg["BLOCK_R"]))](
            xt, w, b_in, idx, out, lnw, lnb, st, wg, D, K, xt.stride(0), 0 if shared else idx.stride(0),
            out.stride(0), w.shape[0], n_st, st_w, LN_EPS,
            overlap.cnt if overlap is not None else idx, overlap.k_per_split if overlap is not None else 1,
            RELU=relu, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"],
            EVEN_D=D % cfg["BLOCK_D"] == 0, GROUP=group, LN_IN=ln_in,
            BLOCK_N=max(2, next_pow2(n_st)), W_CM=cfg.get("W_CM", ""), W_EV=cfg.get("W_EV", ""),
            ST_CM=cfg.get("ST_CM", ""), SIGNAL=overlap is not None,
            num_warps=cfg["num_warps"],
            num_stages=cfg.get("num_stages", 2), **pdl)
    return out


def gather_gemv_t(h, w_t, bias, idx, residual, out, *, config=None, group=1, ln=None, ln_out=None,
                  combine=None, ln_defer=False, overlap=None):
    """out[B,D] = h @ w_t[rows] + bias (+ residual) (checked inputs; h may be fp32); rows as
    in gather_gemv (h's K = idx's K * group). ln = (weight, bias): also ln_out[B,D] =
    LayerNorm(out) (eps LN_EPS). combine = (acc [Kh * nchunk, group], ml [Kh * nchunk, 2],
    nchunk): batch 1 through the dot kernel only; h's values come from these attention partials
    inside the kernel (h gives the shape and is not read). Returns out.
    ln_defer (with ln): returns (out, LayerNorm(out)) where the second is a PendingLN when the
    separate split-K reduction runs (it stores the block stats; no LayerNorm launch), else
    ln_out computed as above. ln_defer="z": the PendingLN also carries z (PendingLN's doc).
    overlap: the Fc2Overlap the fc1 launch that made h counted on (batch 1, group 1, the dot
    route, the split it was planned with, no fused finish)."""
    B, K = h.shape
    D = w_t.shape[1]
    if B == 0:
        return out
    shared = idx.dim() == 1
    dot = (shared or B == 1) and B >= FC2_DOT_MIN_BATCH
    route = (("proj1" if group > 1 else "dot1") if B == 1 else "dot") if dot else "gemv"
    if combine is not None and not (dot and B == 1):
        raise DejavuError("gather_gemv_t: combine= needs batch 1 through the dot kernel")
    cfg = {**FC2_CONFIG[route], **(config or {})}
    block_k, block_d = cfg["BLOCK_K"], cfg["BLOCK_D"]
    per_col = 1 if dot else B  # programs per (split, D block)
    n_d, split, k_per_split = _split_plan(K, D, cfg, per_col)
    final = split == 1
    # in-kernel finish: partial sums unless SPLIT is 1, LayerNorm if asked (FUSED_FINISH)
    fused = FUSED_FINISH and B <= FUSED_MAX_BATCH and (not final or ln is not None)
    if overlap is not None and (route != "dot1" or fused or overlap.k_per_split != k_per_split
                                or overlap.cnt.numel() != 2 * split):
        raise DejavuError("gather_gemv_t: overlap= needs batch 1, group 1, no fused finish and the split "
                          f"it was made for ({overlap.k_per_split} rows per split; this launch: {k_per_split}, "
                          f"{split} splits)")
    part = out if final else torch.empty((split, B, D), dtype=torch.float32, device=h.device)
    res = residual if residual is not None else out  # never read when HAS_RES is false
    cnt = counters(h.device, n_d + 1) if fused else overlap.cnt if overlap is not None else idx  # FUSED / WAIT
    fused_ln = fused and ln is not None
    lnw, lnb = ln if fused_ln else (bias, bias)
    lno = ln_out if fused_ln else out
    # per (row, D block): mean and M2 of the stored y, merged by the LayerNorm program
    stats = torch.empty((B, n_d, 2), dtype=torch.float32, device=h.device) if fused_ln else part
    fin = (cnt, lnw, lnb, lno, stats)
    # SPLIT, N_D, N_COL (programs per D block), N_LN (programs that store y), eps
    sizes = (split, n_d, split * per_col, n_d * per_col if final else n_d, LN_EPS, w_t.shape[0])
    common = dict(FINAL=final, HAS_RES=residual is not None, FUSED=fused, LN=fused_ln,
                  BLOCK_K=block_k, BLOCK_D=block_d, EVEN_D=D % block_d == 0, GROUP=group,
                  BLOCK_S=min(next_pow2(split), max(1, FIN_PARTIALS // block_d)),
                  BLOCK_N=max(2, next_pow2(n_d)), LN_BLOCK=LN_BLOCK, num_warps=cfg["num_warps"],
                  **pdl_args(h.device, "proj" if group > 1 else "fc2"))
    if dot:
        kernel = jit(_gather_dot_t_kernel, h.device)
        apart, ml, nchunk = combine if combine is not None else (h, h, 1)  # never read without COMBINE
        kernel[(n_d, split)](h, w_t, idx, part, bias, res, out, *fin, B, D, K, k_per_split,
                             h.stride(0), *sizes, apart, ml, nchunk, overlap.rows if overlap is not None else 1,
                             DOT_FP32=_dot_fp32(w_t.dtype, h.device),
                             BLOCK_B=max(16, next_pow2(B)), num_stages=cfg.get("num_stages", 3),
                             COMBINE=combine is not None, BLOCK_C=max(2, next_pow2(nchunk)),
                             W_EV=cfg.get("W_EV", ""), WAIT=overlap is not None, SPIN_NS=cfg.get("SPIN_NS", 0),
                             H_CM=".cg" if overlap is not None else "", ROWS_AHEAD=bool(cfg.get("ROWS_AHEAD")),
                             **reg_cap(cfg, h.device), **common)
    else:
        kernel = jit(_gather_gemv_t_kernel, h.device)
        kernel[(B, split, n_d)](h, w_t, idx, part, bias, res, out, *fin, B, D, K, k_per_split,
                                h.stride(0), 0 if shared else idx.stride(0), *sizes,
                                num_stages=cfg.get("num_stages", 2), **common)
    if not final and not fused:  # the separate split reduction (+ LayerNorm at small batch)
        return reduce_partials(part, bias, residual, out, ln, ln_out, ln_defer)
    if ln is not None and not fused:
        layer_norm(out, ln[0], ln[1], LN_EPS, out=ln_out)
    return (out, ln_out) if ln is not None and ln_defer else out


def reduce_partials(part, bias, residual, out, ln=None, ln_out=None, ln_defer=False):
    """out[B,D] = sum_s part[s] + bias (+ residual), part [SPLIT, B, D] fp32 (split-K partial
    sums); ln, ln_out, ln_defer and the return value as gather_gemv_t's. The reduction kernel;
    with ln at batch <= REDUCE_LN_MAX_BATCH (not deferred) the one-launch reduction + LayerNorm."""
    split, B, D = part.shape
    dev = part.device
    block_s = next_pow2(split)
    block = max(128, REDUCE_BLOCK * 4 // block_s)  # ~4096 partials per program
    n_blk = _cdiv(D, block)
    res = residual if residual is not None else out  # never read when HAS_RES is false
    if ln is not None and not ln_defer and B <= REDUCE_LN_MAX_BATCH:
        st = torch.empty((B, n_blk, 2), dtype=torch.float32, device=dev)
        kernel = jit(_split_reduce_ln_kernel, dev)
        kernel[(n_blk,)](part, bias, res, out, counters(dev, 1), ln[0], ln[1], ln_out, st, B, D, split,
                         n_blk, LN_EPS, HAS_RES=residual is not None, BLOCK_D=block, BLOCK_S=block_s,
                         BLOCK_N=max(2, next_pow2(n_blk)), LN_BLOCK=min(LN_BLOCK_ROW, next_pow2(D)),
                         num_warps=8, **pdl_args(dev, "reduce"))
        return out
    defer = ln is not None and bool(ln_defer)
    centred = defer and ln_defer == "z"
    st = torch.empty((B, n_blk, 2), dtype=torch.float32, device=dev) if defer else out
    z = torch.empty_like(out) if centred else None
    reduce = jit(_split_reduce_kernel, dev)
    reduce[(B, n_blk)](part, bias, res, out, st, ln[0] if centred else bias, z if centred else out, B, D, split,
                       n_blk, HAS_RES=residual is not None, BLOCK=block, BLOCK_S=block_s,
                       STATS=2 if centred else int(defer), num_warps=4, **pdl_args(dev, "reduce"))
    if defer:
        return out, PendingLN(out, ln[0], ln[1], st, block, z)
    if ln is not None:
        layer_norm(out, ln[0], ln[1], LN_EPS, out=ln_out)
    return out


def mlp_chain(x, w1, b1, w2_t, b2, idx, residual, out, *, ln=None, ln_out=None, ln_defer=False, config=None):
    """Batch 1 (checked inputs): fc2(relu(fc1(x))) over the rows idx in one launch
    (`_mlp_chain_kernel`), then the split reduction as gather_gemv_t's (reduce_partials: bias,
    residual, ln / ln_defer). config: {"fc1": {...}, "fc2": {...}, "num_warps": n} over CHAIN_CONFIG."""
    config = config or {}
    c1 = {**CHAIN_CONFIG["fc1"], **config.get("fc1", {})}
    c2 = {**CHAIN_CONFIG["fc2"], **config.get("fc2", {})}
    D = x.shape[1]
    K = idx.shape[-1]
    dev = x.device
    r1, block_k, block_d = c1["BLOCK_R"], c2["BLOCK_K"], c2["BLOCK_D"]
    if block_k % r1:
        raise DejavuError(f"mlp_chain: fc2's BLOCK_K {block_k} is not a multiple of fc1's BLOCK_R {r1}")
    n_d, split, k_per_split = _split_plan(K, D, {k: v for k, v in c2.items() if k != "SPLIT"})
    n1 = _cdiv(K, r1)
    h = torch.empty(K, dtype=x.dtype, device=dev)
    part = torch.empty((split, 1, D), dtype=torch.float32, device=dev)
    cnt = counters(dev, CHAIN_COUNTERS + 2 * split)[CHAIN_COUNTERS:]
    kernel = jit(_mlp_chain_kernel, dev)
    kernel[(n1 + split * n_d,)](
        x, w1, b1, w2_t, idx, h, part, cnt, D, K, n1, k_per_split, split, n_d,
        BLOCK_R=r1, BLOCK_D1=c1["BLOCK_D"], EVEN_D1=D % c1["BLOCK_D"] == 0, STAGES1=c1["num_stages"],
        W_EV=c1.get("W_EV", ""), BLOCK_K=block_k, BLOCK_B=16, BLOCK_D=block_d, EVEN_D=D % block_d == 0,
        STAGES2=c2["num_stages"], DOT_FP32=_dot_fp32(w2_t.dtype, dev),
        ROW_ACC=c1["BLOCK_D"] if c1.get("ROW_ACC") else 1, FC2_DOT=c2.get("DOT", True),
        num_warps=config.get("num_warps", CHAIN_CONFIG["num_warps"]), **pdl_args(dev, "fc1"))
    return reduce_partials(part, b2, residual, out, ln, ln_out, ln_defer)


def check_ln(ln, ln_out, B, D, dtype, device):
    """Check the `ln=(weight[D], bias[D])` / `ln_out[B,D]` options of the fused finish; returns
    ln_out (allocated when None), or None without ln."""
    if ln is None:
        if ln_out is not None:
            raise DejavuError("ln_out: given without ln=(weight, bias)")
        return None
    if not isinstance(ln, (tuple, list)) or len(ln) != 2:
        raise DejavuError("ln: expected a (weight, bias) pair")
    check_tensor("ln weight", ln[0], shape=(D,), dtype=dtype, device=device)
    check_tensor("ln bias", ln[1], shape=(D,), dtype=dtype, device=device)
    ln_out = check_out(ln_out, (B, D), dtype, device)
    return ln_out


# ---------------------------------------------------------------------------------------
# public API

def sparse_fc1(x, w1, b1, idx, *, out=None, validate=None, config=None, ln_fold=None, overlap=None):
    """h[B,K] = relu(w1[idx] @ x + b1[idx]); x [B,D] (or a PendingLN: its LayerNorm), w1 [F,D],
    b1 [F], idx [B,K] or [K]. ln_fold: layer_norm.ln_fold(w1, b1, x.weight, x.bias), used
    when x is a PendingLN (the LayerNorm folded into the rows; gather_gemv); with the block
    fold (ln_fold(..., width=x.width)) and x.z, fc1 reads z instead of x and the weight.
    overlap: a `fc2_overlap(K, D, device)` for the sparse_fc2 call that follows (batch 1): fc2
    then starts on each K split as soon as fc1 has stored it."""
    if isinstance(x, PendingLN):
        check_pending(x)
    xt = x.x if isinstance(x, PendingLN) else x
    check_tensor("x", xt, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = xt.shape
    check_tensor("w1", w1, ndim=2, dtype=xt.dtype, device=xt.device)
    F = w1.shape[0]
    if w1.shape[1] != D:
        raise DejavuError(f"w1: shape {tuple(w1.shape)} does not match x's D={D}")
    check_tensor("b1", b1, shape=(F,), dtype=xt.dtype, device=xt.device)
    K, _ = check_index("idx", idx, batch=B, upper=F, device=xt.device,
                       validate=default_validate(validate, xt.device))
    out = check_out(out, (B, K), xt.dtype, xt.device)
    if ln_fold is not None:
        check_tensor("ln_fold.wg", ln_fold.wg, shape=(F,), dtype=torch.float32, device=xt.device)
        check_tensor("ln_fold.wb", ln_fold.wb, shape=(F,), dtype=torch.float32, device=xt.device)
        if ln_fold.wgb is not None:
            check_tensor("ln_fold.wgb", ln_fold.wgb, shape=(F, -(-D // max(1, ln_fold.width))),
                         dtype=torch.float32, device=xt.device)
    return gather_gemv(x, w1, b1, idx, out, relu=True, config=config, ln_fold=ln_fold, overlap=overlap)


def sparse_fc2(h, w2_t, b2, idx, residual=None, *, out=None, ln=None, ln_out=None, validate=None,
               config=None, ln_defer=False, overlap=None):
    """y[B,D] = h @ w2_t[idx] + b2 (+ residual); h [B,K], w2_t [F,D], b2 [D], idx [B,K]|[K].
    ln = (weight[D], bias[D]): returns (y, LayerNorm(y)) instead (eps 1e-5; into ln_out).
    ln_defer (with ln): the second output may be a PendingLN (gather_gemv_t), for sparse_fc1.
    overlap: the Fc2Overlap the sparse_fc1 call that made h was given (h must be that output)."""
    check_tensor("h", h, ndim=2, dtypes=FLOAT_DTYPES)
    B, K = h.shape
    check_tensor("w2_t", w2_t, ndim=2, dtype=h.dtype, device=h.device)
    F, D = w2_t.shape
    check_tensor("b2", b2, shape=(D,), dtype=h.dtype, device=h.device)
    k, _ = check_index("idx", idx, batch=B, upper=F, device=h.device,
                       validate=default_validate(validate, h.device))
    if k != K:
        raise DejavuError(f"idx: K={k} does not match h's K={K}")
    if residual is not None:
        check_tensor("residual", residual, shape=(B, D), dtype=h.dtype, device=h.device)
    out = check_out(out, (B, D), h.dtype, h.device)
    ln_out = check_ln(ln, ln_out, B, D, h.dtype, h.device)
    y = gather_gemv_t(h, w2_t, b2, idx, residual, out, config=config, ln=ln, ln_out=ln_out,
                      ln_defer=ln_defer if ln is not None else False, overlap=overlap)
    return y if ln is None or ln_defer else (y, ln_out)


def sparse_mlp_layer(x, w1, b1, w2_t, b2, idx, residual=None, *, validate=None):
    """fc2(relu(fc1(x))) over the selected neurons: y[B,D]."""
    h = sparse_fc1(x, w1, b1, idx, validate=validate)
    return sparse_fc2(h, w2_t, b2, idx, residual, validate=False)


def check_mlp_weights(x, w1, b1, w2_t, b2) -> int:
    """Check one layer's MLP weights against x [B,D] (w1, w2_t [F,D], b1 [F], b2 [D], x's dtype and
    device) for the one-launch MLPs; returns F."""
    D = x.shape[1]
    check_tensor("w1", w1, ndim=2, dtype=x.dtype, device=x.device)
    F = w1.shape[0]
    if w1.shape[1] != D:
        raise DejavuError(f"w1: shape {tuple(w1.shape)} does not match x's D={D}")
    check_tensor("b1", b1, shape=(F,), dtype=x.dtype, device=x.device)
    check_tensor("w2_t", w2_t, shape=(F, D), dtype=x.dtype, device=x.device)
    check_tensor("b2", b2, shape=(D,), dtype=x.dtype, device=x.device)
    return F


def sparse_mlp_chain(x, w1, b1, w2_t, b2, idx, residual=None, *, out=None, ln=None, ln_out=None, validate=None,
                     config=None, ln_defer=False):
    """Batch 1: y[1,D] = relu(w1[idx] @ x + b1[idx]) @ w2_t[idx] + b2 (+ residual), fc1 and fc2 in one
    launch (then the split reduction); x [1,D], idx [1,K] or [K]. ln, ln_out, ln_defer and the return
    value as sparse_fc2's. h is rounded to x's dtype between the two, as sparse_fc1 + sparse_fc2 do."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x.shape
    if B != 1:
        raise DejavuError(f"sparse_mlp_chain: batch 1 only, got x of shape {tuple(x.shape)}")
    F = check_mlp_weights(x, w1, b1, w2_t, b2)
    K, _ = check_index("idx", idx, batch=1, upper=F, device=x.device,
                       validate=default_validate(validate, x.device))
    if residual is not None:
        check_tensor("residual", residual, shape=(1, D), dtype=x.dtype, device=x.device)
    out = check_out(out, (1, D), x.dtype, x.device)
    ln_out = check_ln(ln, ln_out, 1, D, x.dtype, x.device)
    if K == 0:
        raise DejavuError("idx: K = 0 (no rows selected)")
    y = mlp_chain(x, w1, b1, w2_t, b2, idx.reshape(-1), residual, out, ln=ln, ln_out=ln_out,
                  ln_defer=ln_defer if ln is not None else False, config=config)
    return y if ln is None or ln_defer else (y, ln_out)


# ---------------------------------------------------------------------------------------
# references (PyTorch, any device/dtype; compute in the inputs' dtype unless upcast first)

def _expand_idx(idx, batch):
    return idx.long().expand(batch, -1) if idx.dim() == 1 else idx.long()


def sparse_fc1_ref(x, w1, b1, idx, *, ln_fold=None):
    """relu(w1[idx] @ x + b1[idx]) per row: h[B,K] (x a tensor or a PendingLN; ln_fold, a
    speed option of the kernel, changes nothing here)."""
    x = materialize_ref(x)
    rows = _expand_idx(idx, x.shape[0])
    h = torch.einsum("bkd,bd->bk", w1[rows], x) + b1[rows]
    return torch.relu(h)


def sparse_fc2_ref(h, w2_t, b2, idx, residual=None, *, ln=None, ln_defer=False):
    """sum_k h[:,k] * w2_t[idx[k]] + b2 (+ residual): y[B,D]; with ln=(weight, bias),
    (y, F.layer_norm(y)) (ln_defer changes nothing here: the LayerNorm is computed)."""
    rows = _expand_idx(idx, h.shape[0])
    y = torch.einsum("bk,bkd->bd", h, w2_t[rows]) + b2
    return with_ln_ref(y if residual is None else y + residual, ln)


def with_ln_ref(y, ln):
    """y, or (y, F.layer_norm(y) with ln = (weight, bias), eps 1e-5) in y's dtype: the
    references' form of the fused LayerNorm (the dense model's own function)."""
    if ln is None:
        return y
    return y, torch.nn.functional.layer_norm(y, (y.shape[-1],), ln[0], ln[1], LN_EPS)


def sparse_mlp_layer_ref(x, w1, b1, w2_t, b2, idx, residual=None):
    return sparse_fc2_ref(sparse_fc1_ref(x, w1, b1, idx), w2_t, b2, idx, residual)


def sparse_mlp_chain_ref(x, w1, b1, w2_t, b2, idx, residual=None, *, ln=None, ln_defer=False):
    """sparse_fc2_ref(sparse_fc1_ref(x)) with h rounded to x's dtype between them (as the kernel
    stores it); ln as sparse_fc2_ref's."""
    h = sparse_fc1_ref(x, w1, b1, idx).to(x.dtype)
    return sparse_fc2_ref(h, w2_t, b2, idx, residual, ln=ln)

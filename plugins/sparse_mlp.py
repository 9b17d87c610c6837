"""Sparse MLP for decode: gathered GEMVs over the selected neurons (Triton) + references.

    sparse_fc1(x[B,D], w1[F,D], b1[F], idx[B,K]|[K]) -> h[B,K] = relu(w1[idx] @ x + b1[idx])
    sparse_fc2(h[B,K], w2_t[F,D], b2[D], idx, residual[B,D]|None) -> y[B,D]
                                                   = sum_k h[:,k] * w2_t[idx[k]] + b2 (+ residual)
    sparse_fc2(..., ln=(weight[D], bias[D])) -> (y[B,D], LayerNorm(y)[B,D])   (eps 1e-5)
    sparse_fc2(..., ln=(weight, bias), ln_defer=True) -> (y, PendingLN of y)    (split-K reduction)

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
  bias and residual by a second small kernel (deterministic); with one split the kernel
  finishes alone. With `ln=` the next LayerNorm follows (`layer_norm.layer_norm`), or with
  `ln_defer=True` the reduction stores per-block statistics and returns a `PendingLN` that the
  next layer's Q/K/V kernel normalises itself (deferred_kv.py, batch 1).
- No host sync on the GPU path; launches are CUDA-graph capturable.
- Block sizes are fixed per path (FC1_CONFIG / FC2_CONFIG, picked on an H200, recorded by
  `kernel_settings()`); `config=` overrides them (the benchmark's sweep).
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_index, check_out, check_tensor, default_validate,
                                    gdc_enter, gdc_release, helper, jit, next_pow2, pdl_args)
from dejavu.plugins.layer_norm import PendingLN, layer_norm

tl = None  # triton.language, bound on first launch (see _common.jit)

# Chosen by `benchmarks/kernels.py --sweep` on an H200, timed in CUDA graphs (2026-12-02,
# benchmarks/results/kernels-2026-12-02-sweep-b1.json; summed time over OPT-30B/66B at
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
DOT_MIN_BATCH = 2       # fc1: shared index sets from this batch size use the tl.dot kernel
# fc2 (and the attention output projection): from batch 1. On the H200 at batch 1, OPT-30B,
# the tl.dot fc2 took 37.5 us at density 0.3 and 17.2 at 0.1, the split-K GEMV 50.5 and 27.9;
# fc1 is faster as a GEMV (33.6 vs 37.5 us; H200, 2026-12-02).
FC2_DOT_MIN_BATCH = 1
TARGET_PROGRAMS = 528   # fc2 split-K without a fixed SPLIT: ~4 programs per SM (132 SMs)
REDUCE_BLOCK = 1024
LN_EPS = 1e-5


def kernel_settings() -> dict:
    """The block choices in force, for the engine header's target.kernel_settings."""
    return {"fc1": {k: dict(v) for k, v in FC1_CONFIG.items()},
            "fc2": {k: dict(v) for k, v in FC2_CONFIG.items()},
            "dot_min_batch": DOT_MIN_BATCH, "fc2_dot_min_batch": FC2_DOT_MIN_BATCH,
            "fc2_target_programs": TARGET_PROGRAMS}


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


def _gather_gemv_kernel(x_ptr, w_ptr, b_ptr, idx_ptr, out_ptr, D, K, stride_xb, stride_ib, stride_ob,
                        RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                        EVEN_D: tl.constexpr, GROUP: tl.constexpr, W_EV: tl.constexpr = "",
                        GDC: tl.constexpr = 0):
    # out[b, r] = act(w[row(b, r)] @ x[b] + bias[row(b, r)]); grid (B, cdiv(K, BLOCK_R)).
    # W_EV: eviction policy of the weight loads ("evict_first": the streamed rows do not push the
    # input vector, which every program re-reads, out of L1).
    # row(b, r) = idx[b, r // GROUP] * GROUP + r % GROUP (GROUP 1: rows; head dim: heads).
    # stride_ib = 0 for a shared index set: batch is the fastest grid axis, so the programs
    # reading the same rows run together and share them through L2.
    pid_b = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < K
    gdc_enter(GDC)
    # masked rows gather row 0 (in bounds) and are never stored: the weight loads need no mask
    rows = _group_rows(idx_ptr + pid_b * stride_ib, offs_r, rmask, GROUP)
    w_rows = w_ptr + rows[:, None] * D
    x_row = x_ptr + pid_b.to(tl.int64) * stride_xb
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        if EVEN_D:
            xv = tl.load(x_row + offs_d)
            wv = tl.load(w_rows + offs_d[None, :], eviction_policy=W_EV).to(tl.float32)
        else:
            dmask = offs_d < D
            xv = tl.load(x_row + offs_d, mask=dmask, other=0.0)
            wv = tl.load(w_rows + offs_d[None, :], mask=dmask[None, :], other=0.0,
                         eviction_policy=W_EV).to(tl.float32)
        acc += wv * xv.to(tl.float32)[None, :]
    gdc_release(GDC)
    h = tl.sum(acc, axis=1) + tl.load(b_ptr + rows).to(tl.float32)
    if RELU:
        h = tl.maximum(h, 0.0)
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
    # rows read nothing. CM "": an earlier kernel wrote them and thousands of programs read the
    # same few lines (L1 then serves all but the first warp of each SM; after the PDL wait no
    # stale copy can be in L1; ".cg" there ran 3.6x slower).
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


def _gather_gemv_t_kernel(h_ptr, w_ptr, idx_ptr, part_ptr, b_ptr, res_ptr, out_ptr,
                          B, D, K, K_PER_SPLIT, stride_hb, stride_ib,
                          FINAL: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, GROUP: tl.constexpr,
                          GDC: tl.constexpr = 0):
    # Per-sequence sets: y[b, d] = sum_k h[b, k] * w_t[row(b, k), d]; grid (B, SPLIT, cdiv(D, BLOCK_D));
    # row(b, k) = idx[b, k // GROUP] * GROUP + k % GROUP.
    # FINAL (SPLIT == 1): add bias (+ residual) and store y; else store fp32 partials.
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    idx_row = idx_ptr + pid_b * stride_ib
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
        tl.store(out_ptr + row + offs_d, y.to(out_ptr.dtype.element_ty), mask=dmask)
    else:
        tl.store(part_ptr + pid_s.to(tl.int64) * B * D + row + offs_d, y, mask=dmask)


def _gather_dot_t_kernel(h_ptr, w_ptr, idx_ptr, part_ptr, b_ptr, res_ptr, out_ptr,
                         B, D, K, K_PER_SPLIT, stride_hb,
                         FINAL: tl.constexpr, HAS_RES: tl.constexpr, DOT_FP32: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
                         EVEN_D: tl.constexpr, GROUP: tl.constexpr, GDC: tl.constexpr = 0):
    # Batch 1 or a shared index set: y[b, :] = h[b, :] @ w_t[rows] for all b; grid (cdiv(D, BLOCK_D), SPLIT).
    # FINAL as in _gather_gemv_t_kernel. Each K block's row indices are loaded in its iteration, so
    # Triton gives the gathered weight tile one shared-memory buffer (cp.async issued, then waited
    # for); three one-tile programs per SM keep as many bytes in flight as the memory system serves
    # (loading the indices a block ahead, which multi-buffers the tile, measured no faster).
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_b = tl.arange(0, BLOCK_B)
    bmask = offs_b < B
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    gdc_enter(GDC)
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        rows = _group_rows(idx_ptr, offs_k, kmask, GROUP)
        hv = tl.load(h_ptr + offs_b[:, None] * stride_hb + offs_k[None, :],
                     mask=bmask[:, None] & kmask[None, :], other=0.0)
        if EVEN_D:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :])
        else:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :], mask=dmask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(hv.to(tl.float32), wv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(hv.to(wv.dtype), wv, acc)
    gdc_release(GDC)
    rows_b = offs_b[:, None].to(tl.int64) * D
    mask = bmask[:, None] & dmask[None, :]
    if FINAL:
        y = acc + tl.load(b_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            y += tl.load(res_ptr + rows_b + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows_b + offs_d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_s.to(tl.int64) * B * D + rows_b + offs_d[None, :], acc, mask=mask)


def _split_reduce_kernel(part_ptr, b_ptr, res_ptr, out_ptr, st_ptr, B, D, SPLIT, N_BLK,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                         STATS: tl.constexpr = 0, GDC: tl.constexpr = 0):
    # out[b, d] = sum_s part[s, b, d] + bias[d] (+ residual[b, d]); grid (B, cdiv(D, BLOCK)).
    # All SPLIT partials in one [BLOCK_S, BLOCK] load (one memory round trip, not SPLIT).
    # STATS: also the block's (mean, M2) of the stored (rounded) out at st[b, block] (N_BLK
    # blocks per row), for a consumer that applies the next LayerNorm itself (PendingLN).
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


# ---------------------------------------------------------------------------------------
# launchers

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


def gather_gemv(x, w, bias, idx, out, *, relu, config=None, group=1, kind=None):
    """out[B,K] = act(w[rows] @ x + bias[rows]) (checked inputs; out may be wider than x);
    rows = idx (group 1) or the `group` consecutive rows of each index (K = idx's K * group).
    kind: the PDL kind of the launch (default fc1, or qkv_full with group > 1)."""
    B, D = x.shape
    K = idx.shape[-1] * group
    if K == 0 or B == 0:
        return out
    shared = idx.dim() == 1
    kind = kind or ("qkv_full" if group > 1 else "fc1")
    if (shared or B == 1) and B >= DOT_MIN_BATCH:  # B == 1: [1, K] is the same set as [K]
        cfg = {**FC1_CONFIG["dot"], **(config or {})}
        kernel = jit(_gather_dot_kernel, x.device)
        kernel[(_cdiv(K, cfg["BLOCK_R"]),)](
            x, w, bias, idx, out, B, D, K, x.stride(0), out.stride(0),
            RELU=relu, DOT_FP32=_dot_fp32(w.dtype, x.device), BLOCK_R=cfg["BLOCK_R"],
            BLOCK_B=max(16, next_pow2(B)), BLOCK_D=cfg["BLOCK_D"],
            EVEN_D=D % cfg["BLOCK_D"] == 0, GROUP=group, num_warps=cfg["num_warps"],
            num_stages=cfg.get("num_stages", 3), **pdl_args(x.device, kind))
    else:
        cfg = {**FC1_CONFIG["gemv"], **(config or {})}
        kernel = jit(_gather_gemv_kernel, x.device)
        kernel[(B, _cdiv(K, cfg["BLOCK_R"]))](
            x, w, bias, idx, out, D, K, x.stride(0), 0 if shared else idx.stride(0), out.stride(0),
            RELU=relu, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"], EVEN_D=D % cfg["BLOCK_D"] == 0,
            GROUP=group, W_EV=cfg.get("W_EV", ""), num_warps=cfg["num_warps"],
            num_stages=cfg.get("num_stages", 2), **pdl_args(x.device, kind))
    return out


def gather_gemv_t(h, w_t, bias, idx, residual, out, *, config=None, group=1, ln=None, ln_out=None,
                  ln_defer=False):
    """out[B,D] = h @ w_t[rows] + bias (+ residual) (checked inputs; h may be fp32); rows as
    in gather_gemv (h's K = idx's K * group). ln = (weight, bias): also ln_out[B,D] =
    LayerNorm(out) (eps LN_EPS), returned as (out, ln_out) with ln_defer, whose second is a
    PendingLN when the split-K reduction runs (it stores the block stats; no LayerNorm launch).
    Returns out otherwise."""
    B, K = h.shape
    D = w_t.shape[1]
    if B == 0:
        return out
    shared = idx.dim() == 1
    dot = (shared or B == 1) and B >= FC2_DOT_MIN_BATCH
    route = (("proj1" if group > 1 else "dot1") if B == 1 else "dot") if dot else "gemv"
    cfg = {**FC2_CONFIG[route], **(config or {})}
    block_k, block_d = cfg["BLOCK_K"], cfg["BLOCK_D"]
    n_d, split, k_per_split = _split_plan(K, D, cfg, 1 if dot else B)
    final = split == 1
    part = out if final else torch.empty((split, B, D), dtype=torch.float32, device=h.device)
    res = residual if residual is not None else out  # never read when HAS_RES is false
    common = dict(FINAL=final, HAS_RES=residual is not None, BLOCK_K=block_k, BLOCK_D=block_d,
                  EVEN_D=D % block_d == 0, GROUP=group, num_warps=cfg["num_warps"],
                  **pdl_args(h.device, "proj" if group > 1 else "fc2"))
    if dot:
        kernel = jit(_gather_dot_t_kernel, h.device)
        kernel[(n_d, split)](h, w_t, idx, part, bias, res, out, B, D, K, k_per_split, h.stride(0),
                             DOT_FP32=_dot_fp32(w_t.dtype, h.device), BLOCK_B=max(16, next_pow2(B)),
                             num_stages=cfg.get("num_stages", 3), **common)
    else:
        kernel = jit(_gather_gemv_t_kernel, h.device)
        kernel[(B, split, n_d)](h, w_t, idx, part, bias, res, out, B, D, K, k_per_split,
                                h.stride(0), 0 if shared else idx.stride(0),
                                num_stages=cfg.get("num_stages", 2), **common)
    if not final:
        return reduce_partials(part, bias, residual, out, ln, ln_out, ln_defer)
    if ln is not None:
        layer_norm(out, ln[0], ln[1], LN_EPS, out=ln_out)
    return (out, ln_out) if ln is not None and ln_defer else out


def reduce_partials(part, bias, residual, out, ln=None, ln_out=None, ln_defer=False):
    """out[B,D] = sum_s part[s] + bias (+ residual), part [SPLIT, B, D] fp32 (split-K partial
    sums); ln, ln_out, ln_defer and the return value as gather_gemv_t's."""
    split, B, D = part.shape
    dev = part.device
    block_s = next_pow2(split)
    block = max(128, REDUCE_BLOCK * 4 // block_s)  # ~4096 partials per program
    n_blk = _cdiv(D, block)
    res = residual if residual is not None else out  # never read when HAS_RES is false
    defer = ln is not None and bool(ln_defer)
    st = torch.empty((B, n_blk, 2), dtype=torch.float32, device=dev) if defer else out
    reduce = jit(_split_reduce_kernel, dev)
    reduce[(B, n_blk)](part, bias, res, out, st, B, D, split, n_blk, HAS_RES=residual is not None, BLOCK=block,
                       BLOCK_S=block_s, STATS=int(defer), num_warps=4, **pdl_args(dev, "reduce"))
    if defer:
        return out, PendingLN(out, ln[0], ln[1], st, block)
    if ln is not None:
        layer_norm(out, ln[0], ln[1], LN_EPS, out=ln_out)
    return out


def check_ln(ln, ln_out, B, D, dtype, device):
    """Check the `ln=(weight[D], bias[D])` / `ln_out[B,D]` options; returns ln_out (allocated
    when None), or None without ln."""
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

def sparse_fc1(x, w1, b1, idx, *, out=None, validate=None, config=None):
    """h[B,K] = relu(w1[idx] @ x + b1[idx]); x [B,D], w1 [F,D], b1 [F], idx [B,K] or [K]."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x.shape
    check_tensor("w1", w1, ndim=2, dtype=x.dtype, device=x.device)
    F = w1.shape[0]
    if w1.shape[1] != D:
        raise DejavuError(f"w1: shape {tuple(w1.shape)} does not match x's D={D}")
    check_tensor("b1", b1, shape=(F,), dtype=x.dtype, device=x.device)
    K, _ = check_index("idx", idx, batch=B, upper=F, device=x.device,
                       validate=default_validate(validate, x.device))
    out = check_out(out, (B, K), x.dtype, x.device)
    return gather_gemv(x, w1, b1, idx, out, relu=True, config=config)


def sparse_fc2(h, w2_t, b2, idx, residual=None, *, out=None, ln=None, ln_out=None, validate=None,
               config=None, ln_defer=False):
    """y[B,D] = h @ w2_t[idx] + b2 (+ residual); h [B,K], w2_t [F,D], b2 [D], idx [B,K]|[K].
    ln = (weight[D], bias[D]): returns (y, LayerNorm(y)) instead (eps 1e-5; into ln_out).
    ln_defer (with ln): the second output may be a PendingLN (gather_gemv_t), for the next layer's
    deferred Q/K/V kernel."""
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
                      ln_defer=ln_defer if ln is not None else False)
    return y if ln is None or ln_defer else (y, ln_out)


def sparse_mlp_layer(x, w1, b1, w2_t, b2, idx, residual=None, *, validate=None):
    """fc2(relu(fc1(x))) over the selected neurons: y[B,D]."""
    h = sparse_fc1(x, w1, b1, idx, validate=validate)
    return sparse_fc2(h, w2_t, b2, idx, residual, validate=False)


# ---------------------------------------------------------------------------------------
# references (PyTorch, any device/dtype; compute in the inputs' dtype unless upcast first)

def _expand_idx(idx, batch):
    return idx.long().expand(batch, -1) if idx.dim() == 1 else idx.long()


def sparse_fc1_ref(x, w1, b1, idx):
    """relu(w1[idx] @ x + b1[idx]) per row: h[B,K]."""
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
    references' form of the LayerNorm an op also returns (the dense model's own function)."""
    if ln is None:
        return y
    return y, torch.nn.functional.layer_norm(y, (y.shape[-1],), ln[0], ln[1], LN_EPS)


def sparse_mlp_layer_ref(x, w1, b1, w2_t, b2, idx, residual=None):
    return sparse_fc2_ref(sparse_fc1_ref(x, w1, b1, idx), w2_t, b2, idx, residual)

"""fc2 of the sparse MLP (and the attention output projection): split-K over the selected rows + reference.

    sparse_fc2(h[B,K], w2_t[F,D], b2[D], idx[B,K]|[K], residual[B,D]|None, *, out=None, ln=None,
               ln_out=None, validate=None, config=None, ln_defer=False, n_kept=None) -> y[B,D]
        = sum_k h[:,k] * w2_t[idx[k]] + b2 (+ residual), k < n_kept[b];  ln=(weight, bias): (y, LayerNorm(y))

- Batch 1 and shared sets: `_gather_dot_t_kernel` (blocks "dot1" / "proj1" at batch 1), per-sequence
  sets `_gather_gemv_t_kernel`: docs/kernels.md, "Batches".
- K is split over programs: fp32 partials [SPLIT, B, D] summed in a fixed order with bias and
  residual by `_split_reduce_kernel` (deterministic); with one split the kernel finishes alone.
  With `ln=` the next LayerNorm follows (layer_norm.py), or with `ln_defer=True` the reduction
  stores per-block statistics and returns a PendingLN that the next layer's Q/K/V kernel
  normalises itself (batch 1). Duplicated indices are allowed (summed).
- Blocks: settings.KernelSettings fc2_gemv / fc2_dot / fc2_dot1 / proj1 / fc2_dot_min_batch.
- dtypes, index checks, no host sync: as fc1.py.
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, cdiv, check_index, check_out, check_tensor, default_validate,
                                    dot_fp32, expand_idx, gdc_enter, gdc_release, group_rows, jit, next_pow2, pdl_args)
from dejavu.plugins.layer_norm import LN_EPS, PendingLN, layer_norm, store_row
from dejavu.plugins.settings import DEFAULT, table

tl = None  # triton.language, bound on first launch (see _common.jit)

REDUCE_BLOCK = 1024


def _gather_gemv_t_kernel(h_ptr, w_ptr, idx_ptr, part_ptr, b_ptr, res_ptr, out_ptr,
                          B, D, K, K_PER_SPLIT, stride_hb, stride_ib, nkept_ptr,
                          FINAL: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, GROUP: tl.constexpr,
                          GDC: tl.constexpr = 0, KEEP: tl.constexpr = 0):
    # Per-sequence sets: y[b, d] = sum_k h[b, k] * w_t[row(b, k), d]; grid (B, SPLIT, cdiv(D, BLOCK_D));
    # row(b, k) = idx[b, k // GROUP] * GROUP + k % GROUP.
    # FINAL (SPLIT == 1): add bias (+ residual) and store y; else store fp32 partials.
    # KEEP: only sequence b's first nkept[b] rows, split evenly over the SPLIT programs (as the dot kernel's).
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    idx_row = idx_ptr + pid_b * stride_ib
    gdc_enter(GDC)
    if KEEP:  # nkept: after the wait (the previous kernel may write it)
        n = tl.load(nkept_ptr + pid_b)
        per = tl.cdiv(tl.cdiv(n, tl.num_programs(1)), BLOCK_K) * BLOCK_K
        k_start, k_end = pid_s * per, tl.minimum(pid_s * per + per, n)
    h_row = h_ptr + pid_b * stride_hb
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    # the row indices of the next block are loaded one iteration ahead, so the gathered
    # weight loads do not wait on a dependent index load each iteration
    offs_k = k_start + tl.arange(0, BLOCK_K)
    kmask = offs_k < k_end
    rows = group_rows(idx_row, offs_k, kmask, GROUP)
    hv = tl.load(h_row + offs_k, mask=kmask, other=0.0).to(tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_D:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :]).to(tl.float32)
        else:
            wv = tl.load(w_ptr + rows[:, None] * D + offs_d[None, :], mask=dmask[None, :],
                         other=0.0).to(tl.float32)
        offs_k = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        rows_next = group_rows(idx_row, offs_k, kmask, GROUP)
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
                         B, D, K, K_PER_SPLIT, stride_hb, nkept_ptr,
                         FINAL: tl.constexpr, HAS_RES: tl.constexpr, DOT_FP32: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
                         EVEN_D: tl.constexpr, GROUP: tl.constexpr, GDC: tl.constexpr = 0,
                         KEEP: tl.constexpr = 0):
    # Batch 1 or a shared index set: y[b, :] = h[b, :] @ w_t[rows] for all b; grid (cdiv(D, BLOCK_D), SPLIT).
    # FINAL as in _gather_gemv_t_kernel; KEEP: batch 1, the first nkept[0] rows (a per-token K's, compact_rows'
    # nonzero ones). Each K block's row indices are loaded in its iteration, so Triton gives the gathered weight
    # tile one shared-memory buffer (cp.async issued, then waited for); three one-tile programs per SM keep as many
    # bytes in flight as the memory system serves (loading the indices a block ahead, which multi-buffers the tile,
    # measured no faster).
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_b = tl.arange(0, BLOCK_B)
    bmask = offs_b < B
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    gdc_enter(GDC)
    if KEEP:  # the kept rows first: [0, nkept) split evenly over the SPLIT programs (nkept: after the wait)
        per = tl.cdiv(tl.cdiv(tl.load(nkept_ptr), tl.num_programs(1)), BLOCK_K) * BLOCK_K
        k_start, k_end = pid_s * per, tl.minimum(pid_s * per + per, tl.load(nkept_ptr))
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        rows = group_rows(idx_ptr, offs_k, kmask, GROUP)
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
    store_row(y, out_ptr, row + offs, mask, st_ptr + (pid_b * N_BLK + pid_d) * 2, pid_d, D, BLOCK, STATS)


def split_plan(K, D, cfg, programs_per_split=1):
    """fc2's split-K plan: (n_d D blocks, split, k_per_split rows, a multiple of BLOCK_K)."""
    n_d = cdiv(D, cfg["BLOCK_D"])
    k_blocks = max(1, cdiv(K, cfg["BLOCK_K"]))
    target = cfg["TARGET_PROGRAMS"]
    split = cfg.get("SPLIT") or max(1, min(k_blocks, target // (n_d * programs_per_split)))
    k_per_split = cdiv(k_blocks, split) * cfg["BLOCK_K"]
    return n_d, max(1, cdiv(K, k_per_split)), k_per_split

def gather_gemv_t(h, w_t, bias, idx, residual, out, *, config=None, group=1, ln=None, ln_out=None,
                  ln_defer=False, settings=None, n_kept=None):
    """out[B,D] = h @ w_t[rows] + bias (+ residual) (checked inputs; h may be fp32); rows as
    in gather_gemv (h's K = idx's K * group). ln = (weight, bias): also ln_out[B,D] =
    LayerNorm(out) (eps LN_EPS), returned as (out, ln_out) with ln_defer, whose second is a
    PendingLN when the split-K reduction runs (it stores the block stats; no LayerNorm launch).
    Returns out otherwise. n_kept [B] int32: h is 0 from n_kept[b] on (a per-token K, fc1's; compact_rows'
    count); both routes stop there (rows not read)."""
    B, K = h.shape
    D = w_t.shape[1]
    if B == 0:
        return out
    shared = idx.dim() == 1
    s = settings or DEFAULT
    dot = (shared or B == 1) and B >= s.fc2_dot_min_batch
    route = (("proj1" if group > 1 else "fc2_dot1") if B == 1 else "fc2_dot") if dot else "fc2_gemv"
    cfg = table(getattr(s, route), config)
    block_k, block_d = cfg["BLOCK_K"], cfg["BLOCK_D"]
    n_d, split, k_per_split = split_plan(K, D, cfg, 1 if dot else B)
    final = split == 1
    part = out if final else torch.empty((split, B, D), dtype=torch.float32, device=h.device)
    res = residual if residual is not None else out  # never read when HAS_RES is false
    common = dict(FINAL=final, HAS_RES=residual is not None, BLOCK_K=block_k, BLOCK_D=block_d,
                  EVEN_D=D % block_d == 0, GROUP=group, num_warps=cfg["num_warps"],
                  **pdl_args(h.device, "proj" if group > 1 else "fc2", s.pdl))
    if dot:
        kernel = jit(_gather_dot_t_kernel, h.device)
        kernel[(n_d, split)](h, w_t, idx, part, bias, res, out, B, D, K, k_per_split, h.stride(0), n_kept,
                             DOT_FP32=dot_fp32(w_t.dtype, h.device), BLOCK_B=max(16, next_pow2(B)),
                             num_stages=cfg["num_stages"], KEEP=int(n_kept is not None), **common)
    else:
        kernel = jit(_gather_gemv_t_kernel, h.device)
        kernel[(B, split, n_d)](h, w_t, idx, part, bias, res, out, B, D, K, k_per_split,
                                h.stride(0), 0 if shared else idx.stride(0), n_kept,
                                num_stages=cfg["num_stages"], KEEP=int(n_kept is not None), **common)
    if not final:
        return reduce_partials(part, bias, residual, out, ln, ln_out, ln_defer, settings=s)
    if ln is not None:
        layer_norm(out, ln[0], ln[1], LN_EPS, out=ln_out, settings=s)
    return (out, ln_out) if ln is not None and ln_defer else out


def reduce_partials(part, bias, residual, out, ln=None, ln_out=None, ln_defer=False, *, settings=None):
    """out[B,D] = sum_s part[s] + bias (+ residual), part [SPLIT, B, D] fp32 (split-K partial
    sums); ln, ln_out, ln_defer and the return value as gather_gemv_t's."""
    split, B, D = part.shape
    dev = part.device
    block_s = next_pow2(split)
    block = max(128, REDUCE_BLOCK * 4 // block_s)  # ~4096 partials per program
    n_blk = cdiv(D, block)
    res = residual if residual is not None else out  # never read when HAS_RES is false
    defer = ln is not None and bool(ln_defer)
    st = torch.empty((B, n_blk, 2), dtype=torch.float32, device=dev) if defer else out
    reduce = jit(_split_reduce_kernel, dev)
    reduce[(B, n_blk)](part, bias, res, out, st, B, D, split, n_blk, HAS_RES=residual is not None, BLOCK=block,
                       BLOCK_S=block_s, STATS=int(defer), num_warps=4, **pdl_args(dev, "reduce", (settings or DEFAULT).pdl))
    if defer:
        return out, PendingLN(out, ln[0], ln[1], st, block)
    if ln is not None:
        layer_norm(out, ln[0], ln[1], LN_EPS, out=ln_out, settings=settings)
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
    return check_out(ln_out, (B, D), dtype, device)

def sparse_fc2(h, w2_t, b2, idx, residual=None, *, out=None, ln=None, ln_out=None, validate=None,
               config=None, ln_defer=False, settings=None, n_kept=None):
    """y[B,D] = h @ w2_t[idx] + b2 (+ residual); h [B,K], w2_t [F,D], b2 [D], idx [B,K]|[K].
    ln= (returns (y, LayerNorm(y))) and ln_defer: docs/kernels.md, "API". n_kept [B] int32
    (a per-token K, sparse_fc1's): h is 0 from n_kept[b] on, rows not read at batch 1 (values trusted)."""
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
    if n_kept is not None:
        if idx.dim() == 1 and B > 1:
            raise DejavuError("sparse_fc2: n_kept (a per-token K) needs one index set per sequence")
        check_tensor("n_kept", n_kept, shape=(B,), dtype=torch.int32, device=h.device)
    out = check_out(out, (B, D), h.dtype, h.device)
    ln_out = check_ln(ln, ln_out, B, D, h.dtype, h.device)
    y = gather_gemv_t(h, w2_t, b2, idx, residual, out, config=config, ln=ln, ln_out=ln_out,
                      ln_defer=ln_defer if ln is not None else False, settings=settings, n_kept=n_kept)
    return y if ln is None or ln_defer else (y, ln_out)


def sparse_fc2_ref(h, w2_t, b2, idx, residual=None, *, ln=None, ln_defer=False, n_kept=None):
    """sum_k h[:,k] * w2_t[idx[k]] + b2 (+ residual), k < n_kept[b]: y[B,D]; with ln=(weight, bias),
    (y, F.layer_norm(y)) in y's dtype, the dense model's own function (ln_defer changes nothing
    here: the LayerNorm is computed)."""
    rows = expand_idx(idx, h.shape[0])
    h = h if n_kept is None else h.masked_fill(torch.arange(h.shape[1], device=h.device) >= n_kept[:, None], 0)
    y = torch.einsum("bk,bkd->bd", h, w2_t[rows]) + b2
    y = y if residual is None else y + residual
    return y if ln is None else (y, torch.nn.functional.layer_norm(y, (y.shape[-1],), ln[0], ln[1], LN_EPS))


"""Input-sparse GEMV for TEAL engines: y = W[:, idx] @ h[idx], idx = {i : |h_i| > t}; no host sync, no sort.

- `select_slices(x, t, split)` runs one program per (row, GEMV split): it computes h for its slice of the
  inputs from the producer's output (x itself, norm_w * rms_norm(x), or silu(gate) * up) and writes that
  slice's kept (index, value) pairs in order, with their count [B, split]: no prefix over the row, h is never
  written. x may be the fp32 partials [S, B, N] of the previous GEMV (`sliced_parts`): the select sums them
  in order itself (gate/up's split-K sum folded into down's SwiGLU select: one launch fewer).
- `sliced_parts(idx, val, count, w_t)`: split s reads its slice's pairs; two loads of SUB = block_k / 2 pairs
  a step (fewer than the program's threads, so they land in the tile's row layout: no barrier in the loop),
  the next step's pairs loaded before this step's rows are summed; fp32 partials [split, B, M].
  `sliced_gemv(...)`: its partials summed in order with the residual (`_sum_splits_kernel`);
  `sliced_qkv_rope(...)`: the fused q/k/v, its sum kernel applying RoPE to q and k and writing k and v into
  the caches at pos.
w_t [N, M] = W^T (build time): a kept input is one contiguous row, only kept rows are read; each program
accumulates a [rows, BLOCK_M] fp32 tile (reduced over rows once, after the loop).
Limits: fp16 / bf16 / fp32, contiguous; rows b independent; fp32 accumulation and |h| > t in fp32. t is a
host float per layer (a launch argument a CUDA graph captures). The list form (one select program per row,
a GEMV gathering x) measured slower (5.906 vs 4.545 ms, docs/kernels.md) and is in commit 6d59376; the GEMV's
rows loaded a step ahead (PREFETCH_W) and its loop software-pipelined (LOOP_STAGES) measured slower and are in
commit f72ba62.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_out, check_tensor, gdc_enter, gdc_release, helper, jit,
                                    next_pow2, pdl_args)
from dejavu.plugins.gqa_attention import GQAPartials, _combine_splits, _split_span, gqa_partials_ref
from dejavu.plugins.settings import DEFAULT, KernelSettings


@helper
def _src(x_ptr, offs, mask, PLANE, val_ptr, SRC_SPLIT: tl.constexpr):
    # x at offs: x itself, or the in-order sum of SRC_SPLIT fp32 partials PLANE apart, rounded to val's dtype
    # (every split-K sum of this file goes through here: one rounding)
    # (one return: x may be fp32 where val is not, the fp32 residual stream)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SRC_SPLIT > 0:
        for s in tl.static_range(1, SRC_SPLIT):
            x += tl.load(x_ptr + s * PLANE + offs, mask=mask, other=0.0)
        x = x.to(val_ptr.dtype.element_ty)
    return x


def _sum_splits_kernel(part_ptr, y_ptr, res_ptr, B, M, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
                       HAS_RES: tl.constexpr, GDC: tl.constexpr = 0):
    b, offs_m = tl.program_id(0), tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    gdc_enter(GDC)
    y = _src(part_ptr, b * M + offs_m, offs_m < M, B * M, y_ptr, SPLIT_K)  # the splits in order
    if HAS_RES:  # residual + y, rounded as PyTorch adds two tensors of y's dtype
        y = (tl.load(res_ptr + b * M + offs_m, mask=offs_m < M, other=0.0).to(tl.float32) + y.to(tl.float32))
    tl.store(y_ptr + b * M + offs_m, y.to(y_ptr.dtype.element_ty), mask=offs_m < M)


def split_k_for(B: int, N: int, M: int, config) -> int:
    """GEMV splits of the N inputs: config.split_k, or enough for config.target_programs, each split at least
    config.min_split_inputs long (settings.InputSparseSettings)."""
    if config.split_k is not None:
        return config.split_k
    programs = B * -(-M // config.block_m)
    return max(1, min(-(-config.target_programs // programs), N // config.min_split_inputs))


def input_sparse_gemv_ref(x: torch.Tensor, w_t: torch.Tensor, t: float) -> torch.Tensor:
    """PyTorch reference of the input-sparse product: the masked-dense (x with |x| <= t zeroed) @ w_t, in x's dtype."""
    return (x * (x.float().abs() > t)) @ w_t


# ------------------------------------------------ sliced: a select per GEMV split, fused with the input's producer
NONE, NORM, SWIGLU, ATTN = 0, 1, 2, 3  # the select's PRODUCER: x as it is, norm_w * rms_norm(x), silu(gate) * up,
# the attention's split partials combined (gqa_attention.GQAPartials)


@helper
def _keep(h, offs, inside, t, idx_ptr, val_ptr, b, N, lo, base):
    # the slice's kept (index, value) pairs of this step, after the `base` kept before it; the new count
    keep = (tl.abs(h.to(tl.float32)) > t) & inside
    k = keep.to(tl.int32)
    pos = b * N + lo + base + tl.cumsum(k, 0) - 1  # this slice's segment, ascending
    tl.store(idx_ptr + pos, offs, mask=keep)
    tl.store(val_ptr + pos, h, mask=keep)
    return base + tl.sum(k, 0)


@helper
def _norm_h(xv, nw, rstd, dt):
    # NORM's h, rounded as PyTorch rounds: rms_norm's output in h's dtype dt (val's: x's, or the engine's from an
    # fp32 x), then the weight product
    return (nw.to(tl.float32) * (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)


def _select_slices_kernel(x_ptr, nw_ptr, idx_ptr, val_ptr, count_ptr, N, XS, PLANE, PER, t, eps,
                          PRODUCER: tl.constexpr, SRC_SPLIT: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr,
                          GDC: tl.constexpr = 0, pos_ptr=None, NC=1, BLOCK_S=1, HD=1):
    # ATTN: x_ptr the partials' acc [B, NC, N], nw_ptr their m / l (PLANE apart), the splits that hold slots
    # <= pos[b] (gqa_attention._split_span of NC splits of BLOCK_S-slot tiles). NORM: the slice's first step
    # peeled, its weights loaded before the wait and its x beside the row's sum of squares (two dependent round
    # trips fewer: Llama-3-8B at 50% skipped 3.642 vs 3.692 ms a step, the 70B TP-8 rank 5.517 vs 5.579; H100,
    # 2026-12-06, ad930ee, docs/llama.md)
    b, ps = tl.program_id(0), tl.program_id(1)
    lo = ps * PER
    hi = tl.minimum(lo + PER, N)
    base = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)  # an int32 scalar: kept so far in this slice
    if PRODUCER == 3:
        _, n_splits = _split_span(tl.load(pos_ptr + b).to(tl.int32), NC, BLOCK_S)  # before the wait
    if PRODUCER == 1:  # NORM: the slice's first step of weights before the wait (no kernel writes them)
        offs0 = lo + tl.arange(0, BLOCK)
        nw0 = tl.load(nw_ptr + offs0, mask=offs0 < hi, other=0.0)
    gdc_enter(GDC)
    start = lo
    if PRODUCER == 1:  # NORM: the whole row's sum of squares (each slice's program reads the row: N * 2 bytes, L2),
        # the slice's first step of x loaded beside it
        x0 = _src(x_ptr, b * XS + offs0, offs0 < hi, PLANE, val_ptr, SRC_SPLIT)
        ss = tl.zeros([ROW], dtype=tl.float32)
        for n0 in range(0, N, ROW):
            offs = n0 + tl.arange(0, ROW)
            xv = _src(x_ptr, b * XS + offs, offs < N, PLANE, val_ptr, SRC_SPLIT).to(tl.float32)
            ss += xv * xv
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / N + eps)
        base = _keep(_norm_h(x0, nw0, rstd, val_ptr.dtype.element_ty), offs0, offs0 < hi, t, idx_ptr, val_ptr, b, N,
                     lo, base)
        start = lo + BLOCK
    for n0 in range(start, hi, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        inside = offs < hi
        if PRODUCER != 3:
            xv = _src(x_ptr, b * XS + offs, inside, PLANE, val_ptr, SRC_SPLIT)
        if PRODUCER == 3:  # ATTN: o as gqa_attention's combine kernel computes and rounds it
            h = _combine_splits(x_ptr, nw_ptr, b, offs, inside, n_splits, NC, N, HD, PLANE).to(val_ptr.dtype.element_ty)
        elif PRODUCER == 1:  # NORM's later steps
            h = _norm_h(xv, tl.load(nw_ptr + offs, mask=inside, other=0.0), rstd, val_ptr.dtype.element_ty)
        elif PRODUCER == 2:  # SWIGLU: x [B, 2N] = gate | up; silu rounded to x's dtype, then the product
            g = xv.to(tl.float32)
            u = _src(x_ptr, b * XS + N + offs, inside, PLANE, val_ptr, SRC_SPLIT).to(tl.float32)
            h = ((g / (1.0 + tl.exp(-g))).to(xv.dtype).to(tl.float32) * u).to(xv.dtype)
        else:
            h = xv
        base = _keep(h, offs, inside, t, idx_ptr, val_ptr, b, N, lo, base)
    tl.store(count_ptr + b * tl.num_programs(1) + ps, base)


@helper
def _pairs(idx_ptr, val_ptr, ks, n):
    ok = ks < n
    return tl.load(idx_ptr + ks, mask=ok, other=0), tl.load(val_ptr + ks, mask=ok, other=0.0).to(tl.float32)


@helper
def _rows_times(w_ptr, i, v, ks, n, offs_m, m_ok, M):
    # [SUB, BLOCK_M]: the kept rows i of w_t [N, M] (columns offs_m), each times its value v; rows past the
    # count n are not read
    w = tl.load(w_ptr + i[:, None].to(tl.int64) * M + offs_m[None, :], mask=(ks < n)[:, None] & m_ok[None, :],
                other=0.0)
    return w.to(tl.float32) * v[:, None]


def _sliced_gemv_kernel(idx_ptr, val_ptr, count_ptr, w_ptr, part_ptr, B, N, M, PER, BLOCK_M: tl.constexpr,
                        SUB: tl.constexpr, EVEN_M: tl.constexpr, GDC: tl.constexpr = 0, ATOMIC: tl.constexpr = 0):
    # ATOMIC: part_ptr an fp32 [B, M] that every split adds its sum into (sliced_gemv_add), else the partials
    b, pm, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if EVEN_M:
        m_ok = offs_m >= 0  # all true, and known to be: unpredicated vector loads
    gdc_enter(GDC)
    n = tl.load(count_ptr + b * tl.num_programs(2) + ps)
    idx_ptr += b * N + ps * PER  # this split's n (index, value) pairs
    val_ptr += b * N + ps * PER
    # A step reads 2 * SUB kept rows as two loads of SUB pairs: fewer pairs than the program has threads,
    # so Triton loads them straight into the tile's row layout (no shared-memory conversion, no barrier in
    # the loop); the next step's pairs load before this step's rows are summed (one round trip a step).
    ar = tl.arange(0, SUB)
    i0, v0 = _pairs(idx_ptr, val_ptr, ar, n)
    i1, v1 = _pairs(idx_ptr, val_ptr, SUB + ar, n)
    acc = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, n, 2 * SUB):
        p0 = _rows_times(w_ptr, i0, v0, k0 + ar, n, offs_m, m_ok, M)
        p1 = _rows_times(w_ptr, i1, v1, k0 + SUB + ar, n, offs_m, m_ok, M)
        i0, v0 = _pairs(idx_ptr, val_ptr, k0 + 2 * SUB + ar, n)
        i1, v1 = _pairs(idx_ptr, val_ptr, k0 + 3 * SUB + ar, n)
        acc += p0 + p1
    gdc_release(GDC)
    if ATOMIC:
        tl.atomic_add(part_ptr + b * M + offs_m, tl.sum(acc, 0), mask=m_ok, sem="relaxed")
    else:
        tl.store(part_ptr + (ps * B + b) * M + offs_m, tl.sum(acc, 0), mask=m_ok)


def _sum_rope_kernel(part_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, bias_ptr, qn_ptr, kn_ptr, eps, B, M,
                     QD, KD, T, HKV, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, GDC: tl.constexpr = 0, ROT_D: tl.constexpr = 0):
    # q/k/v's split-K sum (+ their biases; QK_NORM: each q and k head's RMSNorm), RoPE on q and k, k and v into the
    # caches at pos[b]: columns [0, QD) are q, then KD of k, then v; rotate_half's partner of a column is the one
    # ROT_D / 2 away in its head's first ROT_D (the rotary dimensions; 0: all HEAD_D); a column past them is its own
    # (cos 1 and sin 0 there pass it through) (QK_NORM: BLOCK_M a multiple of HEAD_D, so a program holds whole heads)
    b, offs = tl.program_id(0), tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = offs < M
    d = offs % HEAD_D
    if ROT_D == 0 or ROT_D == HEAD_D:
        mate = offs - d + (d + HEAD_D // 2) % HEAD_D
    else:
        mate = offs - d + tl.where(d < ROT_D, (d + ROT_D // 2) % ROT_D, d)
    gdc_enter(GDC)
    dt = q_ptr.dtype.element_ty  # q/k/v in the engine dtype, summed as _sum_splits_kernel sums
    y = _src(part_ptr, b * M + offs, ok, B * M, q_ptr, SPLIT_K).to(tl.float32)
    y_mate = _src(part_ptr, b * M + mate, ok, B * M, q_ptr, SPLIT_K).to(tl.float32)
    if HAS_BIAS:  # the product rounded, then its bias added and rounded again, as PyTorch's qkv + bias rounds
        y = (y + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        y_mate = (y_mate + tl.load(bias_ptr + mate, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    if QK_NORM:  # Qwen3: w * (y * rsqrt(mean over the head of y^2 + eps)) rounded, as models/llama.RMSNorm rounds
        NH: tl.constexpr = BLOCK_M // HEAD_D
        ms = tl.sum(tl.reshape(y * y, [NH, HEAD_D]), axis=1) / HEAD_D  # a head's mean square; its mate's the same
        r = tl.reshape(tl.broadcast_to(tl.rsqrt(ms + eps)[:, None], [NH, HEAD_D]), [BLOCK_M])
        is_qc = offs < QD
        d_mate = mate % HEAD_D
        w = tl.where(is_qc, tl.load(qn_ptr + d), tl.load(kn_ptr + d)).to(tl.float32)
        w_mate = tl.where(is_qc, tl.load(qn_ptr + d_mate), tl.load(kn_ptr + d_mate)).to(tl.float32)
        normed = (w * (y * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        normed_mate = (w_mate * (y_mate * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y_rot, y_rot_mate = tl.where(offs < QD + KD, normed, y), tl.where(offs < QD + KD, normed_mate, y_mate)
    else:
        y_rot, y_rot_mate = y, y_mate
    c = tl.load(cos_ptr + b * HEAD_D + d).to(tl.float32)
    sn = tl.load(sin_ptr + b * HEAD_D + d).to(tl.float32)  # rotate_half's sign folded in
    rot = ((y_rot * c).to(dt).to(tl.float32) + y_rot_mate * sn).to(dt)  # as addcmul(x * cos, roll(x), sin) rounds
    is_q, is_k, is_v = ok & (offs < QD), ok & (offs >= QD) & (offs < QD + KD), ok & (offs >= QD + KD)
    p = tl.load(pos_ptr + b)
    tl.store(q_ptr + b * QD + tl.where(is_q, offs, 0), rot, mask=is_q)
    head = tl.where(is_k, offs - QD, 0) // HEAD_D
    tl.store(kc_ptr + ((b * HKV + head) * T + p) * HEAD_D + d, rot, mask=is_k)
    head = tl.where(is_v, offs - QD - KD, 0) // HEAD_D
    tl.store(vc_ptr + ((b * HKV + head) * T + p) * HEAD_D + d, y.to(dt), mask=is_v)


def select_slices(x: torch.Tensor, t: float, split: int, norm_w: torch.Tensor | None = None, eps: float = 0.0,
                  swiglu: bool = False, dtype: torch.dtype | None = None, settings: KernelSettings | None = None):
    """(idx [B, N] int32, val [B, N], count [B, split] int32): the inputs of h with |h| > t, per slice s of
    the N inputs ([s * per, (s + 1) * per), per = ceil(N / split)): ascending at idx[b, s * per:], count[b, s]
    of them, their values h at val. h [B, N] = x (default), norm_w * rms_norm(x, eps) (norm_w [N]), or
    silu(x[:, :N]) * x[:, N:] (swiglu: x [B, 2N]), never written (select_slices_ref). x [B, N'] in its dtype
    (an fp32 x with norm_w: h in dtype, rms_norm's output rounded to it: the fp32 residual stream), or the fp32
    partials [S, B, N'] of a split-K GEMV (`sliced_parts`), summed in order and rounded to dtype, or the
    attention's split partials (gqa_attention.GQAPartials: h = o [B, H * hd], combined here)."""
    config = (settings or DEFAULT).input_sparse
    if isinstance(x, GQAPartials):
        return _select_attn(x, t, split, settings)
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 3:
        check_tensor("x", x, dtype=torch.float32)  # partials
        if dtype not in FLOAT_DTYPES:
            raise DejavuError(f"select_slices: partials x need the dtype of h, got {dtype}")
    elif x.dim() == 2:
        if dtype not in (None, x.dtype) and (norm_w is None or x.dtype != torch.float32):
            raise DejavuError(f"select_slices: h in {dtype} from x in {x.dtype} is for RMSNorm of an fp32 x only")
        dtype = dtype or x.dtype
    else:
        raise DejavuError(f"x: expected [B, N] or partials [S, B, N], got shape {tuple(x.shape)}")
    B, N = x.shape[-2], x.shape[-1] // 2 if swiglu else x.shape[-1]
    if swiglu and x.shape[-1] % 2:
        raise DejavuError(f"x: swiglu needs gate | up halves of equal width, got {x.shape[-1]} columns")
    if norm_w is not None:
        if swiglu:
            raise DejavuError("select_slices: norm_w and swiglu are two producers; give one")
        check_tensor("norm_w", norm_w, shape=(N,), dtype=dtype, device=x.device)
    if not 1 <= split <= max(N, 1):
        raise DejavuError(f"split must be in [1, {N}], got {split}")
    idx, val = torch.empty(B, N, dtype=torch.int32, device=x.device), torch.empty(B, N, dtype=dtype, device=x.device)
    count = torch.empty(B, split, dtype=torch.int32, device=x.device)
    per = -(-N // split)
    jit(_select_slices_kernel, x.device)[(B, split)](
        x, x if norm_w is None else norm_w, idx, val, count, N, x.shape[-1], B * x.shape[-1], per, float(t),
        float(eps), PRODUCER=SWIGLU if swiglu else NONE if norm_w is None else NORM,
        SRC_SPLIT=x.shape[0] if x.dim() == 3 else 0, BLOCK=min(config.block_select, next_pow2(per)),
        ROW=min(config.block_select, next_pow2(N)), num_warps=config.select_warps,
        **pdl_args(x.device, "is_select", (settings or DEFAULT).pdl))
    return idx, val, count


def _select_attn(p: GQAPartials, t: float, split: int, settings: KernelSettings | None):
    # select_slices of o combined from the attention's split partials (PRODUCER ATTN)
    config = (settings or DEFAULT).input_sparse
    check_tensor("acc", p.acc, ndim=3, dtype=torch.float32)
    B, nc, N = p.acc.shape
    if p.dtype not in FLOAT_DTYPES or N % p.head_dim:
        raise DejavuError(f"select_slices: attention partials of {N} values are not heads of {p.head_dim} in a float dtype")
    check_tensor("ml", p.ml, shape=(2, B, nc, N // p.head_dim), dtype=torch.float32, device=p.acc.device)
    check_tensor("pos", p.pos, shape=(B,), dtype=torch.int64, device=p.acc.device)
    if not 1 <= split <= N:
        raise DejavuError(f"split must be in [1, {N}], got {split}")
    dev = p.acc.device
    idx, val = torch.empty(B, N, dtype=torch.int32, device=dev), torch.empty(B, N, dtype=p.dtype, device=dev)
    count = torch.empty(B, split, dtype=torch.int32, device=dev)
    per = -(-N // split)
    jit(_select_slices_kernel, dev)[(B, split)](
        p.acc, p.ml, idx, val, count, N, N, B * nc * (N // p.head_dim), per, float(t), 0.0, PRODUCER=ATTN,
        SRC_SPLIT=0, BLOCK=min(config.block_select, next_pow2(per)), ROW=16, num_warps=config.select_warps,
        pos_ptr=p.pos, NC=nc, BLOCK_S=p.block_s, HD=p.head_dim,
        **pdl_args(dev, "is_select", (settings or DEFAULT).pdl))
    return idx, val, count


def sum_parts_ref(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, M] in dtype: fp32 partials [S, B, M] summed in order (as the kernels add them), then rounded."""
    acc = part[0].clone()
    for p in part[1:]:
        acc += p
    return acc.to(dtype)


def produce_ref(x: torch.Tensor, norm_w: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False):
    """h of `select_slices` in PyTorch, in x's dtype: x, norm_w * rms_norm(x, eps), or silu(gate) * up."""
    if norm_w is not None:  # normalised in fp32, scaled in x's dtype (models/llama.RMSNorm): F.rms_norm
        return norm_w * F.rms_norm(x, (x.shape[-1],), eps=eps)  # upcasts a half input itself, one kernel
    if swiglu:
        g, u = x.chunk(2, dim=-1)
        return F.silu(g) * u
    return x


def select_slices_ref(x: torch.Tensor, t: float, split: int, norm_w: torch.Tensor | None = None, eps: float = 0.0,
                      swiglu: bool = False, dtype: torch.dtype | None = None):
    """PyTorch reference of `select_slices` (idx -1 and val 0 past each slice's count)."""
    if isinstance(x, GQAPartials):
        h = gqa_partials_ref(x).to(x.acc.device)
    elif x.dim() == 2 and dtype not in (None, x.dtype):  # RMSNorm of an fp32 x, h in dtype
        h = norm_w * F.rms_norm(x, (x.shape[-1],), eps=eps).to(dtype)
    else:
        h = produce_ref(sum_parts_ref(x, dtype) if x.dim() == 3 else x, norm_w, eps, swiglu)
    B, N = h.shape
    per = -(-N // split)
    idx, val = torch.full((B, N), -1, dtype=torch.int32), torch.zeros(B, N, dtype=h.dtype)
    count = torch.zeros(B, split, dtype=torch.int32)
    for b in range(B):
        for s in range(split):
            kept = torch.nonzero(h[b, s * per:(s + 1) * per].float().abs() > t).flatten().cpu() + s * per  # ascending
            idx[b, s * per:s * per + len(kept)] = kept.int()
            val[b, s * per:s * per + len(kept)] = h[b, kept.to(h.device)].cpu()
            count[b, s] = len(kept)
    return idx.to(h.device), val.to(h.device), count.to(h.device)


def sliced_parts(idx: torch.Tensor, val: torch.Tensor, count: torch.Tensor, w_t: torch.Tensor,
                 settings: KernelSettings | None = None, acc: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 partials [split, B, M] of the pairs' GEMV (split = count.shape[1]): split s's sum over its pairs of
    val * w_t[idx, :]; their in-order sum is the product (`sliced_gemv`; or a select's partials x). acc: the
    splits' sums added into it instead (`sliced_gemv_add`)."""
    config = (settings or DEFAULT).input_sparse
    check_tensor("val", val, ndim=2, dtypes=FLOAT_DTYPES)
    B, N = val.shape
    check_tensor("idx", idx, shape=(B, N), dtype=torch.int32, device=val.device)
    check_tensor("count", count, ndim=2, dtype=torch.int32, device=val.device)
    split = count.shape[1]
    if count.shape[0] != B or not 1 <= split <= max(N, 1):
        raise DejavuError(f"count: expected shape ({B}, split <= {N}), got {tuple(count.shape)}")
    check_tensor("w_t", w_t, ndim=2, dtype=val.dtype, device=val.device)
    M = w_t.shape[1]
    check_tensor("w_t", w_t, shape=(N, M))  # a row per input
    if acc is None:
        part = torch.empty(split, B, M, dtype=torch.float32, device=val.device)
    else:
        check_tensor("acc", acc, shape=(B, M), dtype=torch.float32, device=val.device)
        part = acc
    grid = (B, -(-M // config.block_m), split)
    jit(_sliced_gemv_kernel, val.device)[grid](idx, val, count, w_t, part, B, N, M, -(-N // split),
                                               BLOCK_M=config.block_m, SUB=max(1, config.block_k // 2),
                                               EVEN_M=M % config.block_m == 0, ATOMIC=acc is not None,
                                               num_warps=config.num_warps,
                                               **pdl_args(val.device, "is_gemv", (settings or DEFAULT).pdl))
    return part


def sliced_gemv_add(idx: torch.Tensor, val: torch.Tensor, count: torch.Tensor, w_t: torch.Tensor,
                    acc: torch.Tensor, settings: KernelSettings | None = None) -> torch.Tensor:
    """acc [B, M] (fp32) += the pairs' GEMV, in place, and returned: each split adds its fp32 sum into acc with
    an atomic (no split-K sum launch, no partials; the order of the splits' adds is not fixed, so the last
    bits vary from run to run). The fp32 residual stream's o and down (input_sparse.fp32_residual)."""
    return sliced_parts(idx, val, count, w_t, settings, acc=acc)


def sliced_gemv(idx: torch.Tensor, val: torch.Tensor, count: torch.Tensor, w_t: torch.Tensor,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                settings: KernelSettings | None = None):
    """y [B, M] (val's dtype) = residual + sum over the pairs of `select_slices` of val * w_t[idx, :];
    w_t [N, M] (W^T, val's dtype): a kept input's row, contiguous; only kept rows are read."""
    config = (settings or DEFAULT).input_sparse
    part = sliced_parts(idx, val, count, w_t, settings)
    split, B, M = part.shape
    if residual is not None:
        check_tensor("residual", residual, shape=(B, M), dtype=val.dtype, device=val.device)
    out = check_out(out, (B, M), val.dtype, val.device, "out")
    jit(_sum_splits_kernel, val.device)[(B, -(-M // config.block_m))](
        part, out, out if residual is None else residual, B, M, BLOCK_M=config.block_m, SPLIT_K=split,
        HAS_RES=residual is not None, **pdl_args(val.device, "is_sum", (settings or DEFAULT).pdl))
    return out


def sliced_qkv_rope(idx: torch.Tensor, val: torch.Tensor, count: torch.Tensor, w_t: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, settings: KernelSettings | None = None,
                    bias: torch.Tensor | None = None, qk_norm: tuple | None = None,
                    rot: int | None = None) -> torch.Tensor:
    """q [B, H, hd] of a fused q/k/v projection (the pairs' GEMV, w_t [N, (H + 2 Hkv) hd]; + bias [(H + 2 Hkv) hd],
    the q/k/v biases where a checkpoint has them, added to the rounded product before RoPE; qk_norm (q_w [hd],
    k_w [hd], eps): each q and k head through RMSNorm before RoPE, Qwen3), RoPE on q and k (cos, sin [B, hd]: sin
    with rotate_half's sign, -sin on the first half; rot: the rotary dimensions of a head, its first rot (None: all
    hd), cos 1 and sin 0 past them), k and v written into k_cache, v_cache [B, Hkv, T, hd] at slot pos[b] (int64
    [B]): sliced_qkv_rope_ref's result in one launch after the GEMV."""
    M = w_t.shape[1] if w_t.dim() == 2 else -1
    _check_qkv_rope(M, val, cos, sin, pos, k_cache, v_cache, bias, qk_norm, rot)
    return _sum_rope(sliced_parts(idx, val, count, w_t, settings), val.dtype, cos, sin, pos, k_cache, v_cache,
                     settings, bias, qk_norm, rot)


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, settings: KernelSettings | None = None, bias: torch.Tensor | None = None,
             qk_norm: tuple | None = None, rot: int | None = None) -> torch.Tensor:
    """`sliced_qkv_rope` after a dense q/k/v product qkv [B, (H + 2 Hkv) hd] (the dense decode step): the bias,
    the heads' norms, RoPE and the cache writes in one launch; sliced_qkv_rope_ref's result."""
    check_tensor("qkv", qkv, ndim=2, dtypes=FLOAT_DTYPES)
    _check_qkv_rope(qkv.shape[1], qkv, cos, sin, pos, k_cache, v_cache, bias, qk_norm, rot)
    return _sum_rope(qkv, qkv.dtype, cos, sin, pos, k_cache, v_cache, settings, bias, qk_norm, rot)


def _check_qkv_rope(M: int, val, cos, sin, pos, k_cache, v_cache, bias, qk_norm, rot=None) -> None:
    # the q/k/v sum kernel's inputs: M outputs of q, k and v heads, in val's dtype and on its device
    B, Hkv, T, hd = k_cache.shape
    check_tensor("k_cache", k_cache, dtype=val.dtype, device=val.device)
    check_tensor("v_cache", v_cache, shape=(B, Hkv, T, hd), dtype=val.dtype, device=val.device)
    for name, c in (("cos", cos), ("sin", sin)):
        check_tensor(name, c, shape=(B, hd), dtype=val.dtype, device=val.device)
    check_tensor("pos", pos, shape=(B,), dtype=torch.int64, device=val.device)
    if hd % 2 or M % hd or M // hd <= 2 * Hkv:
        raise DejavuError(f"q/k/v: {M} outputs are not q, k and v heads of {hd} with {Hkv} KV heads")
    if rot is not None and not (0 < rot <= hd and rot % 2 == 0):
        raise DejavuError(f"q/k/v: {rot} rotary dimensions are not an even number of a head's {hd}")
    if bias is not None:
        check_tensor("bias", bias, shape=(M,), dtype=val.dtype, device=val.device)
    if qk_norm is not None:
        if hd & (hd - 1):
            raise DejavuError(f"q/k norms in the q/k/v sum kernel need a power-of-two head dimension, got {hd}")
        for name, w in (("q_norm", qk_norm[0]), ("k_norm", qk_norm[1])):
            check_tensor(name, w, shape=(hd,), dtype=val.dtype, device=val.device)


def _sum_rope(part: torch.Tensor, dtype, cos, sin, pos, k_cache, v_cache, settings, bias, qk_norm,
              rot=None) -> torch.Tensor:
    # _sum_rope_kernel over the GEMV's fp32 partials [S, B, M] (summed in order, rounded to dtype) or a product [B, M]
    config = (settings or DEFAULT).input_sparse
    B, Hkv, T, hd = k_cache.shape
    M = part.shape[-1]
    H = M // hd - 2 * Hkv
    block, (q_w, k_w, eps) = config.block_m, qk_norm or (None, None, 0.0)
    if qk_norm is not None:
        block = max(block, hd)  # whole heads per program
    q = torch.empty(B, H, hd, dtype=dtype, device=part.device)
    jit(_sum_rope_kernel, part.device)[(B, -(-M // block))](
        part, q, k_cache, v_cache, cos, sin, pos, q if bias is None else bias, q if q_w is None else q_w,
        q if k_w is None else k_w, float(eps), B, M, H * hd, Hkv * hd, T, Hkv, HEAD_D=hd, BLOCK_M=block,
        SPLIT_K=part.shape[0] if part.dim() == 3 else 0, HAS_BIAS=bias is not None, QK_NORM=qk_norm is not None,
        ROT_D=0 if rot in (None, hd) else rot, **pdl_args(part.device, "is_sum", (settings or DEFAULT).pdl))
    return q


def sliced_qkv_rope_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor | None = None,
                        qk_norm: tuple | None = None, rot: int | None = None) -> torch.Tensor:
    """PyTorch reference of `sliced_qkv_rope` after its GEMV: q [B, H, hd] from qkv [B, (H + 2 Hkv) hd]
    (rows: arange(B) on the device, made once by a caller that runs it every step; qk_norm (q_w, k_w, eps): the
    q and k heads' RMSNorm before RoPE; rot: the rotary dimensions, a head's first rot, None: all)."""
    B, Hkv, _, hd = k_cache.shape
    qkv = qkv.view(B, -1, hd)
    H = qkv.shape[1] - 2 * Hkv
    qkr = qkv[:, :H + Hkv]  # q and k heads rotated in one pass: x cos + rotate_half(x) sin
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        qkr = torch.cat([produce_ref(qkr[:, :H], q_w, eps), produce_ref(qkr[:, H:], k_w, eps)], 1)
    rot = rot or hd  # rotate_half's partner of a rotary column (sin 0 past them)
    mate = torch.cat((qkr[..., :rot].roll(rot // 2, -1), qkr[..., rot:]), -1) if rot < hd else qkr.roll(hd // 2, -1)
    qk = torch.addcmul(qkr * cos[:, None], mate, sin[:, None])
    rows = torch.arange(B, device=qkv.device) if rows is None else rows
    k_cache[rows, :, pos] = qk[:, H:]  # [B, Hkv, hd] at slot pos[b]
    v_cache[rows, :, pos] = qkv[:, H + Hkv:]
    return qk[:, :H]

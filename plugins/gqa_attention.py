"""GQA decode attention for the Llama decode step: one new token per sequence against a static cache,
reading only the slots <= pos[b] (flash-decoding), no host sync, a static grid (CUDA graphs).

    gqa_decode(q [B, H, hd], k_cache, v_cache [B, Hkv, T, hd], pos [B] int64) -> o [B, H * hd] (q's dtype)
    gqa_decode(..., combine=False) -> GQAPartials (more than one split): the o projection's select combines
                                      them (input_sparse.select_slices, PRODUCER ATTN: no combine launch)

- `_gqa_split_kernel`: one program per (row b, KV head j, split c): the n = pos[b] + 1 slots of the row are
  cut into tiles of block_s slots and the tiles into NS ranges of equal whole tiles (`_split_span`: computed
  from pos on the device, so a short context takes few programs of one tile each, a long one NS of many);
  the G = H / Hkv query heads of KV head j (j * G .. j * G + G - 1, as SDPA's [B, Hkv, G, hd] view pairs
  them), padded to 16 rows, against the split's slots by tl.dot: q k^T, scaled after the product (log2
  units: exp2), online softmax in fp32, p (in the cache's dtype) times v, as flash attention rounds. One
  split (NS 1): o divided and rounded to q's dtype in the kernel. Else fp32 partials: acc [B, NS, H * hd]
  unnormalised, m (log2 units) and l [2, B, NS, H]; splits past the row's last slot write nothing.
- `_gqa_combine_kernel`: o[b, i] = sum_c 2^(m_c - M) acc_c[i] / sum_c 2^(m_c - M) l_c over the row's used
  splits (`_combine_splits`, online over c), rounded to q's dtype; the select's ATTN producer calls the
  same helpers, so both round the same o.
NS = min(max_splits, ceil(target_programs / (B * Hkv)), the cache's tiles) (settings.GQAAttnSettings).
Launched with PDL (kinds gqa_attn, late trigger after the loop; gqa_combine). Limits: fp16 / bf16 / fp32,
contiguous; H a multiple of Hkv; hd <= 256; pos[b] in [0, T) is not checked on the device (a sync):
`gqa_decode_ref` is the reference (float64 in the tests).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_tensor, dot_fp32, gdc_enter, gdc_release, helper, jit,
                                    next_pow2, pdl_args)
from dejavu.plugins.settings import DEFAULT, KernelSettings

tl = None  # triton.language, bound on first launch (see _common.jit)
LOG2E = 1.4426950408889634


class GQAPartials(NamedTuple):
    """The split kernel's fp32 partials of one layer (`gqa_decode(..., combine=False)`)."""
    acc: torch.Tensor  # [B, NS, H * hd] unnormalised
    ml: torch.Tensor  # [2, B, NS, H]: the split's max score (log2 units), its sum of 2^(s - m)
    pos: torch.Tensor  # [B] int64: splits c < used_splits(pos[b], NS, block_s) hold slots
    block_s: int
    head_dim: int
    dtype: torch.dtype  # o's (q's)


@helper
def _split_span(pos, NS, BLOCK_S):
    # (tiles per split, splits used) of a row whose last slot is pos: its tiles of BLOCK_S slots in NS ranges
    tiles = pos // BLOCK_S + 1
    per = (tiles + NS - 1) // NS
    return per, (tiles + per - 1) // per


def _gqa_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, acc_ptr, ml_ptr, T, HD, NS, scale,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HD: tl.constexpr,
                      PARTIAL: tl.constexpr, DOT_FP32: tl.constexpr, GDC: tl.constexpr = 0):
    b, j, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HKV, B = tl.num_programs(1), tl.num_programs(0)
    pos = tl.load(pos_ptr + b).to(tl.int32)  # the step's input: written before the graph's first kernel
    per, used = _split_span(pos, NS, BLOCK_S)
    if c < used:
        start = c * per * BLOCK_S
        end = tl.minimum(start + per * BLOCK_S, pos + 1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_HD)
        gd = (offs_g < G)[:, None] & (offs_d < HD)[None, :]
        row = (b * HKV + j) * G + offs_g  # query heads b * H + j * G + g
        base = (b * HKV + j).to(tl.int64) * T * HD
        gdc_enter(GDC)
        q = tl.load(q_ptr + row[:, None] * HD + offs_d[None, :], mask=gd, other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_HD], dtype=tl.float32)
        for s0 in range(start, end, BLOCK_S):  # the first tile holds slot start <= pos: m_i finite after it
            offs_s = s0 + tl.arange(0, BLOCK_S)
            sm = offs_s < end
            tile = base + offs_s[:, None].to(tl.int64) * HD + offs_d[None, :]
            mask = sm[:, None] & (offs_d < HD)[None, :]
            k = tl.load(k_ptr + tile, mask=mask, other=0.0)
            v = tl.load(v_ptr + tile, mask=mask, other=0.0)
            if DOT_FP32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(sm[None, :], s * scale, float("-inf"))  # [BLOCK_G, BLOCK_S], log2 units
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_FP32:
                acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        gdc_release(GDC)
        if PARTIAL:  # acc [B, NS, H * hd]; m, l [2, B, NS, H]
            head = j * G + offs_g
            slot = (b * NS + c) * (HKV * G)
            tl.store(acc_ptr + slot.to(tl.int64) * HD + head[:, None] * HD + offs_d[None, :], acc, mask=gd)
            tl.store(ml_ptr + slot + head, m_i, mask=offs_g < G)
            tl.store(ml_ptr + B * NS * HKV * G + slot + head, l_i, mask=offs_g < G)
        else:
            o = acc / l_i[:, None]
            tl.store(o_ptr + row[:, None] * HD + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=gd)


@helper
def _combine_splits(acc_ptr, ml_ptr, b, offs, mask, n, NC, HH, HD, PLANE):
    # o at offs of row b (fp32): the n splits' partials (acc [B, NC, HH], m / l PLANE apart, [B, NC, HH / HD])
    # combined online over c; each element reads its own head's m and l (a gather: L1/L2)
    H = HH // HD
    head = offs // HD
    a = tl.zeros_like(offs).to(tl.float32)
    big_l = a
    big_m = a - float("inf")
    for c in range(0, n):
        slot = b * NC + c
        m = tl.load(ml_ptr + slot * H + head, mask=mask, other=0.0)
        l_c = tl.load(ml_ptr + PLANE + slot * H + head, mask=mask, other=0.0)
        x = tl.load(acc_ptr + slot.to(tl.int64) * HH + offs, mask=mask, other=0.0)
        m_new = tl.maximum(big_m, m)
        sa = tl.exp2(big_m - m_new)  # 0 at the first split (big_m -inf, m finite)
        sc = tl.exp2(m - m_new)
        a = a * sa + x * sc
        big_l = big_l * sa + l_c * sc
        big_m = m_new
    return a / tl.where(mask, big_l, 1.0)


def _gqa_combine_kernel(acc_ptr, ml_ptr, pos_ptr, o_ptr, HH, HD, NS, BLOCK_S, BLOCK: tl.constexpr,
                        GDC: tl.constexpr = 0):
    b, offs = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < HH
    _, n = _split_span(tl.load(pos_ptr + b).to(tl.int32), NS, BLOCK_S)
    gdc_enter(GDC)
    o = _combine_splits(acc_ptr, ml_ptr, b, offs, ok, n, NS, HH, HD, tl.num_programs(0) * NS * (HH // HD))
    tl.store(o_ptr + b * HH + offs, o.to(o_ptr.dtype.element_ty), mask=ok)


def check_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor):
    """The launcher's checks: (B, H, Hkv, T, hd)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    B, H, hd = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtype=q.dtype, device=q.device)
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] != B or k_cache.shape[3] != hd or Hkv == 0 or H % Hkv or T == 0:
        raise DejavuError(f"k_cache: shape {tuple(k_cache.shape)} is not [B={B}, Hkv | {H}, T, hd={hd}]")
    if not 1 <= hd <= 256:
        raise DejavuError(f"gqa_decode: head dim {hd} is not in [1, 256]")
    check_tensor("v_cache", v_cache, shape=k_cache.shape, dtype=q.dtype, device=q.device)
    check_tensor("pos", pos, shape=(B,), dtype=torch.int64, device=q.device)
    return B, H, Hkv, T, hd


def splits_for(B: int, Hkv: int, T: int, cfg) -> int:
    """The split kernel's NS: enough programs for cfg.target_programs, at most cfg.max_splits and the cache's
    tiles of cfg.block_s slots (settings.GQAAttnSettings)."""
    return max(1, min(cfg.max_splits, -(-cfg.target_programs // (B * Hkv)), -(-T // cfg.block_s)))


def gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
               combine: bool = True, settings: KernelSettings | None = None):
    """o [B, H * hd] in q's dtype: softmax(q k^T / sqrt(hd)) v of the new token's rotated q [B, H, hd] over
    slots 0..pos[b] of k_cache, v_cache [B, Hkv, T, hd] (query head h reads KV head h // (H / Hkv));
    pos [B] int64 on q's device. combine False and more than one split: the splits' GQAPartials instead
    (for input_sparse.select_slices, which combines them)."""
    s = settings or DEFAULT
    cfg = s.gqa_attn
    B, H, Hkv, T, hd = check_gqa(q, k_cache, v_cache, pos)
    if cfg.block_s < 16 or cfg.block_s & (cfg.block_s - 1) or cfg.max_splits < 1 or cfg.target_programs < 1:
        raise DejavuError(f"gqa_attn settings: block_s must be a power of two >= 16 (tl.dot), max_splits and "
                          f"target_programs >= 1, got {cfg.block_s}, {cfg.max_splits}, {cfg.target_programs}")
    G, ns = H // Hkv, splits_for(B, Hkv, T, cfg)  # from T, not pos: a static grid
    o = torch.empty(B, H * hd, dtype=q.dtype, device=q.device)
    acc = ml = o  # never touched with one split
    if ns > 1:
        acc = torch.empty(B, ns, H * hd, dtype=torch.float32, device=q.device)
        ml = torch.empty(2, B, ns, H, dtype=torch.float32, device=q.device)
    jit(_gqa_split_kernel, q.device)[(B, Hkv, ns)](
        q, k_cache, v_cache, pos, o, acc, ml, T, hd, ns, LOG2E / math.sqrt(hd), G=G,
        BLOCK_G=max(16, next_pow2(G)), BLOCK_S=cfg.block_s, BLOCK_HD=max(16, next_pow2(hd)), PARTIAL=ns > 1,
        DOT_FP32=dot_fp32(q.dtype, q.device), num_warps=cfg.num_warps, **pdl_args(q.device, "gqa_attn", s.pdl))
    if ns == 1:
        return o
    if not combine:
        return GQAPartials(acc, ml, pos, cfg.block_s, hd, q.dtype)
    block = min(1024, next_pow2(H * hd))
    jit(_gqa_combine_kernel, q.device)[(B, -(-H * hd // block))](
        acc, ml, pos, o, H * hd, hd, ns, cfg.block_s, BLOCK=block, num_warps=4,
        **pdl_args(q.device, "gqa_combine", s.pdl))
    return o


def used_splits(pos: int, ns: int, block_s: int) -> int:
    """The splits holding slots of a row whose last slot is pos (`_split_span` on the host: the references)."""
    tiles = pos // block_s + 1
    per = -(-tiles // ns)
    return -(-tiles // per)


def decode_mask(pos: torch.Tensor, T: int, dtype: torch.dtype, slots: torch.Tensor | None = None) -> torch.Tensor:
    """The additive mask [B, 1, 1, T] in dtype of `gqa_decode_ref`: -inf at the slots > pos[b] (slots:
    arange(T) on pos's device, made once by a caller that runs it every step)."""
    slots = torch.arange(T, device=pos.device) if slots is None else slots
    return torch.zeros(pos.shape[0], 1, 1, T, dtype=dtype, device=pos.device).masked_fill_(
        slots > pos[:, None, None, None], float("-inf"))


def gqa_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of `gqa_decode` (the decode step's path on the "ref" backend): o [B, H * hd] from one
    scaled_dot_product_attention over the whole cache with the slots > pos[b] masked (mask: `decode_mask`,
    made once per step by the decode step)."""
    B, H, hd = q.shape
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    mask = decode_mask(pos, T, q.dtype) if mask is None else mask
    o = F.scaled_dot_product_attention(q.view(B, Hkv, H // Hkv, hd), k_cache, v_cache, attn_mask=mask)
    return o.reshape(B, H * hd)


def gqa_partials_ref(p: GQAPartials) -> torch.Tensor:
    """o [B, H * hd] in p.dtype from the partials, combined in float64 (tests)."""
    B, ns, HH = p.acc.shape
    H = HH // p.head_dim
    n = [used_splits(int(x), ns, p.block_s) for x in p.pos]
    out = torch.empty(B, HH, dtype=torch.float64)
    for b in range(B):
        m, l_c = p.ml[0, b, :n[b]].double(), p.ml[1, b, :n[b]].double()  # [n, H]
        w = torch.exp2(m - m.max(0).values)
        a = p.acc[b, :n[b]].double().view(n[b], H, p.head_dim)
        out[b] = ((w[:, :, None] * a).sum(0) / (w * l_c).sum(0)[:, None]).reshape(HH)
    return out.to(p.dtype)

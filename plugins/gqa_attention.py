"""GQA decode attention for the Llama decode step: one new token per sequence against a static cache,
reading only the slots <= pos[b] (flash-decoding), no host sync, a static grid (CUDA graphs).

    gqa_decode(q [B, H, hd], k_cache, v_cache [B, Hkv, T, hd], pos [B] int64) -> o [B, H * hd] (q's dtype)
    gqa_decode(..., combine=False) -> GQAPartials (T > chunk): the o projection's select combines them
                                      (input_sparse.select_slices, PRODUCER ATTN: no combine launch)

- `_gqa_chunk_kernel`: one program per (row b, KV head j, chunk c of `chunk` slots of T): the G = H / Hkv
  query heads of KV head j (j * G .. j * G + G - 1, as SDPA's [B, Hkv, G, hd] view pairs them) against
  slots [c * chunk, min((c + 1) * chunk, pos[b] + 1)), block_s slots a step, online softmax in fp32 with
  scores q.k / sqrt(hd) (in log2 units: exp2). A chunk past pos[b] exits at once and writes nothing (the
  combine reads chunks c <= pos[b] // chunk only). G is small (4 on Llama-3-8B, 8 on a 70B TP-8 rank),
  below tl.dot's 16 rows: the scores and the value sum are broadcast products reduced in registers.
  One chunk (T <= chunk): o divided and rounded to q's dtype in the kernel. Else fp32 partials:
  acc [B, NC, H * hd] unnormalised, m (log2 units) and l [2, B, NC, H].
- `_gqa_combine_kernel`: o[b, i] = sum_c 2^(m_c - M) acc_c[i] / sum_c 2^(m_c - M) l_c over the chunks of
  pos[b] (`_combine_chunks`, online over c), rounded to q's dtype; the select's ATTN producer calls the same
  helper, so both round the same o.
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
from dejavu.plugins._common import (FLOAT_DTYPES, check_tensor, gdc_enter, gdc_release, helper, jit, next_pow2,
                                    pdl_args)
from dejavu.plugins.settings import DEFAULT, KernelSettings

tl = None  # triton.language, bound on first launch (see _common.jit)
LOG2E = 1.4426950408889634


class GQAPartials(NamedTuple):
    """The chunk kernel's fp32 partials of one layer (`gqa_decode(..., combine=False)`)."""
    acc: torch.Tensor  # [B, NC, H * hd] unnormalised
    ml: torch.Tensor  # [2, B, NC, H]: the chunk's max score (log2 units), its sum of 2^(s - m)
    pos: torch.Tensor  # [B] int64: chunks c <= pos[b] // chunk hold slots
    chunk: int
    head_dim: int
    dtype: torch.dtype  # o's (q's)


def _gqa_chunk_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, acc_ptr, ml_ptr, T, HD, NC, CHUNK, scale,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HD: tl.constexpr,
                      PARTIAL: tl.constexpr, GDC: tl.constexpr = 0):
    b, j, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HKV, B = tl.num_programs(1), tl.num_programs(0)
    pos = tl.load(pos_ptr + b).to(tl.int32)  # the step's input: written before the graph's first kernel
    start = c * CHUNK
    if start <= pos:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_HD)
        gd = (offs_g < G)[:, None] & (offs_d < HD)[None, :]
        row = (b * HKV + j) * G + offs_g  # query heads b * H + j * G + g
        end = tl.minimum(start + CHUNK, pos + 1)
        base = (b * HKV + j).to(tl.int64) * T * HD
        gdc_enter(GDC)
        q = tl.load(q_ptr + row[:, None] * HD + offs_d[None, :], mask=gd, other=0.0).to(tl.float32) * scale
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_HD], dtype=tl.float32)
        for s0 in range(start, end, BLOCK_S):  # the first step holds slot start <= pos: m_i finite after it
            offs_s = s0 + tl.arange(0, BLOCK_S)
            sm = offs_s < end
            tile = base + offs_s[:, None].to(tl.int64) * HD + offs_d[None, :]
            mask = sm[:, None] & (offs_d < HD)[None, :]
            k = tl.load(k_ptr + tile, mask=mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_S], log2 units
            s = tl.where(sm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            v = tl.load(v_ptr + tile, mask=mask, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        gdc_release(GDC)
        if PARTIAL:  # acc [B, NC, H * hd]; m, l [2, B, NC, H]
            head = j * G + offs_g
            slot = (b * NC + c) * (HKV * G)
            tl.store(acc_ptr + slot.to(tl.int64) * HD + head[:, None] * HD + offs_d[None, :], acc, mask=gd)
            tl.store(ml_ptr + slot + head, m_i, mask=offs_g < G)
            tl.store(ml_ptr + B * NC * HKV * G + slot + head, l_i, mask=offs_g < G)
        else:
            o = acc / l_i[:, None]
            tl.store(o_ptr + row[:, None] * HD + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=gd)


@helper
def _combine_chunks(acc_ptr, ml_ptr, b, offs, mask, n, NC, HH, HD, PLANE):
    # o at offs of row b (fp32): the n chunks' partials (acc [B, NC, HH], m / l PLANE apart, [B, NC, HH / HD])
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
        sa = tl.exp2(big_m - m_new)  # 0 at the first chunk (big_m -inf, m finite)
        sc = tl.exp2(m - m_new)
        a = a * sa + x * sc
        big_l = big_l * sa + l_c * sc
        big_m = m_new
    return a / tl.where(mask, big_l, 1.0)


def _gqa_combine_kernel(acc_ptr, ml_ptr, pos_ptr, o_ptr, HH, HD, NC, CHUNK, BLOCK: tl.constexpr,
                        GDC: tl.constexpr = 0):
    b, offs = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < HH
    n = tl.load(pos_ptr + b).to(tl.int32) // CHUNK + 1
    gdc_enter(GDC)
    o = _combine_chunks(acc_ptr, ml_ptr, b, offs, ok, n, NC, HH, HD, tl.num_programs(0) * NC * (HH // HD))
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


def gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
               combine: bool = True, settings: KernelSettings | None = None):
    """o [B, H * hd] in q's dtype: softmax(q k^T / sqrt(hd)) v of the new token's rotated q [B, H, hd] over
    slots 0..pos[b] of k_cache, v_cache [B, Hkv, T, hd] (query head h reads KV head h // (H / Hkv));
    pos [B] int64 on q's device. combine False and T > chunk: the chunks' GQAPartials instead (for
    input_sparse.select_slices, which combines them)."""
    s = settings or DEFAULT
    cfg = s.gqa_attn
    B, H, Hkv, T, hd = check_gqa(q, k_cache, v_cache, pos)
    if cfg.chunk < 1 or cfg.block_s < 1 or cfg.block_s & (cfg.block_s - 1):
        raise DejavuError(f"gqa_attn settings: chunk must be >= 1 and block_s a power of two, got {cfg.chunk}, "
                          f"{cfg.block_s}")
    G, nc = H // Hkv, -(-T // cfg.chunk)  # from T, not pos: a static grid
    o = torch.empty(B, H * hd, dtype=q.dtype, device=q.device)
    acc = ml = o  # never touched with one chunk
    if nc > 1:
        acc = torch.empty(B, nc, H * hd, dtype=torch.float32, device=q.device)
        ml = torch.empty(2, B, nc, H, dtype=torch.float32, device=q.device)
    block_s = min(cfg.block_s, next_pow2(min(T, cfg.chunk)))
    jit(_gqa_chunk_kernel, q.device)[(B, Hkv, nc)](
        q, k_cache, v_cache, pos, o, acc, ml, T, hd, nc, cfg.chunk, LOG2E / math.sqrt(hd), G=G,
        BLOCK_G=next_pow2(G), BLOCK_S=block_s, BLOCK_HD=max(16, next_pow2(hd)), PARTIAL=nc > 1,
        num_warps=cfg.num_warps, **pdl_args(q.device, "gqa_attn", s.pdl))
    if nc == 1:
        return o
    if not combine:
        return GQAPartials(acc, ml, pos, cfg.chunk, hd, q.dtype)
    block = min(1024, next_pow2(H * hd))
    jit(_gqa_combine_kernel, q.device)[(B, -(-H * hd // block))](
        acc, ml, pos, o, H * hd, hd, nc, cfg.chunk, BLOCK=block, num_warps=4,
        **pdl_args(q.device, "gqa_combine", s.pdl))
    return o


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
    B, nc, HH = p.acc.shape
    H = HH // p.head_dim
    n = (p.pos // p.chunk + 1).tolist()
    out = torch.empty(B, HH, dtype=torch.float64)
    for b in range(B):
        m, l_c = p.ml[0, b, :n[b]].double(), p.ml[1, b, :n[b]].double()  # [n, H]
        w = torch.exp2(m - m.max(0).values)
        a = p.acc[b, :n[b]].double().view(n[b], H, p.head_dim)
        out[b] = ((w[:, :, None] * a).sum(0) / (w * l_c).sum(0)[:, None]).reshape(HH)
    return out.to(p.dtype)

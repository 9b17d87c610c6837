"""fc2's input with the zero rows of h taken out: the nonzero rows first, in order, and their count + reference.

    compact_rows(h[B,K], idx[B,K]|[K], *, out=None, config=None) -> (h_c[B,K], idx_c[B,K] int32, n[B] int32)
        h_c[b, :n[b]] = the nonzero h[b, k] in k order, idx_c[b, :n[b]] their idx; h_c 0 and idx_c 0 from n[b] on

so that sparse_fc2(h_c, w2_t, b2, idx_c, residual, n_kept=n) stops at n: fc2's loop runs over the nonzero
rows only (the ReLU zeros, and a per-token K's dropped rows, which fc1 leaves 0), its time scaling with them
(fc2 masking the zero rows' loads in place, which kept every K block's iteration, timed slower). The same rows are
summed, still in k order, but they fall into other K blocks and programs of fc2 (fp32 reassociation).

- One launch, no atomics, deterministic: grid (B, cdiv(K, BLOCK)); program c counts the nonzero h before its
  block and in the whole row (loads of up to PREFIX_MAX values), then writes its block's nonzero rows to the
  slots after those before it (a prefix sum within the block), and zeros into its block's slots >= n.
- h fp16 / bf16 / fp32 (a value != 0 is kept: NaN too); idx int32 or int64 (values copied, not checked).
  Blocks: settings.CompactSettings. No host sync; CUDA-graph capturable; PDL kind "compact".
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, INDEX_DTYPES, cdiv, check_out, check_tensor, expand_idx, gdc_enter,
                                    gdc_release, jit, next_pow2, pdl_args)
from dejavu.plugins.settings import DEFAULT, table

tl = None  # triton.language, bound on first launch (see _common.jit)


def _compact_rows_kernel(h_ptr, idx_ptr, hc_ptr, ic_ptr, n_ptr, K, stride_hb, stride_ib,
                         BLOCK: tl.constexpr, PREFIX: tl.constexpr, GDC: tl.constexpr = 0):
    # grid (B, cdiv(K, BLOCK)); stride_ib 0: a shared set. Outputs are [B, K] contiguous.
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    start = pid_c * BLOCK
    h_row = h_ptr + pid_b.to(tl.int64) * stride_hb
    out_row = pid_b.to(tl.int64) * K
    gdc_enter(GDC)
    # the nonzero rows before this block and in the whole row: one or a few wide loads (h is in L2: fc1 wrote it)
    before = tl.zeros([], dtype=tl.int32)
    total = tl.zeros([], dtype=tl.int32)
    for p0 in range(0, K, PREFIX):
        offs_p = p0 + tl.arange(0, PREFIX)
        nz_p = (tl.load(h_row + offs_p, mask=offs_p < K, other=0.0) != 0).to(tl.int32)
        total += tl.sum(nz_p, axis=0)
        before += tl.sum(tl.where(offs_p < start, nz_p, 0), axis=0)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < K
    hv = tl.load(h_row + offs, mask=mask, other=0.0)
    rows = tl.load(idx_ptr + pid_b.to(tl.int64) * stride_ib + offs, mask=mask, other=0)
    nz = hv != 0
    slot = before + tl.cumsum(nz.to(tl.int32), axis=0) - 1
    gdc_release(GDC)
    tl.store(hc_ptr + out_row + slot, hv, mask=nz)
    tl.store(ic_ptr + out_row + slot, rows.to(tl.int32), mask=nz)
    # slots >= total are this block's to clear (the nonzero rows fill [0, total), so no program writes both)
    tail = mask & (offs >= total)
    tl.store(hc_ptr + out_row + offs, tl.zeros([BLOCK], dtype=hc_ptr.dtype.element_ty), mask=tail)
    tl.store(ic_ptr + out_row + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=tail)
    if pid_c == 0:
        tl.store(n_ptr + pid_b, total)


def compact_rows(h, idx, *, out=None, config=None, settings=None):
    """(h_c[B,K], idx_c[B,K] int32, n[B] int32): the nonzero rows of h [B,K] (idx [B,K] or [K], their
    indices) first, in k order, n[b] of them; h_c and idx_c are 0 from n[b] on. out: (h_c, idx_c, n) to
    write (checked). config: CompactSettings field overrides. One launch, no host sync."""
    check_tensor("h", h, ndim=2, dtypes=FLOAT_DTYPES)
    B, K = h.shape
    check_tensor("idx", idx, dtypes=INDEX_DTYPES, device=h.device)
    if tuple(idx.shape) not in ((K,), (B, K)):
        raise DejavuError(f"idx: expected shape ({K},) or ({B}, {K}) (h's), got {tuple(idx.shape)}")
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise DejavuError("out: expected (h_c, idx_c, n)")
    hc, ic, n = out if out is not None else (None, None, None)
    hc = check_out(hc, (B, K), h.dtype, h.device, "out h_c")
    ic = check_out(ic, (B, K), torch.int32, h.device, "out idx_c")
    n = check_out(n, (B,), torch.int32, h.device, "out n")
    if B == 0:
        return hc, ic, n
    if K == 0:
        return hc, ic, n.zero_()
    s = settings or DEFAULT
    cfg = table(s.compact, config)
    block = min(cfg["BLOCK"], next_pow2(K))
    prefix = min(cfg["PREFIX_MAX"], next_pow2(K))
    kernel = jit(_compact_rows_kernel, h.device)
    kernel[(B, cdiv(K, block))](h, idx, hc, ic, n, K, h.stride(0), 0 if idx.dim() == 1 else idx.stride(0),
                                BLOCK=block, PREFIX=prefix, num_warps=cfg["num_warps"],
                                **pdl_args(h.device, "compact", s.pdl))
    return hc, ic, n


def compact_rows_ref(h, idx):
    """compact_rows in PyTorch (a stable sort of the rows by h == 0): (h_c[B,K], idx_c[B,K] int32, n[B] int32)."""
    B, K = h.shape
    nz = h != 0
    order = torch.sort((~nz).to(torch.int8), dim=-1, stable=True).indices
    n = nz.sum(-1)
    kept = torch.arange(K, device=h.device) < n[:, None]
    hc = torch.where(kept, h.gather(-1, order), torch.zeros((), dtype=h.dtype, device=h.device))
    ic = torch.where(kept, expand_idx(idx, B).gather(-1, order), 0).to(torch.int32)
    return hc, ic, n.to(torch.int32)

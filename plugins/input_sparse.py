"""Input-sparse GEMV for TEAL engines: y = W[:, idx] @ x[idx], idx = {i : |x_i| > t}; no host sync, no sort.

- `select_inputs(x, t)`: per row b, the ascending list of inputs with |x[b, i]| > t, compacted by a
  prefix sum over blocks of the row (one program per row): idx [B, N] int32, count[b] entries valid.
- `input_sparse_gemv(x, w_t, idx, count)`: y [B, M] = sum over the first count[b] entries i of idx[b] of
  x[b, i] * w_t[i, :]; w_t [N, M] = W^T (build time): a kept input is one contiguous row, only kept rows
  are read. Split-K programs each take a
  slice of the list (of the inputs), accumulate a [BLOCK_K, BLOCK_M] fp32 tile (reduced over k once,
  after the loop) and write fp32 partials [SPLIT_K, B, M]; `_sum_splits_kernel` adds them and casts.
Limits: x, w_t fp16 / bf16 / fp32, contiguous; rows b independent; fp32 accumulation and |x| > t in
fp32. t is a host float per layer (a launch argument a CUDA graph captures).
"""
from __future__ import annotations

import torch

from dejavu.plugins._common import FLOAT_DTYPES, check_out, check_tensor, jit, next_pow2
from dejavu.plugins.settings import DEFAULT, KernelSettings


def _select_inputs_kernel(x_ptr, idx_ptr, count_ptr, N, t, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    base = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)  # an int32 scalar: the kept count so far
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        inside = offs < N
        xv = tl.load(x_ptr + b * N + offs, mask=inside, other=0.0).to(tl.float32)
        keep = (tl.abs(xv) > t) & inside
        k = keep.to(tl.int32)
        pos = base + tl.cumsum(k, 0) - 1  # the slot of each kept input, in ascending order
        tl.store(idx_ptr + b * N + pos, offs, mask=keep)
        base += tl.sum(k, 0)
    tl.store(count_ptr + b, base)


def select_inputs(x: torch.Tensor, t: float, idx: torch.Tensor | None = None,
                  count: torch.Tensor | None = None, settings: KernelSettings | None = None):
    """(idx [B, N] int32, count [B] int32): the inputs of x [B, N] with |x| > t, ascending (settings: None: DEFAULT)."""
    config = (settings or DEFAULT).input_sparse
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, N = x.shape
    idx = check_out(idx, (B, N), torch.int32, x.device, "idx")
    count = check_out(count, (B,), torch.int32, x.device, "count")
    jit(_select_inputs_kernel, x.device)[(B,)](x, idx, count, N, float(t), BLOCK=min(config.block_select, next_pow2(N)),
                                               num_warps=config.select_warps)
    return idx, count


def select_inputs_ref(x: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `select_inputs` (idx padded with -1 past count)."""
    keep = x.float().abs() > t  # [B, N], compared in fp32 as the kernel does
    count, order = keep.sum(1).to(torch.int32), torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    return torch.where(torch.arange(x.shape[1], device=x.device)[None] < count[:, None], order, -1).int(), count


def _input_sparse_gemv_kernel(x_ptr, w_ptr, idx_ptr, count_ptr, part_ptr, B, N, M, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    b, pm, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    n = tl.load(count_ptr + b)
    per = tl.cdiv(tl.cdiv(n, SPLIT_K), BLOCK_K) * BLOCK_K  # this split's slice of the kept list
    lo = ps * per
    hi = tl.minimum(lo + per, n)
    acc = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hi
        i = tl.load(idx_ptr + b * N + ks, mask=k_ok, other=0)
        xv = tl.load(x_ptr + b * N + i, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + i[:, None].to(tl.int64) * M + offs_m[None, :], mask=k_ok[:, None] & m_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * xv[:, None]
    tl.store(part_ptr + (ps * B + b) * M + offs_m, tl.sum(acc, 0), mask=m_ok)


def _sum_splits_kernel(part_ptr, y_ptr, B, M, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    b, offs_m = tl.program_id(0), tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(SPLIT_K):  # the splits in order, as part.sum(0) adds them
        acc += tl.load(part_ptr + (s * B + b) * M + offs_m, mask=offs_m < M, other=0.0)
    tl.store(y_ptr + b * M + offs_m, acc.to(y_ptr.dtype.element_ty), mask=offs_m < M)


def split_k_for(B: int, N: int, M: int, config) -> int:
    """Slices of the list: config.split_k, or enough for config.target_programs (settings.InputSparseSettings)."""
    if config.split_k is not None:
        return config.split_k
    programs = B * -(-M // config.block_m)
    return max(1, min(-(-config.target_programs // programs), -(-N // (2 * config.block_k))))


def input_sparse_gemv(x: torch.Tensor, w_t: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                      out: torch.Tensor | None = None, settings: KernelSettings | None = None):
    """y [B, M] (x's dtype) = sum_{j < count[b]} x[b, idx[b, j]] * w_t[idx[b, j], :]; x [B, N], w_t [N, M]
    (W^T, same dtype), idx [B, N] int32, count [B] int32 from `select_inputs` (entries past count[b] unread)."""
    config = (settings or DEFAULT).input_sparse
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, N = x.shape
    check_tensor("w_t", w_t, ndim=2, dtype=x.dtype, device=x.device)
    M = w_t.shape[1]
    check_tensor("w_t", w_t, shape=(N, M))  # a row per input of x
    check_tensor("idx", idx, shape=(B, N), dtype=torch.int32, device=x.device)
    check_tensor("count", count, shape=(B,), dtype=torch.int32, device=x.device)
    out = check_out(out, (B, M), x.dtype, x.device, "out")
    split = split_k_for(B, N, M, config)
    part = torch.empty(split, B, M, dtype=torch.float32, device=x.device)
    grid = (B, -(-M // config.block_m), split)
    jit(_input_sparse_gemv_kernel, x.device)[grid](x, w_t, idx, count, part, B, N, M, BLOCK_M=config.block_m,
                                                   BLOCK_K=config.block_k, SPLIT_K=split, num_warps=config.num_warps)
    jit(_sum_splits_kernel, x.device)[grid[:2]](part, out, B, M, BLOCK_M=config.block_m, SPLIT_K=split)
    return out


def input_sparse_gemv_ref(x: torch.Tensor, w_t: torch.Tensor, t: float) -> torch.Tensor:
    """PyTorch reference: the masked-dense product (x with |x| <= t zeroed) @ w_t, in x's dtype."""
    return (x * (x.float().abs() > t)) @ w_t

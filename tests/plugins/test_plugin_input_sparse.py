"""Input-sparse GEMV (plugins/input_sparse.py) under Triton's interpreter, against float64 references."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import DEFAULT, InputSparseSettings as _s
from dejavu.plugins.input_sparse import (input_sparse_gemv, input_sparse_gemv_ref, select_inputs, select_inputs_ref,
                                         split_k_for)
from conftest import DTYPES

SMALL = _s(block_select=32, block_m=16, block_k=8)  # many blocks on small shapes


def _ks(blocks):
    """KernelSettings with these input-sparse blocks."""
    return dataclasses.replace(DEFAULT, input_sparse=blocks)


def _poisoned_lists(B, N):
    return torch.full((B, N), -7, dtype=torch.int32), torch.full((B,), -1, dtype=torch.int32)


@pytest.mark.parametrize("B,N,t", [(1, 77, 0.7), (3, 200, 1.2), (2, 33, 10.0), (2, 64, 0.0)])
@pytest.mark.parametrize("config", [SMALL, _s()])
def test_select_inputs_lists_the_kept_inputs_in_order(triton_interp, B, N, t, config):
    g = torch.Generator().manual_seed(B * N)
    x = torch.randn(B, N, generator=g)
    x[:, ::5] = 0.0  # exact zeros: never kept, even at t = 0
    idx, count = _poisoned_lists(B, N)
    select_inputs(x, t, idx, count, settings=_ks(config))
    keep = x.double().abs() > t
    assert count.tolist() == keep.sum(1).tolist()
    for b in range(B):
        assert idx[b, :count[b]].tolist() == torch.nonzero(keep[b]).flatten().tolist()
    ri, rc = select_inputs_ref(x, t)
    assert torch.equal(rc, count) and all(torch.equal(ri[b, :rc[b]], idx[b, :count[b]]) for b in range(B))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,N,M,config", [(1, 77, 45, SMALL), (3, 130, 70, SMALL), (2, 200, 300, _s()),
                                          (1, 96, 40, _s(block_m=16, block_k=8, split_k=3))])
def test_input_sparse_gemv_matches_float64(triton_interp, close, dtype, B, N, M, config):
    g = torch.Generator().manual_seed(N + M)
    x = torch.randn(B, N, generator=g).to(dtype)
    w_t = (torch.randn(N, M, generator=g) / N ** 0.5).to(dtype)
    t = 0.6
    idx, count = select_inputs(x, t, settings=_ks(config))
    out = torch.full((B, M), float("nan"), dtype=dtype)
    input_sparse_gemv(x, w_t, idx, count, out=out, settings=_ks(config))
    keep = x.float().abs() > t
    ref64 = (x.double() * keep) @ w_t.double()
    close(out, ref64, input_sparse_gemv_ref(x, w_t, t))


def test_input_sparse_gemv_reads_only_the_listed_rows(triton_interp):
    """Rows of w_t outside the kept list are NaN: a read of any of them would poison y."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 90, generator=g)
    w_t = torch.randn(90, 50, generator=g)
    idx, count = select_inputs(x, 0.8, settings=_ks(SMALL))
    kept = torch.zeros(90, dtype=torch.bool)
    for b in range(2):
        kept[idx[b, :count[b]].long()] = True
    poisoned = torch.where(kept[:, None], w_t, torch.full_like(w_t, float("nan")))
    y = input_sparse_gemv(x, poisoned, idx, count, settings=_ks(SMALL))
    ref = input_sparse_gemv_ref(x.double(), torch.where(kept[:, None], w_t, 0.0).double(), 0.8)
    assert torch.isfinite(y).all() and (y.double() - ref).abs().max() < 1e-5


def test_split_k_fills_the_device_and_stays_within_the_list():
    assert split_k_for(1, 14336, 4096, _s()) == 9  # down of Llama-3-8B: 64 column blocks of 64, 528 programs
    assert split_k_for(1, 14336, 4096, _s(block_m=128, block_k=64)) == 17  # 32 column blocks
    assert split_k_for(1, 64, 4096, _s()) == 1
    assert split_k_for(1, 4096, 28672, _s(split_k=2)) == 2


def test_launchers_check_their_inputs(triton_interp):
    x = torch.randn(2, 16)
    idx, count = select_inputs(x, 0.5)
    with pytest.raises(DejavuError, match="w_t: expected dtype"):
        input_sparse_gemv(x, torch.randn(16, 8, dtype=torch.float16), idx, count)
    with pytest.raises(DejavuError, match=r"w_t: expected shape \(16, 8\)"):
        input_sparse_gemv(x, torch.randn(15, 8), idx, count)
    with pytest.raises(DejavuError, match="must be contiguous"):
        input_sparse_gemv(x, torch.randn(8, 16).T, idx, count)
    with pytest.raises(DejavuError, match="idx: expected dtype"):
        input_sparse_gemv(x, torch.randn(16, 8), idx.long(), count)
    with pytest.raises(DejavuError, match="x: expected 2 dims"):
        select_inputs(torch.randn(16), 0.5)

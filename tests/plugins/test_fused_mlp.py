"""sparse_mlp_fused (Triton, interpreter) against a float64 reference on the same index set.

The interpreter runs a launch's programs one after another, so REDUCE "barrier" runs with
one program here (its spin would never end otherwise); benchmarks/kernels.py --check runs
it on the GPU with the full grid.
"""
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import sparse_mlp_fused, sparse_mlp_fused_ref
from dejavu.plugins._common import counters

FM = sys.modules["dejavu.plugins.fused_mlp"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
D, F, K = 72, 200, 37  # D = 64 + 8 (piece B masked), K not a multiple of BLOCK_R
VARIANTS = [dict(REDUCE=r, PREFETCH=p, BLOCK_R=b, num_warps=w)
            for r, p, b, w in [("atomic", True, 1, 8), ("atomic", False, 2, 4), ("barrier", True, 2, 8),
                               ("barrier", False, 1, 4), ("kernel", True, 4, 4), ("kernel", False, 1, 8)]]
CPU = torch.device("cpu")


def make(B, dtype, shared, d=D, k=K, idx_dtype=torch.int32):
    x = torch.randn(B, d).to(dtype)
    w1, b1 = (torch.randn(F, d) / d ** 0.5).to(dtype), torch.randn(F).to(dtype)
    w2_t, b2 = (torch.randn(F, d) / max(k, 1) ** 0.5).to(dtype), torch.randn(d).to(dtype)
    if shared:
        idx = torch.randperm(F)[:k].to(idx_dtype)
    else:
        idx = torch.stack([torch.randperm(F)[:k] for _ in range(B)]).to(idx_dtype)
    return x, w1, b1, w2_t, b2, idx


def run(args, residual, config):
    x = args[0]
    y = torch.full(x.shape, float("nan"), dtype=x.dtype)
    out = sparse_mlp_fused(*args, residual, out=y, config=config)
    assert out is y
    # the launch leaves its counters and the atomic buffer as it found them (zero)
    assert not counters(CPU, 2).any()
    assert not FM._zeroed_f32(CPU, x.numel()).any()
    return y


def check(close, args, residual, config):
    y = run(args, residual, config)
    a64 = [t.double() if t.is_floating_point() else t for t in args]
    ref = sparse_mlp_fused_ref(*a64, None if residual is None else residual.double())
    close(y, ref, sparse_mlp_fused_ref(*args, residual))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v.values()))
def test_variants_match_reference(triton_interp, close, dtype, variant):
    args = make(1, dtype, False)
    check(close, args, torch.randn(1, D).to(dtype), {**variant, "PROGRAMS": 5})


@pytest.mark.parametrize("reduce", ["atomic", "barrier", "kernel"])
@pytest.mark.parametrize("B,shared", [(1, True), (3, True), (2, False)])
def test_batches_shared_sets_no_residual(triton_interp, close, reduce, B, shared):
    # B > 1 runs the rows one after another in each program; the grid is the default (132 SMs
    # capped at one program per block); int64 indices
    args = make(B, torch.float16, shared, idx_dtype=torch.int64)
    check(close, args, None, {"REDUCE": reduce, "BLOCK_R": 2})


@pytest.mark.parametrize("d,k", [(64, 3), (200, 1), (16, 37)])
def test_power_of_2_d_and_few_neurons(triton_interp, close, d, k):
    # D a power of 2 (piece B entirely masked), more programs asked for than neurons
    args = make(1, torch.float32, False, d=d, k=k)
    check(close, args, torch.randn(1, d), {"PROGRAMS": 64, "BLOCK_R": 2})


def test_empty_selection_gives_bias_plus_residual(triton_interp):
    args = make(2, torch.float32, False, k=0)
    res = torch.randn(2, D)
    for reduce in ("atomic", "kernel"):
        y = run(args, res, {"REDUCE": reduce})
        assert torch.allclose(y, args[4] + res)


def test_full_density_and_duplicates(triton_interp):
    # every neuron once reproduces the dense MLP; a duplicated neuron counts twice
    x, w1, b1, w2_t, b2, _ = make(1, torch.float32, False)
    dense = torch.relu(x.double() @ w1.double().T + b1.double()) @ w2_t.double() + b2.double()
    y = sparse_mlp_fused(x, w1, b1, w2_t, b2, torch.arange(F, dtype=torch.int32), config={"PROGRAMS": 7})
    assert torch.allclose(y.double(), dense, rtol=1e-5, atol=1e-5)
    idx = torch.tensor([[5, 5, 9]], dtype=torch.int32)
    y = sparse_mlp_fused(x, w1, b1, w2_t, b2, idx, config={"PROGRAMS": 2})
    ref = sparse_mlp_fused_ref(x.double(), w1.double(), b1.double(), w2_t.double(), b2.double(), idx)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_default_config_runs(triton_interp, close):
    args = make(1, torch.bfloat16, False)
    check(close, args, torch.randn(1, D).bfloat16(), None)


def test_bad_inputs_rejected():
    x, w1, b1, w2_t, b2, idx = make(2, torch.float16, False)
    with pytest.raises(DejavuError, match="w1: expected dtype"):
        sparse_mlp_fused(x, w1.float(), b1, w2_t, b2, idx)
    with pytest.raises(DejavuError, match="x: dtype torch.int64 not supported"):
        sparse_mlp_fused(x.long(), w1, b1, w2_t, b2, idx)
    with pytest.raises(DejavuError, match="w2_t: expected shape"):
        sparse_mlp_fused(x, w1, b1, w2_t[:, :-1].contiguous(), b2, idx)
    with pytest.raises(DejavuError, match="w2_t: must be contiguous"):
        sparse_mlp_fused(x, w1, b1, torch.cat([w2_t, w2_t], 1)[:, ::2], b2, idx)
    with pytest.raises(DejavuError, match="b2: expected shape"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2[:-1], idx)
    with pytest.raises(DejavuError, match="w1: shape"):
        sparse_mlp_fused(x, w1[:, :-1].contiguous(), b1, w2_t, b2, idx)
    with pytest.raises(DejavuError, match="idx: dtype torch.float32 not supported"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2, idx.float())
    with pytest.raises(DejavuError, match="out of range"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2, torch.full_like(idx, F))
    with pytest.raises(DejavuError, match="does not match batch"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2, idx[:1])
    with pytest.raises(DejavuError, match="residual: expected shape"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2, idx, torch.randn(2, D + 1).half())
    with pytest.raises(DejavuError, match="out: expected shape"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2, idx, out=torch.empty(1, D, dtype=torch.float16))
    with pytest.raises(DejavuError, match="bad config"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2, idx, config={"REDUCE": "tree"})
    with pytest.raises(DejavuError, match="bad config"):
        sparse_mlp_fused(x, w1, b1, w2_t, b2, idx, config={"BLOCK_K": 4})
    big = torch.zeros(1, FM.MAX_D + 1, dtype=torch.float16)
    with pytest.raises(DejavuError, match="D=16385 > 16384"):
        sparse_mlp_fused(big, big, big[0, :1], big, big[0], idx[:1])

"""sparse_mlp_chain (batch 1, fc1 and fc2 in one launch; Triton, interpreter) against float64
and against sparse_fc1 + sparse_fc2.

The interpreter runs programs in id order, so fc2's tiles never wait on their split's counter
here; benchmarks/kernels.py --check ("chain") runs the full grid on the GPU, 20 calls back to back.
"""
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import sparse_fc1, sparse_fc2, sparse_mlp_chain, sparse_mlp_chain_ref
from dejavu.plugins._common import counters

SM = sys.modules["dejavu.plugins.sparse_mlp"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
CPU = torch.device("cpu")
# D not a multiple of the fc1 / fc2 column blocks below; K not a multiple of BLOCK_K; several splits
D, F, K = 200, 700, 203
SMALL = {"fc1": {"BLOCK_R": 4, "BLOCK_D": 64, "ROW_ACC": False},
         "fc2": {"BLOCK_K": 16, "BLOCK_D": 64, "TARGET_PROGRAMS": 16}}
# sparse_fc1's GEMV blocks and sparse_fc2's batch-1 blocks: the same h and the same split as the pair
PAIRLIKE = {"fc1": {**SM.FC1_CONFIG["gemv"], "ROW_ACC": False}, "fc2": dict(SM.FC2_CONFIG["dot1"])}


def make(dtype, k=K, d=D):
    x = torch.randn(1, d).to(dtype)
    w1, b1 = (torch.randn(F, d) / d ** 0.5).to(dtype), torch.randn(F).to(dtype)
    w2_t, b2 = (torch.randn(F, d) / k ** 0.5).to(dtype), torch.randn(d).to(dtype)
    idx = torch.randperm(F)[:k].to(torch.int32)
    return x, w1, b1, w2_t, b2, idx


def chain_counters_zero(n=64):
    return not counters(CPU, SM.CHAIN_COUNTERS + n)[SM.CHAIN_COUNTERS:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [None, PAIRLIKE, SMALL, {**SMALL, "fc1": {**SMALL["fc1"], "ROW_ACC": True}},
                                    {**SMALL, "fc2": {**SMALL["fc2"], "DOT": False}}],
                         ids=["default", "pairlike", "small", "small-rowacc", "small-nodot"])
def test_matches_float64_and_the_pair(triton_interp, close, dtype, config):
    args = make(dtype)
    res = torch.randn(1, D).to(dtype)
    y = torch.full((1, D), float("nan"), dtype=dtype)
    assert sparse_mlp_chain(*args, res, out=y, config=config) is y
    a64 = [t.double() if t.is_floating_point() else t for t in args]
    close(y, sparse_mlp_chain_ref(*a64, res.double()), sparse_mlp_chain_ref(*args, res))
    pair = sparse_fc2(sparse_fc1(*args[:3], args[5]), args[3], args[4], args[5], res)
    if config is PAIRLIKE:  # the same h, the same split: bit for bit
        assert torch.equal(y, pair)
    else:  # other blocks sum in another order: as close to float64 as the pair is
        close(y, sparse_mlp_chain_ref(*a64, res.double()), pair)
    assert chain_counters_zero()  # every split's counters back at 0 for the next launch


@pytest.mark.parametrize("ln_defer", [False, True])
def test_next_layernorm(triton_interp, close, ln_defer):
    args = make(torch.float32)
    lnw = (1 + 0.1 * torch.randn(D), 0.1 * torch.randn(D))
    out = sparse_mlp_chain(*args, None, ln=lnw, ln_defer=ln_defer, config=SMALL)
    assert isinstance(out, tuple) and len(out) == 2
    y, ln = out
    a64 = [t.double() for t in args[:5]]
    want = sparse_mlp_chain_ref(*a64, args[5])
    close(y, want, sparse_mlp_chain_ref(*args))
    ln = ln if isinstance(ln, torch.Tensor) else sys.modules["dejavu.plugins.layer_norm"].materialize(ln)
    ref_ln = torch.nn.functional.layer_norm(y.double(), (D,), lnw[0].double(), lnw[1].double(), 1e-5)
    assert (ln.double() - ref_ln).abs().max() < 1e-5


def test_idx_shapes_and_one_split(triton_interp, close):
    args = make(torch.float16, k=5)
    y1 = sparse_mlp_chain(*args)
    y2 = sparse_mlp_chain(*args[:5], args[5][None].long())  # [1, K] int64: the same set
    assert torch.equal(y1, y2)
    a64 = [t.double() if t.is_floating_point() else t for t in args]
    close(y1, sparse_mlp_chain_ref(*a64), sparse_mlp_chain_ref(*args))


def test_bad_inputs_rejected():
    x, w1, b1, w2_t, b2, idx = make(torch.float16)
    with pytest.raises(DejavuError, match="batch 1 only"):
        sparse_mlp_chain(torch.cat([x, x]), w1, b1, w2_t, b2, idx)
    with pytest.raises(DejavuError, match="w1: expected dtype"):
        sparse_mlp_chain(x, w1.float(), b1, w2_t, b2, idx)
    with pytest.raises(DejavuError, match="w2_t: expected shape"):
        sparse_mlp_chain(x, w1, b1, w2_t[:, :-1].contiguous(), b2, idx)
    with pytest.raises(DejavuError, match="w2_t: must be contiguous"):
        sparse_mlp_chain(x, w1, b1, torch.cat([w2_t, w2_t], 1)[:, ::2], b2, idx)
    with pytest.raises(DejavuError, match="out of range"):
        sparse_mlp_chain(x, w1, b1, w2_t, b2, torch.full_like(idx, F))
    with pytest.raises(DejavuError, match="idx: dtype torch.float32 not supported"):
        sparse_mlp_chain(x, w1, b1, w2_t, b2, idx.float())
    with pytest.raises(DejavuError, match="residual: expected shape"):
        sparse_mlp_chain(x, w1, b1, w2_t, b2, idx, torch.randn(1, D + 1).half())
    with pytest.raises(DejavuError, match="K = 0"):
        sparse_mlp_chain(x, w1, b1, w2_t, b2, idx[:0])
    with pytest.raises(DejavuError, match="not a multiple of fc1's BLOCK_R"):
        sparse_mlp_chain(x, w1, b1, w2_t, b2, idx, config={"fc1": {"BLOCK_R": 3}})

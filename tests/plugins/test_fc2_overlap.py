"""sparse_fc1 + sparse_fc2 with `overlap=` (batch 1: fc1 counts its programs per K split of fc2,
fc2's tiles wait on those counts; Triton, interpreter) against the same pair without it and float64.

The interpreter runs fc1 to its end before fc2 starts, so a tile never waits here; what runs here
is every count, every wait condition and the counter reset. benchmarks/kernels.py --check
("overlap") runs it on the GPU with PDL, where fc2 starts while fc1 still runs.
"""
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import sparse_fc1, sparse_fc2, sparse_mlp_layer_ref
from dejavu.plugins._common import counters
from dejavu.plugins.layer_norm import PendingLN, materialize

SM = sys.modules["dejavu.plugins.sparse_mlp"]
CPU = torch.device("cpu")
D, F = 200, 700  # D not a multiple of the column blocks below
SMALL1 = {"BLOCK_R": 4, "BLOCK_D": 64}
SMALL2 = {"BLOCK_K": 16, "BLOCK_D": 64, "TARGET_PROGRAMS": 16}  # 4 D blocks: 4 splits


def make(dtype, k):
    x = torch.randn(1, D).to(dtype)
    w1, b1 = (torch.randn(F, D) / D ** 0.5).to(dtype), torch.randn(F).to(dtype)
    w2_t, b2 = (torch.randn(F, D) / k ** 0.5).to(dtype), torch.randn(D).to(dtype)
    idx = torch.randperm(F)[:k].to(torch.int32)
    return x, w1, b1, w2_t, b2, idx


def overlap_counters_zero(n=64):
    return not counters(CPU, SM.OVERLAP_COUNTERS + n)[SM.OVERLAP_COUNTERS:].any()


def pair(x, w1, b1, w2_t, b2, idx, res, c1=None, c2=None, ov=None, **kw):
    h = torch.full((1, idx.shape[-1]), float("nan"), dtype=w1.dtype)
    assert sparse_fc1(x, w1, b1, idx, out=h, config=c1, overlap=ov) is h
    return sparse_fc2(h, w2_t, b2, idx, res, config=c2, overlap=ov, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("k,c1,c2", [(203, None, None), (203, SMALL1, SMALL2), (64, SMALL1, SMALL2),
                                     (5, SMALL1, SMALL2)],
                         ids=["default", "small", "even-splits", "one-split"])
def test_equals_the_pair_without_overlap(triton_interp, close, dtype, k, c1, c2):
    args = make(dtype, k)
    res = torch.randn(1, D).to(dtype)
    ov = SM.fc2_overlap(k, D, CPU, fc1_config=c1, fc2_config=c2)
    split = ov.cnt.numel() // 2
    assert ov.k_per_split * (split - 1) < k <= ov.k_per_split * split
    y = pair(*args, res, c1, c2, ov)
    assert torch.equal(y, pair(*args, res, c1, c2))  # the same blocks, the same sums: bit for bit
    a64 = [t.double() if t.is_floating_point() else t for t in args]
    close(y, sparse_mlp_layer_ref(*a64, res.double()), sparse_mlp_layer_ref(*args, res))
    assert overlap_counters_zero()  # counts and tile arrivals back at 0 for the next layer
    y2 = pair(*args, res, c1, c2, ov)  # the same object again (as a CUDA graph replays it)
    assert torch.equal(y2, y) and overlap_counters_zero()


@pytest.mark.parametrize("ln_defer", [False, True])
def test_next_layernorm_and_pending_input(triton_interp, ln_defer):
    x, w1, b1, w2_t, b2, idx = make(torch.float16, 203)
    lnw = (1 + 0.1 * torch.randn(D).half(), 0.1 * torch.randn(D).half())
    ov = SM.fc2_overlap(203, D, CPU, fc1_config=SMALL1, fc2_config=SMALL2)
    got = pair(x, w1, b1, w2_t, b2, idx, x, SMALL1, SMALL2, ov, ln=lnw, ln_defer=ln_defer)
    want = pair(x, w1, b1, w2_t, b2, idx, x, SMALL1, SMALL2, ln=lnw, ln_defer=ln_defer)
    assert torch.equal(got[0], want[0])
    if ln_defer:
        assert isinstance(got[1], PendingLN)
        # the next layer's fc1 takes the pending LayerNorm, itself overlapped with its fc2
        y = pair(got[1], w1, b1, w2_t, b2, idx, got[0], SMALL1, SMALL2, ov)
        assert torch.equal(y, pair(want[1], w1, b1, w2_t, b2, idx, want[0], SMALL1, SMALL2))
        assert torch.equal(materialize(got[1]), materialize(want[1]))
    else:
        assert torch.equal(got[1], want[1])
    assert overlap_counters_zero()


def test_mismatched_plans_rejected(triton_interp):
    x, w1, b1, w2_t, b2, idx = make(torch.float16, 203)
    ov = SM.fc2_overlap(203, D, CPU, fc1_config=SMALL1, fc2_config=SMALL2)
    with pytest.raises(DejavuError, match="rows per program"):
        sparse_fc1(x, w1, b1, idx, overlap=ov)  # fc1's default BLOCK_R, not the plan's 4
    with pytest.raises(DejavuError, match="batch 1"):
        sparse_fc1(torch.cat([x, x]), w1, b1, idx, config=SMALL1, overlap=ov)
    h = sparse_fc1(x, w1, b1, idx, config=SMALL1, overlap=ov)
    with pytest.raises(DejavuError, match="the split it was made for"):
        sparse_fc2(h, w2_t, b2, idx, config={**SMALL2, "TARGET_PROGRAMS": 8}, overlap=ov)
    sparse_fc2(h, w2_t, b2, idx, config=SMALL2, overlap=ov)  # consumes the counts
    assert overlap_counters_zero()
    with pytest.raises(DejavuError, match="not a multiple of fc1's"):
        SM.fc2_overlap(203, D, CPU, fc1_config={"BLOCK_R": 128}, fc2_config=SMALL2)  # 64 rows per split

"""predictor_topk: the top-k of the low-rank scores, per sequence or shared by the batch."""
import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import predictor_scores, predictor_topk, predictor_topk_ref, predictor_topk_shared

D, N, R = 72, 200, 16


def make(B):
    return torch.randn(B, D), torch.randn(R, D), torch.randn(N, R), torch.randn(N)


@pytest.mark.parametrize("B", [1, 3])
def test_topk_per_sequence_is_the_top_k_set(B):
    x, a, b, bias = make(B)
    idx = predictor_topk(x, a, b, bias, 37)
    assert idx.dtype == torch.int32 and idx.shape == (B, 37)
    ref = predictor_topk_ref(x.double(), a.double(), b.double(), bias.double(), 37)
    assert torch.equal(idx.sort(-1).values, ref.sort(-1).values)


def test_shared_is_top_k_of_the_batch_max():
    x, a, b, bias = make(4)
    idx = predictor_topk_shared(x, a, b, bias, 37)
    assert idx.shape == (37,) and idx.dtype == torch.int32
    scores = predictor_scores(x.double(), a.double(), b.double(), bias.double()).amax(0)
    assert torch.equal(idx.sort().values, scores.topk(37).indices.sort().values.int())
    per_seq = predictor_topk(x, a, b, bias, 37)
    # each sequence's best neuron is in the shared set (it has the column maximum somewhere)
    best = predictor_scores(x, a, b, bias).argmax(-1)
    assert all(int(i) in set(idx.tolist()) for i in best)
    assert per_seq.shape == (4, 37)


def test_bad_inputs_rejected():
    x, a, b, bias = make(2)
    with pytest.raises(DejavuError, match="k: expected an int in \\[0, 200\\]"):
        predictor_topk(x, a, b, bias, N + 1)
    with pytest.raises(DejavuError, match="b: shape"):
        predictor_topk(x, a, b[:, :-1].contiguous(), bias, 5)
    with pytest.raises(DejavuError, match="a: expected dtype"):
        predictor_topk(x, a.half(), b, bias, 5)
    with pytest.raises(DejavuError, match="x: must be contiguous"):
        predictor_topk(torch.randn(D, 2).t(), a, b, bias, 5)


@pytest.mark.parametrize("B,shared", [(1, False), (3, False), (3, True)])
def test_triton_topk_selects_the_same_set(triton_interp, B, shared):
    x, a, b, bias = make(B)
    idx = predictor_topk(x, a, b, bias, 37, shared=shared, method="triton")
    ref = predictor_topk(x, a, b, bias, 37, shared=shared, method="torch")
    assert idx.dtype == torch.int32 and idx.shape == ref.shape
    assert torch.equal(idx.sort(-1).values, ref.sort(-1).values)


def test_triton_topk_ties_and_extremes(triton_interp):
    from dejavu.plugins.predictor import topk_triton

    s = torch.randn(2, 300)
    s[0, :50] = 1e30  # 50 tied maxima, k = 20: exactly 20 of them (the lowest indices)
    s[1, 7] = -float("inf")
    idx = topk_triton(s, 20)
    assert torch.equal(idx[0].sort().values, torch.arange(20, dtype=torch.int32))
    assert torch.equal(s[1].gather(0, idx[1].long()).sort().values, s[1].topk(20).values.sort().values)
    assert topk_triton(s, 300)[1].sort().values.equal(torch.arange(300, dtype=torch.int32))
    with pytest.raises(DejavuError, match="unknown method"):
        predictor_topk(*make(1), 5, method="heap")

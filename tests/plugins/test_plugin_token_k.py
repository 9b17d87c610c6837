"""A per-token MLP K in the kernels (interpreter): the top-k's kept count (kept rows first), fc1 / fc2 stopping
there."""
import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import (DEFAULT, predictor_topk, predictor_topk_ref, share_keep, sparse_fc1, sparse_fc1_ref,
                            sparse_fc2, sparse_fc2_ref)

D, F, K = 72, 200, 37  # not multiples of any block size


def _weights(dtype):
    w1, b1 = (torch.randn(F, D) / D ** 0.5).to(dtype), torch.randn(F).to(dtype)
    w2_t, b2 = (torch.randn(F, D) / K ** 0.5).to(dtype), torch.randn(D).to(dtype)
    return w1, b1, w2_t, b2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,dot_min", [(1, 1), (1, 64), (3, 64)])  # batch 1 through the dot and the GEMV kernel
def test_dropped_rows_read_nothing_and_give_the_reference(triton_interp, close, dtype, B, dot_min):
    import dataclasses

    settings = dataclasses.replace(DEFAULT, fc1_dot_min_batch=dot_min, fc2_dot_min_batch=dot_min)
    x = torch.randn(B, D).to(dtype)
    w1, b1, w2_t, b2 = _weights(dtype)
    idx = torch.stack([torch.randperm(F)[:K] for _ in range(B)]).to(torch.int32)
    n = torch.tensor([K - 1, 1, 0][:B] if B > 1 else [int(torch.randint(2, K - 2, ()))], dtype=torch.int32)
    keep = torch.arange(K) < n[:, None]
    # batch 1: the weight rows of dropped rows are NaN (read, they would poison the outputs)
    w1p, w2p = w1.clone(), w2_t.clone()
    if B == 1:
        w1p[idx[0][~keep[0]].long()] = float("nan")
    h = torch.full((B, K), float("nan"), dtype=dtype)
    sparse_fc1(x, w1p, b1, idx, n, out=h, settings=settings)
    h_ref = sparse_fc1_ref(x.double(), w1.double(), b1.double(), idx, n)
    close(h, h_ref, sparse_fc1_ref(x, w1, b1, idx, n))
    assert (h[~keep] == 0).all()
    # fc2 stops at n: NaN in w2's dropped rows (batch 1) or in h from n on is never read
    if B == 1:
        w2p[idx[0][~keep[0]].long()] = float("nan")
    # neither fc2 route (the dot kernel at batch 1, the GEMV kernel) reads h from n on
    hp = torch.where(keep, h, torch.full_like(h, float("nan")))
    res = torch.randn(B, D).to(dtype)
    y = torch.full((B, D), float("nan"), dtype=dtype)
    sparse_fc2(hp, w2p, b2, idx, res, out=y, settings=settings, n_kept=n)
    y_ref = sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, res.double())
    close(y, y_ref, sparse_fc2_ref(h, w2_t, b2, idx, res))
    assert torch.equal(sparse_fc2_ref(hp.double(), w2_t.double(), b2.double(), idx, res.double(), n_kept=n), y_ref)


@pytest.mark.parametrize("method", ["torch", "triton"])
def test_topk_keep_flags_equal_the_reference(triton_interp, method):
    B, r, N, k = 4, 8, 300, 40
    x, a = torch.randn(B, 48), torch.randn(r, 48) / 48 ** 0.5
    b, bias = 3 * torch.randn(N, r) / r ** 0.5, 0.1 * torch.randn(N)
    for share in (0.002, 0.01, 1.0):
        idx, n = predictor_topk(x, a, b, bias, k, method=method, min_share=share)
        ridx, rn = predictor_topk_ref(x, a, b, bias, k, min_share=share)
        assert torch.equal(n, rn) and n.dtype == torch.int32
        for i in range(B):  # the same kept set first (the kernel's order is not sorted)
            assert set(idx[i][:n[i]].tolist()) == set(ridx[i][:rn[i]].tolist())
            assert set(idx[i].tolist()) == set(ridx[i].tolist())
        assert (n >= 1).all()  # at least each token's best row
    assert (n == 1).all()  # share 1.0: only the best
    with pytest.raises(DejavuError, match="per sequence"):
        predictor_topk(x, a, b, bias, k, shared=True, min_share=0.01)


def test_share_keep_against_float64():
    s = 2 * torch.randn(5, 120, dtype=torch.float64)
    idx = s.topk(30, -1).indices
    got = share_keep(s, idx, 0.01)
    p = torch.softmax(s, -1)
    n = (p >= 0.01).sum(-1).clamp(1, 30)
    assert torch.equal(got, torch.arange(30) < n[:, None])


def test_fc1_keep_errors(triton_interp):
    x = torch.randn(2, D)
    w1, b1, _, _ = _weights(torch.float32)
    idx = torch.randperm(F)[:K].to(torch.int32)
    with pytest.raises(DejavuError, match="per sequence"):
        sparse_fc1(x, w1, b1, idx, torch.ones(2, dtype=torch.int32))
    with pytest.raises(DejavuError, match="n_kept"):
        sparse_fc1(x, w1, b1, torch.stack([idx, idx]), torch.ones(2, K, dtype=torch.bool))
    h, w2_t, b2 = torch.randn(2, K), torch.randn(F, D), torch.randn(D)
    with pytest.raises(DejavuError, match="per sequence"):
        sparse_fc2(h, w2_t, b2, idx, n_kept=torch.ones(2, dtype=torch.int32))
    with pytest.raises(DejavuError, match="n_kept"):
        sparse_fc2(h, w2_t, b2, torch.stack([idx, idx]), n_kept=torch.ones(2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("N,block", [(300, 1024), (2500, 256)])  # one program per row; a split row (NB 10)
def test_topk_kernel_kept_count_equals_share_keep(triton_interp, dtype, N, block):
    """The rule computed inside the top-k launches (log form, the row's logsumexp from the programs'
    partials when split): its kept rows come first, their count and set equal share_keep's on the same
    scores and the float64 softmax rule's; the index set is the plain top-k's."""
    from dejavu.plugins.predictor import topk_triton

    R, k = 3, N // 5
    scores, counts = (3 * torch.randn(R, N)).to(dtype), []
    for share in (1e-6, 1e-4, 2e-3, 1.0):  # 1e-6: more rows pass than k (all kept)
        idx, n = topk_triton(scores, k, config={"block": block}, min_share=share)
        first = torch.arange(k) < n[:, None].long()
        assert torch.equal(share_keep(scores, idx, share), first)  # the kept rows first, then the rest
        p = torch.softmax(scores.double(), -1)
        pk = p.gather(-1, idx.long())
        assert torch.equal((pk >= share) | (pk == p.amax(-1, keepdim=True)), first)  # the float64 rule
        for i in range(R):
            assert set(idx[i].tolist()) == set(topk_triton(scores, k, config={"block": block})[i].tolist())
        counts.append(n)
    assert (counts[0] == k).all() and (counts[-1] == 1).all()  # more rows pass than k; only the best
    assert ((counts[2] > 1) & (counts[2] < k)).any()  # a count between: the kept rows placed first

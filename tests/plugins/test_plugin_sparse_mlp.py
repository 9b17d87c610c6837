"""sparse_fc1 / sparse_fc2 (Triton, interpreter) against float64 references on the same index set."""
import dataclasses
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import DEFAULT, layer_norm_ref, sparse_fc1, sparse_fc1_ref, sparse_fc2, sparse_fc2_ref


DTYPES = [torch.float16, torch.bfloat16, torch.float32]
D, F, K = 72, 200, 37  # not multiples of any block size


def make(B, dtype, shared, idx_dtype=torch.int32, k=K):
    x = torch.randn(B, D).to(dtype)
    w1, b1 = (torch.randn(F, D) / D ** 0.5).to(dtype), torch.randn(F).to(dtype)
    w2_t, b2 = (torch.randn(F, D) / k ** 0.5).to(dtype), torch.randn(D).to(dtype)
    if shared:
        idx = torch.randperm(F)[:k].to(idx_dtype)
    else:
        idx = torch.stack([torch.randperm(F)[:k] for _ in range(B)]).to(idx_dtype)
    return x, w1, b1, w2_t, b2, idx


def run_fc1(x, w1, b1, idx, settings=None):
    h = torch.full((x.shape[0], idx.shape[-1]), float("nan"), dtype=x.dtype)
    out = sparse_fc1(x, w1, b1, idx, out=h, settings=settings)
    assert out is h
    return h


CASES = [(1, False), (3, False), (3, True), (1, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,shared", CASES)
def test_fc1_fc2_match_reference(triton_interp, close, dtype, B, shared):
    x, w1, b1, w2_t, b2, idx = make(B, dtype, shared, torch.int64 if B == 3 else torch.int32)
    h = run_fc1(x, w1, b1, idx)
    h_ref = sparse_fc1_ref(x.double(), w1.double(), b1.double(), idx)
    close(h, h_ref, sparse_fc1_ref(x, w1, b1, idx))

    res = torch.randn(B, D).to(dtype)
    y = torch.full((B, D), float("nan"), dtype=dtype)
    sparse_fc2(h, w2_t, b2, idx, res, out=y)
    y_ref = sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, res.double())
    close(y, y_ref, sparse_fc2_ref(h, w2_t, b2, idx, res))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_fc2_split_paths_without_residual(triton_interp, close, shared, split):
    # SPLIT=1 stores directly (bias in the main kernel); SPLIT=2 goes through the reduction
    x, w1, b1, w2_t, b2, idx = make(3, torch.float16, shared)
    h = torch.randn(3, K).to(torch.float16)
    y = torch.full((3, D), float("nan"), dtype=torch.float16)
    sparse_fc2(h, w2_t, b2, idx, out=y, config={"SPLIT": split, "BLOCK_K": 16})
    y_ref = sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx)
    close(y, y_ref, sparse_fc2_ref(h, w2_t, b2, idx))


def test_full_density_is_the_dense_mlp(triton_interp):
    # idx = every neuron reproduces the dense layer (density 1.0)
    x, w1, b1, w2_t, b2, _ = make(2, torch.float32, True)
    idx = torch.arange(F, dtype=torch.int32)
    y = sparse_fc2(sparse_fc1(x, w1, b1, idx), w2_t, b2, idx)
    dense = torch.relu(x.double() @ w1.double().T + b1.double()) @ w2_t.double() + b2.double()
    assert torch.allclose(y.double(), dense, rtol=1e-5, atol=1e-5)


def test_oracle_selection_matches_dense(triton_interp):
    # keeping every neuron that is active (relu > 0) for this token reproduces the dense MLP
    x, w1, b1, w2_t, b2, _ = make(1, torch.float32, False)
    pre = x.double() @ w1.double().T + b1.double()
    idx = torch.nonzero(pre[0] > 0).flatten().to(torch.int32)[None]
    y = sparse_fc2(sparse_fc1(x, w1, b1, idx), w2_t, b2, idx)
    dense = torch.relu(pre) @ w2_t.double() + b2.double()
    assert torch.allclose(y.double(), dense, rtol=1e-5, atol=1e-5)


def test_duplicates_and_empty_selection(triton_interp):
    x, w1, b1, w2_t, b2, _ = make(1, torch.float32, False)
    idx = torch.tensor([[5, 5, 7]], dtype=torch.int32)
    h = sparse_fc1(x, w1, b1, idx)
    assert torch.equal(h[0, 0], h[0, 1])
    y = sparse_fc2(h, w2_t, b2, idx)
    assert torch.allclose(y.double(), sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx))
    empty = torch.zeros(1, 0, dtype=torch.int32)
    assert sparse_fc1(x, w1, b1, empty).shape == (1, 0)
    y0 = sparse_fc2(torch.zeros(1, 0), w2_t, b2, empty)
    assert torch.equal(y0[0], b2)


def test_bad_inputs_rejected():
    x, w1, b1, w2_t, b2, idx = make(2, torch.float16, False)
    with pytest.raises(DejavuError, match="w1: expected dtype"):
        sparse_fc1(x, w1.float(), b1, idx)
    with pytest.raises(DejavuError, match="x: dtype torch.int64 not supported"):
        sparse_fc1(x.long(), w1, b1, idx)
    with pytest.raises(DejavuError, match="idx: dtype torch.float32 not supported"):
        sparse_fc1(x, w1, b1, idx.float())
    with pytest.raises(DejavuError, match="w1: must be contiguous"):
        sparse_fc1(x, w1.t().contiguous().t(), b1, idx)
    with pytest.raises(DejavuError, match="idx: must be contiguous"):
        sparse_fc1(x, w1, b1, torch.cat([idx, idx], 1)[:, ::2])
    with pytest.raises(DejavuError, match="out of range"):
        sparse_fc1(x, w1, b1, torch.full_like(idx, F))
    with pytest.raises(DejavuError, match="out of range"):
        sparse_fc2(torch.randn(2, K).half(), w2_t, b2, torch.full_like(idx, -1))
    with pytest.raises(DejavuError, match="does not match batch"):
        sparse_fc1(x, w1, b1, idx[:1])
    with pytest.raises(DejavuError, match="expected \\[B, K\\] or \\[K\\]"):
        sparse_fc1(x, w1, b1, idx[None])
    with pytest.raises(DejavuError, match="w1: shape"):
        sparse_fc1(x, w1[:, :-1].contiguous(), b1, idx)
    with pytest.raises(DejavuError, match="does not match h's K"):
        sparse_fc2(torch.randn(2, K + 1).half(), w2_t, b2, idx)
    with pytest.raises(DejavuError, match="residual: expected shape"):
        sparse_fc2(torch.randn(2, K).half(), w2_t, b2, idx, torch.randn(2, D + 1).half())
    with pytest.raises(DejavuError, match="out: expected shape"):
        sparse_fc1(x, w1, b1, idx, out=torch.empty(2, K + 1, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch1_through_dot_kernels(triton_interp, close, monkeypatch, dtype):
    # fc1_dot_min_batch 1 sends a batch-1 set ([1, K]) through the tl.dot kernels
    settings = dataclasses.replace(DEFAULT, fc1_dot_min_batch=1)
    x, w1, b1, w2_t, b2, idx = make(1, dtype, False)
    h = run_fc1(x, w1, b1, idx, settings)
    close(h, sparse_fc1_ref(x.double(), w1.double(), b1.double(), idx), sparse_fc1_ref(x, w1, b1, idx))
    y = torch.full((1, D), float("nan"), dtype=dtype)
    sparse_fc2(h, w2_t, b2, idx, out=y, settings=settings)
    close(y, sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx), sparse_fc2_ref(h, w2_t, b2, idx))


# ---------------------------------------------------------------------------------------
# fc2 with the next LayerNorm (ln=): the split reduction (or the one-split kernel) stores y, then
# the layer_norm kernel; with ln_defer the reduction's block stats instead (test_plugin_pending_ln.py)

SM = sys.modules["dejavu.plugins.fc2"]


def ln_weights(dtype):
    return (1 + 0.2 * torch.randn(D)).to(dtype), (0.2 * torch.randn(D)).to(dtype)


def check_fc2_ln(close, h, w2_t, b2, idx, res, ln, config=None, settings=None):
    """sparse_fc2 into NaN-poisoned outputs: y against the float64 reference, LN(y) against
    float64 LayerNorm of the rounded y."""
    B, dtype = h.shape[0], h.dtype
    y = torch.full((B, D), float("nan"), dtype=dtype)
    y_ln = torch.full((B, D), float("nan"), dtype=dtype)
    got = sparse_fc2(h, w2_t, b2, idx, res, out=y, ln=ln, ln_out=y_ln, config=config, settings=settings)
    r64 = res.double() if res is not None else None
    close(y, sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, r64), sparse_fc2_ref(h, w2_t, b2, idx, res))
    assert got[0] is y and got[1] is y_ln
    ref64 = torch.nn.functional.layer_norm(y.double(), (D,), ln[0].double(), ln[1].double(), 1e-5)
    close(y_ln, ref64, layer_norm_ref(y, *ln))


# (batch, shared set, FC2_DOT_MIN_BATCH): the dot kernel at B 1 and 3 (shared), the GEMV-T
# kernel per sequence at B 3 and 1, and for a shared set
PATHS = [(1, True, 1), (3, True, 1), (3, False, 1), (1, False, 99), (3, True, 99)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,shared,dot_min", PATHS)
@pytest.mark.parametrize("split", [1, 3])
def test_fc2_with_layer_norm(launched, triton_interp, close, monkeypatch, dtype, B, shared, dot_min, split):
    # SPLIT 3 over D blocks of 32 (D 72: a partial last block)
    _, _, _, w2_t, b2, idx = make(B, dtype, shared)
    h, res = torch.randn(B, K).to(dtype), torch.randn(B, D).to(dtype)
    kernels = launched(SM)
    check_fc2_ln(close, h, w2_t, b2, idx, res, ln_weights(dtype), {"SPLIT": split, "BLOCK_K": 16, "BLOCK_D": 32},
                 dataclasses.replace(DEFAULT, fc2_dot_min_batch=dot_min))
    want = "_gather_dot_t_kernel" if (shared or B == 1) and B >= dot_min else "_gather_gemv_t_kernel"
    assert kernels == [want] + (["_split_reduce_kernel"] if split > 1 else []), kernels  # + layer_norm's kernel


def test_bad_layer_norm_weights_rejected():
    _, _, _, w2_t, b2, idx = make(2, torch.float16, False)
    h = torch.randn(2, K).half()
    lw, lb = ln_weights(torch.float16)
    with pytest.raises(DejavuError, match="ln: expected a \\(weight, bias\\) pair"):
        sparse_fc2(h, w2_t, b2, idx, ln=lw)
    with pytest.raises(DejavuError, match="ln weight: expected shape"):
        sparse_fc2(h, w2_t, b2, idx, ln=(lw[:-1].contiguous(), lb))
    with pytest.raises(DejavuError, match="ln bias: expected dtype"):
        sparse_fc2(h, w2_t, b2, idx, ln=(lw, lb.float()))
    with pytest.raises(DejavuError, match="ln weight: on meta"):
        sparse_fc2(h, w2_t, b2, idx, ln=(lw.to("meta"), lb))
    with pytest.raises(DejavuError, match="ln bias: must be contiguous"):
        sparse_fc2(h, w2_t, b2, idx, ln=(lw, torch.stack([lb, lb], 1)[:, 0]))
    with pytest.raises(DejavuError, match="ln_out: given without ln"):
        sparse_fc2(h, w2_t, b2, idx, ln_out=torch.empty(2, D).half())
    with pytest.raises(DejavuError, match="out: expected shape"):
        sparse_fc2(h, w2_t, b2, idx, ln=(lw, lb), ln_out=torch.empty(2, D + 1).half())

"""sparse_fc1 / sparse_fc2 (Triton, interpreter) against float64 references on the same index set."""
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import (layer_norm_ref, sparse_fc1, sparse_fc1_ref, sparse_fc2, sparse_fc2_ref,
                            sparse_mlp_layer)


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


def run_fc1(x, w1, b1, idx):
    h = torch.full((x.shape[0], idx.shape[-1]), float("nan"), dtype=x.dtype)
    out = sparse_fc1(x, w1, b1, idx, out=h)
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
    y = sparse_mlp_layer(x, w1, b1, w2_t, b2, idx)
    dense = torch.relu(x.double() @ w1.double().T + b1.double()) @ w2_t.double() + b2.double()
    assert torch.allclose(y.double(), dense, rtol=1e-5, atol=1e-5)


def test_oracle_selection_matches_dense(triton_interp):
    # keeping every neuron that is active (relu > 0) for this token reproduces the dense MLP
    x, w1, b1, w2_t, b2, _ = make(1, torch.float32, False)
    pre = x.double() @ w1.double().T + b1.double()
    idx = torch.nonzero(pre[0] > 0).flatten().to(torch.int32)[None]
    y = sparse_mlp_layer(x, w1, b1, w2_t, b2, idx)
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
    # DOT_MIN_BATCH = 1 sends a batch-1 set ([1, K]) through the tl.dot kernels
    monkeypatch.setattr(sys.modules["dejavu.plugins.sparse_mlp"], "DOT_MIN_BATCH", 1)
    x, w1, b1, w2_t, b2, idx = make(1, dtype, False)
    h = run_fc1(x, w1, b1, idx)
    close(h, sparse_fc1_ref(x.double(), w1.double(), b1.double(), idx), sparse_fc1_ref(x, w1, b1, idx))
    y = torch.full((1, D), float("nan"), dtype=dtype)
    sparse_fc2(h, w2_t, b2, idx, out=y)
    close(y, sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx), sparse_fc2_ref(h, w2_t, b2, idx))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,shared", [(1, False), (3, True)])
@pytest.mark.parametrize("split", [1, 2])
def test_fc2_rows_ahead(triton_interp, close, dtype, B, shared, split):
    # ROWS_AHEAD: the tl.dot kernel loads the next K block's row indices one iteration ahead; with
    # 16-row blocks the 37 rows take 3 iterations in one split, 2 + 1 (a partial block) in two
    x, w1, b1, w2_t, b2, idx = make(B, dtype, shared)
    h = torch.randn(B, K).to(dtype)
    res = torch.randn(B, D).to(dtype)
    y = torch.full((B, D), float("nan"), dtype=dtype)
    sparse_fc2(h, w2_t, b2, idx, res, out=y, config={"ROWS_AHEAD": True, "BLOCK_K": 16, "SPLIT": split})
    close(y, sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, res.double()),
          sparse_fc2_ref(h, w2_t, b2, idx, res))


# ---------------------------------------------------------------------------------------
# fused split-K finish (FUSED_FINISH): the last program per D block sums the partials, the
# last of those computes LayerNorm(y). The interpreter runs programs one after another: these
# check the logic and the numbers; benchmarks/kernels.py --check runs them on the H200.

SM = sys.modules["dejavu.plugins.sparse_mlp"]


def ln_weights(dtype):
    return (1 + 0.2 * torch.randn(D)).to(dtype), (0.2 * torch.randn(D)).to(dtype)


@pytest.fixture
def fused_on(monkeypatch):
    """The fused finish is opt-in (off by default: BENCHMARKS.md, 2026-12-02): these tests turn it on."""
    monkeypatch.setattr(SM, "FUSED_FINISH", True)


def check_fc2_ln(close, h, w2_t, b2, idx, res, ln, config=None):
    """sparse_fc2 into NaN-poisoned outputs: y against the float64 reference, LN(y) against
    float64 LayerNorm of the rounded y; the counters are 0 again afterwards."""
    B, dtype = h.shape[0], h.dtype
    y = torch.full((B, D), float("nan"), dtype=dtype)
    y_ln = torch.full((B, D), float("nan"), dtype=dtype) if ln else None
    got = sparse_fc2(h, w2_t, b2, idx, res, out=y, ln=ln, ln_out=y_ln, config=config)
    r64 = res.double() if res is not None else None
    close(y, sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, r64), sparse_fc2_ref(h, w2_t, b2, idx, res))
    if ln is None:
        assert got is y
    else:
        assert got[0] is y and got[1] is y_ln
        ref64 = torch.nn.functional.layer_norm(y.double(), (D,), ln[0].double(), ln[1].double(), 1e-5)
        close(y_ln, ref64, layer_norm_ref(y, *ln))
    assert not SM.counters(torch.device("cpu"), 64).any(), "counters not reset"


# (batch, shared set, FC2_DOT_MIN_BATCH): the dot kernel at B 1 and 3 (shared), the GEMV-T
# kernel per sequence at B 3 and 1, and for a shared set
PATHS = [(1, True, 1), (3, True, 1), (3, False, 1), (1, False, 99), (3, True, 99)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,shared,dot_min", PATHS)
@pytest.mark.parametrize("split", [1, 3])
def test_fused_finish_with_layer_norm(launched, triton_interp, close, monkeypatch, fused_on, dtype, B, shared,
                                     dot_min, split):
    # SPLIT 3 over D blocks of 32 (D 72: a partial last block); LayerNorm in blocks of 32
    monkeypatch.setattr(SM, "FC2_DOT_MIN_BATCH", dot_min)
    monkeypatch.setattr(SM, "LN_BLOCK", 32)
    _, _, _, w2_t, b2, idx = make(B, dtype, shared)
    h, res = torch.randn(B, K).to(dtype), torch.randn(B, D).to(dtype)
    kernels = launched(SM)
    check_fc2_ln(close, h, w2_t, b2, idx, res, ln_weights(dtype),
                 {"SPLIT": split, "BLOCK_K": 16, "BLOCK_D": 32})
    want = "_gather_dot_t_kernel" if (shared or B == 1) and B >= dot_min else "_gather_gemv_t_kernel"
    assert kernels == [want], kernels  # one launch: no reduction, no LayerNorm kernel


@pytest.mark.parametrize("B,shared,dot_min", PATHS[:3])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_finish_without_layer_norm(launched, triton_interp, close, monkeypatch, fused_on, B, shared, dot_min,
                                        residual):
    monkeypatch.setattr(SM, "FC2_DOT_MIN_BATCH", dot_min)
    _, _, _, w2_t, b2, idx = make(B, torch.float16, shared)
    h = torch.randn(B, K).half()
    res = torch.randn(B, D).half() if residual else None
    kernels = launched(SM)
    check_fc2_ln(close, h, w2_t, b2, idx, res, None, {"SPLIT": 3, "BLOCK_K": 16, "BLOCK_D": 32})
    assert len(kernels) == 1, kernels
    check_fc2_ln(close, h, w2_t, b2, idx, res, ln_weights(torch.float16))  # default blocks, LN without residual


@pytest.mark.parametrize("why", ["switch", "batch"])
def test_fallback_reduction_and_layer_norm_kernels(launched, triton_interp, close, monkeypatch, fused_on, why):
    # FUSED_FINISH off, or a batch above FUSED_MAX_BATCH: split reduction + layer_norm launches
    if why == "switch":
        monkeypatch.setattr(SM, "FUSED_FINISH", False)
    else:
        monkeypatch.setattr(SM, "FUSED_MAX_BATCH", 2)
    _, _, _, w2_t, b2, idx = make(3, torch.float16, False)
    h, res = torch.randn(3, K).half(), torch.randn(3, D).half()
    kernels = launched(SM)
    check_fc2_ln(close, h, w2_t, b2, idx, res, ln_weights(torch.float16), {"SPLIT": 3, "BLOCK_K": 16})
    assert kernels == ["_gather_gemv_t_kernel", "_split_reduce_kernel"], kernels  # + layer_norm's own kernel
    assert SM.kernel_settings()["fused_finish"] is (why != "switch")


def test_fused_finish_allocates_ln_out_and_matches_unfused(triton_interp, monkeypatch, fused_on):
    _, _, _, w2_t, b2, idx = make(1, torch.float32, True)
    h, res, ln = torch.randn(1, K), torch.randn(1, D), ln_weights(torch.float32)
    y, y_ln = sparse_fc2(h, w2_t, b2, idx, res, ln=ln, config={"SPLIT": 2, "BLOCK_K": 16})
    monkeypatch.setattr(SM, "FUSED_FINISH", False)
    y2, y2_ln = sparse_fc2(h, w2_t, b2, idx, res, ln=ln, config={"SPLIT": 2, "BLOCK_K": 16})
    assert torch.equal(y, y2)  # same partials, same order of summation
    assert torch.allclose(y_ln, y2_ln, rtol=1e-5, atol=1e-5)


def test_fused_finish_is_off_by_default(launched, triton_interp):
    # the shipped default launches the split reduction (fused finish measured slower on the H200)
    _, _, _, w2_t, b2, idx = make(1, torch.float16, True)
    kernels = launched(SM)
    sparse_fc2(torch.randn(1, K).half(), w2_t, b2, idx, config={"SPLIT": 2, "BLOCK_K": 16})
    assert kernels == ["_gather_dot_t_kernel", "_split_reduce_kernel"], kernels
    assert SM.kernel_settings()["fused_finish"] is False


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


@pytest.mark.parametrize("split", [1, 3])
def test_fused_layer_norm_with_large_mean(triton_interp, monkeypatch, split):
    # |mean| >> std: the per-block (mean, M2) merge keeps fp32 accuracy (E[y^2] - E[y]^2 would not)
    monkeypatch.setattr(SM, "LN_BLOCK", 32)
    _, _, _, w2_t, b2, idx = make(3, torch.float32, False)
    h, ln = torch.randn(3, K), ln_weights(torch.float32)
    y, y_ln = sparse_fc2(h, w2_t, b2 + 3000.0, idx, ln=ln, config={"SPLIT": split, "BLOCK_K": 16, "BLOCK_D": 32})
    ref64 = torch.nn.functional.layer_norm(y.double(), (D,), ln[0].double(), ln[1].double(), 1e-5)
    # the fp32 mean alone is off by ~ulp(3000) (PyTorch too: ~1e-4 here): allow 8 ulps of the mean,
    # scaled by rstd and |weight|; E[y^2] - E[y]^2 would be off by ~10% of the variance
    yd = y.double()
    bound = 8 * 2.0 ** -23 * (yd.mean(1).abs() / yd.std(1, unbiased=False)).max().item() * ln[0].abs().max().item()
    err = (y_ln.double() - ref64).abs().max().item()
    assert 1e-3 < bound < 2e-2 and err <= bound, (err, bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shared,dot_min", [(True, 1), (False, 1), (False, 99)])
@pytest.mark.parametrize("row_block", [32, 8192])
def test_split_reduction_with_layer_norm_is_one_launch_at_batch_1(launched, triton_interp, close, monkeypatch, dtype,
                                                                   shared, dot_min, row_block):
    # the default (no fused finish), batch 1, ln given: the split reduction also normalises
    # (its last program), so fc2 + LayerNorm are two launches; LN rows in blocks of 32 or whole
    monkeypatch.setattr(SM, "FC2_DOT_MIN_BATCH", dot_min)
    monkeypatch.setattr(SM, "LN_BLOCK_ROW", row_block)
    _, _, _, w2_t, b2, idx = make(1, dtype, shared)
    h, res = torch.randn(1, K).to(dtype), torch.randn(1, D).to(dtype)
    kernels = launched(SM)
    check_fc2_ln(close, h, w2_t, b2, idx, res, ln_weights(dtype), {"SPLIT": 3, "BLOCK_K": 16})
    main = "_gather_dot_t_kernel" if dot_min == 1 else "_gather_gemv_t_kernel"
    assert kernels == [main, "_split_reduce_ln_kernel"], kernels
    # y bit-equal to the plain reduction's (same partials, same order); LN within fp32 rounding
    y = sparse_fc2(h, w2_t, b2, idx, res, config={"SPLIT": 3, "BLOCK_K": 16})  # no ln: the plain reduction
    ln = ln_weights(dtype)
    y1, y1_ln = sparse_fc2(h, w2_t, b2, idx, res, ln=ln, config={"SPLIT": 3, "BLOCK_K": 16})
    monkeypatch.setattr(SM, "REDUCE_LN_MAX_BATCH", 0)
    y2, y2_ln = sparse_fc2(h, w2_t, b2, idx, res, ln=ln, config={"SPLIT": 3, "BLOCK_K": 16})
    assert torch.equal(y1, y2) and torch.equal(y1, y)
    assert torch.allclose(y1_ln.float(), y2_ln.float(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)


def test_split_reduction_with_layer_norm_large_mean(launched, triton_interp, monkeypatch):
    monkeypatch.setattr(SM, "LN_BLOCK_ROW", 32)
    _, _, _, w2_t, b2, idx = make(1, torch.float32, False)
    h, ln = torch.randn(1, K), ln_weights(torch.float32)
    kernels = launched(SM)
    y, y_ln = sparse_fc2(h, w2_t, b2 + 3000.0, idx, ln=ln, config={"SPLIT": 3, "BLOCK_K": 16, "BLOCK_D": 32})
    assert kernels[-1] == "_split_reduce_ln_kernel"
    ref64 = torch.nn.functional.layer_norm(y.double(), (D,), ln[0].double(), ln[1].double(), 1e-5)
    yd = y.double()
    bound = 8 * 2.0 ** -23 * (yd.mean(1).abs() / yd.std(1, unbiased=False)).max().item() * ln[0].abs().max().item()
    assert (y_ln.double() - ref64).abs().max().item() <= bound

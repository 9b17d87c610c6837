"""compact_rows (interpreter) against its reference and the definition, and fc2 over the compacted rows stopping
at their count against sparse_fc2's float64 reference on the uncompacted (h, idx): the same rows summed."""
import dataclasses

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import (DEFAULT, compact_rows, compact_rows_ref, sparse_fc1, sparse_fc1_ref, sparse_fc2,
                            sparse_fc2_ref)
from dejavu.plugins.layer_norm import LN_EPS

D, F, K = 72, 200, 37  # not multiples of any block size
SMALL = {"BLOCK": 16, "PREFIX_MAX": 16}  # several blocks a row, several prefix loads


def _h(B, k, pattern, dtype):
    """h [B, k]: about half zeros ("relu"), "zero" everywhere, "none" zero, or zero from a per-row count on
    ("keep": a per-token K's rows, ReLU zeros before it)."""
    h = torch.relu(torch.randn(B, k))
    if pattern == "zero":
        h.zero_()
    elif pattern == "none":
        h = torch.rand(B, k) + 0.5
    elif pattern == "keep":
        h[torch.arange(k) >= torch.randint(0, k, (B, 1))] = 0
    return h.to(dtype)


def _poisoned(B, k, dtype):
    return (torch.full((B, k), float("nan"), dtype=dtype), torch.full((B, k), -7, dtype=torch.int32),
            torch.full((B,), -7, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("pattern", ["relu", "zero", "none", "keep"])
@pytest.mark.parametrize("B,shared,k", [(1, True, K), (1, False, 5), (3, False, K), (2, True, 130)])
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_compact_rows_equal_the_reference_and_the_definition(triton_interp, dtype, pattern, B, shared, k, config):
    h = _h(B, k, pattern, dtype)
    idx = (torch.randperm(F)[:k] if shared else torch.stack([torch.randperm(F)[:k] for _ in range(B)]))
    idx = idx.to(torch.int64 if B == 2 else torch.int32)
    out = _poisoned(B, k, dtype)
    got = compact_rows(h, idx, out=out, config=config)
    assert all(g is o for g, o in zip(got, out))
    for g, w in zip(got, compact_rows_ref(h, idx)):
        assert torch.equal(g, w)
    hc, ic, n = got
    rows = idx.long().expand(B, k)
    for b in range(B):  # the definition: the nonzero rows in order, then zeros
        nz = h[b] != 0
        assert int(n[b]) == int(nz.sum())
        assert torch.equal(hc[b, :n[b]], h[b][nz]) and torch.equal(ic[b, :n[b]].long(), rows[b][nz])
        assert (hc[b, n[b]:] == 0).all() and (ic[b, n[b]:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("pattern", ["relu", "zero", "none", "keep"])
@pytest.mark.parametrize("B,route", [(1, "dot"), (1, "gemv"), (3, "gemv")])
@pytest.mark.parametrize("fc2_config", [None, {"BLOCK_K": 16, "SPLIT": 3}], ids=["default", "split3"])
def test_fc2_over_compacted_rows_equals_fc2(triton_interp, close, dtype, pattern, B, route, fc2_config):
    # fc1 (a per-token K for "keep": rows from n on are 0, not read), compact_rows, fc2 stopping at the count
    settings = dataclasses.replace(DEFAULT, fc2_dot_min_batch=1 if route == "dot" else 64)
    x = torch.randn(B, D).to(dtype)
    w1 = (torch.randn(F, D) / D ** 0.5).to(dtype)
    b1 = {"zero": torch.full((F,), -100.0), "none": torch.full((F,), 100.0)}.get(pattern, torch.randn(F)).to(dtype)
    w2_t, b2 = (torch.randn(F, D) / K ** 0.5).to(dtype), torch.randn(D).to(dtype)
    idx = torch.stack([torch.randperm(F)[:K] for _ in range(B)]).to(torch.int32)
    n_kept = torch.randint(1, K, (B,), dtype=torch.int32) if pattern == "keep" else None
    h = sparse_fc1(x, w1, b1, idx, n_kept)
    hc, ic, n = compact_rows(h, idx)
    # poison what fc2 must not read: the weight rows of zero h (any sequence's: NaN times 0 is NaN), and h_c
    # from the count on; row 0 stays finite (the kernels' masked positions in a block gather it, times 0)
    w2p = w2_t.clone()
    w2p[idx[h == 0].long()] = float("nan")
    w2p[idx[h != 0].long()] = w2_t[idx[h != 0].long()]
    w2p[0] = w2_t[0]
    hc = torch.where(torch.arange(K) < n[:, None], hc, torch.full_like(hc, float("nan")))
    res = torch.randn(B, D).to(dtype)
    y = torch.full((B, D), float("nan"), dtype=dtype)
    sparse_fc2(hc, w2p, b2, ic, res, out=y, n_kept=n, config=fc2_config, settings=settings)
    y_ref = sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, res.double())
    close(y, y_ref, sparse_fc2_ref(h, w2_t, b2, idx, res))
    if pattern == "zero":
        assert (n == 0).all()
        close(y, (b2.double() + res.double()).expand(B, D), b2 + res)


@pytest.mark.parametrize("defer", [False, True])
def test_fc2_over_compacted_rows_with_the_next_layer_norm(triton_interp, close, defer):
    # the decode step's batch-1 call at pre-LN (defer_ln_attn): fc2's reduction with the next LayerNorm
    from dejavu.plugins import from_stats_ref

    dtype = torch.float32
    h = _h(1, K, "relu", dtype)
    idx = torch.randperm(F)[:K].to(torch.int32)
    w2_t, b2, res = (torch.randn(F, D) / K ** 0.5), torch.randn(D), torch.randn(1, D)
    ln = (torch.rand(D) + 0.5, torch.randn(D))
    hc, ic, n = compact_rows(h, idx)
    y, z = sparse_fc2(hc, w2_t, b2, ic, res, n_kept=n, ln=ln, ln_defer=defer, config={"BLOCK_K": 16, "SPLIT": 2})
    z = from_stats_ref(z) if defer else z
    y_ref, z_ref = sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, res.double(),
                                  ln=(ln[0].double(), ln[1].double()))
    close(y, y_ref, sparse_fc2_ref(h, w2_t, b2, idx, res))
    close(z, z_ref, torch.nn.functional.layer_norm(y_ref.float(), (D,), ln[0], ln[1], LN_EPS))


def test_fc1_fc2_reference_path_is_unchanged_by_compaction():
    # the references alone (the CPU decode path's compaction): the same sum, float64
    x, w1, b1 = torch.randn(2, D).double(), torch.randn(F, D).double() / D ** 0.5, torch.randn(F).double()
    w2_t, b2 = torch.randn(F, D).double(), torch.randn(D).double()
    idx = torch.stack([torch.randperm(F)[:K] for _ in range(2)])
    h = sparse_fc1_ref(x, w1, b1, idx)
    hc, ic, n = compact_rows_ref(h, idx)
    assert 0 < int(n.min()) and int(n.max()) < K
    y = sparse_fc2_ref(hc, w2_t, b2, ic, n_kept=n)
    assert torch.allclose(y, sparse_fc2_ref(h, w2_t, b2, idx), rtol=1e-12, atol=1e-12)


def test_compact_rows_bad_inputs():
    h, idx = torch.rand(2, K), torch.zeros(2, K, dtype=torch.int32)
    with pytest.raises(DejavuError, match="idx: expected shape"):
        compact_rows(h, idx[:, :-1].contiguous())
    with pytest.raises(DejavuError, match="idx: expected shape"):
        compact_rows(h, torch.zeros(3, K, dtype=torch.int32))
    with pytest.raises(DejavuError, match="dtype"):
        compact_rows(h, idx.float())
    with pytest.raises(DejavuError, match="out: expected"):
        compact_rows(h, idx, out=(h,))
    with pytest.raises(DejavuError, match="out idx_c: expected dtype"):
        compact_rows(h, idx, out=(torch.empty(2, K), torch.empty(2, K, dtype=torch.int64),
                                  torch.empty(2, dtype=torch.int32)))
    with pytest.raises(DejavuError, match="config: unknown"):
        compact_rows(h, idx, config={"BLOCK_R": 4})

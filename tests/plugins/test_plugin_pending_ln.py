"""A LayerNorm left to its consumer (layer_norm.PendingLN): fc2's split-K reduction stores block
stats instead of a LayerNorm launch, the next layer's deferred Q/K/V kernel normalises its input as
it loads it. Against float64 references (Triton interpreter)."""
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import sparse_fc2
from dejavu.plugins.layer_norm import PendingLN, block_stats, check_pending, from_stats_ref, layer_norm, pending_ln

SM = sys.modules["dejavu.plugins.fc2"]
LN = sys.modules["dejavu.plugins.layer_norm"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
D, F, K = 72, 200, 37  # not multiples of any block size


def weights(dtype, k=K):
    w1, b1 = (torch.randn(F, D) / D ** 0.5).to(dtype), torch.randn(F).to(dtype)
    w2_t, b2 = (torch.randn(F, D) / k ** 0.5).to(dtype), torch.randn(D).to(dtype)
    g, beta = (1 + 0.2 * torch.randn(D)).to(dtype), (0.2 * torch.randn(D)).to(dtype)
    return w1, b1, w2_t, b2, (g, beta)


def index(B, shared, k=K):
    if shared:
        return torch.randperm(F)[:k].to(torch.int32)
    return torch.stack([torch.randperm(F)[:k] for _ in range(B)]).to(torch.int32)


def ln64(x, ln):
    return torch.nn.functional.layer_norm(x.double(), (x.shape[-1],), ln[0].double(), ln[1].double(), 1e-5)


@pytest.mark.parametrize("width", [32, 256, 7])
def test_block_stats_against_float64(width):
    x = torch.randn(3, D) * 4 + 2
    st = block_stats(x, width)
    n = -(-D // width)
    assert st.shape == (3, n, 2) and st.dtype == torch.float32
    for i in range(n):
        blk = x.double()[:, i * width:(i + 1) * width]
        assert torch.allclose(st[:, i, 0].double(), blk.mean(1), rtol=1e-6, atol=1e-6)
        assert torch.allclose(st[:, i, 1].double(), (blk - blk.mean(1, keepdim=True)).square().sum(1), rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,shared", [(1, True), (1, False), (3, False)])
def test_fc2_with_deferred_layer_norm_stores_stats_not_a_layer_norm(launched, triton_interp, dtype, B, shared):
    # split reduction: y as without ln (bit-equal), block stats of the stored y, no LayerNorm launch
    _, _, w2_t, b2, ln = weights(dtype)
    idx = index(B, shared)
    h, res = torch.randn(B, K).to(dtype), torch.randn(B, D).to(dtype)
    cfg = {"SPLIT": 3, "BLOCK_K": 16}
    y0 = sparse_fc2(h, w2_t, b2, idx, res, config=cfg)
    names = launched(SM, LN)
    y, p = sparse_fc2(h, w2_t, b2, idx, res, ln=ln, ln_defer=True, config=cfg)
    assert names[-1] == "_split_reduce_kernel" and "_layer_norm_kernel" not in names, names
    assert isinstance(p, PendingLN) and p.x is y and p.weight is ln[0] and p.bias is ln[1]
    assert torch.equal(y, y0)
    want = block_stats(y, p.width)
    assert p.stats.shape == want.shape
    assert torch.allclose(p.stats, want, rtol=1e-5, atol=1e-5)


def test_fc2_with_deferred_layer_norm_gives_the_layer_norm(triton_interp, close):
    # what a consumer merges from the stats equals LayerNorm(y) (float64 of the stored y)
    _, _, w2_t, b2, ln = weights(torch.float16)
    idx = index(1, False)
    h, res = torch.randn(1, K).half(), torch.randn(1, D).half()
    y, p = sparse_fc2(h, w2_t, b2, idx, res, ln=ln, ln_defer=True, config={"SPLIT": 3, "BLOCK_K": 16})
    close(from_stats_ref(p), ln64(y, ln), torch.nn.functional.layer_norm(y, (D,), *ln, 1e-5))


def test_fc2_with_deferred_layer_norm_without_a_reduction_computes_it(triton_interp, monkeypatch):
    # SPLIT 1 (no reduction kernel to store stats): the LayerNorm is computed, a tensor returned
    _, _, w2_t, b2, ln = weights(torch.float32)
    idx = index(1, True)
    h = torch.randn(1, K)
    y, y_ln = sparse_fc2(h, w2_t, b2, idx, ln=ln, ln_defer=True, config={"SPLIT": 1})
    assert isinstance(y_ln, torch.Tensor)
    assert torch.allclose(y_ln.double(), ln64(y, ln), rtol=1e-5, atol=1e-5)


def test_bad_pending_layer_norm_rejected():
    _, _, _, _, ln = weights(torch.float16)
    good = pending_ln(torch.randn(1, D).half(), *ln, width=32)
    check_pending(good)
    with pytest.raises(DejavuError, match="PendingLN.stats: expected shape"):
        check_pending(good._replace(width=64))
    with pytest.raises(DejavuError, match="PendingLN.stats: expected dtype"):
        check_pending(good._replace(stats=good.stats.half()))
    with pytest.raises(DejavuError, match="PendingLN.weight: expected shape"):
        check_pending(good._replace(weight=ln[0][:-1].contiguous()))
    with pytest.raises(DejavuError, match="PendingLN.width: expected a positive int"):
        check_pending(good._replace(width=0))


# ---- the LayerNorm before a deferred-K/V attention, left to its Q/K/V kernel -------------
H_A, HD_A, S_A = 5, 12, 21  # D_A = 60: not a multiple of any block
D_A = H_A * HD_A


def attn_weights(dtype):
    w = [torch.randn(D_A, D_A) / D_A ** 0.5, torch.randn(D_A) / 4, torch.randn(2 * D_A, D_A) / D_A ** 0.5,
         torch.randn(2 * D_A) / 4, torch.randn(D_A, D_A) / D_A ** 0.5, torch.randn(D_A) / 4]
    ln = ((1 + 0.2 * torch.randn(D_A)).to(dtype), (0.2 * torch.randn(D_A)).to(dtype))
    return [t.to(dtype) for t in w], ln


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,shared,config", [
    (1, False, None),  # batch 1: the shared-set kernel (QKV_CONFIG_B1)
    (1, False, {"qkv": {"SPLIT": 3, "BLOCK_D": 16}}),  # several slices of D: every program normalises its own
    (3, True, {"qkv": {"SPLIT": 2, "BLOCK_D": 16}}),  # a [Kh] set for the batch: the LayerNorm computed first
    (2, False, None),  # per-sequence sets: the per-sequence kernel, the LayerNorm computed first
    (1, False, {"qkv": {"SHARED_MIN_BATCH": None}})])  # batch 1 on the per-sequence kernel
def test_deferred_attention_of_pending_layer_norm(launched, triton_interp, close, dtype, B, shared, config):
    from dejavu.plugins.deferred_kv import sparse_attn_decode_deferred, sparse_attn_decode_deferred_ref
    w, ln = attn_weights(dtype)
    w64 = [t.double() for t in w]
    hist0 = torch.randn(B, S_A, D_A).to(dtype)
    vl0 = torch.randint(0, 6, (B, H_A), dtype=torch.int32)
    pos = torch.tensor([7, 9, 12][:B])
    hidx = torch.randperm(H_A)[:3].to(torch.int32) if shared else torch.stack(
        [torch.randperm(H_A)[:3] for _ in range(B)]).to(torch.int32)
    x, res = (torch.randn(B, D_A) * 2 + 0.7).to(dtype), torch.randn(B, D_A).to(dtype)
    p = pending_ln(x, *ln, width=16)
    names = launched()
    k0, v0 = [torch.randn(B, H_A, S_A, HD_A).to(dtype) for _ in range(2)]  # slots < valid_len: as filled
    kc, vc, hist, vl = k0.clone(), v0.clone(), hist0.clone(), vl0.clone()
    y = sparse_attn_decode_deferred(p, *w, hidx, kc, vc, hist, vl, pos, res, config=config)
    in_kernel = B == 1 and not (config or {}).get("qkv", {}).get("SHARED_MIN_BATCH", 1) is None
    assert ("_layer_norm_kernel" in names) != in_kernel, names
    assert "_qkv_partial_shared_kernel" in names or not in_kernel, names
    # x_hist[b, pos] holds LayerNorm(x) as the layer_norm kernel rounds it (up to the stats' last bits)
    rows = torch.arange(B)
    want_ln = ln64(x, ln)
    err = (hist[rows, pos].double() - want_ln).abs().max().item()
    assert err <= 2 * (layer_norm(x, *ln).double() - want_ln).abs().max().item() + 1e-6, err
    others = torch.ones(B, S_A, dtype=torch.bool)
    others[rows, pos] = False
    assert torch.equal(hist[others], hist0[others])  # no other slot touched
    # y, the caches and valid_len against the float64 reference of the LayerNorm'd input
    k64, v64, vl64 = k0.double(), v0.double(), vl0.clone()
    ref = sparse_attn_decode_deferred_ref(want_ln, *w64, hidx, k64, v64, hist0.double(), vl64, pos, res.double())
    kt, vt = k0.clone(), v0.clone()
    tor = sparse_attn_decode_deferred_ref(p, *w, hidx, kt, vt, hist0.clone(), vl0.clone(), pos, res)
    close(y, ref, tor)
    assert torch.equal(vl, vl64)
    written = k64 != k0.double()  # the selected heads' slots min(valid_len, pos)..pos
    assert written.any() and torch.equal(kc[~written], k0[~written]) and torch.equal(vc[~written], v0[~written])
    close(kc[written], k64[written], kt[written])
    close(vc[written], v64[written], vt[written])

"""Input-sparse GEMV (plugins/input_sparse.py): per-split selects, the pairs' GEMV and its sums, under Triton's
interpreter, against float64 references."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import DEFAULT, InputSparseSettings as _s
from dejavu.plugins.input_sparse import (input_sparse_gemv_ref, produce_ref, select_slices, select_slices_ref,
                                         qkv_rope, sliced_gemv, sliced_gemv_add, sliced_parts, sliced_qkv_rope,
                                         sliced_qkv_rope_ref, split_k_for, sum_parts_ref)
from conftest import DTYPES

SMALL = _s(block_select=32, block_m=16, block_k=8)  # many blocks on small shapes
WIDE_K = dataclasses.replace(SMALL, block_m=32, block_k=64, num_warps=2)  # 32 pairs a load: past most splits' counts
WIDE_M = dataclasses.replace(SMALL, block_m=128, block_k=16)  # one column block, wider than M: masked columns


def _ks(blocks):
    """KernelSettings with these input-sparse blocks."""
    return dataclasses.replace(DEFAULT, input_sparse=blocks)


def test_split_k_fills_the_device_with_splits_of_min_split_inputs():
    assert split_k_for(1, 14336, 4096, _s()) == 9  # down of Llama-3-8B: 64 column blocks of 64, 528 programs
    assert split_k_for(1, 14336, 4096, _s(block_m=128)) == 17  # 32 column blocks
    assert split_k_for(1, 4096, 4096, _s()) == 9  # o
    assert split_k_for(1, 4096, 4096, _s(min_split_inputs=1024)) == 4  # fewer, longer splits
    assert split_k_for(1, 14336, 4096, _s(min_split_inputs=2048)) == 7
    assert split_k_for(1, 64, 4096, _s()) == 1
    assert split_k_for(1, 4096, 28672, _s(split_k=2)) == 2


# ---------------------------------------------------------------- sliced: per-split selects and the pairs' GEMV
def _producer_input(B, N, producer, dtype, g):
    """x for a producer (swiglu: gate | up, [B, 2N]) and its norm weight (NORM: [N], else None)."""
    x = torch.randn(B, 2 * N if producer == "swiglu" else N, generator=g)
    x[:, ::7] = 0.0  # exact zeros: never kept, even at t = 0
    nw = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype) if producer == "norm" else None
    return x.to(dtype), nw


PRODUCERS = ["none", "norm", "swiglu"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("B,N,split,t,config", [(1, 77, 3, 0.6, SMALL), (3, 200, 5, 0.9, SMALL), (2, 130, 1, 0.6, _s()),
                                                (2, 33, 4, 50.0, SMALL), (1, 64, 2, 0.0, SMALL)])
def test_select_slices_pairs_each_split_in_order(triton_interp, dtype, producer, B, N, split, t, config):
    """Per split: the kept inputs of h ascending, their values, their count; t 50: none kept, t 0: every
    non-zero input; N not a multiple of the split or the block."""
    g = torch.Generator().manual_seed(N * split)
    x, nw = _producer_input(B, N, producer, dtype, g)
    kw = dict(norm_w=nw, eps=1e-5, swiglu=producer == "swiglu")
    idx, val, count = select_slices(x, t, split, settings=_ks(config), **kw)
    ri, rv, rc = select_slices_ref(x, t, split, **kw)
    assert torch.equal(count, rc)
    h = produce_ref(x, nw, 1e-5, producer == "swiglu").double()
    per = -(-N // split)
    for b in range(B):
        for s in range(split):
            n = int(rc[b, s])
            want = torch.nonzero(h[b, s * per:(s + 1) * per].abs() > t).flatten() + s * per
            assert idx[b, s * per:s * per + n].tolist() == ri[b, s * per:s * per + n].tolist() == want.tolist()
            # h as PyTorch rounds it (RMSNorm's rsqrt may differ in the last bit of fp32)
            torch.testing.assert_close(val[b, s * per:s * per + n], rv[b, s * per:s * per + n], rtol=2e-3, atol=0)
    if t == 50.0:
        assert int(count.sum()) == 0
    if t == 0.0:
        assert int(count.sum()) == int((h != 0).sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("B,N,M,t,config,residual", [(1, 77, 45, 0.6, SMALL, True), (3, 130, 64, 0.6, SMALL, False),
                                                     (2, 200, 300, 0.9, _s(), True),
                                                     (1, 96, 40, 0.6, _s(block_m=16, block_k=8, split_k=3), True),
                                                     (2, 50, 48, 50.0, SMALL, True), (2, 40, 33, 0.0, SMALL, False),
                                                     (2, 200, 45, 0.6, WIDE_K, True),
                                                     (1, 130, 64, 0.3, WIDE_K, False),
                                                     (2, 50, 48, 50.0, WIDE_K, True),
                                                     (2, 40, 33, 0.0, WIDE_K, False),
                                                     (2, 200, 45, 0.6, WIDE_M, True)])
def test_sliced_gemv_matches_float64(triton_interp, close, dtype, producer, B, N, M, t, config, residual):
    """residual + the kept inputs of h times their rows of w_t: M a multiple of block_m (unmasked loads)
    and not, several splits, none kept (y = residual), every input kept (t 0)."""
    g = torch.Generator().manual_seed(N + M)
    x, nw = _producer_input(B, N, producer, dtype, g)
    w_t = (torch.randn(N, M, generator=g) / N ** 0.5).to(dtype)
    res = torch.randn(B, M, generator=g).to(dtype) if residual else None
    kw = dict(norm_w=nw, eps=1e-5, swiglu=producer == "swiglu")
    split = split_k_for(B, N, M, config)
    idx, val, count = select_slices(x, t, split, settings=_ks(config), **kw)
    out = torch.full((B, M), float("nan"), dtype=dtype)
    sliced_gemv(idx, val, count, w_t, res, out=out, settings=_ks(config))
    h = produce_ref(x, nw, 1e-5, producer == "swiglu")
    ref64 = (h.double() * (h.float().abs() > t)) @ w_t.double() + (0 if res is None else res.double())
    same = input_sparse_gemv_ref(h, w_t, t) if t > 0 else h @ w_t
    close(out, ref64, same if res is None else res + same)


_ROUNDED = {torch.float16: dict(rtol=2e-3, atol=0), torch.bfloat16: dict(rtol=1e-2, atol=0),
            torch.float32: dict(rtol=1e-5, atol=0)}  # one rounding to the dtype, and rms_norm's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,N,M,t,config", [(1, 77, 45, 0.6, SMALL), (3, 130, 64, 0.6, WIDE_K), (2, 96, 40, 0.0, SMALL),
                                            (2, 60, 33, 50.0, SMALL)])
def test_fp32_residual_stream_select_and_add_match_float64(triton_interp, close, dtype, B, N, M, t, config):
    """The fp32 residual stream (input_sparse.fp32_residual): the RMSNorm select of an fp32 x writes h in the
    weights' dtype (rms_norm's output rounded to it, then the weight product), and sliced_gemv_add adds every
    split's sum into the fp32 stream in place: against float64 and against the residual + sliced_gemv of the same
    pairs; none kept (t 50) leaves the stream as it was."""
    g = torch.Generator().manual_seed(N * M)
    x = torch.randn(B, N, generator=g) * 3
    nw = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype)
    w_t = (torch.randn(N, M, generator=g) / N ** 0.5).to(dtype)
    split = split_k_for(B, N, M, config)
    idx, val, count = select_slices(x, t, split, nw, 1e-5, dtype=dtype, settings=_ks(config))
    ri, rv, rc = select_slices_ref(x, t, split, nw, 1e-5, dtype=dtype)
    assert val.dtype == dtype and torch.equal(count, rc)
    per = -(-N // split)
    for b in range(B):
        for s in range(split):
            at = slice(s * per, s * per + int(rc[b, s]))
            assert idx[b, at].tolist() == ri[b, at].tolist()
            torch.testing.assert_close(val[b, at], rv[b, at], rtol=2e-3, atol=0)
    h = nw.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5))
    stream = torch.randn(B, M, generator=g)
    before = stream.clone()
    assert sliced_gemv_add(idx, val, count, w_t, stream, settings=_ks(config)) is stream  # in place
    hr = torch.zeros(B, N, dtype=torch.float64)  # h as the select rounded it, at the kept inputs
    for b in range(B):
        at = ri[b] >= 0
        hr[b, ri[b][at].long()] = rv[b][at].double()
        torch.testing.assert_close(hr[b, ri[b][at].long()], h[b, ri[b][at].long()], **_ROUNDED[dtype])
    ref64 = hr @ w_t.double() + before.double()
    same = before + sliced_gemv(idx, val, count, w_t, settings=_ks(config)).float()
    close(stream, ref64, same)
    if t == 50.0:
        assert torch.equal(stream, before)
    with pytest.raises(DejavuError, match=r"acc: expected dtype torch.float32"):
        sliced_gemv_add(idx, val, count, w_t, stream.to(torch.float64), settings=_ks(config))
    if dtype != torch.float32:
        with pytest.raises(DejavuError, match="for RMSNorm of an fp32 x only"):
            select_slices(x.to(dtype), t, split, nw, 1e-5, dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("S,B,N,split", [(2, 1, 77, 3), (3, 2, 130, 1), (1, 3, 40, 4)])
def test_select_slices_sums_the_previous_gemvs_partials(triton_interp, close, dtype, producer, S, B, N, split):
    """x as fp32 partials [S, B, N'] (gate/up's split-K GEMV before down's SwiGLU select): the select sums them
    in order and rounds to dtype as sliced_gemv's sum does, then selects as from that sum; the whole chain
    sliced_parts -> select -> sliced_gemv against float64."""
    g = torch.Generator().manual_seed(S * N + split)
    x, nw = _producer_input(B, N, producer, dtype, g)
    w_t = (torch.randn(N, x.shape[1], generator=g) / N ** 0.5).to(dtype)  # a GEMV whose output is x's width
    pi, pv, pc = select_slices(x[:, :N].contiguous(), -1.0, S, settings=_ks(SMALL))  # every input kept, S splits
    part = sliced_parts(pi, pv, pc, w_t, settings=_ks(SMALL))  # [S, B, N']
    assert part.shape == (S, B, x.shape[1]) and part.dtype == torch.float32
    kw = dict(norm_w=nw, eps=1e-5, swiglu=producer == "swiglu")
    y = sum_parts_ref(part, dtype)
    assert torch.equal(y, sliced_gemv(pi, pv, pc, w_t, settings=_ks(SMALL)))  # the same in-order sum
    t = 0.3
    idx, val, count = select_slices(part, t, split, dtype=dtype, settings=_ks(SMALL), **kw)
    ri, rv, rc = select_slices(y, t, split, settings=_ks(SMALL), **kw)
    assert torch.equal(count, rc) and val.dtype == dtype
    fi, fv, fc = select_slices_ref(part, t, split, dtype=dtype, **kw)
    assert torch.equal(fc, count)
    for b in range(B):
        for s, per in ((s, -(-N // split)) for s in range(split)):
            n = int(count[b, s])
            assert torch.equal(idx[b, s * per:s * per + n], ri[b, s * per:s * per + n])
            assert torch.equal(idx[b, s * per:s * per + n], fi[b, s * per:s * per + n])
            assert torch.equal(val[b, s * per:s * per + n], rv[b, s * per:s * per + n])
    w2 = (torch.randn(N, 24, generator=g) / N ** 0.5).to(dtype)
    out = sliced_gemv(idx, val, count, w2, settings=_ks(SMALL))
    h = produce_ref(y, nw, 1e-5, producer == "swiglu")
    close(out, (h.double() * (h.float().abs() > t)) @ w2.double(), input_sparse_gemv_ref(h, w2, t))


@pytest.mark.parametrize("config", [SMALL, WIDE_K, WIDE_M])
def test_sliced_gemv_reads_only_the_kept_rows(triton_interp, config):
    """Rows of w_t outside the pairs are NaN: a read of any of them would poison y (nor a row past a split's
    count: a load of more pairs than the split holds, WIDE_K)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 90, generator=g)
    w_t = torch.randn(90, 50, generator=g)
    idx, val, count = select_slices(x, 0.8, 4, settings=_ks(config))
    kept = (x.abs() > 0.8).any(0)
    poisoned = torch.where(kept[:, None], w_t, torch.full_like(w_t, float("nan")))
    y = sliced_gemv(idx, val, count, poisoned, settings=_ks(config))
    ref = input_sparse_gemv_ref(x.double(), torch.where(kept[:, None], w_t, 0.0).double(), 0.8)
    assert torch.isfinite(y).all() and (y.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("config", [SMALL, WIDE_K])
def test_sliced_gemv_ignores_stale_pairs_past_the_count(triton_interp, config):
    """Past each split's count the pair buffers hold what an earlier launch left there: NaN values and
    indices out of range must not reach y."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 90, generator=g)
    w_t = torch.randn(90, 50, generator=g)
    settings = _ks(config)
    idx, val, count = select_slices(x, 0.8, 4, settings=settings)
    per = -(-90 // 4)
    for b in range(2):
        for s in range(4):
            n, end = int(count[b, s]), min((s + 1) * per, 90)
            idx[b, s * per + n:end] = 10 ** 6
            val[b, s * per + n:end] = float("nan")
    y = sliced_gemv(idx, val, count, w_t, settings=settings)
    ref = input_sparse_gemv_ref(x.double(), w_t.double(), 0.8)
    assert torch.isfinite(y).all() and (y.double() - ref).abs().max() < 1e-5


def test_sliced_launchers_check_their_inputs(triton_interp):
    x = torch.randn(2, 16)
    with pytest.raises(DejavuError, match=r"norm_w: expected shape \(16,\)"):
        select_slices(x, 0.5, 2, norm_w=torch.ones(15))
    with pytest.raises(DejavuError, match="halves of equal width"):
        select_slices(torch.randn(2, 15), 0.5, 2, swiglu=True)
    with pytest.raises(DejavuError, match=r"split must be in \[1, 16\]"):
        select_slices(x, 0.5, 0)
    with pytest.raises(DejavuError, match="partials x need the dtype of h"):
        select_slices(torch.randn(2, 2, 16), 0.5, 2)
    with pytest.raises(DejavuError, match="expected dtype torch.float32"):
        select_slices(torch.randn(2, 2, 16, dtype=torch.float16), 0.5, 2, dtype=torch.float16)
    idx, val, count = select_slices(x, 0.5, 2)
    with pytest.raises(DejavuError, match=r"w_t: expected shape \(16, 8\)"):
        sliced_gemv(idx, val, count, torch.randn(15, 8))
    with pytest.raises(DejavuError, match=r"residual: expected shape \(2, 8\)"):
        sliced_gemv(idx, val, count, torch.randn(16, 8), residual=torch.randn(8))
    with pytest.raises(DejavuError, match="count: expected shape"):
        sliced_gemv(idx, val, count[:1], torch.randn(16, 8))
    kc = torch.zeros(2, 1, 4, 4)
    with pytest.raises(DejavuError, match="not q, k and v heads of 4 with 1 KV heads"):
        sliced_qkv_rope(idx, val, count, torch.randn(16, 8), torch.ones(2, 4), torch.ones(2, 4),
                        torch.zeros(2, dtype=torch.long), kc, kc.clone())
    with pytest.raises(DejavuError, match="pos: expected dtype torch.int64"):
        sliced_qkv_rope(idx, val, count, torch.randn(16, 12), torch.ones(2, 4), torch.ones(2, 4),
                        torch.zeros(2, dtype=torch.int32), kc, kc.clone())
    with pytest.raises(DejavuError, match=r"bias: expected shape \(12,\)"):
        sliced_qkv_rope(idx, val, count, torch.randn(16, 12), torch.ones(2, 4), torch.ones(2, 4),
                        torch.zeros(2, dtype=torch.long), kc, kc.clone(), bias=torch.zeros(8))
    with pytest.raises(DejavuError, match=r"k_norm: expected shape \(4,\)"):
        sliced_qkv_rope(idx, val, count, torch.randn(16, 12), torch.ones(2, 4), torch.ones(2, 4),
                        torch.zeros(2, dtype=torch.long), kc, kc.clone(), qk_norm=(torch.ones(4), torch.ones(3), 1e-6))
    kc6, ones6 = torch.zeros(2, 1, 4, 6), torch.ones(6)
    with pytest.raises(DejavuError, match="power-of-two head dimension, got 6"):
        sliced_qkv_rope(idx, val, count, torch.randn(16, 18), torch.ones(2, 6), torch.ones(2, 6),
                        torch.zeros(2, dtype=torch.long), kc6, kc6.clone(), qk_norm=(ones6, ones6, 1e-6))


def _rope64(qkv, cos, sin, H, Hkv, hd, qk_norm=None, rot=None):
    """q, k rotated and v of qkv [B, (H + 2 Hkv) hd] in float64 (sin signed for rotate_half; qk_norm (q_w, k_w,
    eps): each q and k head's RMSNorm first; rot: the rotary dimensions, a head's first rot, the rest as they are)."""
    x = qkv.double().view(qkv.shape[0], -1, hd)
    qk = x[:, :H + Hkv]
    if qk_norm is not None:
        w = torch.cat([qk_norm[0].double().expand(H, hd), qk_norm[1].double().expand(Hkv, hd)])
        qk = qk / (qk.pow(2).mean(-1, keepdim=True) + qk_norm[2]).sqrt() * w
    rot = rot or hd
    r = qk[..., :rot] * cos.double()[:, None, :rot] + qk[..., :rot].roll(rot // 2, -1) * sin.double()[:, None, :rot]
    r = torch.cat((r, qk[..., rot:]), -1)
    return r[:, :H], r[:, H:], x[:, H + Hkv:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hkv,hd,config,with_bias,with_norm,rot", [
    (1, 4, 2, 16, SMALL, False, False, None), (3, 6, 2, 8, SMALL, True, False, None),
    (2, 2, 1, 32, _s(), True, False, None), (2, 4, 2, 8, SMALL, False, True, None),
    (1, 2, 1, 32, SMALL, True, True, None), (3, 6, 3, 16, _s(), False, True, None),
    (2, 4, 2, 16, SMALL, True, False, 12), (1, 2, 1, 32, _s(), False, False, 24), (2, 6, 2, 8, SMALL, False, True, 6)])
def test_sliced_qkv_rope_matches_float64(triton_interp, close, dtype, B, H, Hkv, hd, config, with_bias, with_norm,
                                         rot):
    """q rotated, and k (rotated) and v written into the caches at pos[b] only (after the sliced GEMV, and after a
    dense product: `qkv_rope`): poisoned caches keep their NaN elsewhere; blocks that straddle heads (block_m 16
    against hd 8 / 32); q/k/v biases (Qwen2) added before RoPE; each q and k head's RMSNorm before RoPE (Qwen3),
    two heads a block (hd 8 in 16; 16 in 64, the last block part masked) or a block widened to the head (hd 32
    against block_m 16); a partial rotary (rot of hd: Phi-4-mini), cos 1 and sin 0 past it."""
    g = torch.Generator().manual_seed(H * hd + B)
    N, M, T = 40, (H + 2 * Hkv) * hd, 7
    x, nw = _producer_input(B, N, "norm", dtype, g)
    w_t = (torch.randn(N, M, generator=g) / N ** 0.5).to(dtype)
    r = rot or hd
    ang = torch.rand(B, r // 2, generator=g) * 6
    ones, zeros = torch.ones(B, hd - r), torch.zeros(B, hd - r)
    cos = torch.cat((ang.cos(), ang.cos(), ones), -1).to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin(), zeros), -1).to(dtype)
    pos = torch.randint(0, T, (B,), generator=g)
    kc, vc = (torch.full((B, Hkv, T, hd), float("nan"), dtype=dtype) for _ in range(2))
    bias = torch.randn(M, generator=g).to(dtype) if with_bias else None
    qk_norm = (tuple((1 + 0.3 * torch.randn(hd, generator=g)).to(dtype) for _ in range(2)) + (1e-6,)
               if with_norm else None)
    t = 0.6
    split = split_k_for(B, N, M, config)
    idx, val, count = select_slices(x, t, split, nw, 1e-5, settings=_ks(config))
    q = sliced_qkv_rope(idx, val, count, w_t, cos, sin, pos, kc, vc, settings=_ks(config), bias=bias, qk_norm=qk_norm,
                        rot=rot)
    h = produce_ref(x, nw, 1e-5)
    y64, y = (h.double() * (h.float().abs() > t)) @ w_t.double(), input_sparse_gemv_ref(h, w_t, t)
    if with_bias:
        y64, y = y64 + bias.double(), y + bias
    q64, k64, v64 = _rope64(y64, cos, sin, H, Hkv, hd, qk_norm, rot)
    kt, vt = (torch.full_like(kc, float("nan")) for _ in range(2))
    qt = sliced_qkv_rope_ref(y, cos, sin, pos, kt, vt, qk_norm=qk_norm, rot=rot)
    rows = torch.arange(B)
    close(q, q64, qt)
    close(kc[rows, :, pos], k64, kt[rows, :, pos])
    close(vc[rows, :, pos], v64, vt[rows, :, pos])
    written = torch.zeros(B, Hkv, T, dtype=torch.bool)
    written[rows, :, pos] = True
    assert kc[~written].isnan().all() and vc[~written].isnan().all()
    # the same launch after a dense product (the dense decode step): the masked product in, its bias added there
    kd, vd = (torch.full_like(kc, float("nan")) for _ in range(2))
    qd = qkv_rope(input_sparse_gemv_ref(h, w_t, t), cos, sin, pos, kd, vd, settings=_ks(config), bias=bias,
                  qk_norm=qk_norm, rot=rot)
    close(qd, q64, qt)
    close(kd[rows, :, pos], k64, kt[rows, :, pos])
    close(vd[rows, :, pos], v64, vt[rows, :, pos])
    assert kd[~written].isnan().all() and vd[~written].isnan().all()

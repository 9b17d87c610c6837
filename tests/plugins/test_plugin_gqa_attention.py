"""The Llama decode step's GQA attention (plugins/gqa_attention.py) under Triton's interpreter, against a
float64 reference over the slots <= pos[b]."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import DEFAULT, GQAAttnSettings
from dejavu.plugins.gqa_attention import (GQAPartials, gqa_decode, gqa_decode_ref, gqa_partials_ref, splits_for,
                                          used_splits)
from conftest import DTYPES


def _ks(**kw):
    return dataclasses.replace(DEFAULT, gqa_attn=GQAAttnSettings(**kw))


def _inputs(B, H, Hkv, hd, T, dtype, g):
    q = torch.randn(B, H, hd, generator=g).to(dtype)
    k = (1.5 * torch.randn(B, Hkv, T, hd, generator=g)).to(dtype)  # peaked softmaxes too
    v = torch.randn(B, Hkv, T, hd, generator=g).to(dtype)
    return q, k, v


def ref64(q, k, v, pos):
    """float64 softmax(q k^T / sqrt(hd)) v over slots <= pos[b]: [B, H * hd]."""
    B, H, hd = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(H // Hkv, dim=1)  # [B, H, T, hd]: query head h reads KV head h // G
    s = torch.einsum("bhd,bhtd->bht", q.double(), kk) / hd ** 0.5
    s = s.masked_fill(torch.arange(T)[None, None, :] > pos[:, None, None], float("-inf"))
    o = torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), v.double().repeat_interleave(H // Hkv, dim=1))
    return o.reshape(B, H * hd)


CASES = [  # B, H, Hkv, hd, T, pos (None: random per row), block_s, max_splits, target_programs
    (1, 4, 1, 16, 5, [0], 16, 8, 132),  # one tile, pos 0: one slot, one split (o itself)
    (2, 6, 2, 24, 37, [36, 0], 16, 3, 132),  # pos T - 1 and 0 in one batch (3 splits used, 1); hd, T not powers of 2
    (3, 8, 2, 32, 150, None, 16, 4, 132),  # G 4 (Llama-3-8B's), splits of several tiles, different per row
    (2, 8, 1, 40, 70, [69, 32], 32, 32, 132),  # G 8 (a 70B TP-8 rank's), pos at a tile's first slot
    (2, 3, 3, 8, 40, None, 16, 2, 132),  # G 1 (multi-head KV), hd 8 padded to 16
    (1, 4, 2, 16, 100, [99], 16, 32, 4),  # target_programs 4 over 2 KV heads: 2 splits of 4 tiles
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hkv,hd,T,pos,block_s,max_splits,target", CASES)
def test_gqa_decode_equals_the_float64_reference(triton_interp, close, dtype, B, H, Hkv, hd, T, pos, block_s,
                                                 max_splits, target):
    g = torch.Generator().manual_seed(T * H + hd)
    q, k, v = _inputs(B, H, Hkv, hd, T, dtype, g)
    pos = torch.tensor(pos) if pos is not None else torch.randint(0, T, (B,), generator=g)
    # slots past pos poisoned: never read (a NaN there would spread through the softmax or the value sum)
    past = torch.arange(T)[None, :] > pos[:, None]  # [B, T]
    k[past[:, None, :, None].expand_as(k)] = float("nan")
    v[past[:, None, :, None].expand_as(v)] = float("nan")
    ks = _ks(block_s=block_s, max_splits=max_splits, target_programs=target)
    out = gqa_decode(q, k, v, pos, settings=ks)
    want = ref64(q, k.nan_to_num(), v.nan_to_num(), pos)
    qt, kt, vt = (x.nan_to_num() for x in (q, k, v))
    close(out, want, gqa_decode_ref(qt, kt, vt, pos))
    parts = gqa_decode(q, k, v, pos, combine=False, settings=ks)
    ns = splits_for(B, Hkv, T, ks.gqa_attn)
    assert ns == min(max_splits, -(-target // (B * Hkv)), -(-T // block_s))
    if ns == 1:
        assert torch.equal(parts, out)  # one split: o itself
    else:
        assert isinstance(parts, GQAPartials) and parts.acc.shape == (B, ns, H * hd)
        close(gqa_partials_ref(parts), want, gqa_decode_ref(qt, kt, vt, pos))


def test_splits_cover_the_row_in_whole_tiles():
    """used_splits (the kernels' _split_span): the programs c < used, each taking [c * per, (c + 1) * per)
    tiles of 16 slots cut at pos, cover slots 0..pos exactly once with no program empty; program `used` (where
    there is one) would start past pos; equal whole tiles but for the last; never more than ns programs."""
    for ns in (1, 2, 3, 7, 32):
        for pos in range(0, 300, 7):
            used = used_splits(pos, ns, 16)
            per = -(-(pos // 16 + 1) // ns)  # tiles a program
            spans = [range(c * per * 16, min((c + 1) * per * 16, pos + 1)) for c in range(used)]
            assert 1 <= used <= ns and all(len(r) > 0 for r in spans)
            assert [i for r in spans for i in r] == list(range(pos + 1))
            assert all(len(r) == per * 16 for r in spans[:-1])
            assert used == ns or used * per * 16 > pos  # a program past `used` holds no slot
    # a 128 + 128-token context on the 8B shape (NS 17): one tile a program; a long one (NS 32): 8 tiles each
    assert used_splits(191, 17, 32) == 6 and used_splits(7999, 32, 32) == 32 and used_splits(0, 32, 32) == 1


def test_gqa_decode_ref_is_the_masked_softmax(triton_interp):
    q, k, v = _inputs(2, 8, 2, 16, 12, torch.float64, torch.Generator().manual_seed(1))
    pos = torch.tensor([11, 3])
    assert (gqa_decode_ref(q, k, v, pos) - ref64(q, k, v, pos)).abs().max() < 1e-12


def test_bad_inputs_are_dejavu_errors(triton_interp):
    q, k, v = _inputs(2, 8, 2, 16, 12, torch.float32, torch.Generator().manual_seed(2))
    pos = torch.tensor([3, 4])
    with pytest.raises(DejavuError, match="pos: expected dtype torch.int64"):
        gqa_decode(q, k, v, pos.int())
    with pytest.raises(DejavuError, match=r"pos: expected shape \(2,\)"):
        gqa_decode(q, k, v, pos[:1])
    with pytest.raises(DejavuError, match="k_cache: shape .* is not"):
        gqa_decode(q, k[..., :8].contiguous(), v[..., :8].contiguous(), pos)  # another head dim
    with pytest.raises(DejavuError, match="k_cache: shape .* is not"):
        gqa_decode(q[:, :7].contiguous(), k, v, pos)  # 7 query heads over 2 KV heads
    with pytest.raises(DejavuError, match="v_cache: expected dtype"):
        gqa_decode(q, k, v.half(), pos)
    with pytest.raises(DejavuError, match="must be contiguous"):
        gqa_decode(q, k.transpose(2, 3), v, pos)
    for bad in (dict(block_s=12), dict(block_s=8), dict(max_splits=0)):
        with pytest.raises(DejavuError, match="block_s must be a power of two >= 16"):
            gqa_decode(q, k, v, pos, settings=_ks(**bad))
    with pytest.raises(DejavuError, match="head dim 512"):
        gqa_decode(torch.zeros(1, 2, 512), torch.zeros(1, 1, 4, 512), torch.zeros(1, 1, 4, 512), pos[:1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hkv,hd,T,max_splits,split", [(2, 8, 2, 24, 37, 3, 5), (3, 4, 1, 16, 70, 2, 1)])
def test_o_projections_select_combines_the_partials(triton_interp, close, dtype, B, H, Hkv, hd, T, max_splits, split):
    """select_slices on the splits' partials (PRODUCER ATTN, the combine fused into the select) picks what it
    picks from the combine kernel's o, with the same values; per-row positions, pos 0 and T - 1 among them."""
    from dejavu.plugins.input_sparse import select_slices, select_slices_ref

    g = torch.Generator().manual_seed(B * T + split)
    q, k, v = _inputs(B, H, Hkv, hd, T, dtype, g)
    pos = torch.tensor([T - 1, 0, 9][:B])
    ks = dataclasses.replace(_ks(block_s=16, max_splits=max_splits),
                             input_sparse=dataclasses.replace(DEFAULT.input_sparse, block_select=32))
    parts = gqa_decode(q, k, v, pos, combine=False, settings=ks)
    o = gqa_decode(q, k, v, pos, settings=ks)
    t = float(o.float().abs().median())  # about half kept
    idx, val, count = select_slices(parts, t, split, settings=ks)
    want_idx, want_val, want_count = select_slices(o, t, split, settings=ks)
    assert torch.equal(count, want_count) and count.sum() > 0
    for b in range(B):
        for s in range(split):
            per = -(-H * hd // split)
            n = int(count[b, s])
            assert torch.equal(idx[b, s * per:s * per + n], want_idx[b, s * per:s * per + n])
            assert torch.equal(val[b, s * per:s * per + n], want_val[b, s * per:s * per + n])
    ri, rv, rc = select_slices_ref(parts, t, split)  # the float64 combine, rounded, thresholded
    assert (count - rc).abs().sum() <= 2  # a value within an ulp of t may fall either side
    kept = torch.zeros(B, H * hd, dtype=torch.bool)
    for b in range(B):
        for s in range(split):
            per = -(-H * hd // split)
            kept[b, idx[b, s * per:s * per + int(count[b, s])].long()] = True
    close(torch.where(kept, o, 0).to(dtype), torch.where(kept, ref64(q, k, v, pos), 0),
          torch.where(kept, gqa_decode_ref(q, k, v, pos), 0))


def test_bad_partials_are_dejavu_errors(triton_interp):
    from dejavu.plugins.input_sparse import select_slices

    q, k, v = _inputs(2, 8, 2, 16, 40, torch.float32, torch.Generator().manual_seed(4))
    parts = gqa_decode(q, k, v, torch.tensor([3, 39]), combine=False, settings=_ks(block_s=16, max_splits=4))
    with pytest.raises(DejavuError, match="split must be in"):
        select_slices(parts, 0.1, 0)
    with pytest.raises(DejavuError, match="ml: expected shape"):
        select_slices(parts._replace(ml=parts.ml[:, :1].contiguous()), 0.1, 2)
    with pytest.raises(DejavuError, match="not heads of 24"):
        select_slices(parts._replace(head_dim=24), 0.1, 2)

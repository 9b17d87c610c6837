"""sparse_attn_decode (Triton, interpreter) against the masked-dense float64 reference."""
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import sparse_attn_decode, sparse_attn_decode_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
H, HD, S = 6, 12, 20  # D = 72; head dim not a power of two
D = H * HD
NAMES = ("wq", "bq", "wkv", "bkv", "wo_t", "bo")


def make(B, dtype):
    w = [torch.randn(D, D) / D ** 0.5, torch.randn(D) / 4, torch.randn(2 * D, D) / D ** 0.5,
         torch.randn(2 * D) / 4, torch.randn(D, D) / D ** 0.5, torch.randn(D) / 4]
    caches = [torch.randn(B, H, S, HD), torch.randn(B, H, S, HD)]
    return [t.to(dtype) for t in w], [c.to(dtype) for c in caches]


def heads(B, kh, shared):
    if shared:
        return torch.randperm(H)[:kh].to(torch.int32)
    return torch.stack([torch.randperm(H)[:kh] for _ in range(B)]).to(torch.int64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,shared", [(1, False), (3, False), (3, True)])
def test_decode_steps_match_masked_dense(triton_interp, close, dtype, B, shared):
    """Three decode steps in a row, new head sets each step; outputs and caches follow the reference."""
    w, (kc, vc) = make(B, dtype)
    k64, v64 = kc.double(), vc.double()      # float64 reference state
    kt, vt = kc.clone(), vc.clone()          # same-dtype torch state
    pos = torch.tensor(7)
    for step in range(3):
        x, res = torch.randn(B, D).to(dtype), torch.randn(B, D).to(dtype)
        hidx = heads(B, 4, shared)
        y = torch.full((B, D), float("nan"), dtype=dtype)
        sparse_attn_decode(x, *w, hidx, kc, vc, pos, res, out=y)
        ref = sparse_attn_decode_ref(x.double(), *[t.double() for t in w], hidx, k64, v64, pos,
                                     res.double())
        t_out = sparse_attn_decode_ref(x, *w, hidx, kt, vt, pos, res)
        close(y, ref, t_out)
        close(kc, k64, kt)
        close(vc, v64, vt)
        pos += 1


def test_all_heads_is_dense_attention_and_positions_per_sequence(triton_interp):
    B = 2
    w, (kc, vc) = make(B, torch.float32)
    x = torch.randn(B, D)
    pos = torch.tensor([3, 11], dtype=torch.int32)  # one position per sequence
    hidx = torch.arange(H, dtype=torch.int32)
    k0, v0 = kc.double().clone(), vc.double().clone()
    y = sparse_attn_decode(x, *w, hidx, kc, vc, pos)
    # dense decode written out by hand in float64
    wq, bq, wkv, bkv, wo_t, bo = [t.double() for t in w]
    q = (x.double() @ wq.T + bq).view(B, H, HD)
    kv = (x.double() @ wkv.T + bkv).view(B, 2, H, HD)
    for b in range(B):
        p = int(pos[b])
        k0[b, :, p], v0[b, :, p] = kv[b, 0], kv[b, 1]
        att = torch.softmax(torch.einsum("hd,hsd->hs", q[b], k0[b, :, :p + 1]), -1)
        o = torch.einsum("hs,hsd->hd", att, v0[b, :, :p + 1]).reshape(D)
        assert torch.allclose(y[b].double(), o @ wo_t + bo, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_s", [4, 8])
@pytest.mark.parametrize("chunk", [4, 8])
def test_context_split_into_chunks(triton_interp, close, chunk, block_s):
    # S = 20 positions in chunks of 4 or 8 (tiles of 4 or 8 slots): partial softmaxes combined by a
    # second kernel; chunks past pos unused
    B = 2
    w, (kc, vc) = make(B, torch.float16)
    x, hidx = torch.randn(B, D).half(), heads(B, 3, False)
    pos = torch.tensor([5, 17])
    k64, v64, kt, vt = kc.double(), vc.double(), kc.clone(), vc.clone()
    for step in range(2):
        y = torch.full((B, D), float("nan"), dtype=torch.float16)
        sparse_attn_decode(x, *w, hidx, kc, vc, pos, out=y, config={"CHUNK": chunk, "BLOCK_S": block_s})
        ref = sparse_attn_decode_ref(x.double(), *[t.double() for t in w], hidx, k64, v64, pos)
        close(y, ref, sparse_attn_decode_ref(x, *w, hidx, kt, vt, pos))
        pos += 1


def test_python_int_pos_and_no_heads(triton_interp):
    w, (kc, vc) = make(1, torch.float32)
    x, res = torch.randn(1, D), torch.randn(1, D)
    empty = torch.zeros(1, 0, dtype=torch.int32)
    y = sparse_attn_decode(x, *w, empty, kc, vc, 0, res)
    assert torch.allclose(y, w[5] + res)   # no heads selected: bias + residual
    assert torch.allclose(kc[0, :, 0], (x @ w[2].T + w[3])[0, :D].view(H, HD))


def test_bad_inputs_rejected():
    w, (kc, vc) = make(2, torch.float16)
    x = torch.randn(2, D).half()
    hidx = heads(2, 3, False)
    with pytest.raises(DejavuError, match="head_idx: indices out of range"):
        sparse_attn_decode(x, *w, torch.full_like(hidx, H), kc, vc, 0)
    with pytest.raises(DejavuError, match="pos: out of range"):
        sparse_attn_decode(x, *w, hidx, kc, vc, torch.tensor(S))
    with pytest.raises(DejavuError, match="pos: expected an int or an int32/int64 tensor"):
        sparse_attn_decode(x, *w, hidx, kc, vc, 1.5)
    with pytest.raises(DejavuError, match="k_cache: must be contiguous"):
        sparse_attn_decode(x, *w, hidx, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, 0)
    with pytest.raises(DejavuError, match="v_cache: expected shape"):
        sparse_attn_decode(x, *w, hidx, kc, vc[:, :, :-1].contiguous(), 0)
    with pytest.raises(DejavuError, match="wkv: expected shape"):
        sparse_attn_decode(x, w[0], w[1], w[2][:D].contiguous(), *w[3:], hidx, kc, vc, 0)
    with pytest.raises(DejavuError, match="head_idx: dtype torch.float32"):
        sparse_attn_decode(x, *w, hidx.float(), kc, vc, 0)

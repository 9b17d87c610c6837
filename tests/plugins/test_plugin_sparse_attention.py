"""sparse_attn_decode (Triton, interpreter) against the masked-dense float64 reference."""
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import layer_norm_ref, sparse_attn_decode, sparse_attn_decode_ref

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


@pytest.mark.parametrize("last,early", [(False, False), (True, False), (False, True)],
                         ids=["combine_kernel", "last_combine", "early_kv"])
@pytest.mark.parametrize("chunk", [4, 8])
def test_context_split_into_chunks(triton_interp, close, chunk, last, early):
    # S = 20 positions in chunks of 4 or 8: partial softmaxes combined (by a second kernel, or by
    # the last chunk program of each head to finish: LAST_COMBINE); chunks past pos unused;
    # EARLY_KV: the slots before pos loaded before the PDL wait, slot pos after it (8-slot tiles)
    from dejavu.plugins._common import counters
    B = 2
    w, (kc, vc) = make(B, torch.float16)
    x, hidx = torch.randn(B, D).half(), heads(B, 3, False)
    pos = torch.tensor([5, 17])
    k64, v64, kt, vt = kc.double(), vc.double(), kc.clone(), vc.clone()
    for step in range(2):  # the counters are back to 0 after a launch: a second one combines too
        y = torch.full((B, D), float("nan"), dtype=torch.float16)
        sparse_attn_decode(x, *w, hidx, kc, vc, pos, out=y,
                           config={"CHUNK": chunk, "BLOCK_S": 8 if early else 4, "LAST_COMBINE": last,
                                   "EARLY_KV": early})
        ref = sparse_attn_decode_ref(x.double(), *[t.double() for t in w], hidx, k64, v64, pos)
        close(y, ref, sparse_attn_decode_ref(x, *w, hidx, kt, vt, pos))
        assert not counters(x.device, B * 3).any()
        pos += 1


def test_last_combine_launches_one_kernel_fewer(triton_interp, monkeypatch):
    """LAST_COMBINE: no _attn_combine_kernel launch (with a mutation check: that kernel's launch
    is what the default path takes)."""
    import dejavu.plugins.sparse_attention as SA
    launched = []
    real_jit = SA.jit
    monkeypatch.setattr(SA, "jit", lambda fn, dev: launched.append(fn.__name__) or real_jit(fn, dev))
    w, (kc, vc) = make(1, torch.float32)
    x, hidx = torch.randn(1, D), heads(1, 2, False)
    for last in (False, True):
        launched.clear()
        sparse_attn_decode(x, *w, hidx, kc, vc, 9, config={"CHUNK": 4, "BLOCK_S": 4, "LAST_COMBINE": last})
        assert ("_attn_combine_kernel" in launched) != last


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("pos", [5, 17])
@pytest.mark.parametrize("ahead", [False, True], ids=["rows_in_loop", "rows_ahead"])
def test_combine_folded_into_projection(triton_interp, close, monkeypatch, dtype, pos, ahead):
    """Batch 1, FOLD_COMBINE: the output projection combines the chunks' partials itself (k-blocks
    of 64 rows span several 12-channel heads; chunks past pos weigh nothing): the float64
    reference's output, and the unfolded path's within rounding. rows_ahead: the projection's
    row indices loaded one K block ahead (ROWS_AHEAD), 16-row blocks in one split: 3 iterations
    whose blocks straddle heads."""
    if ahead:
        SM = sys.modules["dejavu.plugins.sparse_mlp"]
        monkeypatch.setitem(SM.FC2_CONFIG, "proj1",
                            {**SM.FC2_CONFIG["proj1"], "ROWS_AHEAD": True, "BLOCK_K": 16, "SPLIT": 1})
    w, (kc, vc) = make(1, dtype)
    x, res, hidx = torch.randn(1, D).to(dtype), torch.randn(1, D).to(dtype), heads(1, 4, False)
    k64, v64, kt, vt = kc.double(), vc.double(), kc.clone(), vc.clone()
    ys = []
    for fold in (True, False):
        k, v = kc.clone(), vc.clone()
        y = torch.full((1, D), float("nan"), dtype=dtype)
        sparse_attn_decode(x, *w, hidx, k, v, torch.tensor(pos), res, out=y,
                           config={"CHUNK": 4, "BLOCK_S": 4, "FOLD_COMBINE": fold})
        ys.append(y)
    ref = sparse_attn_decode_ref(x.double(), *[t.double() for t in w], hidx, k64, v64, pos, res.double())
    close(ys[0], ref, sparse_attn_decode_ref(x, *w, hidx, kt, vt, pos, res))
    assert torch.allclose(ys[0].float(), ys[1].float(), rtol=1e-2 if dtype == torch.float16 else 1e-5,
                          atol=1e-2 if dtype == torch.float16 else 1e-5)


def test_fold_only_at_batch1_dot_route():
    """FOLD_COMBINE applies at batch 1 only; gather_gemv_t rejects combine= elsewhere."""
    from dejavu.plugins.sparse_mlp import gather_gemv_t
    w, _ = make(2, torch.float32)
    h = torch.randn(2, 4 * HD)
    with pytest.raises(DejavuError, match="combine= needs batch 1"):
        gather_gemv_t(h, w[4], w[5], heads(2, 4, False), None, torch.empty(2, D),
                      group=HD, combine=(h, h, 2))


# batch 1 with S_max <= PROJ_MAX_S: attention and output projection in one launch. D = 72 in
# column tiles of 16: 4 heads x 5 tiles, 3 tiles per group (PROJ_TARGET 9) -> 2 groups, the
# second with a masked tile; BLOCK_S 4 -> several position blocks with a masked tail.
PROJ = {"PROJ_MAX_S": 64, "PROJ_BLOCK_S": 4, "PROJ_BLOCK_D": 16, "PROJ_TARGET": 9}
SA, SM = sys.modules["dejavu.plugins.sparse_attention"], sys.modules["dejavu.plugins.sparse_mlp"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dot", [True, False], ids=["dot", "sum"])
@pytest.mark.parametrize("shared", [False, True], ids=["one-row", "shared"])
def test_attention_and_projection_in_one_launch(launched, triton_interp, close, dtype, dot, shared):
    """Three steps (positions 1, 9, 19): _attn_proj_kernel and the reduction over heads (no
    chunked attention, combine or projection kernel); y, the MLP's LayerNorm of y through the
    one-launch reduction, and the caches against float64; y against the chunked path's."""
    w, (kc, vc) = make(1, dtype)
    lnw = ((1 + 0.2 * torch.randn(D)).to(dtype), (0.2 * torch.randn(D)).to(dtype))
    k64, v64, kt, vt = kc.double(), vc.double(), kc.clone(), vc.clone()
    names = launched(SA, SM)
    for pos in (1, 9, 19):
        x, res, hidx = torch.randn(1, D).to(dtype), torch.randn(1, D).to(dtype), heads(1, 4, shared)
        kc2, vc2 = kc.clone(), vc.clone()
        y, ln_out = [torch.full((1, D), float("nan"), dtype=dtype) for _ in range(2)]
        names.clear()
        sparse_attn_decode(x, *w, hidx, kc, vc, torch.tensor(pos), res, out=y, ln=lnw, ln_out=ln_out,
                           config={**PROJ, "PROJ_DOT": dot})
        assert "_attn_proj_kernel" in names and "_split_reduce_ln_kernel" in names, names
        assert not {"_attn_decode_kernel", "_attn_combine_kernel", "_gather_dot_t_kernel"} & set(names), names
        ref = sparse_attn_decode_ref(x.double(), *[t.double() for t in w], hidx, k64, v64, pos, res.double())
        close(y, ref, sparse_attn_decode_ref(x, *w, hidx, kt, vt, pos, res))
        # the LayerNorm of the stored (rounded) y, as the layer_norm kernel would compute it (bf16:
        # rounded to nearest as on the GPU, _common._patch_interpreter_bf16)
        ln64 = torch.nn.functional.layer_norm(y.double(), (D,), *[t.double() for t in lnw], 1e-5)
        close(ln_out, ln64, layer_norm_ref(y, *lnw))
        close(kc, k64, kt)
        close(vc, v64, vt)
        chunked = sparse_attn_decode(x, *w, hidx, kc2, vc2, torch.tensor(pos), res)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        assert torch.allclose(y.float(), chunked.float(), rtol=tol, atol=tol)


def test_one_launch_only_for_short_contexts_at_batch1(launched, triton_interp):
    """S_max above PROJ_MAX_S, or batch 2: the chunked attention and the projection kernel."""
    names = launched(SA, SM)
    for B, max_s in ((1, S - 1), (2, 64), (1, S)):
        w, (kc, vc) = make(B, torch.float32)
        names.clear()
        sparse_attn_decode(torch.randn(B, D), *w, heads(B, 2, True), kc, vc, 7,
                           config={**PROJ, "PROJ_MAX_S": max_s})
        assert ("_attn_proj_kernel" in names) == (B == 1 and max_s >= S), (B, max_s, names)
        assert ("_attn_decode_kernel" in names) != ("_attn_proj_kernel" in names), names

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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,shared", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("fused", [False, True], ids=["reduce-kernel", "fused-finish"])
def test_output_projection_with_layer_norm(triton_interp, close, monkeypatch, dtype, B, shared, fused):
    # ln=: y and LayerNorm(y) (the next LayerNorm, ln_mlp): from the reduction + layer_norm
    # kernels (default) or from the output projection's own launch (sparse_mlp.FUSED_FINISH)
    monkeypatch.setattr(sys.modules["dejavu.plugins.sparse_mlp"], "FUSED_FINISH", fused)
    w, (kc, vc) = make(B, dtype)
    x, res, hidx = torch.randn(B, D).to(dtype), torch.randn(B, D).to(dtype), heads(B, 4, shared)
    lw, lb = (1 + 0.2 * torch.randn(D)).to(dtype), (0.2 * torch.randn(D)).to(dtype)
    y = torch.full((B, D), float("nan"), dtype=dtype)
    y_ln = torch.full((B, D), float("nan"), dtype=dtype)
    k64, v64, kt, vt = kc.double(), vc.double(), kc.clone(), vc.clone()
    pos = torch.tensor([9, 4, 13][:B])
    got = sparse_attn_decode(x, *w, hidx, kc, vc, pos, res, out=y, ln=(lw, lb), ln_out=y_ln)
    assert got[0] is y and got[1] is y_ln
    ref, ref_ln = sparse_attn_decode_ref(x.double(), *[t.double() for t in w], hidx, k64, v64, pos,
                                         res.double(), ln=(lw.double(), lb.double()))
    t_out, _ = sparse_attn_decode_ref(x, *w, hidx, kt, vt, pos, res, ln=(lw, lb))
    close(y, ref, t_out)
    ln64 = torch.nn.functional.layer_norm(y.double(), (D,), lw.double(), lb.double(), 1e-5)
    close(y_ln, ln64, layer_norm_ref(y, lw, lb))


def test_layer_norm_without_heads_and_bad_weights(triton_interp):
    w, (kc, vc) = make(1, torch.float32)
    x, res = torch.randn(1, D), torch.randn(1, D)
    lw, lb = 1 + 0.2 * torch.randn(D), 0.2 * torch.randn(D)
    empty = torch.zeros(1, 0, dtype=torch.int32)
    y, y_ln = sparse_attn_decode(x, *w, empty, kc, vc, 0, res, ln=(lw, lb))
    assert torch.allclose(y, w[5] + res)
    assert torch.allclose(y_ln, torch.nn.functional.layer_norm(y, (D,), lw, lb, 1e-5), atol=1e-5)
    with pytest.raises(DejavuError, match="ln weight: expected dtype"):
        sparse_attn_decode(x, *w, empty, kc, vc, 0, res, ln=(lw.half(), lb))
    with pytest.raises(DejavuError, match="ln bias: expected shape"):
        sparse_attn_decode(x, *w, empty, kc, vc, 0, res, ln=(lw, lb[None]))

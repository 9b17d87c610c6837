"""sparse_attn_decode_deferred and refresh_heads (Triton, interpreter) against float64 references."""
import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins.deferred_kv import recompute_kv_ref, sparse_attn_decode_deferred, sparse_attn_decode_deferred_ref
from dejavu.plugins.qkv_partial import hist_slots
from dejavu.plugins.sparse_attention import sparse_attn_decode_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
H, HD, S = 5, 12, 21  # D = 60, 2*hd = 24: not block multiples (BLOCK_R 16, BLOCK_D 128, BLOCK_P 16)
D = H * HD


def weights(dtype):
    w = [torch.randn(D, D) / D ** 0.5, torch.randn(D) / 4, torch.randn(2 * D, D) / D ** 0.5,
         torch.randn(2 * D) / 4, torch.randn(D, D) / D ** 0.5, torch.randn(D) / 4]
    return [t.to(dtype) for t in w]


def nan_caches(B, dtype, s=S):
    return [torch.full((B, H, s, HD), float("nan"), dtype=dtype) for _ in range(2)]


def heads(B, kh, shared):
    if shared:
        return torch.randperm(H)[:kh].to(torch.int32)
    return torch.stack([torch.randperm(H)[:kh] for _ in range(B)]).to(torch.int64)


def expected_written(B, hidx, valid_len, pos):
    """bool [B, H, S]: slots the call must fill (selected heads, min(valid_len, pos)..pos)."""
    hs = hidx.long().expand(B, -1) if hidx.dim() == 1 else hidx.long()
    p = pos.long().reshape(-1).expand(B)
    w = torch.zeros(B, H, S, dtype=torch.bool)
    for b in range(B):
        for h in hs[b].tolist():
            lo = min(int(valid_len[b, h]), int(p[b]))
            w[b, h, lo:int(p[b]) + 1] = True
    return w



def spy_launches(monkeypatch, record):
    """Route every plugin launch through a spy that records (kernel name, grid, launch kwargs) first."""
    from dejavu.plugins._common import jit as real_jit

    class Spy:
        def __init__(self, fn, dev):
            self.fn, self.k = fn, real_jit(fn, dev)

        def __getitem__(self, grid):
            def launch(*a, **kw):
                record(self.fn.__name__, tuple(grid), kw)
                return self.k[grid](*a, **kw)
            return launch

    import dejavu.plugins.qkv_partial as QP
    monkeypatch.setattr(QP, "jit", Spy)  # the Q/K/V launches

@pytest.mark.parametrize("dtype,config", [(torch.float16, None), (torch.float32, None),
                                          # D = 60 in slices of 16 (masked tail), rows in 16s
                                          (torch.float16, {"qkv": {"BLOCK_D": 16, "SPLIT": 3, "BLOCK_R": 16,
                                                                   "FINISH_R": 16},
                                                           "attn": {"CHUNK": 4}}),
                                          # shared sets: one missing slot per dot row block, the
                                          # rest through the finishing slow path
                                          (torch.float32, {"qkv": {"SHARED_MIN_BATCH": 2, "SHARED_P": 2, "BLOCK_D": 32}}),
                                          # a tile wider than the chunk
                                          (torch.float16, {"qkv": {"BLOCK_D": 16, "SPLIT": 3},
                                                           "attn": {"CHUNK": 4, "BLOCK_S": 8}})],
                         ids=["fp16", "fp32", "fp16-split-D", "fp32-shared-P2", "fp16-wide-tile"])
@pytest.mark.parametrize("shared", [False, True])
def test_deferred_decode_equals_full_kv_decode(triton_interp, close, dtype, config, shared):
    """Steps with changing head sets: deferred output == masked dense with K/V of all heads."""
    B = 3
    w = weights(dtype)
    w64 = [t.double() for t in w]
    # a history of earlier inputs (slots before the first pos, and skipped ones), and the full
    # policy's caches holding their K/V for every head
    x0 = torch.randn(B, S, D).to(dtype)
    full_k, full_v = (x0.double() @ w64[2].T + w64[3]).view(B, S, 2, H, HD).permute(2, 0, 3, 1, 4).contiguous()
    kc, vc = nan_caches(B, dtype)  # deferred (kernel): unselected slots stay NaN
    kt, vt = nan_caches(B, dtype)  # deferred (reference in dtype)
    k64, v64 = nan_caches(B, torch.float64)
    hist, hist_t, hist64 = x0.clone(), x0.clone(), x0.double()
    vl, vl_t, vl64 = [torch.zeros(B, H, dtype=torch.int32) for _ in range(3)]
    pos = torch.tensor([0, 3, 5])
    for step in range(6):
        x, res = torch.randn(B, D).to(dtype), torch.randn(B, D).to(dtype)
        hidx = heads(B, 2, shared)
        y = torch.full((B, D), float("nan"), dtype=dtype)
        sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, out=y, config=config)
        ref = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, hist64, vl64, pos, res.double())
        tor = sparse_attn_decode_deferred_ref(x, *w, hidx, kt, vt, hist_t, vl_t, pos, res)
        full = sparse_attn_decode_ref(x.double(), *w64, hidx, full_k, full_v, pos, res.double())
        assert torch.allclose(ref, full, atol=1e-10, rtol=1e-10)  # the policy changes nothing
        close(y, ref, tor)
        assert torch.equal(vl, vl64)
        written = torch.isfinite(kc)
        assert torch.equal(written, torch.isfinite(k64))
        assert torch.allclose(k64[written], full_k[written]) and torch.allclose(v64[written], full_v[written])
        pos = pos + torch.tensor([1, 2, 1])  # sequence 1 skips slots: their K/V come from the history


def test_deferred_no_heads_and_int_pos(triton_interp):
    w = weights(torch.float32)
    kc, vc = nan_caches(1, torch.float32)
    hist, vl = torch.zeros(1, S, D), torch.zeros(1, H, dtype=torch.int32)
    x, res = torch.randn(1, D), torch.randn(1, D)
    y = sparse_attn_decode_deferred(x, *w, torch.zeros(1, 0, dtype=torch.int32), kc, vc, hist, vl, 2, res)
    assert torch.allclose(y, w[5] + res)
    assert torch.equal(hist[0, 2], x[0]) and torch.isnan(kc).all() and (vl == 0).all()


def test_bad_inputs_rejected():
    B = 2
    w = weights(torch.float16)
    x_hist, x = torch.randn(B, S, D).half(), torch.randn(B, D).half()
    kc, vc = nan_caches(B, torch.float16)
    vl = torch.zeros(B, H, dtype=torch.int32)
    hidx = heads(B, 2, False)

    def call(*, xh=x_hist, h=hidx, k=kc, v=vl, pos=3, ws=w, config=None):
        sparse_attn_decode_deferred(x, *ws, h, k, vc, xh, v, pos, config=config)

    with pytest.raises(DejavuError, match="head_idx: indices out of range"):
        call(h=torch.full_like(hidx, H))
    with pytest.raises(DejavuError, match="pos: out of range"):
        call(pos=torch.tensor(S))
    with pytest.raises(DejavuError, match="valid_len: expected dtype torch.int32"):
        call(v=vl.long())
    with pytest.raises(DejavuError, match="valid_len: expected shape"):
        call(v=vl[:, :-1].contiguous())
    for sp in (3, 24):  # the shared-set kernel's tl.dot has next_pow2(B) * SHARED_P rows
        with pytest.raises(DejavuError, match="SHARED_P must be a power of 2"):
            call(h=hidx[0].contiguous(), config={"qkv": {"SHARED_P": sp, "BLOCK_P": 32}})
    with pytest.raises(DejavuError, match="x_hist: must be contiguous"):
        call(xh=x_hist.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(DejavuError, match="x_hist: expected shape"):
        call(xh=x_hist[:, :-1].contiguous())
    with pytest.raises(DejavuError, match="k_cache: shape"):
        call(k=kc[:1].contiguous())
    with pytest.raises(DejavuError, match="wkv: expected dtype"):
        call(ws=[*w[:2], w[2].float(), *w[3:]])


def test_shared_set_kernel_equals_per_sequence_kernel(triton_interp):
    """Batch 3 with one head set: the shared-set Q/K/V kernel (weights read once for the batch)
    and the per-sequence one (forced by SHARED_MIN_BATCH) write the same caches and outputs."""
    B, dtype = 3, torch.float32
    w = weights(dtype)
    x_hist, x, res = torch.randn(B, S, D), torch.randn(B, D), torch.randn(B, D)
    vl0 = torch.tensor([[0, 9, 13, 20, 2], [1, 0, 2, 2, 0], [5, 5, 5, 5, 5]], dtype=torch.int32)
    pos, hidx = torch.tensor([20, 17, 6]), torch.tensor([0, 3, 4], dtype=torch.int32)
    outs = []
    for cfg in ({"qkv": {"SHARED_MIN_BATCH": 2}},):
        kc, vc = nan_caches(B, dtype)
        vl, hist = vl0.clone(), x_hist.clone()
        y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, config=cfg)
        outs.append((y, kc, vc, vl, hist))
    cfg = {"qkv": {"SHARED_MIN_BATCH": None}}
    kc, vc = nan_caches(B, dtype)
    vl, hist = vl0.clone(), x_hist.clone()
    y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, config=cfg)
    for out in outs:  # shared-set kernel against per-sequence
        for a, b in zip(out, (y, kc, vc, vl, hist)):
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split,sp,bp", [(None, 16, 16), (1, 16, 16), (3, 16, 16), (None, 32, 32), (3, 32, 32)])
def test_batch1_shared_kernel_equals_per_sequence_kernel(triton_interp, split, sp, bp):
    """Batch 1 with its [1, Kh] set through the shared-set kernel (SHARED_MIN_BATCH 1, SHARED_P
    16: x at pos and 15 missing slots in one tl.dot; more go through the finishing slow path;
    SHARED_P 32 with BLOCK_P 32: 31 slots, no slow path at these gaps) writes the same
    caches, valid_len, history and output as the per-sequence kernel."""
    dtype = torch.float32
    w = weights(dtype)
    x_hist, x, res = torch.randn(1, S, D), torch.randn(1, D), torch.randn(1, D)
    vl0 = torch.tensor([[0, 9, 20, 20, 2]], dtype=torch.int32)  # gaps 20 (slow path), 11, 0, 0, 18
    pos, hidx = torch.tensor([20]), torch.tensor([[0, 1, 3, 4]], dtype=torch.int32)
    outs = []
    for smin in (1, None):
        kc, vc = nan_caches(1, dtype)
        vl, hist = vl0.clone(), x_hist.clone()
        cfg = {"qkv": {"SHARED_MIN_BATCH": smin, "SHARED_P": sp, "BLOCK_P": bp, "BLOCK_D": 16, "SPLIT": split}}
        y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, config=cfg)
        outs.append((y, kc, vc, vl, hist))
    assert torch.isfinite(outs[0][1][0, 0, :21]).all() and torch.isnan(outs[0][1][0, 2]).all()
    for a, b in zip(*outs):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 2])
def test_slow_path_shared_out_over_programs(triton_interp, B):
    """SLOW_Z programs per row block share the finishing kernel's slow path (SHARED_P 2: one missing
    slot from the partials, the rest in whole-D chunks of BLOCK_P 16; gaps up to 20 = two chunks):
    for SLOW_Z 1, 2, 3 and auto the output, caches and valid_len equal the float64 reference's (caches
    start random: the slots below valid_len stand for earlier steps' K/V)."""
    dtype = torch.float32
    w = weights(dtype)
    x_hist, x, res = torch.randn(B, S, D), torch.randn(B, D), torch.randn(B, D)
    kc0, vc0 = torch.randn(B, H, S, HD), torch.randn(B, H, S, HD)
    vl0 = torch.tensor([[0, 9, 20, 20, 2], [3, 0, 1, 20, 0]][:B], dtype=torch.int32)  # gaps 20, 11, 0, 18
    pos, hidx = torch.tensor([20, 19][:B]), torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    hidx = hidx if B > 1 else hidx[None]
    w64 = [t.double() for t in w]
    k64, v64, vl64 = kc0.double(), vc0.double(), vl0.clone()
    ref = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, x_hist.double(), vl64, pos,
                                          res.double())
    for z in (1, 2, 3, None):  # None: 640 // 12 row blocks -> 8
        kc, vc, vl, hist = kc0.clone(), vc0.clone(), vl0.clone(), x_hist.clone()
        cfg = {"qkv": {"SHARED_MIN_BATCH": 1, "SHARED_P": 2, "BLOCK_D": 16, "SLOW_Z": z}}
        y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, config=cfg)
        assert torch.equal(vl, vl64)
        for got, want in ((y, ref), (kc, k64), (vc, v64)):
            assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), z


def test_slow_z_fills_one_wave():
    """SLOW_Z None: programs per row block so that ~SLOW_TARGET finishing programs run (1 to 8)."""
    from dejavu.plugins.qkv_finish import slow_z
    from dejavu.plugins.settings import DEFAULT, table
    cfg = table(DEFAULT.qkv_b1, {"SLOW_Z": None, "SLOW_TARGET": 640})
    # OPT-30B, batch 1: 6 heads (d0.1) x 3 segments x 8 blocks of 16 rows; 17 heads (d0.3); 3 heads
    assert [slow_z(cfg, n) for n in (144, 408, 72, 30, 700)] == [4, 1, 8, 8, 1]
    assert slow_z({**cfg, "SLOW_Z": 3}, 408) == 3 and slow_z({"SLOW_Z": 1}, 5) == 1


def _same(a, b):
    """Equal, NaN where the other is NaN (unwritten slots)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("split", [1, 4], ids=["split1", "split4"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-seq", "shared"])
def test_split_d_finish_equals_reference(triton_interp, close, shared, split):
    """The finishing kernel sums the slices' partials (SPLIT 4, two slices per load; SPLIT 1), for
    Q/K/V, per-sequence and shared sets, with gaps
    of 0 (valid_len >= pos), 1..16 (partials) and 17..20 (slow path): the float64 reference's values;
    a second call from the same state gives the same bits."""
    B, dtype = 3, torch.float16
    w = weights(dtype)
    x_hist, x, res = torch.randn(B, S, D).to(dtype), torch.randn(B, D).to(dtype), torch.randn(B, D).to(dtype)
    vl0 = torch.tensor([[0, 9, 13, 20, 2], [1, 0, 2, 17, 20], [5, 6, 2, 0, 3]], dtype=torch.int32)
    pos = torch.tensor([20, 17, 6])
    hidx = torch.tensor([0, 3, 4], dtype=torch.int32) if shared else \
        torch.tensor([[0, 3, 4], [1, 3, 4], [2, 3, 4]], dtype=torch.int32)
    # D = 60 in 4 slices of 16 (masked tail); hd 12 rows in one block of 16
    qkv = {"BLOCK_D": 16, "BLOCK_R": 16, "FINISH_R": 16, "SPLIT": split, "FINISH_S": 2,  # 2 loads of 2 splits
           "SHARED_MIN_BATCH": 2 if shared else None, "SHARED_P": 4}

    # the caches hold the K/V of the slots below valid_len (attention reads them), NaN elsewhere
    kv64 = (x_hist.double() @ w[2].double().T + w[3].double()).view(B, S, 2, H, HD).permute(2, 0, 3, 1, 4)
    filled = (torch.arange(S)[None, None, :] < vl0[:, :, None])[..., None]  # [B, H, S, 1]

    def caches(dt):
        return [torch.where(filled, kv64[c], float("nan")).to(dt) for c in (0, 1)]

    def run():
        kc, vc = caches(dtype)
        vl, hist = vl0.clone(), x_hist.clone()
        y = torch.full((B, D), float("nan"), dtype=dtype)
        sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, out=y, config={"qkv": qkv})
        return y, kc, vc, vl, hist

    first = run()
    for a, b in zip(first, run()):
        assert _same(a, b)
    y, kc, vc, vl, hist = first
    k64, v64 = caches(torch.float64)
    kt, vt = caches(dtype)
    w64 = [t.double() for t in w]
    ref = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, x_hist.double(), vl0.clone(), pos,
                                          res.double())
    tor = sparse_attn_decode_deferred_ref(x, *w, hidx, kt, vt, x_hist.clone(), vl0.clone(), pos, res)
    close(y, ref, tor)
    mask = expected_written(B, hidx, vl0, pos)
    # slots before pos to fill per head (+ pos itself): [20, 0, 18], [17 or 16, 0, 0 (rewound)], [4 or 1, 6, 3]
    assert mask.sum() == (21 + 1 + 19) + (17 + 1 + 1) + (2 + 7 + 4) if shared else \
        (21 + 1 + 19) + (18 + 1 + 1) + (5 + 7 + 4)
    fin = mask | filled[..., 0]
    for got, ref64, tor in ((kc, k64, kt), (vc, v64, vt)):
        assert torch.equal(torch.isfinite(got).all(-1), fin) and torch.isnan(got[~fin]).all()
        close(got[mask], ref64[mask], tor[mask])


def check_step(y, x, ln, w64, hidx, state64, vl, p, res):
    """One batch-1 deferred step's output y (and valid_len vl) against the float64 reference, whose
    state (caches, history, valid_len) state64 it advances; ln: the input's LayerNorm (a PendingLN
    input), None: x is the normalised input."""
    x64 = torch.nn.functional.layer_norm(x.double(), (D,), *[t.double() for t in ln]) if ln else x.double()
    ref = sparse_attn_decode_deferred_ref(x64, *w64, hidx, *state64, torch.tensor([p]), res.double())
    assert torch.equal(vl, state64[3])
    tol = 2e-2 if y.dtype == torch.float16 else 1e-4
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("pending", [False, True], ids=["x_ln", "pending-ln"])
@pytest.mark.parametrize("slow", [{}, {"FOLD_SLOW_Z": 2, "FOLD_SLOW_R": 8}, {"FOLD_SLOW_Z": 2}],
                         ids=["z1r16", "z2r8", "z2r16"])
def test_folded_finish_equals_finishing_kernel(triton_interp, launched, close, dtype, pending, slow):
    """Batch 1 with the Q/K/V finishing kernel folded into attention (FOLD_FINISH): over four steps
    with gaps of 0, 1..3 (the partials, SHARED_P 4) and up to 41 (the partial kernel's first
    z-slices: several 16-slot chunks, over 1 or 2 chunk sets x 1 or 2 row sub-blocks), in chunks
    of 8 positions (fresh slots spanning two chunks; a chunk holding only pos), the caches,
    valid_len and history equal the finishing kernel's bit for bit, the output is close to the
    float64 reference, and no finishing kernel runs (and one does with FOLD_FINISH off)."""
    from dejavu.plugins.layer_norm import pending_ln
    S2 = 48
    w = weights(dtype)
    w64 = [t.double() for t in w]
    ln = (torch.rand(D) + 0.5).to(dtype), (torch.randn(D) / 4).to(dtype)
    x_hist0 = torch.randn(1, S2, D).to(dtype)
    kc0, vc0 = torch.randn(1, H, S2, HD).to(dtype), torch.randn(1, H, S2, HD).to(dtype)
    vl0 = torch.tensor([[0, 29, 40, 40, 12]], dtype=torch.int32)
    steps = [(40, [0, 1, 3, 4]), (41, [2, 0]), (43, [0, 1]), (44, [4, 3, 2])]  # pos, heads
    inputs = [(torch.randn(1, D).to(dtype), torch.randn(1, D).to(dtype)) for _ in steps]
    # (SHARED_P_UNFOLDED None: the unfolded path's partials hold the slots the folded one's do)
    qkv = {"BLOCK_D": 16, "BLOCK_R": 16, "SHARED_P": 4, "SHARED_P_UNFOLDED": None, "FOLD_SLOW_Z": 1, **slow}
    attn = {"CHUNK": 8, "BLOCK_S": 8}
    runs = {}
    for fold in (True, False):
        kc, vc, vl, hist = kc0.clone(), vc0.clone(), vl0.clone(), x_hist0.clone()
        k64, v64, vl64, h64 = kc0.double(), vc0.double(), vl0.clone(), x_hist0.double()
        ys = []
        for (p, hs), (x, res) in zip(steps, inputs):
            names = launched()
            x_in = pending_ln(x, *ln, width=32) if pending else x
            hidx = torch.tensor([hs], dtype=torch.int32)
            y = sparse_attn_decode_deferred(x_in, *w, hidx, kc, vc, hist, vl, torch.tensor([p]), res,
                                            config={"qkv": {**qkv, "FOLD_FINISH": fold}, "attn": attn})
            assert ("_qkv_finish_kernel" in names) != fold, names
            assert "_attn_combine_kernel" in names and "_layer_norm_kernel" not in names, names
            check_step(y, x, ln if pending else None, w64, hidx, (k64, v64, h64, vl64), vl, p, res)
            ys.append(y)
        runs[fold] = (ys, kc, vc, vl, hist)
    (ys_f, *state_f), (ys_u, *state_u) = runs[True], runs[False]
    for a, b in zip(state_f, state_u):
        if slow.get("FOLD_SLOW_R", 16) == qkv["BLOCK_R"]:
            assert torch.equal(a, b)
        else:  # slow sub-blocks of another height: the interpreter's dots (numpy's BLAS) may sum the
            # same products in another order (1 fp32 ulp with numpy 2.4.6; equal with the numpy CI had
            # in 2026-12-03); the float64 bound above holds either way
            assert torch.allclose(a, b, rtol=2 ** -10 if dtype == torch.float16 else 1e-6, atol=1e-6)
    for a, b in zip(ys_f, ys_u):  # attention sums the fresh slots in another order: fp32 rounding only
        assert torch.allclose(a.double(), b.double(), rtol=1e-2 if dtype == torch.float16 else 1e-5, atol=1e-3)
    # every slot of the selected heads up to their last pos is filled (the slow path ran)
    assert runs[True][3][0].tolist() == [44, 44, 45, 45, 45]


def test_folded_finish_needs_a_combine_launch():
    """FOLD_FINISH applies only where the attention kernel has a combine launch after it (which
    commits valid_len): not for one chunk or a tile narrower than the chunk; attend_heads refuses the
    partials otherwise."""
    from dejavu.plugins.sparse_attention import QKVPartials, attend_heads, folds_finish
    from dejavu.plugins.settings import DEFAULT
    assert DEFAULT.qkv_b1.FOLD_FINISH == "wide"  # batch 1 default (2026-12-03)
    assert folds_finish(1, 64) and not folds_finish(2, 64) and not folds_finish(1, 32)
    assert not folds_finish(1, 64, {"BLOCK_S": 16})
    q = torch.zeros(1, HD)
    parts = QKVPartials(q, q, 1, 3, 16, q, q)
    kc = torch.zeros(1, H, 64, HD)
    hidx, vl = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, H, dtype=torch.int32)
    with pytest.raises(DejavuError, match="Q/K/V partials need batch 1"):  # no commit
        attend_heads(q, hidx, kc, kc, torch.tensor([3]), 1, finish=parts)
    with pytest.raises(DejavuError, match="Q/K/V partials need batch 1"):  # one chunk: no combine launch
        attend_heads(q, hidx, kc[:, :, :32], kc[:, :, :32], torch.tensor([3]), 1, commit=(vl, None, q),
                     finish=parts)


@pytest.mark.parametrize("mode,max_split,folds", [(True, 3, True), (True, 4, True), ("wide", 3, True),
                                                   ("wide", 4, False)])
def test_folded_finish_caps_the_slices(triton_interp, launched, mode, max_split, folds):
    """4 slices of D: FOLD_FINISH True folds, with more slices than FOLD_MAX_SPLIT (the attention kernel
    unrolls their loads) the partial kernel takes FOLD_MAX_SPLIT slices; "wide" (batch 1's default)
    folds only past FOLD_MAX_SPLIT: no finishing kernel where it folds, the same caches as FOLD_FINISH
    off, the output within rounding."""
    w = weights(torch.float32)
    x, res = torch.randn(1, D), torch.randn(1, D)
    x_hist, kc0 = torch.randn(1, 40, D), torch.randn(1, H, 40, HD)
    outs = []
    for fold in (True, False):
        kc, vc, hist = kc0.clone(), kc0.clone(), x_hist.clone()
        vl = torch.tensor([[0, 30, 39, 2, 5]], dtype=torch.int32)
        names = launched()
        y = sparse_attn_decode_deferred(x, *w, torch.tensor([[1, 3]], dtype=torch.int32), kc, vc, hist, vl,
                                        torch.tensor([39]), res,
                                        config={"qkv": {"FOLD_FINISH": mode if fold else False, "SPLIT": 4,
                                                        "FOLD_MAX_SPLIT": max_split, "BLOCK_D": 16}})
        assert ("_qkv_finish_kernel" in names) != (fold and folds), names
        assert names.count("_qkv_partial_shared_kernel") == 1, names
        outs.append((y, kc, vc, vl, hist))
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5) if folds else torch.equal(a, b)
    y_f, y_u = outs[0][0], outs[1][0]
    assert torch.allclose(y_f, y_u, rtol=1e-5, atol=1e-5) if folds else torch.equal(y_f, y_u)


# ---- the slots past the Q/K/V partials (a head unselected for long); a longer cache so gaps pass the
# partials' 15 slots
S2 = 48


def test_hist_slots_follow_the_qkv_route():
    # batch 1: the shared-set kernel with SHARED_P - 1 = 15; batches: BLOCK_P 16 per sequence, a
    # shared set SHARED_P - 1 = 3 (settings.qkv); a config overrides
    assert hist_slots(1, torch.zeros(1, 2, dtype=torch.int32)) == 15
    assert hist_slots(3, torch.zeros(3, 2, dtype=torch.int32)) == 16
    assert hist_slots(3, torch.zeros(2, dtype=torch.int32)) == 3
    assert hist_slots(1, torch.zeros(1, 2, dtype=torch.int32), {"SHARED_P": 2}) == 1


def test_unfolded_route_takes_shared_p_unfolded(triton_interp, monkeypatch):
    """Batch 1's default config: the partial kernel's P is SHARED_P_UNFOLDED (32) on the unfolded route
    and SHARED_P (16) with refresh heads in the launch, or folded into attention."""
    from dejavu.plugins.refresh_heads import refresh_heads
    seen = []
    spy_launches(monkeypatch, lambda name, grid, kw: seen.append((kw["P"], kw["BLOCK_P"]))
                 if name == "_qkv_partial_shared_kernel" else None)
    w = weights(torch.float32)
    hidx = torch.tensor([[1, 3]], dtype=torch.int32)
    vl = torch.tensor([[0, 20, 40, 2, 12]], dtype=torch.int32)
    cases = [({"qkv": {"BLOCK_D": 16, "FOLD_FINISH": False}}, {}, (32, 32)),
             ({"qkv": {"BLOCK_D": 16, "FOLD_FINISH": False}}, {"refresh": "pick"}, (16, 16)),
             ({"qkv": {"BLOCK_D": 16, "FOLD_FINISH": True}, "attn": {"CHUNK": 8, "BLOCK_S": 8}}, {}, (16, 16))]
    for cfg, kw, want in cases:
        seen.clear()
        if kw.get("refresh") == "pick":
            kw = {"refresh": refresh_heads(hidx, vl, torch.tensor([40]), 2, lag=1)}
        kc, vc = torch.randn(1, H, 48, HD), torch.randn(1, H, 48, HD)
        sparse_attn_decode_deferred(torch.randn(1, D), *w, hidx, kc, vc, torch.randn(1, 48, D), vl.clone(),
                                    torch.tensor([40]), torch.randn(1, D), config=cfg, **kw)
        assert seen == [want], (cfg, kw, seen)


# ---------------------------------------------------------------------------------------
# refresh heads (batch 1): K/V of heads that do not attend, so none falls past the partials

def _refresh_expected(hidx, vl, pos, r, lag, max_lag=None):
    sel = set(hidx.reshape(-1).tolist())
    hi = 1 << 30 if max_lag is None else max_lag
    lags = [(p, h) for h in range(vl.shape[1]) for p in [pos - min(int(vl[0, h]), pos)]
            if h not in sel and lag <= p <= hi]
    order = [h for _, h in sorted(lags, key=lambda t: (-t[0], t[1]))][:r]
    return order + [-1] * (r - len(order))


@pytest.mark.parametrize("r,lag,max_lag", [(1, None, None), (3, None, None), (4, 2, None), (8, 1, None),
                                           (4, 3, 12), (6, 15, 15)])
def test_refresh_heads_picks_the_most_lagging_unselected(triton_interp, r, lag, max_lag):
    """The r most lagging heads outside the head set with `lag` (default hist_slots) to `max_lag`
    missing slots, ties to the lower head, -1 after the last: kernel, reference and a plain sort."""
    from dejavu.plugins.refresh_heads import refresh_heads, refresh_heads_ref
    g = torch.Generator().manual_seed(r * 7 + (lag or 0))
    for trial in range(6):
        Hh = [5, 12, 40][trial % 3]
        pos = 30 + trial
        vl = torch.randint(0, 40, (1, Hh), generator=g, dtype=torch.int32)
        vl[0, :2] = vl[0, 2]  # ties
        hidx = torch.randperm(Hh, generator=g)[:max(1, Hh // 4)].to(torch.int32)
        hidx = hidx if trial % 2 else hidx[None, :]
        thr = hist_slots(1, hidx) if lag is None else lag
        want = _refresh_expected(hidx, vl, pos, r, thr, max_lag)
        got = refresh_heads(hidx, vl, torch.tensor([pos]), r, lag=lag, max_lag=max_lag)
        ref = refresh_heads_ref(hidx, vl, torch.tensor([pos]), r, lag=lag, max_lag=max_lag)
        assert got.dtype == torch.int32 and got.tolist() == want, (trial, got.tolist(), want)
        assert ref.tolist() == want


def test_refresh_heads_bad_inputs_rejected():
    from dejavu.plugins.refresh_heads import refresh_heads
    vl = torch.zeros(1, H, dtype=torch.int32)
    hidx = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(DejavuError, match="batch 1"):
        refresh_heads(hidx, torch.zeros(2, H, dtype=torch.int32), torch.tensor([3]), 2)
    with pytest.raises(DejavuError, match="r must"):
        refresh_heads(hidx, vl, torch.tensor([3]), 0)
    with pytest.raises(DejavuError, match="max_lag"):
        refresh_heads(hidx, vl, torch.tensor([3]), 2, lag=4, max_lag=3)
    with pytest.raises(DejavuError):
        refresh_heads(torch.tensor([0, H], dtype=torch.int32), vl, torch.tensor([3]), 2, validate=True)
    with pytest.raises(DejavuError):
        refresh_heads(hidx, vl.long(), torch.tensor([3]), 2)


REFRESH_CONFIGS = {  # name: (op config, whether the route takes refresh heads)
    "two-launch": ({"qkv": {"BLOCK_D": 16, "SHARED_P": 4, "FOLD_FINISH": False}}, True),
    "two-launch-slowz2": ({"qkv": {"BLOCK_D": 32, "SHARED_P": 4, "FOLD_FINISH": False, "SLOW_Z": 2}}, True),
    "folded": ({"qkv": {"BLOCK_D": 16, "SHARED_P": 4, "FOLD_FINISH": True, "FOLD_SLOW_Z": 2},
                "attn": {"CHUNK": 8, "BLOCK_S": 8}}, False),
}


@pytest.mark.parametrize("name,dtype", [(n, torch.float32 if i % 2 == 0 else torch.float16)
                                        for i, n in enumerate(REFRESH_CONFIGS)], ids=list(REFRESH_CONFIGS))
def test_refresh_steps_equal_the_reference(triton_interp, dtype, name):
    """Batch 1 decode steps with refresh heads from refresh_heads (some past the partials: the slow
    path, and -1 slots): output, caches and valid_len equal the float64 reference's where the route
    takes them (the refresh heads' slots up to pos written, valid_len pos + 1, nothing else of theirs
    touched); on routes that leave them out, the same output and the refresh heads untouched."""
    from dejavu.plugins.refresh_heads import refresh_heads, refresh_route
    cfg, takes = REFRESH_CONFIGS[name]
    w = weights(dtype)
    w64 = [t.double() for t in w]
    x_hist0 = torch.randn(1, S2, D).to(dtype)
    kc0, vc0 = torch.randn(1, H, S2, HD).to(dtype), torch.randn(1, H, S2, HD).to(dtype)
    vl0 = torch.tensor([[0, 29, 40, 33, 12]], dtype=torch.int32)
    steps = [(40, [1]), (41, [2, 4]), (43, [0]), (44, [3, 2])]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    kc, vc, vl, hist = kc0.clone(), vc0.clone(), vl0.clone(), x_hist0.clone()
    k64, v64, vl64, h64 = kc0.double(), vc0.double(), vl0.clone(), x_hist0.double()
    refreshed = 0
    for p, hs in steps:
        x, res = torch.randn(1, D).to(dtype), torch.randn(1, D).to(dtype)
        pos = torch.tensor([p])
        hidx = torch.tensor(hs, dtype=torch.int32)
        ref_h = refresh_heads(hidx, vl, pos, 3, lag=2)  # 3 slots: a -1 at some steps
        assert refresh_route(1, S2, D, HD, hidx, cfg) == takes
        before = [(kc.clone(), vc.clone(), vl.clone())]
        y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, config=cfg, refresh=ref_h)
        live = [h for h in ref_h.tolist() if h >= 0]
        refreshed += len(live)
        if takes:
            want = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, h64, vl64, pos, res.double(),
                                                   refresh=ref_h)
            for h in live:
                assert int(vl[0, h]) == p + 1
        else:  # the refresh heads as they were; the reference without them
            want = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, h64, vl64, pos, res.double())
            kb, vb, vlb = before[0]
            for h in live:
                assert int(vl[0, h]) == int(vlb[0, h])
                assert torch.equal(kc[0, h], kb[0, h]) and torch.equal(vc[0, h], vb[0, h])
        assert torch.equal(vl, vl64)
        assert torch.allclose(y.double(), want, **tol)
        for got, ref in ((kc, k64), (vc, v64), (hist, h64)):
            assert torch.allclose(got.double(), ref, **tol)
    assert refreshed >= 4


def test_refresh_leaves_caches_outside_the_refresh_heads_alone(triton_interp):
    """NaN-poisoned caches: one step with refresh heads writes exactly the selected and refresh
    heads' slots min(valid_len, pos)..pos (a -1 slot writes nothing), with float64 K/V values."""
    dtype = torch.float32
    cfg = {"qkv": {"BLOCK_D": 16, "SHARED_P": 4, "FOLD_FINISH": False}}
    w = weights(dtype)
    x_hist = torch.randn(1, S2, D)
    vl0 = torch.tensor([[40, 35, 20, 41, 38]], dtype=torch.int32)
    pos = torch.tensor([41])
    hidx = torch.tensor([0], dtype=torch.int32)
    refresh = torch.tensor([2, -1, 4], dtype=torch.int32)  # 2: 21 missing slots (slow path), 4: 3
    kc, vc = nan_caches(1, dtype, S2)
    vl = vl0.clone()
    sparse_attn_decode_deferred(torch.randn(1, D), *w, hidx, kc, vc, x_hist, vl, pos, torch.randn(1, D),
                                config=cfg, refresh=refresh)
    mask = torch.zeros(1, H, S2, dtype=torch.bool)
    for h in (0, 2, 4):
        mask[0, h, min(int(vl0[0, h]), 41):42] = True
    assert torch.equal(torch.isfinite(kc).all(-1), mask) and torch.equal(torch.isfinite(vc).all(-1), mask)
    kv = (x_hist[0].double() @ w[2].double().T + w[3].double()).view(S2, 2, H, HD).permute(1, 2, 0, 3)
    assert torch.allclose(kc[0][mask[0]].double(), kv[0][mask[0]], atol=1e-4)
    assert torch.allclose(vc[0][mask[0]].double(), kv[1][mask[0]], atol=1e-4)
    assert vl.tolist() == [[42, 35, 42, 41, 42]]


def test_refresh_bad_inputs_rejected():
    w = weights(torch.float32)
    kc, vc = nan_caches(1, torch.float32, S2)
    args = (torch.randn(1, D), *w, torch.tensor([0, 1], dtype=torch.int32), kc, vc, torch.randn(1, S2, D),
            torch.zeros(1, H, dtype=torch.int32), torch.tensor([5]))
    for bad in (torch.tensor([1], dtype=torch.int32), torch.tensor([H], dtype=torch.int32),
                torch.tensor([2, 2], dtype=torch.int32), torch.tensor([-2], dtype=torch.int32)):
        with pytest.raises(DejavuError, match="refresh"):
            sparse_attn_decode_deferred(*args, validate=True, refresh=bad)
    with pytest.raises(DejavuError, match="refresh"):
        sparse_attn_decode_deferred(*args, validate=True, refresh=torch.tensor([2]))  # int64


def test_batch1_qkv_launch_leaves_sm_slots():
    """Batch 1's Q/K/V partial launch (shared-set kernel, before any fold cap) stays within
    qkv_b1's TARGET_PROGRAMS, below the 528 = 4 x 132 slots its programs fill on an H200 (4 per SM),
    so the predictors' stream can start beside it; its slices of D cover D. OPT shapes, every head count."""
    from dejavu.plugins.qkv_partial import qkv_split
    from dejavu.plugins.settings import DEFAULT, table
    cfg = table(DEFAULT.qkv_b1)
    assert cfg["TARGET_PROGRAMS"] < 4 * 132
    for D, H in ((2048, 32), (5120, 40), (7168, 56), (9216, 72), (12288, 96)):
        nb = -(-(D // H) // cfg["BLOCK_R"])
        for kh in range(1, H + 1):
            groups = kh * 3 * nb
            split, d_per, _ = qkv_split(cfg, D, groups, False)
            assert split == 1 or split * groups <= cfg["TARGET_PROGRAMS"], (D, kh, split)
            assert d_per % cfg["BLOCK_D"] == 0 and d_per * (split - 1) < D <= d_per * split

"""catch_up_kv (the deferred K/V slots past the Q/K/V kernels' partials, computed ahead of the step)
and sparse_attn_decode_deferred(caught_up=True) (Triton, interpreter) against float64 references."""
import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins.deferred_kv import (catch_up_kv, catch_up_kv_ref, hist_slots, sparse_attn_decode_deferred,
                                        sparse_attn_decode_deferred_ref)

H, HD, S = 5, 12, 48  # D = 60: not a block multiple (BLOCK_R 16, BLOCK_D 128 / 16)
D = H * HD


def weights(dtype):
    w = [torch.randn(D, D) / D ** 0.5, torch.randn(D) / 4, torch.randn(2 * D, D) / D ** 0.5,
         torch.randn(2 * D) / 4, torch.randn(D, D) / D ** 0.5, torch.randn(D) / 4]
    return [t.to(dtype) for t in w]


def nan_caches(B, dtype):
    return [torch.full((B, H, S, HD), float("nan"), dtype=dtype) for _ in range(2)]


def test_hist_slots_follow_the_qkv_route():
    # batch 1: the shared-set kernel with SHARED_P - 1 = 15; batches: BLOCK_P 16 per sequence, a
    # shared set SHARED_P - 1 = 3 (QKV_CONFIG); a config overrides
    assert hist_slots(1, torch.zeros(1, 2, dtype=torch.int32)) == 15
    assert hist_slots(3, torch.zeros(3, 2, dtype=torch.int32)) == 16
    assert hist_slots(3, torch.zeros(2, dtype=torch.int32)) == 3
    assert hist_slots(1, torch.zeros(1, 2, dtype=torch.int32), {"SHARED_P": 2}) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("B,shared,qkv", [(1, False, {}), (1, False, {"SHARED_P": 2}), (3, False, {}),
                                          (3, True, {})], ids=["b1", "b1-P2", "b3", "b3-shared"])
def test_catch_up_fills_only_the_slots_past_the_partials(triton_interp, close, dtype, B, shared, qkv):
    """NaN-poisoned caches: exactly the selected heads' slots min(valid_len, pos) + hist_slots ..
    pos - 1 get written, with the K/V of the history (float64 bound); valid_len is unchanged."""
    w = weights(dtype)
    wkv, bkv = w[2], w[3]
    x_hist = torch.randn(B, S, D).to(dtype)
    vl0 = torch.tensor([[0, 9, 47, 3, 30], [5, 0, 1, 44, 2], [0, 0, 0, 0, 0]][:B], dtype=torch.int32)
    pos = torch.tensor([47, 40, 10][:B])
    hidx = torch.tensor([0, 1, 3], dtype=torch.int32) if shared else torch.tensor([[0, 1, 4], [3, 1, 2], [0, 2, 4]][:B])
    cfg = {"qkv": qkv, "catchup": {"BLOCK_D": 16, "Z": 2}}  # several D chunks; 2 programs share the chunks
    hist = hist_slots(B, hidx, qkv)
    vl = vl0.clone()
    kc, vc = nan_caches(B, dtype)
    catch_up_kv(x_hist, wkv, bkv, hidx, kc, vc, vl, pos, config=cfg)
    k64, v64 = nan_caches(B, torch.float64)
    catch_up_kv_ref(x_hist.double(), wkv.double(), bkv.double(), hidx, k64, v64, vl0.clone(), pos, config=cfg)
    kt, vt = nan_caches(B, dtype)
    catch_up_kv_ref(x_hist, wkv, bkv, hidx, kt, vt, vl0.clone(), pos, config=cfg)
    mask = torch.zeros(B, H, S, dtype=torch.bool)
    hs = hidx.long().expand(B, -1) if hidx.dim() == 1 else hidx.long()
    for b in range(B):
        for h in hs[b].tolist():
            mask[b, h, min(int(vl0[b, h]), int(pos[b])) + hist:int(pos[b])] = True
    assert mask.sum() > 0
    assert torch.equal(vl, vl0)
    for got, ref, tor in ((kc, k64, kt), (vc, v64, vt)):
        assert torch.equal(torch.isfinite(got).all(-1), mask)
        assert torch.isnan(got[~mask]).all() and torch.equal(torch.isfinite(ref).all(-1), mask)
        close(got[mask], ref[mask], tor[mask])
    kv = (x_hist.double() @ wkv.double().T + bkv.double()).view(B, S, 2, H, HD).permute(2, 0, 3, 1, 4)
    assert torch.allclose(k64[mask], kv[0][mask]) and torch.allclose(v64[mask], kv[1][mask])


CONFIGS = {  # name: (batch, shared set, op config)
    "b1-two-launch": (1, False, {"qkv": {"BLOCK_D": 16, "SHARED_P": 4, "FOLD_FINISH": False}}),
    "b1-folded": (1, False, {"qkv": {"BLOCK_D": 16, "SHARED_P": 4, "FOLD_FINISH": True, "FOLD_SLOW_Z": 2},
                             "attn": {"CHUNK": 8, "BLOCK_S": 8}}),
    "b1-fused": (1, False, {"qkv": {"BLOCK_D": 16, "SHARED_P": 4, "FUSED_FINISH": True}}),
    "b2": (2, False, {"qkv": {"BLOCK_D": 32, "SPLIT": 2}}),
    "b2-shared-fused-split1": (2, True, {"qkv": {"BLOCK_D": 16, "SPLIT": 1, "FUSED_FINISH": True}}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_caught_up_steps_equal_the_reference(triton_interp, dtype, name):
    """Decode steps with gaps past the partials: catch_up_kv then the op with caught_up=True gives the
    float64 reference's output, caches and valid_len; the op alone with caught_up=True leaves exactly
    those slots unwritten (so it does skip its slow path), and without it fills them itself."""
    B, shared, cfg = CONFIGS[name]
    cfg = {**cfg, "catchup": {"BLOCK_D": 32}}
    w = weights(dtype)
    w64 = [t.double() for t in w]
    x_hist0 = torch.randn(B, S, D).to(dtype)
    kc0, vc0 = torch.randn(B, H, S, HD).to(dtype), torch.randn(B, H, S, HD).to(dtype)  # earlier steps' K/V
    vl0 = torch.tensor([[0, 29, 40, 40, 12], [3, 0, 40, 21, 40]][:B], dtype=torch.int32)
    steps = [(40, [0, 1, 3]), (41, [2, 0, 4]), (43, [0, 1, 4]), (44, [4, 3, 2])]  # pos, heads (batch row 0)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    kc, vc, vl, hist = kc0.clone(), vc0.clone(), vl0.clone(), x_hist0.clone()
    k64, v64, vl64, h64 = kc0.double(), vc0.double(), vl0.clone(), x_hist0.double()
    skipped = 0
    for p, hs in steps:
        x, res = torch.randn(B, D).to(dtype), torch.randn(B, D).to(dtype)
        pos = torch.tensor([p, p - 1][:B])
        hidx = torch.tensor(hs, dtype=torch.int32)
        hidx = hidx if shared else torch.stack([hidx, hidx.flip(0)][:B])
        # the op alone, told the slots were caught up: those slots stay NaN
        kn, vn = [torch.where(torch.zeros_like(c, dtype=torch.bool), c, float("nan")) for c in (kc, vc)]
        sparse_attn_decode_deferred(x, *w, hidx, kn, vn, hist.clone(), vl.clone(), pos, res, config=cfg,
                                    caught_up=True)
        hsel = hidx.long().expand(B, -1) if hidx.dim() == 1 else hidx.long()
        want_nan = torch.zeros(B, H, S, dtype=torch.bool)
        for b in range(B):
            for h in hsel[b].tolist():
                want_nan[b, h, min(int(vl[b, h]), int(pos[b])) + hist_slots(B, hidx, cfg["qkv"]):int(pos[b])] = True
        written = torch.isfinite(kn).all(-1)
        assert not (written & want_nan).any()
        skipped += int(want_nan.sum())
        # catch-up, then the op
        catch_up_kv(hist, w[2], w[3], hidx, kc, vc, vl, pos, config=cfg)
        y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, pos, res, config=cfg, caught_up=True)
        ref = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, h64, vl64, pos, res.double())
        assert torch.equal(vl, vl64)
        assert torch.allclose(y.double(), ref, **tol)
        for got, want in ((kc, k64), (vc, v64), (hist, h64)):
            assert torch.allclose(got.double(), want, **tol)
    assert skipped > 0  # some step had slots past the partials


def test_catch_up_bad_inputs_rejected():
    w = weights(torch.float32)
    x_hist = torch.randn(1, S, D)
    kc, vc = nan_caches(1, torch.float32)
    vl = torch.zeros(1, H, dtype=torch.int32)
    hidx = torch.tensor([[0, 1]])
    with pytest.raises(DejavuError, match="pos"):
        catch_up_kv(x_hist, w[2], w[3], hidx, kc, vc, vl, torch.tensor([S]), validate=True)
    with pytest.raises(DejavuError):
        catch_up_kv(x_hist.half(), w[2], w[3], hidx, kc, vc, vl, torch.tensor([3]), validate=True)
    with pytest.raises(DejavuError):
        catch_up_kv(x_hist, w[2], w[3], torch.tensor([[0, H]]), kc, vc, vl, torch.tensor([3]), validate=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("z", [1, 2])
def test_partial_slow_equals_finishing_slow_path(triton_interp, monkeypatch, dtype, z):
    """Batch 1, PARTIAL_SLOW: the slots past the partials come from the Q/K/V partial kernel's slow
    z-slices (FOLD_SLOW_Z chunk sets) while the finishing kernel still runs, skipping them: output,
    caches, valid_len and history over steps with gaps of up to 40 equal the finishing kernel's slow
    path (same 16-row dots: bit for bit) and are close to the float64 reference."""
    from dejavu.plugins import deferred_kv as DK
    w = weights(dtype)
    w64 = [t.double() for t in w]
    x_hist0 = torch.randn(1, S, D).to(dtype)
    kc0, vc0 = torch.randn(1, H, S, HD).to(dtype), torch.randn(1, H, S, HD).to(dtype)
    vl0 = torch.tensor([[0, 29, 40, 40, 12]], dtype=torch.int32)
    steps = [(40, [0, 1, 3, 4]), (41, [2, 0]), (43, [0, 1]), (44, [4, 3, 2])]
    inputs = [(torch.randn(1, D).to(dtype), torch.randn(1, D).to(dtype)) for _ in steps]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    grids = []  # (kernel name, grid, SLOW / CAUGHT_UP constexprs) of every launch through deferred_kv.jit
    real_jit = DK.jit

    class Spy:
        def __init__(self, fn, dev):
            self.fn, self.k = fn, real_jit(fn, dev)

        def __getitem__(self, grid):
            def launch(*a, **kw):
                grids.append((self.fn.__name__, tuple(grid), kw.get("SLOW"), kw.get("CAUGHT_UP")))
                return self.k[grid](*a, **kw)
            return launch

    monkeypatch.setattr(DK, "jit", Spy)
    runs = {}
    for part in (True, False):
        cfg = {"qkv": {"BLOCK_D": 16, "BLOCK_R": 16, "SHARED_P": 4, "FINISH_R": 16, "FOLD_FINISH": False,
                       "PARTIAL_SLOW": part, "FOLD_SLOW_Z": z, "FOLD_SLOW_R": 16}}
        kc, vc, vl, hist = kc0.clone(), vc0.clone(), vl0.clone(), x_hist0.clone()
        k64, v64, vl64, h64 = kc0.double(), vc0.double(), vl0.clone(), x_hist0.double()
        ys = []
        for (p, hs), (x, res) in zip(steps, inputs):
            hidx = torch.tensor([hs], dtype=torch.int32)
            grids.clear()
            y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, torch.tensor([p]), res, config=cfg)
            (pn, pgrid, slow, _), (fn, _, _, caught) = grids[:2]
            assert (pn, fn) == ("_qkv_partial_shared_kernel", "_qkv_finish_kernel"), grids
            # z slow z-slices beside the 4 slices of D (60 columns in 16-column blocks), the finish told so
            assert (slow, pgrid[2], bool(caught)) == ((z, 4 + z, True) if part else (0, 4, False)), grids
            ref = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, h64, vl64, torch.tensor([p]),
                                                  res.double())
            assert torch.equal(vl, vl64)
            assert torch.allclose(y.double(), ref, **tol)
            ys.append(y)
        runs[part] = (ys, kc, vc, vl, hist)
    for a, b in zip(runs[True][0] + list(runs[True][1:]), runs[False][0] + list(runs[False][1:])):
        assert torch.equal(a, b)
    assert runs[True][3][0].tolist() == [44, 44, 45, 45, 45]  # every selected slot filled


@pytest.mark.parametrize("slow_p", [32, 64])
@pytest.mark.parametrize("route", ["finish", "finish-z2", "partial", "fold"])
def test_slow_path_slots_per_pass(triton_interp, slow_p, route):
    """SLOW_P slots per whole-D pass of the slow path (finishing kernel, with 1 or 2 programs per row
    block; the partial kernel's slow z-slices; folded): gaps of up to 40 slots past the partials in one
    or two passes give the float64 reference's output, caches and valid_len over four steps."""
    dtype = torch.float32
    w = weights(dtype)
    w64 = [t.double() for t in w]
    qkv = {"BLOCK_D": 16, "BLOCK_R": 16, "SHARED_P": 4, "FINISH_R": 16, "SLOW_P": slow_p,
           "FOLD_FINISH": route == "fold", "PARTIAL_SLOW": route == "partial", "FOLD_SLOW_Z": 2,
           "SLOW_Z": 2 if route == "finish-z2" else 1}
    cfg = {"qkv": qkv, "attn": {"CHUNK": 8, "BLOCK_S": 8}}
    kc, vc = torch.randn(1, H, S, HD), torch.randn(1, H, S, HD)
    vl, hist = torch.tensor([[0, 29, 40, 40, 12]], dtype=torch.int32), torch.randn(1, S, D)
    k64, v64, vl64, h64 = kc.double(), vc.double(), vl.clone(), hist.double()
    for p, hs in [(40, [0, 1, 3, 4]), (41, [2, 0]), (43, [0, 1]), (47, [4, 3, 2])]:
        x, res = torch.randn(1, D), torch.randn(1, D)
        hidx = torch.tensor([hs], dtype=torch.int32)
        y = sparse_attn_decode_deferred(x, *w, hidx, kc, vc, hist, vl, torch.tensor([p]), res, config=cfg)
        ref = sparse_attn_decode_deferred_ref(x.double(), *w64, hidx, k64, v64, h64, vl64, torch.tensor([p]),
                                              res.double())
        assert torch.equal(vl, vl64)
        for got, want in ((y, ref), (kc, k64), (vc, v64)):
            assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)
    assert vl[0].tolist() == [44, 44, 48, 48, 48]

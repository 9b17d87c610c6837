"""predictor_topk: the top-k of the low-rank scores, per sequence or shared by the batch."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import predictor_scores, predictor_topk, predictor_topk_ref
from dejavu.plugins.predictor import topk_triton_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

D, N, R = 72, 200, 16


def make(B):
    return torch.randn(B, D), torch.randn(R, D), torch.randn(N, R), torch.randn(N)


@pytest.mark.parametrize("B", [1, 3])
def test_topk_per_sequence_is_the_top_k_set(B):
    x, a, b, bias = make(B)
    idx = predictor_topk(x, a, b, bias, 37)
    assert idx.dtype == torch.int32 and idx.shape == (B, 37)
    ref = predictor_topk_ref(x.double(), a.double(), b.double(), bias.double(), 37)
    assert torch.equal(idx.sort(-1).values, ref.sort(-1).values)


def test_shared_is_top_k_of_the_batch_max():
    x, a, b, bias = make(4)
    idx = predictor_topk(x, a, b, bias, 37, shared=True)
    assert idx.shape == (37,) and idx.dtype == torch.int32
    scores = predictor_scores(x.double(), a.double(), b.double(), bias.double()).amax(0)
    assert torch.equal(idx.sort().values, scores.topk(37).indices.sort().values.int())
    per_seq = predictor_topk(x, a, b, bias, 37)
    # each sequence's best neuron is in the shared set (it has the column maximum somewhere)
    best = predictor_scores(x, a, b, bias).argmax(-1)
    assert all(int(i) in set(idx.tolist()) for i in best)
    assert per_seq.shape == (4, 37)


def test_bad_inputs_rejected():
    x, a, b, bias = make(2)
    with pytest.raises(DejavuError, match="k: expected an int in \\[0, 200\\]"):
        predictor_topk(x, a, b, bias, N + 1)
    with pytest.raises(DejavuError, match="b: shape"):
        predictor_topk(x, a, b[:, :-1].contiguous(), bias, 5)
    with pytest.raises(DejavuError, match="a: expected dtype"):
        predictor_topk(x, a.half(), b, bias, 5)
    with pytest.raises(DejavuError, match="x: must be contiguous"):
        predictor_topk(torch.randn(D, 2).t(), a, b, bias, 5)


@pytest.mark.parametrize("B,shared", [(1, False), (3, False), (3, True)])
def test_triton_topk_selects_the_same_set(triton_interp, B, shared):
    x, a, b, bias = make(B)
    idx = predictor_topk(x, a, b, bias, 37, shared=shared, method="triton")
    ref = predictor_topk(x, a, b, bias, 37, shared=shared, method="torch")
    assert idx.dtype == torch.int32 and idx.shape == ref.shape
    assert torch.equal(idx.sort(-1).values, ref.sort(-1).values)


def test_triton_topk_ties_and_extremes(triton_interp):
    from dejavu.plugins.predictor import topk_triton

    s = torch.randn(2, 300)
    s[0, :50] = 1e30  # 50 tied maxima, k = 20: exactly 20 of them (the lowest indices)
    s[1, 7] = -float("inf")
    idx = topk_triton(s, 20)
    assert torch.equal(idx[0].sort().values, torch.arange(20, dtype=torch.int32))
    assert torch.equal(s[1].gather(0, idx[1].long()).sort().values, s[1].topk(20).values.sort().values)
    assert topk_triton(s, 300)[1].sort().values.equal(torch.arange(300, dtype=torch.int32))
    with pytest.raises(DejavuError, match="unknown method"):
        predictor_topk(*make(1), 5, method="heap")


# ------------------------------------------------------------------------ topk_triton itself
# The expected set is unique given the tie rule: a stable descending sort (equal scores keep
# index order; -0.0 == +0.0; NaN first, as torch.topk ranks it) and its first k indices.
# Configs force the paths: one program per row, rows split over programs (split launches
# under the interpreter).
ONE, MANY = None, dict(block=256)


def expected_set(s, k):
    return topk_triton_ref(s, k)


def assert_topk(s, idx, k):
    """idx[R,k] is s's top-k set with ties at the k-th value taken lowest index first."""
    assert idx.dtype == torch.int32 and idx.shape == (s.shape[0], k)
    for row, (si, ii) in enumerate(zip(s.float(), idx.long())):
        assert len(set(ii.tolist())) == k, f"row {row}: repeated indices"
        if 0 < k < s.shape[1]:
            chosen = torch.zeros(s.shape[1], dtype=torch.bool)
            chosen[ii] = True
            assert si[chosen].min() >= si[~chosen].max(), f"row {row}: a larger score was left out"
    assert torch.equal(idx.sort(-1).values, expected_set(s, k).sort(-1).values)


@pytest.mark.parametrize("N,config", [(1, ONE), (56, ONE), (1000, ONE), (1000, MANY), (5000, ONE)])
def test_topk_triton_equals_torch_topk(triton_interp, N, config):
    from dejavu.plugins.predictor import topk_triton

    s = (torch.randperm(2 * N).float() - N).view(2, N) * 1e-3  # distinct, both signs
    for k in sorted({0, 1, int(0.3 * N), N} if N < 5000 else {0, int(0.3 * N)}):  # 5000: slow
        idx = topk_triton(s, k, config)
        assert idx.shape == (2, k)
        ref = torch.topk(s, k, dim=-1, sorted=False).indices.int()
        assert torch.equal(idx.sort(-1).values, ref.sort(-1).values), (N, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [ONE, MANY])
def test_topk_triton_ties_follow_the_lowest_index_rule(triton_interp, dtype, config):
    from dejavu.plugins.predictor import topk_triton

    N = 1000
    s = torch.cat([torch.randn(1, N), torch.randint(-6, 6, (1, N)) / 4]).to(dtype)  # row 1: ties
    for k in (300, N - 1):
        assert_topk(s, topk_triton(s, k, config), k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_triton_signs_zeros_and_extremes(triton_interp, dtype):
    from dejavu.plugins.predictor import topk_triton

    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal / 4  # subnormal
    vals = torch.tensor([0.0, -0.0, big, -big, float("inf"), -float("inf"), tiny, -tiny, 1.0, -1.0])
    s = vals[torch.randint(0, len(vals), (2, 777))].to(dtype)
    s[1] = torch.randn(777).to(dtype) * big / 4
    s[1, ::7] = -0.0
    s[1, 3::7] = 0.0
    for config in (ONE, MANY):
        for k in (1, 400, 776):
            assert_topk(s, topk_triton(s, k, config), k)
    z = torch.tensor([[0.0, -0.0, -0.0, 0.0, -1.0]], dtype=dtype)  # -0.0 ties +0.0: lowest index wins
    assert topk_triton(z, 2).sort().values.tolist() == [[0, 1]]
    assert topk_triton(torch.tensor([[1.0, float("nan"), 2.0]], dtype=dtype), 1).tolist() == [[1]]


def test_topk_triton_many_programs_per_row(triton_interp):
    from dejavu.plugins.predictor import topk_triton

    s = torch.randn(2, 2000).half()
    s[1, 500:1500] = 0.5  # the k-th value's ties spread over several programs
    for k in (1000, 1999):  # 16 programs of 128 per row (a [16, 256] tile at 2 warps)
        assert_topk(s, topk_triton(s, k, dict(block=128, warps=2)), k)
    # block raised until NB <= 8 * warps = 8: 2000 / 256 -> 8 programs
    assert_topk(s, topk_triton(s, 1000, dict(block=128, warps=1)), 1000)


def test_topk_triton_opt30b_mlp_row(triton_interp):
    from dejavu.plugins.predictor import topk_triton

    s = torch.randn(1, 28672).half()  # OPT-30B's MLP width at 30% density
    assert_topk(s, topk_triton(s, 8602), 8602)


def test_topk_triton_rejects_bad_input(triton_interp):
    from dejavu.plugins.predictor import topk_triton

    with pytest.raises(DejavuError, match="N=65537 > 65536"):
        topk_triton(torch.randn(1, 65537), 5)
    with pytest.raises(DejavuError, match="k must be an int in \\[0, 10\\]"):
        topk_triton(torch.randn(2, 10), 11)
    with pytest.raises(DejavuError, match="scores: expected 2 dims"):
        topk_triton(torch.randn(10), 3)
    with pytest.raises(DejavuError, match="scores: dtype torch.float64 not supported"):
        topk_triton(torch.randn(2, 10, dtype=torch.float64), 3)
    with pytest.raises(DejavuError, match="unknown key\\(s\\) blocks"):
        topk_triton(torch.randn(2, 10), 3, dict(blocks=64))
    with pytest.raises(DejavuError, match="block must be a power of 2"):
        topk_triton(torch.randn(2, 10), 3, dict(block=100))


@pytest.mark.parametrize("method", ["torch", "triton"])
def test_shared_with_one_sequence_is_its_own_top_k(triton_interp, method):
    x, a, b, bias = make(1)
    shared = predictor_topk(x, a, b, bias, 37, shared=True, method=method)
    per_seq = predictor_topk(x, a, b, bias, 37, method=method)
    assert shared.shape == (37,) and torch.equal(shared, per_seq[0])


COMPILE = textwrap.dedent('''
    import itertools
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    import dejavu.plugins.predictor as PR

    PR.tl = tl
    for name, obj in list(vars(PR).items()):  # @helper device functions, as _common.jit does
        if getattr(obj, "_dejavu_helper", False) and not isinstance(obj, JITFunction):
            setattr(PR, name, triton.jit(obj))
    SIG = {"s_ptr": "*fp16", "out_ptr": "*i32", "ws_ptr": "*i32", "N": "i32", "K": "i32",
           "NB": "i32", "stride_s": "i32", "stride_o": "i32", "nkept_ptr": "*i32", "lse_ptr": "*fp32",
           "log_share": "fp32"}
    for dt, bits in (("fp16", 16), ("bf16", 16), ("fp32", 32)):
        rounds = bits // 8
        variants = [(PR._SPLIT, 0, 1, False, 32), (PR._SPLIT, rounds, rounds, True, 32)]
        if dt == "fp16":
            variants += [(PR._SPLIT, 1, 2, False, 32), (PR._SINGLE, 0, rounds, True, 1)]
        for (mode, first, last, compact, nb_p2), keep in itertools.product(variants, (0, 1)):  # 1: a per-token K
            c = dict(BLOCK=1024 if nb_p2 > 1 else 64, NB_P2=nb_p2, KEY_BITS=bits, MODE=mode, FIRST=first,
                     LAST=last, COMPACT=compact, KEEP=keep)
            sig = dict(SIG, s_ptr="*" + dt, **{name: "constexpr" for name in c})
            src = ASTSource(JITFunction(PR._topk_kernel), signature=sig, constexprs=c)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8 if nb_p2 > 1 else 1))
            assert "cubin" in k.asm
    print("ALL OK")
''')


def test_topk_kernel_compiles_for_sm90_in_every_mode():
    """Every launch form of the top-k kernel compiles for sm_90 (the interpreter accepts more)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


# ------------------------------------------------------------------------ Triton scoring
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(72, 16, 200), (1030, 56, 77)])  # D, r, N: none a block multiple
def test_triton_scores_match_float64(triton_interp, close, dtype, shape):
    from dejavu.plugins.predictor import predictor_scores_triton

    Dx, r, n = shape
    x, a = torch.randn(1, Dx).to(dtype), (torch.randn(r, Dx) / Dx ** 0.5).to(dtype)
    b, bias = (torch.randn(n, r) / r ** 0.5).to(dtype), torch.randn(n).to(dtype)
    ref = predictor_scores(x.double(), a.double(), b.double(), bias.double())
    for config in (None, {"a": {"BLOCK_R": 2, "BLOCK_D": 256}, "b": {"BLOCK_R": 8, "BLOCK_D": 32}}):
        out = predictor_scores_triton(x, a, b, bias, config=config)
        assert out.dtype == dtype
        close(out, ref, predictor_scores(x, a, b, bias))


def test_triton_scoring_selects_a_top_k_set(triton_interp):
    x, a, b, bias = make(1)
    for shared in (False, True):
        idx = predictor_topk(x, a, b, bias, 37, shared=shared, scoring="triton")
        ref = predictor_topk_ref(x.double(), a.double(), b.double(), bias.double(), 37, shared=shared)
        assert idx.dtype == torch.int32 and idx.shape == ref.shape
        assert torch.equal(idx.sort(-1).values, ref.sort(-1).values)
    # batches score with cuBLAS (the same function: the same sets as scoring="torch")
    x3 = torch.randn(3, D)
    assert torch.equal(predictor_topk(x3, a, b, bias, 37, scoring="triton"),
                       predictor_topk(x3, a, b, bias, 37, scoring="torch"))
    with pytest.raises(DejavuError, match="unknown scoring 'cublas'"):
        predictor_topk(x, a, b, bias, 5, scoring="cublas")


def test_triton_scores_batch_one_only(triton_interp):
    from dejavu.plugins.predictor import predictor_scores_triton

    with pytest.raises(DejavuError, match="batch 1 only"):
        predictor_scores_triton(*make(2))


# ------------------------------------------------------------------------ int8 rows (the engines' MLP predictors)
def make_int8(B, Dx=D, r=R, n=N, dtype=torch.float32):
    """x, a_q [r, Dx] int8, b_q [n, r] int8, bias, (a_scale [r], b_scale [n]) fp16, and a, b dequantized (fp64)."""
    aq, bq = torch.randint(-127, 128, (r, Dx), dtype=torch.int8), torch.randint(-127, 128, (n, r), dtype=torch.int8)
    sa = (torch.rand(r) + 0.5).div(127 * Dx ** 0.5).half()  # dequantized rows ~ 1/sqrt(fan-in)
    sb = (torch.rand(n) + 0.5).div(127 * r ** 0.5).half()
    deq = lambda q, s: q.double() * s.double()[:, None]  # noqa: E731
    return (torch.randn(B, Dx).to(dtype), aq, bq, torch.randn(n).to(dtype), (sa, sb), deq(aq, sa), deq(bq, sb))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(72, 16, 200), (1030, 56, 77)])  # D, r, N: none a block multiple
def test_int8_scores_match_float64(triton_interp, close, dtype, shape):
    """((x @ a_q.T) * a_scale) @ b_q.T * b_scale + bias against float64 of the dequantized rows: the torch
    path (CPU; batches on the GPU) and the Triton GEMVs reading int8 with the scale once per output row."""
    from dejavu.plugins.predictor import predictor_scores_triton

    x, aq, bq, bias, scales, a64, b64 = make_int8(1, *shape, dtype=dtype)
    ref = predictor_scores(x.double(), a64, b64, bias.double())
    same = predictor_scores(x, a64.to(dtype), b64.to(dtype), bias)  # float rows in x's dtype
    out = predictor_scores(x, aq, bq, bias, scales)
    assert out.dtype == dtype
    close(out, ref, same)
    for config in (None, {"a": {"BLOCK_R": 2, "BLOCK_D": 256}, "b": {"BLOCK_R": 8, "BLOCK_D": 32}}):
        tri = predictor_scores_triton(x, aq, bq, bias, config=config, scales=scales)
        assert tri.dtype == dtype
        close(tri, ref, same)


@pytest.mark.parametrize("B", [1, 3])
def test_int8_topk_selects_the_float64_top_k(triton_interp, B):
    x, aq, bq, bias, scales, a64, b64 = make_int8(B)
    ref = predictor_topk_ref(x.double(), a64, b64, bias.double(), 37)
    assert torch.equal(predictor_topk_ref(x.double(), aq, bq, bias.double(), 37, scales=scales), ref)
    for kw in ({}, {"method": "triton"}, {"scoring": "triton", "method": "triton"}):
        idx = predictor_topk(x, aq, bq, bias, 37, scales=scales, **kw)
        assert idx.dtype == torch.int32 and torch.equal(idx.sort(-1).values, ref.sort(-1).values)
    got, n = predictor_topk(x, aq, bq, bias, 60, scales=scales, min_share=0.01, scoring="triton", method="triton")
    want, n_ref = predictor_topk_ref(x.double(), a64, b64, bias.double(), 60, min_share=0.01)
    assert torch.equal(n, n_ref) and all(set(got[i, :n[i]].tolist()) == set(want[i, :n[i]].tolist()) for i in range(B))


def test_int8_bad_inputs_rejected():
    x, aq, bq, bias, (sa, sb), a64, b64 = make_int8(2)
    with pytest.raises(DejavuError, match="a: expected dtype torch.int8"):
        predictor_topk(x, a64.float(), b64.float(), bias, 5, scales=(sa, sb))
    with pytest.raises(DejavuError, match="a_scale: expected dtype torch.float16"):
        predictor_topk(x, aq, bq, bias, 5, scales=(sa.float(), sb))
    with pytest.raises(DejavuError, match="b_scale: expected shape"):
        predictor_topk(x, aq, bq, bias, 5, scales=(sa, sb[:-1].contiguous()))
    with pytest.raises(DejavuError, match="a: expected dtype"):
        predictor_topk(x, aq, bq, bias, 5)  # int8 rows without their scales

"""layer_norm (Triton, interpreter) against a float64 reference."""
import pytest
import torch
import torch.nn.functional as F

from dejavu.errors import DejavuError
from dejavu.plugins import layer_norm, layer_norm_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make(R, D, dtype, offset=0.0):
    x = (torch.randn(R, D) * 3 + offset).to(dtype)
    return x, torch.randn(D).to(dtype), torch.randn(D).to(dtype)


def torch_same_dtype(x, w, b, eps):
    """PyTorch's answer in x's dtype, rounded the way the interpreter rounds.

    Triton 3.6's interpreter converts fp32 -> bf16 by truncation (compiled kernels round to
    nearest), so a bf16 kernel output is up to 1 ulp off where PyTorch's is up to 1/2 ulp:
    bf16 compares with PyTorch's fp32 result truncated to bf16 the same way."""
    if x.dtype != torch.bfloat16:
        return F.layer_norm(x, (x.shape[1],), w, b, eps)
    y = F.layer_norm(x.float(), (x.shape[1],), w.float(), b.float(), eps)
    return (y.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def check(close, x, w, b, config=None, eps=1e-5):
    out = torch.full_like(x, float("nan"))
    y = layer_norm(x, w, b, eps, out=out, config=config)
    assert y is out
    ref64 = layer_norm_ref(x.double(), w.double(), b.double(), eps)
    close(y, ref64, torch_same_dtype(x, w, b, eps))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("R,D", [(1, 7), (3, 200), (1, 1000), (3, 1000)])
def test_whole_row_matches_reference(triton_interp, close, dtype, R, D):
    check(close, *make(R, D, dtype))


def test_large_mean_is_stable(triton_interp):
    # mean/std = 1000: E[x^2] - E[x]^2 in fp32 is off by ~1e-2 relative here. Rounding the fp32
    # mean alone costs ~2e-5 (PyTorch too), above the shared fp32 bound: compare with PyTorch.
    x, w, b = make(3, 300, torch.float32)
    x = x / 3 + 1000.0
    ref64 = layer_norm_ref(x.double(), w.double(), b.double(), 0.0)
    y = layer_norm(x, w, b, 0.0, out=torch.full_like(x, float("nan")))
    torch_y = F.layer_norm(x, (300,), w, b, 0.0)
    for norm in (lambda t: t.abs().max(), torch.linalg.vector_norm):
        err, torch_err = norm(y.double() - ref64).item(), norm(torch_y.double() - ref64).item()
        assert err <= 2 * torch_err + 1e-6 * norm(ref64).item(), (err, torch_err)
    assert ((y.double() - ref64).norm() / ref64.norm()).item() < 2e-4


def test_default_plan_and_allocated_out(triton_interp):
    from dejavu.plugins.layer_norm import _plan
    from dejavu.plugins.settings import DEFAULT, table
    assert _plan(7, table(DEFAULT.layer_norm)) == (8, 4)
    assert _plan(7168, table(DEFAULT.layer_norm)) == (8192, 8)
    assert _plan(12288, table(DEFAULT.layer_norm)) == (16384, 16)  # OPT-175B
    assert _plan(200, table(DEFAULT.layer_norm, {"num_warps": 2})) == (256, 2)
    with pytest.raises(DejavuError, match="rows of 20000 elements, more than MAX_BLOCK=16384"):
        _plan(20000, table(DEFAULT.layer_norm))
    x, w, b = make(2, 33, torch.float16)
    y = layer_norm(x, w, b)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert layer_norm(x[:0], w, b).shape == (0, 33)


def test_bad_inputs_rejected():
    x, w, b = make(2, 40, torch.float16)
    with pytest.raises(DejavuError, match="x: dtype torch.int64 not supported"):
        layer_norm(x.long(), w, b)
    with pytest.raises(DejavuError, match="weight: expected dtype"):
        layer_norm(x, w.float(), b)
    with pytest.raises(DejavuError, match="bias: expected dtype"):
        layer_norm(x, w, b.bfloat16())
    with pytest.raises(DejavuError, match="x: must be contiguous"):
        layer_norm(torch.cat([x, x], 1)[:, ::2], w, b)
    with pytest.raises(DejavuError, match="x: expected 2 dims"):
        layer_norm(x[None], w, b)
    with pytest.raises(DejavuError, match="weight: expected shape \\(40,\\)"):
        layer_norm(x, w[:-1].contiguous(), b)
    with pytest.raises(DejavuError, match="bias: expected shape"):
        layer_norm(x, w, torch.cat([b, b]))
    with pytest.raises(DejavuError, match="weight: on meta"):
        layer_norm(x, w.to("meta"), b)
    with pytest.raises(DejavuError, match="out: expected dtype"):
        layer_norm(x, w, b, out=torch.empty(2, 40))
    with pytest.raises(DejavuError, match="unknown key"):
        layer_norm(x, w, b, config={"BLOCK": 64})  # rows are held whole

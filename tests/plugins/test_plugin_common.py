"""plugins/_common.py: the device helper `last_arrival`, and `jit` binding helpers across
modules (interpreter; tests/plugins/conftest.py).

The interpreter runs a launch's programs one after another, so this checks the logic (one
last program per launch, the counter back to 0 for the next launch), not the GPU memory
ordering; benchmarks/kernels.py --check runs the kernels that use it on the H200.
"""
from __future__ import annotations

import pytest
import torch

from dejavu.plugins._common import jit, last_arrival

tl = None  # bound by jit


def _sum_last_kernel(x_ptr, part_ptr, out_ptr, cnt_ptr, N, BLOCK: tl.constexpr, NP2: tl.constexpr):
    # each program sums its block of x into part[pid]; the last to arrive sums part into out
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(part_ptr + pid, tl.sum(tl.load(x_ptr + offs, mask=offs < N, other=0.0), 0))
    n = tl.num_programs(0)
    if last_arrival(cnt_ptr, n):
        p = tl.arange(0, NP2)
        tl.store(out_ptr, tl.sum(tl.load(part_ptr + p, mask=p < n, other=0.0, cache_modifier=".cg"), 0))
        tl.store(out_ptr + 1, pid.to(tl.float32))


@pytest.mark.parametrize("n_prog", [1, 2, 7])
def test_last_arrival_one_last_program_and_reset(n_prog):
    g = torch.Generator().manual_seed(n_prog)
    block = 16
    cnt = torch.zeros(1, dtype=torch.int32)
    kernel = jit(_sum_last_kernel, torch.device("cpu"))
    for _ in range(2):  # the counter must be back to 0 for the second launch
        x = torch.randn(n_prog * block - 3, generator=g, dtype=torch.float64).float()
        part = torch.full((n_prog,), float("nan"))
        out = torch.full((2,), float("nan"))
        kernel[(n_prog,)](x, part, out, cnt, x.numel(), BLOCK=block, NP2=max(2, 1 << (n_prog - 1).bit_length()))
        assert int(cnt.item()) == 0
        assert out[0].item() == pytest.approx(x.double().sum().item(), abs=1e-5)
        assert out[1].item() == n_prog - 1  # the interpreter runs programs in order: the last is the last


def test_jit_binds_helpers_in_the_modules_they_come_from(triton_interp):
    # a kernel calling a helper imported from another plugin module (deferred_kv's Q/K/V kernel
    # calls sparse_mlp._ln_merge, which calls _ln_merge_rows there): the helper is wrapped where
    # the kernel sees it, and `tl` and the helpers of the helper's own module are bound too
    import triton

    import dejavu.plugins._common as C
    import dejavu.plugins.sparse_mlp as SM
    raw = getattr(SM._ln_merge, "fn", SM._ln_merge)  # the plain function (jit may have wrapped it)
    assert raw._dejavu_helper
    g = {"_ln_merge": raw, "__name__": "a_kernel_module"}
    C._bind_helpers(g, triton)
    assert g["tl"] is triton.language and hasattr(g["_ln_merge"], "run")
    assert SM.tl is triton.language and hasattr(SM._ln_merge_rows, "run")


def _to_bf16_kernel(x_ptr, y_ptr, z_ptr, N, BLOCK: tl.constexpr):
    # y: an explicit cast; z: the implicit cast of a store into a bf16 tensor
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, x.to(tl.bfloat16), mask=m)
    tl.store(z_ptr + offs, x * 1.0, mask=m)


def test_interpreter_rounds_fp32_to_bf16_as_the_gpu(triton_interp):
    """_common patches the interpreter's fp32 -> bf16 cast (it truncates) to round to nearest
    even: bit for bit torch's conversion, ties, NaN, infinities, overflow, subnormals included."""
    special = torch.tensor([4.214, 1.2406, -0.97065, 1 + 2 ** -8, 1 + 3 * 2 ** -8, float("nan"), float("inf"),
                            -float("inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -3e-39])
    x = torch.cat([special, torch.randn(3000) * 10, torch.randn(500) * 1e-38])
    y, z = (torch.empty(x.numel(), dtype=torch.bfloat16) for _ in range(2))
    jit(_to_bf16_kernel, x.device)[(triton_cdiv(x.numel(), 1024),)](x, y, z, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16)
    for got in (y, z):
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert same.all(), x[~same][:5]


def triton_cdiv(a, b):
    return -(-a // b)


def test_reg_cap_only_for_cuda_launches(triton_interp, monkeypatch):
    """reg_cap: the maxnreg launch option from a config's "maxnreg" on CUDA devices; nothing for the
    interpreter (CPU tensors), nor when the key is unset or None."""
    import dejavu.plugins._common as C
    cuda = torch.device("cuda")
    monkeypatch.setattr(C, "interpreting", lambda: False)
    assert C.reg_cap({"maxnreg": 168}, cuda) == {"maxnreg": 168}
    assert C.reg_cap({"maxnreg": None}, cuda) == {} and C.reg_cap({}, cuda) == {}
    assert C.reg_cap({"maxnreg": 168}, torch.device("cpu")) == {}
    monkeypatch.setattr(C, "interpreting", lambda: True)
    assert C.reg_cap({"maxnreg": 168}, cuda) == {}

"""plugins/_common.py: `jit` binding helpers across modules (interpreter; tests/plugins/conftest.py),
the register cap and the interpreter's bf16 rounding."""
from __future__ import annotations

import importlib

import pytest
import torch

from dejavu.plugins._common import helper, jit

tl = None  # bound by jit


def test_jit_binds_helpers_in_the_modules_they_come_from(triton_interp):
    # a kernel calling a helper imported from another plugin module (fc2's reduction kernel calls
    # layer_norm.store_row, which calls _block_stats there): the helper is wrapped where the kernel
    # sees it, and `tl` and the helpers of the helper's own module are bound too
    import triton

    import dejavu.plugins._common as C
    SM = importlib.import_module("dejavu.plugins.layer_norm")  # the package attribute is the function
    raw = getattr(SM.store_row, "fn", SM.store_row)  # the plain function (jit may have wrapped it)
    assert raw._dejavu_helper
    g = {"store_row": raw, "__name__": "a_kernel_module"}
    C.bind_helpers(g, triton)
    assert g["tl"] is triton.language and hasattr(g["store_row"], "run")
    assert SM.tl is triton.language and hasattr(SM._block_stats, "run")


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


def _wrap_kernel(x_ptr, y_ptr):
    x = tl.load(x_ptr)
    tl.store(y_ptr, x * 65536)  # int32: 2^16 * 2^16 wraps, as the GPU computes it


def test_interpreter_computes_no_overflow_check_it_would_drop(triton_interp):
    """The interpreter's int32 arithmetic wraps as before (its overflow asserts need the builder's debug
    option, off), and the checks feeding those asserts are no longer computed (sanitize_overflow off)."""
    import triton.runtime.interpreter as interp

    x, y = torch.tensor([65536, 3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    jit(_wrap_kernel, x.device)[(1,)](x, y)
    assert int(y) == 0  # 2^32 mod 2^32
    assert not interp.interpreter_builder.options.debug
    assert not interp.interpreter_builder.options.sanitize_overflow


@helper
def _helper_sum(x):
    return tl.sum(tl.zeros_like(x) + x, 0)  # tl.zeros_like: a helper of triton.language.standard (tl.core)


def _helper_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr, _helper_sum(tl.load(x_ptr + offs)) + tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0))


def test_interpreter_patches_the_language_once_per_launch(triton_interp, monkeypatch):
    """A kernel calling helpers (its own module's, triton.language.standard's) patches each language module
    once per launch, not at every helper call (_patch_interpreter_helper_calls), computes what it did before,
    and leaves triton.language as it found it after the launch."""
    import triton.language as tlang
    import triton.runtime.interpreter as interp

    import dejavu.plugins._common as C

    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(1)
    kernel = jit(_helper_kernel, x.device)
    calls = []
    original = interp._patch_lang.original  # the interpreter's own
    monkeypatch.setattr(interp, "_patch_lang", lambda fn: (calls.append(fn), original(fn))[1])
    C._patch_interpreter_helper_calls()  # around the counting one
    before = tlang.sum
    for _ in range(3):
        kernel[(1,)](x, y, BLOCK=16)
    assert float(y) == 120.0 and tlang.sum is before
    # per launch: the kernel's module (tl), then standard.py's helpers' (tl.core) once; never _helper_sum's
    assert len(calls) == 3 * 2, [getattr(f, "__name__", f) for f in calls]

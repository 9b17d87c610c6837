"""Plugin tests run the Triton kernels on CPU tensors through Triton's interpreter.

The interpreter must be chosen before `triton` is first imported (Triton decides then how
its own library functions run), so it is switched on here, at conftest import. Only this
folder's tests launch kernels; `dejavu.plugins` itself imports Triton lazily (at the first
launch), so test folders that use the references are unaffected. If some earlier test in
the same process imported Triton without the interpreter, the launchers say so with a
DejavuError (set TRITON_INTERPRET=1 for the whole run then).
"""
import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Error bounds against the float64 reference (STYLE.md): max|out-ref| <= 2*max|torch-ref| + atol,
# and ||out-ref|| / ||ref|| <= rel.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 5e-3), torch.bfloat16: (8e-3, 3e-2)}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def assert_close_to_ref(out, ref64, torch_out):
    """out: kernel result; ref64: float64 reference; torch_out: PyTorch in out's dtype."""
    atol, rel = TOL[out.dtype]
    assert out.shape == ref64.shape
    assert torch.isfinite(out).all(), "non-finite output (unwritten NaN-poisoned elements?)"
    err = (out.double() - ref64).abs().max().item()
    torch_err = (torch_out.double() - ref64).abs().max().item()
    assert err <= 2 * torch_err + atol, f"max error {err:.3g} vs torch {torch_err:.3g} + {atol}"
    relnorm = ((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert relnorm <= rel, f"relative norm error {relnorm:.3g} > {rel}"


@pytest.fixture
def close():
    """assert_close_to_ref, as a fixture (test modules here are not a package)."""
    return assert_close_to_ref


def plugin_modules():
    """Every dejavu.plugins module that launches kernels (the ones with their own `jit`)."""
    import importlib
    import pkgutil

    import dejavu.plugins as P
    mods = [importlib.import_module(f"dejavu.plugins.{m.name}") for m in pkgutil.iter_modules(P.__path__)]
    return [m for m in mods if hasattr(m, "jit") and not m.__name__.endswith("_common")]


@pytest.fixture
def launched(monkeypatch):
    """launched(*modules): a list that fills with the names of the kernel functions launched from
    now on through those plugin modules' `jit` (none given: every plugin module's)."""
    def watch(*mods):
        names = []
        mods = mods or plugin_modules()
        for mod in mods:
            real = mod.jit
            monkeypatch.setattr(mod, "jit", lambda fn, dev, real=real: names.append(fn.__name__) or real(fn, dev))
        return names
    return watch


@pytest.fixture
def triton_interp():
    """Skip kernel tests where triton is not installed (it is an optional dependency)."""
    pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _seed(request):
    # different random inputs in every test, reproducible from the test's id
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))

"""benchmarks/e2e.py's ablation rows on the CPU reference path: each applies (an engine change undone
exactly, or other kernel settings for the row's engine), changes what it says, and leaves the plugins'
defaults alone."""
import sys
from pathlib import Path

import pytest
import torch

_BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, _BENCH)  # for this import only (benchmarks/kernels.py must not shadow HF's `kernels`)
try:
    import e2e  # noqa: E402
finally:
    sys.path.remove(_BENCH)

def _state(eng):
    return eng.decoder.options, eng.decoder.pred.topk, eng.ops.settings


def _engine(settings=None):
    from dejavu.runtime import Engine

    c, ranks = e2e.TINY, (32, 4)
    return Engine.from_tensors(e2e.header_for(c, 0.5, "float32", ranks), e2e.random_tensors(c, torch.float32, "cpu",
                                                                                             ranks), "cpu",
                               kernel_settings=settings)


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.mark.parametrize("name", sorted(e2e.ABLATIONS))
def test_ablation_applies_and_undo_restores(engine, name):
    from dejavu.plugins import DEFAULT

    before = _state(engine)
    want = engine.generate([[2, 5, 7, 9]], 3, stop_at_eos=False)
    row = e2e.ABLATIONS[name]
    undo = None
    if isinstance(row, e2e.Settings):  # the row's engine gets other settings; the defaults stay
        ks = row.fn(DEFAULT)
        assert ks != DEFAULT and DEFAULT == type(DEFAULT)(), name
        eng = _engine(ks)
        assert eng.ops.settings is ks
        assert eng.generate([[2, 5, 7, 9]], 3, stop_at_eos=False) == want, name  # timing-only on CPU
        return
    undo = row(engine)
    try:
        changed = _state(engine) != before
        assert changed == (name not in ("same", "same2")), name
        got = engine.generate([[2, 5, 7, 9]], 3, stop_at_eos=False)  # the row runs
        if name in ("same", "same2", "nopdl", "mainzero", "norefresh", "refresh4", "nolnqkv", "nounfolded",
                    "nofoldfinish", "qkvt528", "cublasscore"):
            assert got == want, name  # timing-only on the reference path: the same tokens
    finally:
        if undo:
            undo()
    assert _state(engine) == before, name


def test_decode_options_cannot_change_what_the_engine_was_built_with(engine):
    with pytest.raises(ValueError, match="fixed when the decoder is built"):
        engine.decoder.set_options(kv_policy="full")

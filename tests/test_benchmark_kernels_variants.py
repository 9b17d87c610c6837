"""benchmarks/kernels.py --mlp-variants: every variant changes the kernel settings it names, and
its undo restores all of them exactly."""
import copy
import sys
from pathlib import Path

import pytest

# benchmarks/ leaves sys.path again, and the module is renamed: a top-level "kernels" would be taken
# for Hugging Face's `kernels` package (transformers >= 5.2x looks for it with find_spec)
_BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, _BENCH)
try:
    import kernels as K  # noqa: E402
finally:
    sys.path.remove(_BENCH)
    sys.modules["dejavu_bench_kernels"] = sys.modules.pop("kernels")


def settings():
    C = sys.modules["dejavu.plugins._common"]
    return copy.deepcopy((C.PDL_CONFIG, K.SM.FC2_CONFIG, K.SM.FC1_CONFIG, K.SM.FUSED_FINISH))


@pytest.mark.parametrize("name", sorted(K.MLP_VARIANTS))
def test_variant_changes_settings_and_undo_restores_them(name):
    before = settings()
    undo = K.MLP_VARIANTS[name]()
    assert (settings() != before) == (name != "default"), name
    if undo:
        undo()
    assert settings() == before, name


def test_early_and_prefetch_variants_set_what_they_say():
    C = sys.modules["dejavu.plugins._common"]
    undo = K.MLP_VARIANTS["fc1earlyfc2pf2"]()
    try:
        assert "fc1" in C.PDL_CONFIG["EARLY"] and C.PDL_CONFIG["PREFETCH"]["fc2"] == 2
    finally:
        undo()
    assert "fc1" not in C.PDL_CONFIG["EARLY"] and "fc2" not in (C.PDL_CONFIG.get("PREFETCH") or {})

"""benchmarks/kernels.py --mlp-variants: fc2 block configs passed to the kernels, no module setting patched."""
import sys
from pathlib import Path


# benchmarks/ leaves sys.path again, and the module is renamed: a top-level "kernels" would be taken
# for Hugging Face's `kernels` package (transformers >= 5.2x looks for it with find_spec)
_BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, _BENCH)
try:
    import kernels as K  # noqa: E402
finally:
    sys.path.remove(_BENCH)
    sys.modules["dejavu_bench_kernels"] = sys.modules.pop("kernels")


def test_variants_are_fc2_batch1_configs():
    """Every variant is a `config=` override of fc2's batch-1 blocks: known keys only, nothing patched."""
    from dejavu.plugins import DEFAULT
    from dejavu.plugins.settings import table

    keys = set(vars(DEFAULT.fc2_dot1))
    for name, cfg in K.MLP_VARIANTS.items():
        assert isinstance(cfg, dict) and set(cfg) <= keys, name
        table(DEFAULT.fc2_dot1, cfg)  # a valid override (unknown keys raise)
    assert K.MLP_VARIANTS["default"] == {}
    assert K.Run.settings == DEFAULT  # the run's settings: the plugins' defaults, nothing patched

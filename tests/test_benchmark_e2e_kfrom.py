"""benchmarks/e2e.py --k-from: a built engine's per-layer K mapped onto another shape."""
import sys
from pathlib import Path

import pytest

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.predictors import Predictors
from dejavu.models.loader import load_config
from dejavu.runtime.spec import spec_from_header

_BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
_HELP = str(Path(__file__).resolve().parent / "compiler")
sys.path[:0] = [_BENCH, _HELP]  # for these imports only (benchmarks/kernels.py must not shadow HF's `kernels`)
try:
    import e2e  # noqa: E402
    from helpers_compiler import random_predictors  # noqa: E402
finally:
    sys.path.remove(_BENCH), sys.path.remove(_HELP)


def test_k_mapping_is_proportional_in_layers_and_k():
    kf = e2e.KFrom("x", 0.5, mlp=(0.1, 0.5, 1.0), attn=(1.0, 0.5, 0.25))
    mk, ak = kf.ks(6, 100, 8)  # target layers 0..5 read source layers 0,0,1,1,2,2
    assert mk == [10, 10, 50, 50, 100, 100] and ak == [8, 8, 4, 4, 2, 2]
    mk, ak = kf.ks(2, 1000, 56)  # fewer layers: source 0 and 1
    assert mk == [100, 500] and ak == [56, 28]
    assert kf.ks(3, 3, 3) == ([1, 2, 3], [3, 2, 1])  # K >= 1, <= N


def test_k_from_a_built_engine_onto_the_opt_30b_shape(tiny_opt_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path / "cache"))
    cfg = load_config(tiny_opt_dir)
    preds = Predictors.from_state_dict(random_predictors(cfg, rank=8, rank_attn=4), {"source": "attn_in", "lookahead": 1})
    s = build_engine(tiny_opt_dir, BuildConfig(density=0.7), tmp_path / "m.engine", progress=False, predictors=preds)
    kf = e2e.KFrom.from_engine(str(tmp_path / "m.engine"))
    assert kf.density == pytest.approx(0.7) and len(kf.mlp) == cfg.num_hidden_layers
    c = e2e.SHAPES["opt-30b"]
    h = e2e.header_for(c, kf, "float16", (512, 56))
    spec = spec_from_header(h)
    L, F, H = c["num_hidden_layers"], c["ffn_dim"], c["num_attention_heads"]
    assert len(spec.mlp_k) == L
    for l in range(L):  # each OPT-30B layer keeps its source layer's fractions (to rounding)
        j = l * cfg.num_hidden_layers // L
        assert abs(spec.mlp_k[l] / F - s["mlp_k"][j] / cfg.ffn_dim) <= 0.5 / F + 1e-12
        assert abs(spec.attn_k[l] / H - s["attn_k"][j] / cfg.num_attention_heads) <= 0.5 / H + 1e-12

"""The compiler's engines through the runtime: layout agreement and masked-dense equality."""
from __future__ import annotations

import pytest
import torch

from dejavu.runtime import Engine
from runtime_helpers import MaskedDense, engine_from_dense, random_predictors, tiny_model

build = pytest.importorskip("dejavu.compiler.build")
layout = pytest.importorskip("dejavu.compiler.layout")
config = pytest.importorskip("dejavu.compiler.config")


def test_compiler_kernel_layout_equals_runtime_helper():
    model = tiny_model(seed=1)
    _, mine = engine_from_dense(model)
    theirs = layout.kernel_layout(model, torch.float32)
    assert set(theirs) == {k for k in mine if ".pred_" not in k}
    for k, v in theirs.items():
        assert torch.equal(v, mine[k]), k


def test_compiled_engine_greedy_equals_masked_dense(tiny_opt_dir, tmp_path):
    from dejavu.compiler.predictors import Predictors
    from dejavu.models.loader import load_model

    model, cfg = load_model(tiny_opt_dir, dtype=torch.float32)
    pi = {"source": "attn_in", "lookahead": 1}
    preds = Predictors.from_state_dict(random_predictors(cfg, seed=5), pi)
    path = tmp_path / "t.engine"
    build.build_engine(tiny_opt_dir, config.BuildConfig(density=0.5, dtype="float32", allocation="uniform"),
                       path, progress=False, predictors=preds)
    eng = Engine.load(path)
    header, tensors = eng.header, {k: v for k, v in eng.tensors.items()}
    prompt = eng.tokenizer.encode("The game began")
    ref = MaskedDense(model, header, tensors)
    assert eng.generate([prompt], 32, stop_at_eos=False)[0] == ref.generate(prompt, 32)


def test_compiled_dense_engine_equals_dense_model(tiny_opt_dir, tmp_path):
    from dejavu.models.loader import load_model

    model, _ = load_model(tiny_opt_dir, dtype=torch.float32)
    path = tmp_path / "d.engine"
    build.build_engine(tiny_opt_dir, config.BuildConfig(density=1.0, no_predictors=True, dtype="float32"),
                       path, progress=False)
    eng = Engine.load(path)
    ids = torch.tensor([eng.tokenizer.encode("In 1990 the game")])
    with torch.no_grad():
        torch.testing.assert_close(eng.logits(ids), model(ids), atol=1e-5, rtol=1e-5)

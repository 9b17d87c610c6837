"""The compiler's engines through the runtime: layout agreement and masked-dense equality."""
from __future__ import annotations

import pytest
import torch

from dejavu.runtime import Engine
from runtime_helpers import MaskedDense, engine_from_dense, random_predictors, tiny_model

build = pytest.importorskip("dejavu.compiler.build")


def test_compiler_kernel_layout_equals_runtime_helper():
    model = tiny_model(seed=1)
    _, mine = engine_from_dense(model)
    theirs = build.kernel_layout(model, torch.float32)
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
    build.build_engine(tiny_opt_dir, build.BuildConfig(density=0.5, dtype="float32", allocation="uniform"),
                       path, progress=False, predictors=preds)
    eng = Engine.load(path)
    header, tensors = eng.header, {k: v for k, v in eng.tensors.items()}
    prompt = eng.tokenizer.encode("The game began")
    ref = MaskedDense(model, header, tensors)
    assert eng.generate([prompt], 32, stop_at_eos=False)[0] == ref.generate(prompt, 32)

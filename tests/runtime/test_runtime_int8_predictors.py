"""Engines with int8 MLP predictors (build_config.predictor_dtype): the runtime reads the int8 rows and their
fp16 scales, selects what a float engine of the dequantized values selects, the same with the overlap on and
off; engines written before the field run as before."""
from __future__ import annotations

import json

import torch

from dejavu.compiler.predictors import quantize_rows
from dejavu.engine_file import read_engine, write_engine
from dejavu.runtime import Engine
from runtime_helpers import engine_from_dense, tiny_model
from test_runtime_overlap import PROMPT, _fake_cuda_engine


def _int8(header, tensors):
    """(int8 engine, float engine of its dequantized values): the MLP predictors' a, b as int8 rows."""
    q, f = dict(tensors), dict(tensors)
    for name in [n for n in tensors if ".pred_mlp." in n and n.endswith((".a", ".b"))]:
        q[name], q[name + "_scale"] = quantize_rows(tensors[name])
        f[name] = q[name].float() * q[name + "_scale"].float()[:, None]
    hq = json.loads(json.dumps(header))
    hq["build_config"]["predictor_dtype"] = {"mlp": "int8", "attn": "float"}
    return (hq, q), (header, f)


def _run(eng, prompts, n=8):
    eng.decoder.pred.trace = []
    tokens = eng.generate(prompts, n, stop_at_eos=False)
    return tokens, [(l, kind, idx.tolist()) for l, kind, idx in eng.decoder.pred.trace]


def test_int8_engine_selects_what_its_dequantized_float_engine_selects(tmp_path):
    (hq, q), (hf, f) = _int8(*engine_from_dense(tiny_model(seed=2), 0.3, 0.5))
    write_engine(tmp_path / "q.engine", hq, q)
    eng = Engine.load(tmp_path / "q.engine", "cpu", overlap=False)
    assert eng.spec.int8_predictors == {"mlp"}
    assert eng.tensors["layers.0.pred_mlp.a"].dtype == torch.int8
    assert eng.tensors["layers.0.pred_mlp.a_scale"].dtype == torch.float16  # not cast to the engine dtype
    got = _run(eng, [PROMPT, PROMPT[:3]])
    # the float32 CPU path dequantizes exactly (q * scale in fp32): the same scores, indices and tokens
    assert got == _run(Engine.from_tensors(hf, f, "cpu", overlap=False), [PROMPT, PROMPT[:3]])
    assert any(kind == "mlp" for _, kind, _ in got[1])


def test_int8_selection_same_with_overlap_on_and_off(monkeypatch):
    (hq, q), _ = _int8(*engine_from_dense(tiny_model(seed=2), 0.5, 0.5, "attn_in", 1))
    want = _run(Engine.from_tensors(hq, q, "cpu", overlap=False), [PROMPT])
    fake, eng, dec = _fake_cuda_engine(monkeypatch, hq, q)
    assert dec.pred.overlapping
    assert _run(eng, [PROMPT]) == want
    assert any(op == "record" and s == "side" for op, s, _ in fake.log)


def test_old_engine_runs_as_before(tmp_path):
    """An engine file without build_config.predictor_dtype: float predictors, the same tokens and indices
    as the same engine stating float explicitly."""
    header, tensors = engine_from_dense(tiny_model(seed=2), 0.3, 0.5)
    assert "predictor_dtype" not in header["build_config"]
    write_engine(tmp_path / "old.engine", header, tensors)
    old = Engine.load(tmp_path / "old.engine", "cpu", overlap=False)
    assert old.spec.int8_predictors == frozenset()
    explicit = json.loads(json.dumps(header))
    explicit["build_config"]["predictor_dtype"] = {"mlp": "float", "attn": "float"}
    h, t = read_engine(tmp_path / "old.engine")
    assert h == header
    assert _run(old, [PROMPT]) == _run(Engine.from_tensors(explicit, t, "cpu", overlap=False), [PROMPT])

"""benchmarks/llama_prompt_prefill.py on a tiny Llama engine: its prefills against the token-parallel logits."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location(
    "llama_prompt_prefill", Path(__file__).resolve().parents[1] / "benchmarks" / "llama_prompt_prefill.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_prefills_against_token_parallel_logits(tmp_path):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.runtime import Engine
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=1)
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=256, calib_window=64, dtype="float32"),
                 tmp_path / "t.engine", progress=False)
    eng = Engine.load(tmp_path / "t.engine")
    ids = torch.randint(0, 320, (3, 20), generator=torch.Generator().manual_seed(0))
    lp = F.log_softmax(eng.logits(ids), -1)
    par = {p: float(-lp[:, p - 1:-1].gather(-1, ids[:, p:, None]).mean()) for p in (1, 6)}
    assert study.decoded_nll(eng, ids, 6, "thresholded") == pytest.approx(par[6], abs=1e-5)
    assert study.decoded_nll(eng, ids, 1, "engine") == pytest.approx(par[1], abs=1e-5)  # one token: thresholded
    assert abs(study.decoded_nll(eng, ids, 6, "engine") - par[6]) > 1e-3  # positions 1-5 dense
    assert abs(study.decoded_nll(eng, ids, 1, "dense") - par[1]) > 1e-3
    assert "prefill" not in eng.decoder.__dict__  # the engine's own prefill is back
    # "sink": the dense prefill's first token, then the decode reads a thresholded first position: one-token
    # prompts decode as the engine's prefill does after that first token
    _, dense_first = study.decoded_scores(eng, ids, 6, "dense")
    _, sink_first = study.decoded_scores(eng, ids, 6, "sink")
    assert torch.equal(sink_first, dense_first)
    lp_engine = F.log_softmax(eng.decode_logits(ids, 1).float(), -1)
    eng.decoder.prefill = study._prefill(eng.decoder, "sink")
    try:
        lp_sink = F.log_softmax(eng.decode_logits(ids, 1).float(), -1)
    finally:
        del eng.decoder.prefill
    assert torch.allclose(lp_sink[:, 1:], lp_engine[:, 1:], atol=1e-5)
    assert not torch.allclose(lp_sink[:, 0], lp_engine[:, 0], atol=1e-4)
    out = tmp_path / "r.json"
    res = study.main([str(tmp_path / "t.engine"), "--model", str(folder), "--prompt", "32", "--window", "64",
                      "--windows", "2", "--prefills", "engine", "dense", "--out", str(out)])
    assert json.loads(out.read_text()) == res and res["scored_tokens"] == 2 * 32
    # the first decoded token: a dense prefill's is the dense model's (its engine is dense but for masks),
    # the engine's reads a thresholded first position
    dense_first, engine_first = (res["prefills"][n]["first_token"] for n in ("dense", "engine"))
    assert dense_first["kl"] == pytest.approx(0.0, abs=1e-6) and dense_first["argmax_agrees"] == 1.0
    assert dense_first["nll"] == pytest.approx(dense_first["nll_dense"], abs=1e-5)
    assert engine_first["kl"] > 1e-4
    assert set(res["prefills"]) == {"engine", "dense"} and math.isfinite(res["ppl_dense"])


def test_first_token_scores_against_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    dense_lp = F.log_softmax(torch.randn(5, 7, generator=g), -1)
    lp = F.log_softmax(torch.randn(5, 7, generator=g), -1)
    target = torch.tensor([0, 3, 6, 2, 2])
    got = study.first_token(lp, dense_lp, target)
    p, q = dense_lp.double().exp(), lp.double().exp()
    assert got["kl"] == pytest.approx(float((p * (p / q).log()).sum(-1).mean()), rel=1e-5)
    assert got["nll"] == pytest.approx(float(-lp[range(5), target].mean()), rel=1e-6)
    assert got["argmax_agrees"] == float((lp.argmax(-1) == dense_lp.argmax(-1)).float().mean())
    assert study.first_token(dense_lp, dense_lp, target)["kl"] == pytest.approx(0.0, abs=1e-6)

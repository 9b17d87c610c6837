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
    out = tmp_path / "r.json"
    res = study.main([str(tmp_path / "t.engine"), "--model", str(folder), "--prompt", "32", "--window", "64",
                      "--windows", "2", "--prefills", "engine", "dense", "--out", str(out)])
    assert json.loads(out.read_text()) == res and res["scored_tokens"] == 2 * 32
    assert set(res["prefills"]) == {"engine", "dense"} and math.isfinite(res["ppl_dense"])

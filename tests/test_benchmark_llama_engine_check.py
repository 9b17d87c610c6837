"""benchmarks/llama_engine_check.py on a tiny fp32 engine: engine and simulation give one perplexity."""
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "llama_engine_check", Path(__file__).resolve().parents[1] / "benchmarks" / "llama_engine_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_engine_and_simulation_agree_on_a_tiny_fp32_engine(tmp_path):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=1)
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=256, calib_window=64, dtype="float32"),
                 tmp_path / "t.engine", progress=False)
    out = tmp_path / "r.json"
    assert check.main([str(tmp_path / "t.engine"), "--model", str(folder), "--tokens", "256", "--window", "64",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["scored_tokens"] == 4 * 63 and r["ppl_engine"] == pytest.approx(r["ppl_simulation"], rel=1e-5)
    # the engine's own masks, counted: the simulation's bytes (fp32: the same masks)
    assert 0.2 < r["skip_realized_engine"] == pytest.approx(r["skip_realized_simulation"], abs=2e-3)
    assert r["ppl_simulation"] != pytest.approx(r["ppl_dense"], rel=1e-3)


def test_a_rotated_engines_simulation_is_the_rotated_model(tmp_path):
    """--rotate-keep: the thresholds are the rotated model's, so the simulation rotates the model
    on the engine's calibration windows first; engine and simulation then agree in fp32."""
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=1)
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=256, calib_window=64, dtype="float32", rotate_keep=2),
                 tmp_path / "r.engine", progress=False)
    out = tmp_path / "r.json"
    assert check.main([str(tmp_path / "r.engine"), "--model", str(folder), "--tokens", "256", "--window", "64",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ppl_engine"] == pytest.approx(r["ppl_simulation"], rel=1e-5)
    assert r["ppl_simulation"] != pytest.approx(r["ppl_dense"], rel=1e-3)
    assert r["rotate_keep"] == 2


def test_a_distilled_engine_gets_no_simulation_of_the_source_weights(tmp_path):
    """--distill-steps: the engine's weights were trained at build, so a simulation on the source model would
    measure another model; it is left out (null) and the engine is measured against the source's dense model."""
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=1)
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=256, calib_window=64, dtype="float32",
                                     distill_steps=2, refine_evals=0), tmp_path / "d.engine", progress=False)
    out = tmp_path / "d.json"
    assert check.main([str(tmp_path / "d.engine"), "--model", str(folder), "--tokens", "256", "--window", "64",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["distilled"] and r["ppl_simulation"] is None and r["skip_realized_simulation"] is None
    assert 0.2 < r["skip_realized_engine"] < 0.8  # its own thresholds on its own weights
    assert r["ppl_engine"] != pytest.approx(r["ppl_dense"], rel=1e-3)

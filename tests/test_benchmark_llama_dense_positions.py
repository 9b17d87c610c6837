"""benchmarks/llama_dense_positions.py on a tiny Llama: every position read whole is the dense model."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "llama_dense_positions", Path(__file__).resolve().parents[1] / "benchmarks" / "llama_dense_positions.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_ranges_between_sparse_and_dense(tmp_path):
    import dejavu.compiler.gated_sparsity as G
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=1)
    plain = G._hooks
    r = study.main(["--model", str(folder), "--skip", "0.5", "--windows", "2", "--window", "64",
                    "--calib-tokens", "256", "--ranges", "0-0", "0-64", "1-32"])["ranges"]
    assert G._hooks is plain  # gated_sparsity's own hooks are back
    assert r["0-64"]["vs_dense_pct"] == pytest.approx(0.0, abs=1e-9)  # every position whole: the dense model
    assert abs(r["0-0"]["vs_dense_pct"]) > 1e-3 and abs(r["1-32"]["ppl"] - r["0-0"]["ppl"]) > 1e-6

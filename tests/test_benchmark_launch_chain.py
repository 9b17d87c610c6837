"""benchmarks/launch_chain.py: the chain's arithmetic under Triton's interpreter, the floor bound by hand, one
line and exit 2 without a GPU."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_chain.py"
_spec = importlib.util.spec_from_file_location("launch_chain", SCRIPT)
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


def test_smoke_chain_sums_every_launch():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")  # in a subprocess: the interpreter before triton is imported
    p = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "5 launches summed as expected" in p.stdout


def test_floor_bound_is_ten_launches_a_layer_over_the_floor():
    got = lc.floor_bound(2.5)
    assert got["llama-3-8b"] == pytest.approx((1.924 + 10 * 32 * 2.5e-3) / 1.924, abs=1e-3)
    assert got["llama-3-70b-tp8"] == pytest.approx((2.099 + 10 * 80 * 2.5e-3) / 2.099, abs=1e-3)
    assert lc.floor_bound(0.0) == {"llama-3-8b": 1.0, "llama-3-70b-tp8": 1.0}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_one_line_and_exit_2(capsys):
    assert lc.main([]) == 2
    assert capsys.readouterr().err.strip() == "launch_chain: needs a GPU (or --smoke under TRITON_INTERPRET=1)"

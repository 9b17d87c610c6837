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


def test_weight_slices_are_whole_blocks_a_program_cycled_over_the_pool():
    ws = lc.weight_slices(programs=4, mb=0.05, launches=7, pool_bytes=3 * 2 * 4 * lc.READ_BLOCK * 6, device="cpu")
    per = ws[0].numel()
    assert per % (4 * lc.READ_BLOCK) == 0 and abs(2 * per - 0.05 * 2**20) <= 2 * 4 * lc.READ_BLOCK
    assert all(w.numel() == per for w in ws)
    starts = [w.storage_offset() for w in ws]
    assert starts == [(i % 3) * per for i in range(7)]  # three slices fit the pool; launch i reads slice i mod 3


def test_read_efficiency_against_the_copy_bandwidth():
    r = {"bytes_per_launch": 8_000_000, "us_per_launch": 3.0}
    got = lc.read_efficiency(r, copy=4000.0)  # GB/s: 8 MB take 2 µs
    assert got == {"at_copy_us": 2.0, "over_floor": 1.5, "extra_us": 1.0}

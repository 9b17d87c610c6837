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


SHAPE = dict(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             num_hidden_layers=3, vocab_size=100)


def test_gemv_bytes_are_the_kept_rows_of_each_projection():
    qkv, o, gu, down = lc.gemv_bytes(SHAPE, skip=0.5)
    assert qkv == 0.5 * 64 * (4 + 2 * 2) * 16 * 2 and o == 0.5 * 64 * 64 * 2
    assert gu == 0.5 * 64 * 2 * 96 * 2 and down == 0.5 * 96 * 64 * 2
    assert lc.gemv_bytes(SHAPE, skip=0.0)[0] == 2 * qkv


def _run(overhead_us: float, small_us: float, copy_GBps: float = 1.0) -> dict:
    # a run's JSON whose reading launches take their bytes at the copy bandwidth plus a fixed overhead
    sizes = [1_000, 4_000, 64_000]
    reads = [{"bytes_per_launch": n, "us_per_launch": n / (copy_GBps * 1e3) + overhead_us, "pdl": True,
              "early": False, "programs": 8} for n in sizes]
    runs = [{"programs": 2, "pdl": True, "us_per_launch": small_us}, {"programs": 1, "pdl": True, "us_per_launch": 99.0}]
    return {"copy_GBps": copy_GBps, "reads": reads, "runs": runs}  # no "sms": 8 reading programs / 4


def test_structure_bound_is_the_floor_without_fixed_costs():
    b = lc.structure_bound(_run(0.0, 0.0), {"s": SHAPE})["s"]
    assert b["over_floor"] == 1.0 and b["step_ms"] == b["floor_ms"]


def test_structure_bound_adds_each_launchs_fixed_cost():
    copy = 1.0  # GB/s: a byte a ns, 1e3 bytes a µs
    b = lc.structure_bound(_run(2.0, 0.5, copy), {"s": SHAPE})["s"]
    per, head = sum(lc.gemv_bytes(SHAPE)), 2 * 100 * 64
    layer = per / 1e3 + 4 * 2.0 + 6 * 0.5  # the reads are linear in bytes: the interpolation is exact
    assert b["layer_us"] == pytest.approx(layer, abs=0.01)
    assert b["step_ms"] == pytest.approx((3 * layer + head / 1e3) / 1e3, abs=1e-3)
    assert b["over_floor"] == pytest.approx(b["step_ms"] / ((3 * per + head) / 1e6), abs=2e-3)


def test_from_a_raw_file_prints_both_llama_shapes(tmp_path, capsys):
    raw = tmp_path / "run.json"
    raw.write_text(__import__("json").dumps(_run(1.0, 0.5, copy_GBps=3000.0)))
    assert lc.main(["--from", str(raw)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in out] == ["llama-3-8b", "llama-3-70b-tp8"]  # no early reads in this run
    assert all("x)" in ln for ln in out)


def test_structure_bound_needs_both_chains():
    r = _run(1.0, 1.0)
    r["reads"] = r["reads"][:1]
    with pytest.raises(ValueError, match="no reading chain"):
        lc.structure_bound(r, {"s": SHAPE})


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


def test_plot_draws_the_reading_chains(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot_launch_chain", SCRIPT.parent / "plot_launch_chain.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    run = _run(1.0, 0.5, copy_GBps=3000.0)
    for r in run["reads"]:
        r.update(lc.read_efficiency(r, 3000.0))
    raw = tmp_path / "run.json"
    raw.write_text(__import__("json").dumps(run))
    assert plot.main([str(raw), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["p.png", "run.json"]  # no temporary file left

"""benchmarks/input_sparse_sweep.py's --smoke mode: tiny shapes on the CPU under Triton's interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "input_sparse_sweep.py"


def test_smoke_checks_and_times_every_projection(tmp_path):
    """Every projection kind of the tiny shape: its defaults (gate/up's block_k 64: input_sparse.projections) and
    other warps, each checked against PyTorch before it is timed (no errors), the best per shape recorded; a bad
    --models is one argparse line."""
    pytest.importorskip("triton")
    out = tmp_path / "r.json"
    env = dict(os.environ, TRITON_INTERPRET="1")  # in a subprocess: the interpreter before triton is imported
    p = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--stages", "warps", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(out.read_text())
    names = {"tiny/qkv", "tiny/o", "tiny/gate_up", "tiny/down"}
    assert d["errors"] == [] and {s["shape"] for s in d["shapes"]} == names == set(d["best"])
    assert all(0 < s["kept_rows"] < s["N"] and s["read_bytes"] == s["kept_rows"] * s["M"] * 2 for s in d["shapes"])
    got = {(r["shape"], r["stage"]) for r in d["results"]}
    assert got == {(n, st) for n in names for st in ("default", "warps")}
    default = {r["shape"]: r for r in d["results"] if r["stage"] == "default"}
    assert all(r["settings"] == {} for r in default.values())  # settings: what differs from the kind's defaults
    assert default["tiny/gate_up"]["config"]["block_k"] == 64 and default["tiny/o"]["config"]["block_k"] == 128
    assert all(r["config"]["projections"] == [] for r in d["results"])  # the launch takes the config as it is
    assert {r["settings"].get("num_warps") for r in d["results"] if r["stage"] == "warps"} == {2}
    assert all(r["max_rel_diff"] <= 2e-2 and r["us"] > 0 for r in d["results"])
    assert d["bandwidth"]["copy_GBps"] > 0 and "best settings" in p.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--models", "llama-9", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown shape(s) llama-9" in bad.stderr.strip().splitlines()[-1]

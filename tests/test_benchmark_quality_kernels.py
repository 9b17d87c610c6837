"""benchmarks/quality_kernels.py on a tiny model, CPU: engines built, each path scored, the JSON."""
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

# loaded from its file: benchmarks/ stays off sys.path (a top-level "kernels" module there would be taken
# for Hugging Face's `kernels` package by transformers in the same process)
_SPEC = importlib.util.spec_from_file_location(
    "dejavu_bench_quality_kernels", Path(__file__).resolve().parents[1] / "benchmarks" / "quality_kernels.py")
Q = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(Q)


def test_quality_runs_on_a_tiny_model(tiny_opt_dir, tmp_path, capsys):
    out = tmp_path / "q.json"
    argv = ["--model", str(tiny_opt_dir), "--engines", "0.5/1.0", "--dtype", "float32", "--devices", "cpu",
            "--cpu-paths", "parallel,decode,generate", "--ppl-tokens", "200", "--tasks", "copa", "--limit", "3",
            "--work", str(tmp_path / "engines"), "--out", str(out)]
    assert Q.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["errors"] == [] and got["meta"]["torch"]
    (eng,) = got["engines"]
    assert eng["sha256"] == hashlib.sha256(Path(eng["path"]).read_bytes()).hexdigest()
    rows = {r["path"]: r for r in got["results"]}
    assert set(rows) == {None, "parallel", "decode", "generate"} and rows[None]["kind"] == "dense"
    # the decode loop from an empty cache scores what the token-parallel path scores
    assert rows["decode"]["perplexity"] == pytest.approx(rows["parallel"]["perplexity"], rel=1e-5)
    assert rows["decode"]["tasks"] == rows["parallel"]["tasks"]
    assert all(r["sha256"] == eng["sha256"] for p, r in rows.items() if p)
    # per-example agreement with the CPU parallel reference: decode scores the same, so all equal
    agree = {(x["path"], x["metric"]): x for x in got["agreement"]}
    assert set(agree) == {("decode", "acc"), ("generate", "acc")}  # copa records no acc_norm
    assert agree["decode", "acc"]["n"] == 3 and agree["decode", "acc"]["fraction"] == 1.0
    assert "| parallel |" in capsys.readouterr().out


def test_engine_specs():
    assert Q.parse_engine("d0.7") == {"name": "d0.7", "density": 0.7}
    assert Q.parse_engine("0.3/1.0") == {"name": "m0.3-a1", "mlp_density": 0.3, "attn_density": 1.0}


def test_agreement_takes_the_cpu_run_of_the_same_path_for_gpu_rows():
    def row(device, path, preds):
        return {"model": "e.engine", "sha256": "s", "device": device, "path": path,
                "tasks": {"copa": {"preds": preds}}}

    rows = [row("cpu", "parallel", [0, 1, 1, 0]), row("cpu", "generate", [1, 1, 1, 0]),
            row("cpu", "decode", [0, 1, 1, 1]), row("cuda", "generate", [1, 1, 1, 0]), row("cuda", "decode", [0, 1, 1, 0])]
    got = {(x["device"], x["path"]): (x["reference"], x["equal"]) for x in Q.agreement(rows)}
    # GPU rows against the CPU run of their own path; CPU rows against the CPU parallel run
    assert got == {("cpu", "generate"): ("cpu parallel", 3), ("cpu", "decode"): ("cpu parallel", 3),
                   ("cuda", "generate"): ("cpu generate", 4), ("cuda", "decode"): ("cpu decode", 3)}

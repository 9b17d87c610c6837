"""dejavu-compare: Polygraphy comparison of an engine with its dense model; exit status gates CI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dejavu.errors import DejavuError
from dejavu.runtime.compare import main, parse_tolerance

from _helpers import write_test_engine

pytest.importorskip("polygraphy")


@pytest.fixture(scope="module")
def engines(tiny_opt_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    return {"dense": write_test_engine(tiny_opt_dir, d / "d1.engine"),
            "broken": write_test_engine(tiny_opt_dir, d / "broken.engine", perturb=0.05),
            "anon": write_test_engine(tiny_opt_dir, d / "anon.engine", record_source=False)}


def _report(capsys, argv):
    rc = main(argv + ["--json", "--tokens", "32"])
    return rc, json.loads(capsys.readouterr().out)


def test_density_1_passes(engines, capsys):
    rc, r = _report(capsys, [str(engines["dense"])])
    assert rc == 0 and r["passed"]
    c = r["comparisons"][0]
    assert (c["reference"], c["test"]) == ("dense-torch", "engine")
    assert c["top1_agreement"] == 1.0 and c["outputs"]["logits"]["max_absdiff"] < 1e-3


def test_broken_engine_fails(engines, capsys):
    rc, r = _report(capsys, [str(engines["broken"])])
    assert rc == 1 and not r["passed"]
    assert r["comparisons"][0]["outputs"]["logprobs"]["max_absdiff"] > 1e-2


def test_loose_tolerances_pass_the_broken_engine(engines, capsys):
    rc, _ = _report(capsys, [str(engines["broken"]), "--atol", "100", "--rtol", "1e9", "--top1-min", "0"])
    assert rc == 0


def test_exit_status_from_the_command_line(engines, tiny_opt_dir, capsys):
    cmd = [sys.executable, "-m", "dejavu.runtime.compare", "--tokens", "16", "--samples", "1"]
    assert subprocess.run(cmd + [str(engines["broken"])], capture_output=True).returncode == 1
    with pytest.raises(SystemExit) as e:  # usage error: the header names no dense model
        main([str(engines["anon"]), "--tokens", "16"])
    assert e.value.code == 2 and "pass --dense MODEL" in capsys.readouterr().err
    assert main([str(engines["anon"]), "--dense", str(tiny_opt_dir), "--tokens", "16"]) == 0


def test_onnx_runners(tiny_opt_dir, engines, tmp_path, capsys):
    """The compiler's dense prefill.onnx through ONNX Runtime in --onnx-dir."""
    pytest.importorskip("onnxruntime")
    onnx_export = pytest.importorskip("dejavu.compiler.onnx_export")
    from dejavu.models.loader import load_model

    model, _ = load_model(tiny_opt_dir)
    onnx_export.export_onnx(model, tmp_path)
    rc, r = _report(capsys, [str(engines["dense"]), "--onnx-dir", str(tmp_path)])
    names = [(c["reference"], c["test"]) for c in r["comparisons"]]
    assert names == [("dense-torch", "engine"), ("dense-torch", "dense-onnx")]
    assert rc == 0, r


@pytest.mark.parametrize("argv, match", [
    (["/nonexistent.engine"], "engine file not found"),
    (["{dense}", "--top1-min", "2"], "--top1-min must be in"),
    (["{dense}", "--atol", "nosuch:1"], "unknown output 'nosuch'"),
    (["{dense}", "--onnx-dir", "/nonexistent"], "not a folder"),
])
def test_usage_errors(engines, argv, match):
    argv = [a.format(dense=engines["dense"]) for a in argv]
    with pytest.raises(DejavuError, match=match):
        main.__wrapped__(argv)


def test_parse_tolerance():
    assert parse_tolerance(["0.5", "logprobs:1e-2"], 1e-3, "--atol") == {"": 0.5, "logprobs": 0.01}

"""dejavu-compare: Polygraphy comparison of an engine with its dense model; exit status gates CI."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.runtime.evaluation.compare import main, parse_tolerance

from _helpers import write_test_engine

pytest.importorskip("polygraphy")


@pytest.fixture(scope="module")
def engines(tiny_opt_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    return {"dense": write_test_engine(tiny_opt_dir, d / "d1.engine"),
            "broken": write_test_engine(tiny_opt_dir, d / "broken.engine", perturb=0.05),
            "anon": write_test_engine(tiny_opt_dir, d / "anon.engine", record_source=False),
            "sparse": write_test_engine(tiny_opt_dir, d / "d5.engine", density=0.5)}


def _report(capsys, argv):
    rc = main(argv + ["--json", "--tokens", "32"])
    return rc, json.loads(capsys.readouterr().out)


def test_density_1_passes(engines, capsys):
    rc, r = _report(capsys, [str(engines["dense"]), "--exact"])
    assert rc == 0 and r["passed"] and r["comparisons"][0]["gate"] == "exact"
    c = r["comparisons"][0]
    assert (c["reference"], c["test"]) == ("dense-torch", "engine")
    assert c["top1_agreement"] == 1.0 and c["outputs"]["logits"]["max_absdiff"] < 1e-3


def test_broken_engine_fails(engines, capsys):
    rc, r = _report(capsys, [str(engines["broken"]), "--exact"])
    assert rc == 1 and not r["passed"]
    assert r["comparisons"][0]["outputs"]["logprobs"]["max_absdiff"] > 1e-2


def test_loose_tolerances_pass_the_broken_engine(engines, capsys):
    rc, _ = _report(capsys, [str(engines["broken"]), "--exact", "--atol", "100", "--rtol", "1e9",
                             "--exact-top1-min", "0"])
    assert rc == 0


def test_exit_status_from_the_command_line(engines, tiny_opt_dir, capsys):
    cmd = [sys.executable, "-m", "dejavu.runtime.evaluation.compare", "--tokens", "16", "--samples", "1"]
    assert subprocess.run(cmd + [str(engines["broken"]), "--exact"], capture_output=True).returncode == 1
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


def test_sparse_engine_gate_kl_and_top1(engines, tiny_opt_dir, capsys):
    """A sparse engine: gated on mean KL(dense || engine) and top-1, both checked against a
    hand computation; the element-wise tolerances only with --exact."""
    from dejavu.models.loader import load_model
    from dejavu.runtime.evaluation.compare import sample_feeds
    from dejavu.runtime.engine import Engine
    from dejavu.datafiles import WIKITEXT2_TEST
    from dejavu.runtime.evaluation.evaluate import read_text

    path = str(engines["sparse"])
    rc, r = _report(capsys, [path, "--samples", "2", "--max-kl", "100", "--top1-min", "0"])
    assert rc == 0 and r["mode"] == "sparse"
    c = r["comparisons"][0]
    assert c["gate"] == "sparse" and c["outputs"]["logits"]["passed"] is False  # not what gates a sparse engine
    eng, (model, _) = Engine.load(path), load_model(tiny_opt_dir)
    kl = top1 = n = nll_d = nll_e = 0.0
    for feed in sample_feeds(eng.tokenizer, read_text(WIKITEXT2_TEST), 32, 2):
        ids = torch.as_tensor(feed["input_ids"])
        with torch.no_grad():
            ld = torch.log_softmax(model(ids).double(), -1)[0]
            le = torch.log_softmax(eng.logits(ids).double(), -1)[0]
        kl += float((ld.exp() * (ld - le)).sum())
        top1 += float((ld.argmax(-1) == le.argmax(-1)).sum())
        n += ld.shape[0]
        nll_d -= float(ld[:-1].gather(1, ids[0, 1:, None]).sum())
        nll_e -= float(le[:-1].gather(1, ids[0, 1:, None]).sum())
    assert c["kl_mean"] == pytest.approx(kl / n, rel=1e-3, abs=1e-6) and c["kl_mean"] > 1e-3
    assert c["top1_agreement"] == pytest.approx(top1 / n)
    assert c["ppl_increase"] == pytest.approx(math.exp((nll_e - nll_d) / (n - 2)) - 1, rel=1e-3, abs=1e-6)
    assert _report(capsys, [path, "--samples", "2", "--max-kl", f"{0.9 * c['kl_mean']}", "--top1-min", "0"])[0] == 1
    above = f"{min(1, top1 / n + 0.01)}"
    assert _report(capsys, [path, "--samples", "2", "--max-kl", "100", "--top1-min", above])[0] == 1
    rc, r = _report(capsys, [path, "--samples", "2", "--exact"])
    assert rc == 1 and r["mode"] == "exact" and r["comparisons"][0]["gate"] == "exact"
    assert main([path, "--samples", "2", "--tokens", "32", "--max-kl", "100", "--top1-min", "0"]) == 0
    text = capsys.readouterr().out
    assert "checked: mean KL" in text and "perplexity " in text and "(not gated; --exact)" in text


@pytest.mark.parametrize("argv, match", [
    (["/nonexistent.engine"], "engine file not found"),
    (["{dense}", "--top1-min", "2"], "--top1-min must be in"),
    (["{dense}", "--exact-top1-min", "-1"], "--exact-top1-min must be in"),
    (["{dense}", "--max-kl", "-1"], "--max-kl must be >= 0"),
    (["{dense}", "--atol", "nosuch:1"], "unknown output 'nosuch'"),
    (["{dense}", "--onnx-dir", "/nonexistent"], "not a folder"),
])
def test_usage_errors(engines, argv, match):
    argv = [a.format(dense=engines["dense"]) for a in argv]
    with pytest.raises(DejavuError, match=match):
        main.__wrapped__(argv)


def test_parse_tolerance():
    assert parse_tolerance(["0.5", "logprobs:1e-2"], 1e-3, "--atol") == {"": 0.5, "logprobs": 0.01}


def test_dense_model_from_the_header():
    from dejavu.runtime.evaluation.compare import dense_from_header

    assert dense_from_header({"model": "opt-mini"}) == "opt-mini"  # a preset
    assert dense_from_header({"model": "facebook/opt-125m"}) == "facebook/opt-125m"  # a hub id
    # a folder's base name (what dejavu-compile records for a folder) names nothing here: one line
    with pytest.raises(DejavuError, match="a folder's base name.*pass --dense MODEL"):
        dense_from_header({"model": "my-finetuned-opt"})
    with pytest.raises(DejavuError, match="does not name its dense model"):
        dense_from_header({"build_config": {}})


def test_dtype_runs_both_models_in_it(engines, capsys):
    # A float32 density-1.0 engine against its dense model: element-wise equal in float32; in bfloat16
    # both run in bfloat16 (their rounding differs from float32 by far more than the float32 gap).
    _, r32 = _report(capsys, [str(engines["dense"]), "--exact"])
    _, rbf = _report(capsys, [str(engines["dense"]), "--exact", "--dtype", "bf16", "--atol", "1", "--rtol", "1e9"])
    d32 = r32["comparisons"][0]["outputs"]["logits"]["max_absdiff"]
    dbf = rbf["comparisons"][0]["outputs"]["logits"]["max_absdiff"]
    assert d32 < 1e-3 < dbf
    assert rbf["comparisons"][0]["top1_agreement"] > 0.9
    with pytest.raises(SystemExit) as e:
        main([str(engines["dense"]), "--dtype", "fp8"])
    assert e.value.code == 2 and "argument --dtype: 'fp8' is not one of" in capsys.readouterr().err

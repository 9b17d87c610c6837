"""`dejavu-compile --onnx-out` on opt-mini with the per-token MLP K: form (a) in ONNX Runtime equals
the CPU runtime's decode of the same engine on WikiText-2 test tokens (logits, and the rows each
token keeps in every layer; the comparison is benchmarks/onnx_token_k_check.py's).

The predictors are random (b scaled so the predicted shares are spread): the test is about the
export reproducing the engine's rule, not about the predictors' quality, and training them on
opt-mini would take minutes on the test machines."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.predictors import Predictors
from dejavu.engine_file import read_header
from dejavu.models.loader import load_config
from dejavu.models.presets import OPT_MINI_DIR
from helpers_compiler import random_predictors

_spec = importlib.util.spec_from_file_location(  # the comparison: benchmarks/onnx_token_k_check.py
    "onnx_token_k_check", Path(__file__).resolve().parents[2] / "benchmarks" / "onnx_token_k_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not (OPT_MINI_DIR / "config.json").is_file(), reason="models/opt-mini is not there")

PI = {"source": "attn_in", "lookahead": 1}
SEQ = 48


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("opt_mini_token_k")
    cfg = load_config(OPT_MINI_DIR)
    sd = {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in random_predictors(cfg, rank=16).items()}
    preds = Predictors.from_state_dict(sd, PI)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJAVU_CACHE", str(d / "cache"))  # the held-out caches stay with the test
        s = build_engine("opt-mini", BuildConfig(mlp_density=0.2, attn_density=0.75, allocation="uniform",
                                                 dtype="float32", heldout_tokens=512),
                         d / "m.engine", onnx_out=d / "onnx", progress=False, predictors=preds)
    return d, s, cfg


def test_onnx_equals_the_cpu_runtime_on_opt_mini(built):
    d, s, cfg = built
    tk = read_header(d / "m.engine")["build_config"]["token_k"]
    assert tk["form"] == "share" and s["token_k"]["k_max"] == tk["k_max"]
    assert s["onnx"]["form_a_max_abs_diff"] <= 2 * s["onnx"]["form_a_torch_same_dtype_max_abs_diff"] + 1e-4
    r = check.compare(d / "m.engine", d / "onnx", SEQ)
    assert r["per_token_k"] and r["tokens"] == SEQ and len(r["per_layer"]) == cfg.num_hidden_layers
    assert r["max_abs_logits_diff"] <= 1e-5 * r["max_abs_logit"] + 1e-4, r
    for row in r["per_layer"]:
        assert row["k"] == tk["k_max"][row["layer"]]
        _same_rows(row)
        assert row["kept_rows"]["min"] < row["kept_rows"]["max"] <= row["k"]  # a count per token, not a fixed K


def _same_rows(row):
    """Every token keeps the same rows on both sides (on these tokens today: identical), but for a
    row a float32 rounding from the rule's edge: ONNX Runtime's prefill and the runtime's decode
    steps compute the scores along different paths (opt-mini, 512 tokens: 1 flag of ~2.2M, 4e-8 from
    its edge; benchmarks/results/onnx-token-k-2026-12-05-opt-mini-cpu.json)."""
    assert row["rows_kept_by_one_side"] <= 2 and (row["max_edge_margin_of_those"] or 0.0) <= 1e-4, row


def test_token_k_off_exports_the_fixed_k_graph(built, tmp_path, monkeypatch):
    # the same engine without the per-token K: TopK of K_l and no keep flags, in both forms
    d, s, cfg = built
    bc = read_header(d / "m.engine")["build_config"]
    sd = {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in random_predictors(cfg, rank=16).items()}
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path / "cache"))
    off = build_engine("opt-mini", BuildConfig(mlp_density=0.2, attn_density=0.75, allocation="uniform",
                                               dtype="float32", heldout_tokens=512, token_k="off"),
                       tmp_path / "off.engine", onnx_out=tmp_path / "onnx", progress=False,
                       predictors=Predictors.from_state_dict(sd, PI))
    assert off["token_k"] is None and off["mlp_k"] == bc["mlp_k"]
    std = onnx.load(str(tmp_path / "onnx" / "decode.sparse.onnx"), load_external_data=False)
    assert not any(n.op_type in ("GreaterOrEqual", "GatherElements") for n in std.graph.node)
    inits = {t.name: t for t in std.graph.initializer}
    for l in range(cfg.num_hidden_layers):
        k = onnx.numpy_helper.to_array(inits[f"layers.{l}.pred_mlp.topk.k"])
        assert int(k[0]) == bc["mlp_k"][l]
    plugin = onnx.load(str(tmp_path / "onnx" / "decode.plugin.onnx"), load_external_data=False)
    assert all(len(n.input) == 6 for n in plugin.graph.node if n.op_type == "SparseMLP")
    r = check.compare(tmp_path / "off.engine", tmp_path / "onnx", SEQ)
    assert not r["per_token_k"] and r["max_abs_logits_diff"] <= 1e-5 * r["max_abs_logit"] + 1e-4, r
    for row in r["per_layer"]:
        assert row["k"] == bc["mlp_k"][row["layer"]] and row["kept_rows"]["min"] == row["kept_rows"]["max"] == row["k"]
        _same_rows(row)

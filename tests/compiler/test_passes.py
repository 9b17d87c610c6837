"""Rewrite passes: ops present/absent after each pass; form (a) in ONNX Runtime equals masked dense."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.onnx_export import build_dense_graph, check_model, run_onnxruntime
from dejavu.compiler.passes import (PASSES, PassSettings, insert_predictors, rewrite_sparse_attention,
                                    rewrite_sparse_mlp, run_passes, to_plugin_form)
from dejavu.compiler.predictors import Predictors
from dejavu.errors import DejavuError
from helpers_compiler import random_predictors, tiny_model

pytest.importorskip("onnxruntime")

MLP_K, ATTN_K = [10, 20], [2, 3]  # tiny model: F = 48, H = 4


@pytest.fixture(scope="module")
def tiny():
    m, cfg = tiny_model()
    return m, cfg, random_predictors(cfg)


def _settings(preds, **kw):
    return PassSettings(**{"mlp_k": MLP_K, "attn_k": ATTN_K, "predictors": preds, **kw})


def _ops(g):
    return Counter(n.op_type for n in g.graph.node)


def _names(g):
    return {n.name for n in g.graph.node}


def test_pass_order():
    assert [p.__name__ for p in PASSES] == ["insert_predictors", "rewrite_sparse_mlp",
                                            "rewrite_sparse_attention", "to_plugin_form"]


def test_each_pass_ops_present_and_absent(tiny, caplog):
    m, cfg, preds = tiny
    st = _settings(preds, form="plugin")
    g = build_dense_graph(m, "decode")
    dense_ops = _ops(g)
    assert "TopK" not in dense_ops and dense_ops["Relu"] == 2

    caplog.set_level("INFO", logger="dejavu.compiler.passes")
    g = insert_predictors(g, st)
    assert {"layers.0.pred_mlp/MatMul_a", "layers.1.pred_attn/Add"} <= _names(g)
    assert "TopK" not in _ops(g)
    assert "added 4 predictor subgraphs" in caplog.text

    g = rewrite_sparse_mlp(g, st)
    ops, names = _ops(g), _names(g)
    assert ops["TopK"] == 2 and "layers.0.fc1/MatMul" not in names and "layers.1.act/Relu" not in names
    assert {"layers.0.sparse_mlp/gather_w1", "layers.0.sparse_mlp/relu", "layers.0.sparse_mlp/gather_w2_t"} <= names
    assert ops["Relu"] == 2  # the sparse Relu replaces the dense one
    assert "layers.1.q_proj/MatMul" in names  # attention untouched so far
    assert "rewrote 2 MLPs" in caplog.text

    g = rewrite_sparse_attention(g, st)
    ops, names = _ops(g), _names(g)
    assert ops["TopK"] == 4 and ops["GatherND"] == 4 and ops["Softmax"] == 2
    assert not any(n.startswith(("layers.0.q_proj/", "layers.0.attn_core/", "layers.0.out_proj/")) for n in names)
    assert "layers.0.k_proj/MatMul" in names and "layers.0.v_proj/MatMul" in names  # K/V stay dense
    assert "rewrote 2 attention blocks" in caplog.text
    check_model(g)  # form (a) is standard ONNX: checker + strict shape inference

    g = to_plugin_form(g, st)
    ops = _ops(g)
    assert ops["Predictor"] == 4 and ops["SparseMLP"] == 2 and ops["SparseAttention"] == 2
    assert not {"TopK", "GatherND", "Softmax", "Relu"} & set(ops)
    custom = [n for n in g.graph.node if n.domain]
    assert {n.domain for n in custom} == {"dejavu"}
    assert any(o.domain == "dejavu" for o in g.opset_import)
    for n in custom:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["plugin_namespace"] == b"dejavu" and attrs["plugin_version"] == b"1" and attrs["k"] >= 1
    sa = next(n for n in custom if n.name == "layers.1.sparse_attn")
    assert {a.name for a in sa.attribute} >= {"num_heads", "head_dim", "k"}
    onnx.checker.check_model(g)
    onnx.shape_inference.infer_shapes(g)
    assert "4 dejavu.Predictor" in caplog.text


def test_standard_form_skips_plugin_pass(tiny):
    m, _, preds = tiny
    g = run_passes(build_dense_graph(m, "prefill"), _settings(preds))
    assert not any(n.domain for n in g.graph.node)


def _masked_reference(m, ids, preds, pi, mlp_k=MLP_K, attn_k=ATTN_K):
    with torch.no_grad(), masked_sparsity(m, mlp_k, attn_k, "predicted", Predictors.from_state_dict(preds, pi)):
        return m(ids).numpy()


@pytest.mark.parametrize("pi", [{"source": "attn_in", "lookahead": 1}, {"source": "attn_in", "lookahead": 0},
                                {"source": "mlp_in", "lookahead": 1}], ids=["attn_in-1", "attn_in-0", "mlp_in-1"])
def test_form_a_equals_masked_dense(tiny, pi):
    m, cfg, preds = tiny
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    g = check_model(run_passes(build_dense_graph(m, "prefill"), _settings(preds, predictor_input=pi)))
    out = run_onnxruntime(g, {"input_ids": ids.numpy()})["logits"]
    ref = _masked_reference(m, ids, preds, pi)
    with torch.no_grad():
        dense = m(ids).numpy()
    assert np.abs(dense - ref).max() > 0.1  # the sparsity matters, so the comparison means something
    assert np.abs(out - ref).max() <= 1e-4


def test_form_a_decode_step_equals_masked_dense(tiny):
    m, cfg, preds = tiny
    pi = {"source": "attn_in", "lookahead": 1}
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    st = _settings(preds, predictor_input=pi)
    pre = run_onnxruntime(run_passes(build_dense_graph(m, "prefill"), st), {"input_ids": ids[:, :6].numpy()})
    dec = check_model(run_passes(build_dense_graph(m, "decode"), st))
    feeds = {"input_ids": ids[:, 6:].numpy(), "position_ids": np.full((2, 1), 6, np.int64)}
    feeds.update({k.replace("present", "past"): v for k, v in pre.items() if k.startswith("present")})
    out = run_onnxruntime(dec, feeds)["logits"][:, 0]
    ref = _masked_reference(m, ids, preds, pi)[:, 6]
    assert np.abs(out - ref).max() <= 1e-4


def test_chunked_topk_is_exact(tiny, caplog):
    m, cfg, preds = tiny
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    mlp_k = [45, 30]
    one = run_passes(build_dense_graph(m, "prefill"), _settings(preds, mlp_k=mlp_k))
    chunked = check_model(run_passes(build_dense_graph(m, "prefill"), _settings(preds, mlp_k=mlp_k, topk_limit=8)))
    topks = [n for n in chunked.graph.node if n.op_type == "TopK"]
    assert len(topks) > 4  # K = 45 in rounds of <= 8
    for n in topks:
        k = onnx.numpy_helper.to_array(next(t for t in chunked.graph.initializer if t.name == n.input[1]))
        assert int(k[0]) <= 8
    a = run_onnxruntime(one, {"input_ids": ids.numpy()})["logits"]
    b = run_onnxruntime(chunked, {"input_ids": ids.numpy()})["logits"]
    ref = _masked_reference(m, ids, preds, {"source": "attn_in", "lookahead": 1}, mlp_k=mlp_k)
    assert np.abs(a - b).max() <= 1e-5 and np.abs(b - ref).max() <= 1e-4


def test_full_k_leaves_layer_dense(tiny):
    m, cfg, preds = tiny
    g = run_passes(build_dense_graph(m, "prefill"), _settings(preds, mlp_k=[48, 10], attn_k=[4, 2]))
    names = _names(g)
    assert "layers.0.fc1/MatMul" in names and "layers.0.q_proj/MatMul" in names
    assert "layers.0.pred_mlp/MatMul_a" not in names
    assert "layers.1.fc1/MatMul" not in names


def test_errors(tiny):
    m, _, preds = tiny
    g = build_dense_graph(m, "prefill")
    with pytest.raises(DejavuError, match="insert_predictors first"):
        rewrite_sparse_mlp(g, _settings(preds))
    with pytest.raises(DejavuError, match="missing"):
        insert_predictors(build_dense_graph(m, "prefill"), _settings({}))
    with pytest.raises(DejavuError, match="lookahead"):
        insert_predictors(build_dense_graph(m, "prefill"),
                          _settings(preds, predictor_input={"source": "mlp_in", "lookahead": 0}))
    with pytest.raises(DejavuError, match="form"):
        _settings(preds, form="tensorrt")

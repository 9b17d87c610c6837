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


# ------------------------------------------------------------------ a per-token MLP K (the share rule)

TOKEN_K = {"form": "share", "threshold": [0.03, 0.012], "k_max": [20, 40]}  # layer 0: 2 K; layer 1: 2 K


@pytest.fixture(scope="module")
def sharp(tiny):
    """The tiny model with MLP predictor scores spread wide (b x 8), so each token's shares differ
    and the rule keeps a count per token."""
    m, cfg, preds = tiny
    return m, cfg, {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in preds.items()}


def _with_outputs(g, names):
    """g with intermediate tensors `names` as extra graph outputs (ONNX Runtime returns them)."""
    out = onnx.ModelProto()
    out.CopyFrom(g)
    out.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    return out


def _token_k_reference(m, ids, preds, dtype=torch.float64):
    from dejavu.compiler.token_k import TokenK

    tk = TokenK(tuple(TOKEN_K["k_max"]), tuple(TOKEN_K["threshold"]), tuple(MLP_K), "share")
    pi = {"source": "attn_in", "lookahead": 1}
    with torch.no_grad(), masked_sparsity(m.to(dtype), MLP_K, ATTN_K, "predicted",
                                          Predictors.from_state_dict(preds, pi).to("cpu", dtype), token_k=tk):
        out = m(ids).double().numpy()
    m.float()
    return out


def _share_rule_f64(scores: np.ndarray, theta: float, k_max: int):
    """float64 reference, one token at a time: (the top-k_max rows as a set, the rows kept)."""
    sel, kept = [], []
    for s in scores.reshape(-1, scores.shape[-1]).astype(np.float64):
        p = np.exp(s - s.max())
        p /= p.sum()
        top = set(np.argsort(-s, kind="stable")[:k_max].tolist())
        sel.append(top)
        kept.append({j for j in top if p[j] >= theta or s[j] == s.max()})
    return sel, kept


def test_token_k_graph_ops_static_shapes_and_plugin_form(sharp, caplog):
    m, cfg, preds = sharp
    caplog.set_level("INFO", logger="dejavu.compiler.passes")
    st = _settings(preds, token_k=TOKEN_K)
    g = check_model(run_passes(build_dense_graph(m, "decode"), st))  # checker + strict shape inference
    ops = _ops(g)
    assert ops["GreaterOrEqual"] == 2 and ops["GatherElements"] == 2 and ops["ReduceMax"] == 2
    assert "Softmax" not in {n.op_type for n in g.graph.node if ".pred_mlp" in n.name}  # no softmax over F
    assert "share>=0.03" in caplog.text
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer}
    topk = {n.name: int(inits[n.input[1]][0]) for n in g.graph.node if n.op_type == "TopK"}
    assert topk["layers.0.pred_mlp.topk/TopK"] == 20 and topk["layers.1.pred_mlp.topk/TopK"] == 40  # k_max
    assert topk["layers.0.pred_attn.topk/TopK"] == ATTN_K[0]
    shapes = {v.name: v.type.tensor_type for v in g.graph.value_info}
    for l, k in enumerate(TOKEN_K["k_max"]):  # static: the batch is the only symbolic dim (decode: S = 1)
        for name, elem in ((f"layers.{l}.pred_mlp.keep", onnx.TensorProto.BOOL),
                           (f"layers.{l}.sparse_mlp/keep", onnx.TensorProto.FLOAT)):
            t = shapes[name]
            dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
            assert t.elem_type == elem and dims == ["batch", 1, k], (name, dims)

    p = run_passes(build_dense_graph(m, "decode"), _settings(preds, token_k=TOKEN_K, form="plugin"))
    onnx.checker.check_model(p)
    onnx.shape_inference.infer_shapes(p)
    assert not {"TopK", "GreaterOrEqual", "GatherElements", "ReduceMax", "Cast"} & set(_ops(p))
    nodes = {n.name: n for n in p.graph.node}
    for l, (theta, k) in enumerate(zip(TOKEN_K["threshold"], TOKEN_K["k_max"])):
        pred, mlp = nodes[f"layers.{l}.pred_mlp"], nodes[f"layers.{l}.sparse_mlp"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in pred.attribute}
        assert list(pred.output) == [f"layers.{l}.pred_mlp.idx", f"layers.{l}.pred_mlp.keep"]
        assert attrs["k"] == k and attrs["min_share"] == pytest.approx(theta, rel=1e-7)
        assert list(mlp.input)[-1] == f"layers.{l}.pred_mlp.keep" and len(mlp.input) == 7
        assert {a.name: onnx.helper.get_attribute_value(a) for a in mlp.attribute}["k"] == k
        heads = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[f"layers.{l}.pred_attn"].attribute}
        assert "min_share" not in heads and len(nodes[f"layers.{l}.pred_attn"].output) == 1


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_form_a_token_k_equals_masked_dense_and_the_float64_rule(sharp, dtype):
    m, cfg, preds = sharp
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    g = check_model(run_passes(build_dense_graph(m, "prefill", dtype), _settings(preds, token_k=TOKEN_K)))
    names = [f"layers.{l}.pred_mlp.{t}" for l in range(2) for t in ("scores", "idx", "keep")]
    out = run_onnxruntime(_with_outputs(g, names), {"input_ids": ids.numpy()})
    counts, near = [], 0
    for l, (theta, k) in enumerate(zip(TOKEN_K["threshold"], TOKEN_K["k_max"])):
        s, idx, keep = (out[f"layers.{l}.pred_mlp.{t}"] for t in ("scores", "idx", "keep"))
        assert s.dtype == np.dtype(dtype) and keep.dtype == np.bool_ and idx.shape == keep.shape == (2, 9, k)
        sel, kept = _share_rule_f64(s, theta, k)
        p = np.exp(s.astype(np.float64) - s.astype(np.float64).max(-1, keepdims=True))
        logp = np.log(p / p.sum(-1, keepdims=True)).reshape(-1, s.shape[-1])
        # rows whose log-share is within a few roundings of the scores' dtype of log(theta) may go
        # either way (ONNX Runtime's CPU computes float16 ops in float32 and may skip a rounding)
        tol = 1.5 * np.finfo(s.dtype).eps * np.abs(s).max() + 1e-6  # a half ulp in s and in the logsumexp
        for t, (ix, kp) in enumerate(zip(idx.reshape(-1, k), keep.reshape(-1, k))):
            assert set(ix.tolist()) == sel[t] or dtype == "float16"  # float16 scores tie; then: a top-k
            assert s.reshape(-1, s.shape[-1])[t][ix].min() >= np.delete(s.reshape(-1, s.shape[-1])[t], ix).max()
            far = np.abs(logp[t][ix] - np.log(theta)) > tol
            assert np.array_equal(kp[far], np.isin(ix, sorted(kept[t]))[far]), (l, t)
            counts.append(int(kp.sum()))
            near += int((~far).sum())
    assert near <= 0.02 * sum(TOKEN_K["k_max"]) * 18, near  # the comparison covers nearly every row
    assert len(set(counts)) > 4 and min(counts) >= 1 and max(counts) <= max(TOKEN_K["k_max"])  # a count per token

    ref = _token_k_reference(m, ids, preds)
    same = _token_k_reference(m, ids, preds, getattr(torch, dtype))
    fixed = _masked_reference(m, ids, preds, {"source": "attn_in", "lookahead": 1})
    assert np.abs(fixed - ref).max() > 0.1  # the per-token K is not the fixed K
    err = np.abs(out["logits"].astype(np.float64) - ref).max()
    assert err <= 2 * np.abs(same - ref).max() + 1e-4, err


def test_form_a_token_k_decode_step_equals_masked_dense(sharp):
    m, cfg, preds = sharp
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
    st = _settings(preds, token_k=TOKEN_K)
    pre = run_onnxruntime(run_passes(build_dense_graph(m, "prefill"), st), {"input_ids": ids[:, :6].numpy()})
    dec = check_model(run_passes(build_dense_graph(m, "decode"), st))
    feeds = {"input_ids": ids[:, 6:].numpy(), "position_ids": np.full((2, 1), 6, np.int64)}
    feeds.update({k.replace("present", "past"): v for k, v in pre.items() if k.startswith("present")})
    out = run_onnxruntime(dec, feeds)["logits"][:, 0]
    assert np.abs(out - _token_k_reference(m, ids, preds)[:, 6]).max() <= 1e-4


def test_token_k_off_keeps_the_fixed_k_graph(sharp):
    m, _, preds = sharp
    off = run_passes(build_dense_graph(m, "prefill"), _settings(preds))
    assert not {"GreaterOrEqual", "GatherElements", "ReduceMax"} & set(_ops(off))
    assert not any(".keep" in n.name for n in off.graph.node)
    plugin = run_passes(build_dense_graph(m, "prefill"), _settings(preds, form="plugin"))
    assert all(len(n.output) == 1 for n in plugin.graph.node if n.op_type == "Predictor")
    assert all(len(n.input) == 6 for n in plugin.graph.node if n.op_type == "SparseMLP")


@pytest.mark.parametrize("tk,msg", [({"form": "mass", "threshold": [0.1, 0.1], "k_max": [20, 40]}, "form"),
                                    ({"form": "share", "threshold": [0.1], "k_max": [20, 40]}, "threshold"),
                                    ({"form": "share", "threshold": [0.1, 1.5], "k_max": [20, 40]}, "threshold"),
                                    ({"form": "share", "threshold": [0.1, 0.1], "k_max": [5, 40]}, "k_max")])
def test_bad_token_k_settings(tiny, tk, msg):
    with pytest.raises(DejavuError, match=msg):
        _settings(tiny[2], token_k=tk)

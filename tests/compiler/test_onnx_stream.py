"""--onnx-out written piece by piece with external data equals the in-memory export (tiny OPT, CPU):
the same nodes and weights, the same ONNX Runtime outputs, valid on the path."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from dejavu.compiler.onnx_export import build_dense_graph, check_model, run_onnxruntime
from dejavu.compiler.onnx_stream import DATA_FILE, INLINE_BYTES, write_onnx
from dejavu.compiler.passes import PassSettings, run_passes
from dejavu.models.loader import Checkpoint, load_model
from helpers_compiler import random_predictors

pytest.importorskip("onnxruntime")

PI = {"source": "attn_in", "lookahead": 1}


def _in_memory(model, preds, mlp_k, attn_k, dtype, topk_limit, token_k=None):
    """The whole-graph export: build_dense_graph + run_passes, as one model in memory each (shapes
    inferred after the passes: ONNX Runtime's optimiser reads value_info)."""
    out = {}
    for mode in ("prefill", "decode"):
        dense = build_dense_graph(model, mode, dtype)
        out[f"{mode}.onnx"] = check_model(dense)
        st = PassSettings(mlp_k=mlp_k, attn_k=attn_k, predictors=preds, predictor_input=PI, topk_limit=topk_limit,
                          token_k=token_k)
        out[f"{mode}.sparse.onnx"] = check_model(run_passes(dense, st))
        out[f"{mode}.plugin.onnx"] = run_passes(dense, PassSettings(**{**st.__dict__, "form": "plugin"}))
    return out


def _inits(m):
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


# float16 with a per-token MLP K (layer 0: k_max 80 in TopK rounds of 16, then the keep flags)
@pytest.mark.parametrize("dtype,per_token_k", [("float32", False), ("float16", True)])
def test_streamed_export_equals_in_memory_export(make_tiny_opt_dir, tmp_path, dtype, per_token_k):
    folder = make_tiny_opt_dir(num_hidden_layers=3)
    model, cfg = load_model(folder)
    preds = random_predictors(cfg, rank=8, rank_attn=4)
    # layer 0 sparse in both kinds, layer 1 MLP dense, layer 2 heads dense; a TopK limit of 16
    # takes layer 0's MLP top-40 in rounds (the chunked form TensorRT needs above 3840)
    mlp_k, attn_k, limit = [40, cfg.ffn_dim, 30], [2, 3, cfg.num_attention_heads], 16
    by_layer = lambda l: {k: v for k, v in preds.items() if k.startswith(f"layers.{l}.")}
    out = tmp_path / "onnx"
    tk = {"form": "share", "threshold": [0.01, 0.0, 0.02], "k_max": [80, cfg.ffn_dim, 60]} if per_token_k else None
    report = write_onnx(Checkpoint(folder), dtype, mlp_k, attn_k, by_layer, PI, limit, out, token_k=tk)
    ref = _in_memory(model, preds, mlp_k, attn_k, dtype, limit, tk)
    std = ref["prefill.sparse.onnx"]
    assert any(n.op_type == "GreaterOrEqual" for n in std.graph.node) == per_token_k

    assert sorted(p.name for p in out.iterdir()) == sorted([DATA_FILE, *ref])  # no partial folder left
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).numpy()
    for name, mem in ref.items():
        path = out / name
        onnx.checker.check_model(str(path))
        graph_only = onnx.load(str(path), load_external_data=False)
        big = [t for t in graph_only.graph.initializer if t.data_location == TensorProto.EXTERNAL]
        assert big and all(len(t.raw_data) < INLINE_BYTES for t in graph_only.graph.initializer
                           if t.data_location != TensorProto.EXTERNAL)
        streamed = onnx.load(str(path))
        assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in streamed.graph.node] == \
               [(n.name, n.op_type, list(n.input), list(n.output)) for n in mem.graph.node], name
        a, b = _inits(streamed), _inits(mem)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
        assert streamed.graph.input == mem.graph.input and streamed.graph.output == mem.graph.output
        assert streamed.graph.value_info == mem.graph.value_info
        if "plugin" in name:
            assert any(n.domain == "dejavu" for n in streamed.graph.node)
            continue
        feeds = {"input_ids": ids}
        if name.startswith("decode"):
            past = run_onnxruntime(ref["prefill.onnx"], {"input_ids": ids})
            feeds = {"input_ids": ids[:, :1], "position_ids": np.full((2, 1), 7, np.int64),
                     **{k.replace("present", "past"): v for k, v in past.items() if k.startswith("present")}}
        got, want = run_onnxruntime(path, feeds), run_onnxruntime(mem, feeds)
        assert got.keys() == want.keys()
        for k in got:
            assert got[k].dtype == np.dtype(dtype) and np.array_equal(got[k], want[k]), (name, k)
    # and the graphs compute the model: form (a) in ONNX Runtime vs masked dense in float64
    assert report["form_a_max_abs_diff"] <= 2 * report["form_a_torch_same_dtype_max_abs_diff"] + 1e-4
    if dtype == "float32":
        assert report["form_a_max_abs_diff"] <= 1e-4

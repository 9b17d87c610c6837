"""Dense ONNX export: valid graphs, stable names, ONNX Runtime equals PyTorch (fp32, ≤ 1e-4)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from dejavu.compiler.onnx_export import build_dense_graph, check_model, export_onnx, run_onnxruntime
from dejavu.errors import DejavuError
from helpers_compiler import tiny_model

pytest.importorskip("onnxruntime")

VARIANTS = [{}, {"do_layer_norm_before": False}, {"word_embed_proj_dim": 16}, {"enable_bias": False}]


def _prefill(m, ids):
    return run_onnxruntime(check_model(build_dense_graph(m, "prefill")), {"input_ids": ids.numpy()})


@pytest.mark.parametrize("over", VARIANTS, ids=["pre-ln", "post-ln", "project", "no-bias"])
def test_prefill_logits_equal_pytorch(over):
    m, cfg = tiny_model(**over)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    out = _prefill(m, ids)
    with torch.no_grad():
        ref = m(ids)
    assert np.abs(out["logits"] - ref.numpy()).max() <= 1e-4
    assert out["present.1.key"].shape == (2, cfg.num_attention_heads, 9, cfg.head_dim)
    out5 = _prefill(m, ids[:1, :5])  # dynamic batch and sequence
    assert np.abs(out5["logits"] - ref[:1, :5].numpy()).max() <= 1e-4


@pytest.mark.parametrize("over", VARIANTS[:2], ids=["pre-ln", "post-ln"])
def test_decode_step_equals_full_recompute(over):
    m, cfg = tiny_model(**over)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids)
    dec = check_model(build_dense_graph(m, "decode"))
    past = _prefill(m, ids[:, :5])
    for t in range(5, 8):  # three decode steps, feeding presents back as pasts
        feeds = {"input_ids": ids[:, t:t + 1].numpy(), "position_ids": np.full((2, 1), t, np.int64)}
        feeds.update({k.replace("present", "past"): v for k, v in past.items() if k.startswith("present")})
        past = run_onnxruntime(dec, feeds)
        assert np.abs(past["logits"][:, 0] - ref[:, t].numpy()).max() <= 1e-4
        assert past["present.0.value"].shape[2] == t + 1


def test_stable_names_and_valid_graph():
    m, cfg = tiny_model()
    g = build_dense_graph(m, "decode")
    onnx.checker.check_model(g)
    names = {n.name for n in g.graph.node}
    inits = {t.name for t in g.graph.initializer}
    for l in range(cfg.num_hidden_layers):
        for op in ("fc1/MatMul", "fc1/Add", "act/Relu", "fc2/MatMul", "q_proj/MatMul", "k_proj/MatMul",
                   "v_proj/MatMul", "out_proj/MatMul"):
            assert f"layers.{l}.{op}" in names
        assert {f"layers.{l}.fc1.weight_t", f"layers.{l}.fc2.weight_t", f"layers.{l}.q_proj.weight_t"} <= inits
    assert [i.name for i in g.graph.input][:2] == ["input_ids", "position_ids"]
    assert {o.name for o in g.graph.output} >= {"logits", "present.0.key", "present.1.value"}


def test_export_writes_files(tmp_path):
    m, _ = tiny_model()
    paths = export_onnx(m, tmp_path / "onnx")
    for p in paths.values():
        onnx.checker.check_model(str(p))


def test_bad_mode():
    m, _ = tiny_model()
    with pytest.raises(DejavuError, match="prefill"):
        build_dense_graph(m, "train")

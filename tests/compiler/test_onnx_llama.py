"""Llama ONNX export (compiler/onnx_llama.py): onnx.checker, ONNX Runtime vs PyTorch (fp32, <= 1e-4),
dense and TEAL-sparse, prefill and decode."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from dejavu.compiler.gated_sparsity import GatedSparsity, calibrate, gated_sparsity
from dejavu.compiler.onnx_export import check_model, run_onnxruntime
from dejavu.compiler.onnx_llama import build_llama_graph
from llama_helpers import tiny_llama

pytest.importorskip("onnxruntime")

VARIANTS = {"gqa_tied": {}, "mha_untied": dict(num_key_value_heads=6, tie_word_embeddings=False),
            "llama3_rope": dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=16)),
            "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),  # q/k/v biases, o none
            "llama_biases": dict(attention_bias=True, mlp_bias=True),
            "qwen3": dict(model_type="qwen3", head_dim=16),  # the q and k heads' RMSNorm, q 96 wide in a hidden of 48
            # YaRN: ramped frequencies over an original context of 4, cos and sin scaled by its attention factor
            "qwen2_yarn": dict(model_type="qwen2", rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                      original_max_position_embeddings=4)),
            # LongRoPE: the 10 and 11 positions scored are all past an original context of 8 (the long factors),
            # or all inside one of 12 (the short ones)
            **{f"longrope_{kind}": dict(rope_scaling=dict(rope_type="longrope", original_max_position_embeddings=n,
                                                          short_factor=[1.0, 1.2, 1.5, 2.0],
                                                          long_factor=[1.0, 2.0, 6.0, 16.0]))
               for kind, n in (("long", 8), ("short", 12))},
            "partial_rotary": dict(partial_rotary_factor=0.75),  # RoPE over 6 of a head's 8 dimensions (Phi-4-mini)
            "smollm3": dict(model_type="smollm3", no_rope_layers=[0, 1])}  # layer 0 without RoPE (NoPE)


def _thresholds(m, skip=0.4):
    """Per-layer thresholds of m's own activations on random tokens (not the tokens scored)."""
    from dejavu.compiler.build_llama import INPUTS, _Blocks

    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        cal = calibrate(_Blocks(m), ids)
    return {k: [cal.threshold(k, l, skip) for l in range(len(m.layers))] for k in INPUTS}


def _torch(m, ids, th):
    if th is None:
        with torch.no_grad():
            return m(ids)
    calib = th  # the engine's thresholds, {key: [L]}
    with torch.no_grad(), gated_sparsity(m, calib, GatedSparsity(skip=0.4)):
        return m(ids)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "teal"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_equal_pytorch(variant, sparse):
    m = tiny_llama(seed=2, **VARIANTS[variant])
    th = _thresholds(m) if sparse else None
    ids = torch.randint(0, 320, (2, 11), generator=torch.Generator().manual_seed(1))
    ref = _torch(m, ids, th)
    if sparse:
        assert (ref - _torch(m, ids, None)).abs().max() > 1e-2  # the masks change the logits
    pre = check_model(build_llama_graph(m, "prefill", th))
    out = run_onnxruntime(pre, {"input_ids": ids.numpy()})
    assert np.abs(out["logits"] - ref.numpy()).max() <= 1e-4
    Hkv, hd = m.config.num_key_value_heads, m.config.head_dim
    assert out["present.1.value"].shape == (2, Hkv, 11, hd)
    # decode: the first 10 tokens' K/V from prefill, then one step at position 10
    past = run_onnxruntime(pre, {"input_ids": ids[:, :10].numpy()})
    feeds = {"input_ids": ids[:, 10:].numpy(), "position_ids": np.full((2, 1), 10, np.int64)}
    for l in range(m.config.num_hidden_layers):
        for kind in ("key", "value"):
            feeds[f"past.{l}.{kind}"] = past[f"present.{l}.{kind}"]
    step = run_onnxruntime(check_model(build_llama_graph(m, "decode", th)), feeds)
    assert np.abs(step["logits"][:, 0] - ref[:, 10].numpy()).max() <= 1e-4
    assert step["present.0.key"].shape == (2, Hkv, 11, hd)


def test_sparse_graph_masks_every_projection_input_by_name():
    m = tiny_llama()
    th = _thresholds(m)
    names = {n.name for n in build_llama_graph(m, "decode", th).graph.node}
    for l in range(2):
        for key in ("attn_in", "o_in", "mlp_in", "down_in"):
            assert f"layers.{l}.{key}/mask" in names
        for proj in ("q", "k", "v", "o", "gate", "up", "down"):
            assert f"layers.{l}.{proj}_proj/MatMul" in names
    assert not any(n.op_type == "Where" for n in build_llama_graph(m, "decode").graph.node)
    assert not any(n.endswith("_proj/Add") for n in names)  # no biases, no Add
    q = {n.name for n in build_llama_graph(tiny_llama(model_type="qwen2"), "decode", th).graph.node}
    assert {n for n in q if n.endswith("_proj/Add")} == {f"layers.{l}.{p}_proj/Add" for l in range(2) for p in "qkv"}
    assert not any(n.startswith(("layers.0.q_norm/", "layers.0.k_norm/")) for n in names)
    q3 = {n.name for n in build_llama_graph(tiny_llama(model_type="qwen3"), "decode", th).graph.node}
    assert {f"layers.{l}.{p}_norm/Scale" for l in range(2) for p in "qk"} <= q3


def test_dejavu_compile_onnx_out_writes_dense_and_sparse_graphs(tmp_path):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny")
    s = build_engine(folder, BuildConfig(density=0.6, calib_tokens=256, calib_window=64, dtype="float32"),
                     tmp_path / "t.engine", progress=False, onnx_out=tmp_path / "onnx")
    assert s["onnx"]["files"] == ["decode.onnx", "decode.sparse.onnx", "prefill.onnx", "prefill.sparse.onnx"]
    assert s["onnx"]["max_abs_diff"] <= 1e-4

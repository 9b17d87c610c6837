"""dejavu.plugins.kernel_settings: what an engine header records of the kernels' block choices."""
import json
import sys

import dejavu.plugins as P


def test_kernel_settings_cover_every_kernel_and_follow_the_configs(monkeypatch):
    s = P.kernel_settings()
    assert set(s) == {"sparse_mlp", "fused_mlp", "deferred_qkv", "deferred_qkv_b1", "attention", "topk",
                      "layer_norm"}
    assert json.loads(json.dumps(s)) == json.loads(json.dumps(s))  # JSON-ready (tuples become lists)
    dk = sys.modules["dejavu.plugins.deferred_kv"]
    monkeypatch.setitem(dk.QKV_CONFIG, "BLOCK_D", 64)
    assert P.kernel_settings()["deferred_qkv"]["BLOCK_D"] == 64
    monkeypatch.setitem(dk.QKV_CONFIG_B1, "SHARED_P", 8)
    assert P.kernel_settings()["deferred_qkv_b1"]["SHARED_P"] == 8
    assert P.kernel_settings()["topk"]["method"] == sys.modules["dejavu.plugins.predictor"].TOPK_METHOD

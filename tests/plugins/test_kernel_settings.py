"""dejavu.plugins.kernel_settings: what an engine header records of the kernels' block choices."""
import json
import sys

import dejavu.plugins as P


def test_kernel_settings_cover_every_kernel_and_follow_the_configs(monkeypatch):
    s = P.kernel_settings()
    assert set(s) == {"sparse_mlp", "deferred_qkv", "deferred_qkv_b1", "attention", "topk",
                      "scoring", "layer_norm", "pdl"}
    assert json.loads(json.dumps(s)) == json.loads(json.dumps(s))  # JSON-ready (tuples become lists)
    dk = sys.modules["dejavu.plugins.qkv_partial"]
    monkeypatch.setitem(dk.QKV_CONFIG, "BLOCK_D", 64)
    assert P.kernel_settings()["deferred_qkv"]["BLOCK_D"] == 64
    monkeypatch.setitem(dk.QKV_CONFIG_B1, "SHARED_P", 8)
    assert P.kernel_settings()["deferred_qkv_b1"]["SHARED_P"] == 8
    assert P.kernel_settings()["topk"]["method"] == sys.modules["dejavu.plugins.predictor"].TOPK_METHOD
    pr = sys.modules["dejavu.plugins.predictor"]
    monkeypatch.setattr(pr, "SCORE_METHOD", "torch")
    monkeypatch.setitem(pr.SCORE_CONFIG, "b", {"BLOCK_R": 2})
    assert P.kernel_settings()["scoring"] == {"method": "torch", "a": pr.SCORE_CONFIG["a"], "b": {"BLOCK_R": 2}}


def test_pdl_launch_options_follow_the_config(monkeypatch):
    import pytest
    import torch

    from dejavu.errors import DejavuError

    C = sys.modules["dejavu.plugins._common"]
    assert C.pdl_args(torch.device("cpu"), "fc1") == {}  # never on CPU (no griddepcontrol there)
    monkeypatch.setattr(C, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(C, "_SM90", {})
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(C.PDL_CONFIG, "ENABLED", True)
    monkeypatch.setitem(C.PDL_CONFIG, "EARLY", ("attn",))
    assert C.pdl_args(cuda, "attn") == {"GDC": 2, "launch_pdl": True}
    assert C.pdl_args(cuda, "fc1") == {"GDC": 1, "launch_pdl": True}
    with pytest.raises(DejavuError, match="unknown kernel kind"):
        C.pdl_args(cuda, "fc3")
    monkeypatch.setitem(C.PDL_CONFIG, "PLAIN", ("pred",))  # kinds kept off PDL
    assert C.pdl_args(cuda, "pred") == {} and C.pdl_args(cuda, "fc1")["launch_pdl"]
    monkeypatch.setitem(C.PDL_CONFIG, "PLAIN", ("fc9",))
    with pytest.raises(DejavuError, match="unknown kernel kind 'fc9'"):
        C.pdl_args(cuda, "fc1")
    monkeypatch.setitem(C.PDL_CONFIG, "PLAIN", ())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(C, "_SM90", {})  # the capability is asked once per device
    assert C.pdl_args(cuda, "attn") == {}  # below sm_90: plain launches
    monkeypatch.setitem(C.PDL_CONFIG, "ENABLED", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(C, "_SM90", {})
    assert C.pdl_args(cuda, "attn") == {}
    assert P.kernel_settings()["pdl"]["EARLY"] == ["attn"]

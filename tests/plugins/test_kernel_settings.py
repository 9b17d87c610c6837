"""plugins.settings: the kernels' settings as frozen data, what an engine header records of them, and
the PDL launch options they give."""
import dataclasses
import json
import sys

import pytest
import torch

import dejavu.plugins as P
from dejavu.errors import DejavuError


def test_settings_round_trip_through_json_and_reject_unknown_keys():
    s = P.resolve_kernel_settings("sm_90", 132)
    assert P.KernelSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    # the H200's SM count keeps the defaults the kernels were measured with; the arch is recorded
    assert dataclasses.replace(s, arch=None) == P.DEFAULT and s.arch == "sm_90"
    assert P.KernelSettings.from_dict({}) == P.DEFAULT  # missing fields: the defaults
    with pytest.raises(DejavuError, match="unknown key"):
        P.KernelSettings.from_dict({"qkv_b1": {"BLOCK_Q": 3}})
    with pytest.raises(DejavuError, match="unknown key"):
        P.KernelSettings.from_dict({"sparse_mlp": {}})  # an older header's format
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.DEFAULT.qkv_b1.SHARED_P = 8  # nothing patches them


def test_resolution_follows_the_target_gpu():
    a100 = P.resolve_kernel_settings("sm_80", 108)
    assert not a100.pdl.ENABLED  # no griddepcontrol below sm_90
    assert a100.fc2_dot1.TARGET_PROGRAMS == round(396 * 108 / 132) and a100.proj1.TARGET_PROGRAMS == 432
    assert a100.qkv_b1.TARGET_PROGRAMS == round(512 * 108 / 132) and a100.arch == "sm_80"
    assert P.resolve_kernel_settings(None) is P.DEFAULT  # CPU


def test_config_overrides_check_their_keys():
    from dejavu.plugins.settings import table
    assert table(P.DEFAULT.attn, {"CHUNK": 8})["CHUNK"] == 8
    with pytest.raises(DejavuError, match="unknown key"):
        table(P.DEFAULT.attn, {"CHUNKS": 8})


def test_pdl_launch_options_follow_the_settings(monkeypatch):
    C = sys.modules["dejavu.plugins._common"]
    pdl = P.DEFAULT.pdl
    assert C.pdl_args(torch.device("cpu"), "fc1") == {}  # never on CPU (no griddepcontrol there)
    monkeypatch.setattr(C, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(C, "_SM90", {})
    cuda = torch.device("cuda", 0)
    early = dataclasses.replace(pdl, EARLY=("attn",))
    assert C.pdl_args(cuda, "attn", early) == {"GDC": 2, "launch_pdl": True}
    assert C.pdl_args(cuda, "fc1", early) == {"GDC": 1, "launch_pdl": True}
    with pytest.raises(DejavuError, match="unknown kernel kind"):
        C.pdl_args(cuda, "fc3")
    assert C.pdl_args(cuda, "pred") == {} and C.pdl_args(cuda, "fc1")["launch_pdl"]  # kinds kept off PDL
    with pytest.raises(DejavuError, match="unknown kernel kind 'fc9'"):
        C.pdl_args(cuda, "fc1", dataclasses.replace(pdl, PLAIN=("fc9",)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(C, "_SM90", {})  # the capability is asked once per device
    assert C.pdl_args(cuda, "attn") == {}  # below sm_90: plain launches
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(C, "_SM90", {})
    assert C.pdl_args(cuda, "attn", dataclasses.replace(pdl, ENABLED=False)) == {}

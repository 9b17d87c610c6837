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
    assert a100.input_sparse.projections == P.DEFAULT.input_sparse.projections  # no target_programs among them
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


@pytest.mark.parametrize("arch,sms", [("sm_90", 132), ("sm_80", 108)])
def test_layer_settings_pin_what_the_launchers_resolve_from_k(arch, sms):
    """resolve_layer_settings pins per layer what the batch-1 launchers resolve from its K at each call,
    on OPT-30B and OPT-1.3B shapes at densities 0.05-1: fc2's and the projection's split of K, the Q/K/V
    slices of D with and without the fold (caches too short for it), the fold, the finishing kernel's
    programs per row block."""
    from dejavu.plugins.fc2 import split_plan
    from dejavu.plugins.qkv_finish import slow_z
    from dejavu.plugins.qkv_partial import qkv_split

    s = P.resolve_kernel_settings(arch, sms)
    for D, H, F in ((7168, 56, 28672), (2048, 32, 8192)):
        hd, dens = D // H, (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
        mlp_k, attn_k = [round(d * F) for d in dens], [max(1, round(d * H)) for d in dens]
        layers = P.resolve_layer_settings(s, D, hd, mlp_k, attn_k)
        assert len(layers) == len(dens)
        for k, kh, o in zip(mlp_k, attn_k, layers):
            pinned = s.with_overrides(o)
            for part, K in (("fc2_dot1", k), ("proj1", kh * hd)):
                assert split_plan(K, D, vars(getattr(pinned, part))) == split_plan(K, D, vars(getattr(s, part)))
            q, qp = vars(s.qkv_b1), vars(pinned.qkv_b1)
            rows = kh * 3 * -(-hd // q["BLOCK_R"])
            for attn_folds in (False, True):
                assert (qkv_split(qp, D, rows, bool(qp["FOLD_FINISH"]) and attn_folds)
                        == qkv_split(q, D, rows, bool(q["FOLD_FINISH"]) and attn_folds))
            assert slow_z(qp, kh * 3 * -(-hd // q["FINISH_R"])) == slow_z(q, kh * 3 * -(-hd // q["FINISH_R"]))
            assert isinstance(qp["FOLD_FINISH"], bool) and qp["SLOW_Z"] is not None
    # OPT-30B on the H200: d0.1's 6 heads take 14 slices of D, folded (capped to 8); d0.3's 17 take 5
    d01, d03 = P.resolve_layer_settings(P.DEFAULT, 7168, 128, [2867, 8602], [6, 17])
    assert (d01["qkv_b1"]["SPLIT"], d01["qkv_b1"]["FOLD_FINISH"]) == (14, True)
    assert (d03["qkv_b1"]["SPLIT"], d03["qkv_b1"]["FOLD_FINISH"]) == (5, False)


def test_layer_overrides_check_their_names():
    s = P.DEFAULT.with_overrides({"fc2_dot1": {"SPLIT": 3}, "qkv_b1": {"FOLD_FINISH": False}})
    assert s.fc2_dot1.SPLIT == 3 and s.qkv_b1.FOLD_FINISH is False and s.proj1 == P.DEFAULT.proj1
    with pytest.raises(DejavuError, match="unknown key"):
        P.DEFAULT.with_overrides({"fc2_dot1": {"SPLITS": 3}})
    with pytest.raises(DejavuError, match="not a part"):
        P.DEFAULT.with_overrides({"arch": {"x": 1}})


def test_projection_settings_are_overrides_of_the_one_table():
    """input_sparse.projections (kind, field, value) triples become per-kind overrides (with_overrides); by
    default gate/up's block_k only (the other kinds launch the table as it is); they survive JSON, scale with
    the SM count where they set target_programs, and a kind or field that is not one is a DejavuError."""
    assert P.resolve_projection_settings(P.DEFAULT) == {"qkv": {}, "o": {}, "down": {},
                                                        "gate_up": {"input_sparse": {"block_k": 64}}}
    assert P.DEFAULT.input_sparse.block_k == 128  # the table's, for the other kinds
    kinds = (("down", "block_m", 32), ("down", "num_warps", 2), ("o", "target_programs", 264))
    s = dataclasses.replace(P.DEFAULT, input_sparse=P.InputSparseSettings(projections=kinds))
    assert P.KernelSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    over = P.resolve_projection_settings(s)
    assert over == {"qkv": {}, "gate_up": {}, "down": {"input_sparse": {"block_m": 32, "num_warps": 2}},
                    "o": {"input_sparse": {"target_programs": 264}}}
    down = s.with_overrides(over["down"]).input_sparse
    assert (down.block_m, down.num_warps, down.block_k) == (32, 2, P.DEFAULT.input_sparse.block_k)
    assert s.with_overrides(over["qkv"]) == s
    for bad in (("attn", "block_m", 32), ("o", "blockm", 32), ("o", "projections", ()), ("o",)):
        with pytest.raises(DejavuError, match="input_sparse.projections"):
            P.resolve_projection_settings(dataclasses.replace(
                P.DEFAULT, input_sparse=P.InputSparseSettings(projections=(bad,))))


def test_projection_target_programs_scale_with_the_sm_count(monkeypatch):
    import dejavu.plugins.settings as S

    kinds = (("o", "target_programs", 264), ("o", "block_m", 32))
    monkeypatch.setattr(S, "DEFAULT", dataclasses.replace(S.DEFAULT, input_sparse=S.InputSparseSettings(
        projections=kinds)))
    s = S.resolve_kernel_settings("sm_80", 66)  # half the H200's SMs
    assert s.input_sparse.target_programs == 264 and s.input_sparse.projections == (
        ("o", "target_programs", 132), ("o", "block_m", 32))


def test_headers_before_the_split_attention_kernel_load():
    """An engine header written when the attention kernel cut the cache into fixed chunks (gqa_attn.chunk, and
    block_s slots a step of a chunk) loads with the split kernel's defaults for those two; its other fields
    are kept."""
    old = {"gqa_attn": {"kernel": True, "chunk": 32, "block_s": 8, "num_warps": 8, "fuse_combine": False}}
    got = P.KernelSettings.from_dict(old).gqa_attn
    assert got == P.GQAAttnSettings(kernel=True, num_warps=8, fuse_combine=False)
    with pytest.raises(DejavuError, match="unknown key"):
        P.KernelSettings.from_dict({"gqa_attn": {"chunks": 32}})

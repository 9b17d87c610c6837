"""The runtime reads the kernel settings an engine header records (target.kernel_settings, and per layer
target.layer_kernel_settings) and falls back, with a logged line, to the settings resolved where it runs
(per layer from the layers' K) when they were made for another GPU, are missing, or come from an older
header format."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from dejavu.plugins import DEFAULT, KernelSettings, resolve_kernel_settings, resolve_layer_settings
from dejavu.runtime import Engine
from runtime_helpers import engine_from_dense, tiny_model


@pytest.fixture(scope="module")
def built():
    return engine_from_dense(tiny_model(seed=5), 0.5, 0.5)


def _engine(built, recorded, layers=None, **kw):
    header, tensors = built
    target = {**header["target"], "kernel_settings": recorded}
    if layers is not None:
        target["layer_kernel_settings"] = layers
    return Engine.from_tensors({**header, "target": target}, tensors, "cpu", **kw)


def _resolved_here(eng, base):
    """Each layer's settings resolved from the engine's K under base."""
    s = eng.spec
    return [base.with_overrides(o) for o in resolve_layer_settings(base, s.hidden_size, s.head_dim, s.mlp_k, s.attn_k)]


def _layers(eng):
    return [eng.ops.layer(l).settings for l in range(eng.spec.num_layers)]


def test_header_settings_made_for_this_device_are_used(built, caplog):
    mine = dataclasses.replace(DEFAULT, qkv_b1=dataclasses.replace(DEFAULT.qkv_b1, SHARED_P=8))
    L = built[0]["model_config"]["num_hidden_layers"]
    with caplog.at_level(logging.INFO, logger="dejavu"):
        eng = _engine(built, mine.to_dict(), [{}] * L)
    assert eng.ops.settings == mine and not caplog.records and _layers(eng) == [mine] * L


@pytest.mark.parametrize("recorded,why", [
    (resolve_kernel_settings("sm_90", 132).to_dict(), "engine built for sm_90, running on cpu"),
    ({"sparse_mlp": {"fc1": {}}, "pdl": {"ENABLED": True}}, "unreadable"),  # the format before KernelSettings
])
def test_settings_for_another_gpu_or_format_fall_back_with_a_logged_line(built, caplog, recorded, why):
    with caplog.at_level(logging.INFO, logger="dejavu"):
        eng = _engine(built, recorded)
    assert eng.ops.settings == resolve_kernel_settings(None)
    assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert eng.generate([[2, 5, 7]], 2, stop_at_eos=False)  # still loads and runs


def test_engines_without_the_field_load_with_the_defaults(built):
    header, tensors = built
    header = {**header, "target": {k: v for k, v in header["target"].items() if k != "kernel_settings"}}
    assert Engine.from_tensors(header, tensors, "cpu").ops.settings == DEFAULT
    assert Engine.from_tensors({k: v for k, v in header.items() if k != "target"}, tensors,
                               "cpu").ops.settings == DEFAULT


def test_settings_passed_to_the_engine_replace_the_header(built):
    ks = dataclasses.replace(DEFAULT, attn=dataclasses.replace(DEFAULT.attn, CHUNK=8))
    eng = _engine(built, DEFAULT.to_dict(), kernel_settings=ks)
    assert eng.ops.settings is ks and isinstance(ks, KernelSettings)


def test_layer_settings_recorded_in_the_header_are_read_per_layer(built, caplog):
    L = built[0]["model_config"]["num_hidden_layers"]
    layers = [{"fc2_dot1": {"SPLIT": l + 1}, "qkv_b1": {"FOLD_FINISH": l % 2 == 0}} for l in range(L)]
    with caplog.at_level(logging.INFO, logger="dejavu"):
        eng = _engine(built, DEFAULT.to_dict(), layers)
    assert eng.ops.settings == DEFAULT and not caplog.records
    assert [(s.fc2_dot1.SPLIT, s.qkv_b1.FOLD_FINISH) for s in _layers(eng)] == [(l + 1, l % 2 == 0) for l in range(L)]
    assert all(s.proj1 == DEFAULT.proj1 for s in _layers(eng))  # the fields no entry names: the engine's


def test_a_header_with_one_set_for_every_layer_is_resolved_per_layer_with_a_logged_line(built, caplog):
    with caplog.at_level(logging.INFO, logger="dejavu"):
        eng = _engine(built, DEFAULT.to_dict())  # the header format before per-layer settings
    assert _layers(eng) == _resolved_here(eng, DEFAULT)
    assert any("one kernel-settings set for every layer" in r.getMessage() for r in caplog.records)
    assert eng.generate([[2, 5, 7]], 2, stop_at_eos=False)


@pytest.mark.parametrize("layers,why", [([{"fc2_dot1": {"SPLIT": 2}}], "a list of"),  # one entry, not one per layer
                                        ("all", "a list of"), (None, None)])
def test_unreadable_or_foreign_layer_settings_fall_back_to_the_layers_k(built, caplog, layers, why):
    L = built[0]["model_config"]["num_hidden_layers"]
    bad = [{"fc2_dot1": {"SPLITS": 2}}] * L  # an unknown field
    with caplog.at_level(logging.INFO, logger="dejavu"):
        eng = _engine(built, DEFAULT.to_dict(), bad if layers is None else layers)
        other = _engine(built, resolve_kernel_settings("sm_90", 132).to_dict(), [{"fc2_dot1": {"SPLIT": 2}}] * L)
    assert _layers(eng) == _resolved_here(eng, DEFAULT) and _layers(other) == _resolved_here(other, DEFAULT)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("layer kernel settings unreadable" in m and (why or "unknown key") in m for m in msgs), msgs
    assert any("engine built for sm_90" in m for m in msgs), msgs  # another GPU: its per-layer list is not read


def test_settings_passed_to_the_engine_are_resolved_per_layer(built):
    ks = dataclasses.replace(DEFAULT, fc2_dot1=dataclasses.replace(DEFAULT.fc2_dot1, TARGET_PROGRAMS=2))
    eng = _engine(built, DEFAULT.to_dict(), [{"fc2_dot1": {"SPLIT": 7}}] * 2, kernel_settings=ks)
    assert _layers(eng) == _resolved_here(eng, ks) and eng.ops.settings is ks


H100, H100_PCIE = ("sm_90", 132, "NVIDIA H100 80GB HBM3"), ("sm_90", 114, "NVIDIA H100 PCIe")


def _target(gpu, settings, tuned=False):
    t = {"device": "cuda", "arch": gpu[0], "name": gpu[2], "kernel_settings": settings.to_dict()}
    return {**t, "tuned": {"gpu": gpu[2], "step_ms": [5.0, 4.9], "trials": []}} if tuned else t


def test_settings_resolved_for_another_gpu_of_the_arch_are_resolved_again_where_they_differ(caplog):
    """An untuned engine built on a GPU of the same arch: its settings where the resolution here is the same (same
    SM count), those resolved for this GPU where it is not (the grid targets scale with the SM count)."""
    from dejavu.runtime.ops import header_settings

    built_on = resolve_kernel_settings("sm_90", 132)
    assert header_settings(_target(H100, built_on), H100) == (built_on, True)
    assert header_settings(_target(("sm_90", 132, "NVIDIA H200"), built_on), H100) == (built_on, True)
    with caplog.at_level(logging.INFO, logger="dejavu"):
        got, own = header_settings(_target(H100, built_on), H100_PCIE)
    assert not own and got == resolve_kernel_settings("sm_90", 114) != built_on
    assert got.input_sparse.target_programs == round(528 * 114 / 132)
    assert any("resolved for NVIDIA H100 80GB HBM3, running on NVIDIA H100 PCIe" in r.getMessage()
               for r in caplog.records)


def test_launch_shapes_tuned_on_one_gpu_are_used_on_that_gpu_only(caplog):
    """dejavu-tune's settings (target.tuned) on the GPU they were timed on; on another (even of the same arch and
    SM count) the defaults resolved there, with a warning naming dejavu-tune, as vLLM's tuned tables by device name."""
    from dejavu.runtime.ops import header_settings
    from dejavu.runtime.tune import with_setting

    base = resolve_kernel_settings("sm_90", 132)
    tuned = with_setting(with_setting(base, "qkv", "target_programs", 396), "gate_up", "block_k", 128)
    assert tuned != base
    with caplog.at_level(logging.INFO, logger="dejavu"):
        assert header_settings(_target(H100, tuned, tuned=True), H100) == (tuned, True)
    assert not caplog.records
    for elsewhere in (("sm_90", 132, "NVIDIA H200"), H100_PCIE):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dejavu"):
            got, own = header_settings(_target(H100, tuned, tuned=True), elsewhere)
        assert not own and got == resolve_kernel_settings("sm_90", elsewhere[1])
        [rec] = caplog.records
        assert rec.levelno == logging.WARNING and f"tuned on {H100[2]}, running on {elsewhere[2]}" in rec.getMessage()
        assert "dejavu-tune" in rec.getMessage()
    # a header that names no GPU (before target.name): the arch alone decides, as before
    old = {k: v for k, v in _target(H100, tuned, tuned=True).items() if k != "name"}
    assert header_settings(old, H100_PCIE) == (tuned, True)

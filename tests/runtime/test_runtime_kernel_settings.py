"""The runtime reads the kernel settings an engine header records (target.kernel_settings) and falls back,
with a logged line, to the settings resolved where it runs when they were made for another GPU, are
missing, or come from an older header format."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from dejavu.plugins import DEFAULT, KernelSettings, resolve_kernel_settings
from dejavu.runtime import Engine
from runtime_helpers import engine_from_dense, tiny_model


@pytest.fixture(scope="module")
def built():
    return engine_from_dense(tiny_model(seed=5), 0.5, 0.5)


def _engine(built, recorded, **kw):
    header, tensors = built
    header = {**header, "target": {**header["target"], "kernel_settings": recorded}}
    return Engine.from_tensors(header, tensors, "cpu", **kw)


def test_header_settings_made_for_this_device_are_used(built, caplog):
    mine = dataclasses.replace(DEFAULT, qkv_b1=dataclasses.replace(DEFAULT.qkv_b1, SHARED_P=8))
    with caplog.at_level(logging.INFO, logger="dejavu"):
        eng = _engine(built, mine.to_dict())
    assert eng.ops.settings == mine and not caplog.records


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

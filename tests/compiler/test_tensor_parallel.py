"""Tensor-parallel builds: `BuildConfig.tp` / `dejavu-compile --tp` write one shard per rank."""
from __future__ import annotations

import pytest
import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.cli import inspect_main, main
from dejavu.compiler.predictors import Predictors
from dejavu.compiler.tensor_parallel import shard_engine
from dejavu.engine_file import read_engine
from dejavu.errors import DejavuError
from dejavu.models.loader import load_config
from helpers_compiler import random_predictors


def test_build_tp2_equals_sharded_single_build(tiny_opt_dir, tmp_path):
    preds = Predictors.from_state_dict(random_predictors(load_config(tiny_opt_dir), rank=8, rank_attn=4),
                                       {"source": "attn_in", "lookahead": 1})
    cfg = dict(mlp_density=0.3, attn_density=0.5, dtype="float32")  # both kinds sparse everywhere
    build_engine(tiny_opt_dir, BuildConfig(**cfg), tmp_path / "one.engine", progress=False, predictors=preds)
    s = build_engine(tiny_opt_dir, BuildConfig(**cfg, tp=2), tmp_path / "m.engine", progress=False,
                     predictors=preds)
    assert "m.rank0-of-2.engine" in s["engine"]
    header, tensors = read_engine(tmp_path / "one.engine")
    for r, (hr, tr) in enumerate(shard_engine(header, tensors, 2)):
        got_h, got_t = read_engine(tmp_path / f"m.rank{r}-of-2.engine")
        assert got_h["build_config"]["tp"] == hr["build_config"]["tp"]
        assert got_h["build_config"]["tp"]["k_per_rank"]["mlp"] == [-(-k // 2) for k in s["mlp_k"]]
        assert got_t.keys() == tr.keys() and all(torch.equal(got_t[n], tr[n]) for n in tr)
    assert not (tmp_path / "m.engine").exists()


def test_cli_tp_pattern_and_errors(tiny_opt_dir, tmp_path, capsys):
    out = str(tmp_path / "d-{rank}-of-{size}.engine")
    assert main([str(tiny_opt_dir), "--density", "1.0", "--no-predictors", "--tp", "2", "-o", out, "-q"]) == 0
    assert (tmp_path / "d-0-of-2.engine").is_file() and (tmp_path / "d-1-of-2.engine").is_file()
    capsys.readouterr()
    assert inspect_main([str(tmp_path / "d-1-of-2.engine")]) == 0
    assert "tp          shard 1 of 2: heads 2, ffn 64" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([str(tiny_opt_dir), "--density", "1.0", "--no-predictors", "--tp", "3", "-q",
              "-o", str(tmp_path / "x.engine")])
    assert e.value.code == 2 and not list(tmp_path.glob("x*"))
    assert "--tp 3 must divide num_attention_heads" in capsys.readouterr().err
    with pytest.raises(DejavuError, match="tp"):
        BuildConfig(tp=0)


def test_a_gpu_target_records_each_layers_kernel_settings_for_each_rank():
    """A target resolved for a GPU gets each layer's kernel settings from its K (build.layer_target); a
    shard's header gets them from the rank's K; a CPU target records none (the runtime resolves them)."""
    import json

    from dejavu.compiler.build import layer_target
    from dejavu.compiler.tensor_parallel import _split_rule
    from dejavu.plugins import resolve_kernel_settings, resolve_layer_settings

    ks = resolve_kernel_settings("sm_90", 132)
    cpu = {"device": "cpu", "arch": None, "kernel_settings": {}}
    assert layer_target(cpu, 7168, 56, [2867], [6]) is cpu
    gpu = layer_target({"device": "cuda", "arch": "sm_90", "kernel_settings": ks.to_dict()}, 7168, 56,
                       [2867, 8602], [6, 17])
    assert gpu["layer_kernel_settings"] == resolve_layer_settings(ks, 7168, 128, [2867, 8602], [6, 17])
    assert json.loads(json.dumps(gpu["layer_kernel_settings"])) == gpu["layer_kernel_settings"]  # JSON as it is
    header = {"model_config": {"num_attention_heads": 56, "ffn_dim": 28672, "hidden_size": 7168},
              "build_config": {"mlp_k": [2867, 8602], "attn_k": [6, 17]}, "target": gpu}
    ranks, _ = _split_rule(header, 2)
    want = resolve_layer_settings(ks, 7168, 128, [1434, 4301], [3, 9])
    assert all(hr["target"]["layer_kernel_settings"] == want for hr in ranks)


def test_shards_are_written_in_one_pass_byte_for_byte_and_all_or_none(tiny_opt_dir, tmp_path):
    """write_shards lays each tensor out once for every rank (a part's chunks read once), its files equal
    byte for byte the single-file writer's on shard_engine's tensors, and a part that fails midway leaves no
    rank's file (not even the ranks before it)."""
    from dejavu.compiler.tensor_parallel import write_shards
    from dejavu.engine_file import TensorPart, encode_engine

    build_engine(tiny_opt_dir, BuildConfig(mlp_density=0.5, attn_density=0.5, dtype="float32"),
                 tmp_path / "one.engine", progress=False,
                 predictors=Predictors.from_state_dict(random_predictors(load_config(tiny_opt_dir), rank=8,
                                                                         rank_attn=4),
                                                       {"source": "attn_in", "lookahead": 1}))
    header, tensors = read_engine(tmp_path / "one.engine")
    reads = {}

    def counted(name, t):
        def chunks():
            reads[name] = reads.get(name, 0) + 1
            return TensorPart.of(name, t).chunks()
        return TensorPart(t.dtype, t.shape, chunks)

    size, files = write_shards(tmp_path / "m.engine", header, {n: counted(n, t) for n, t in tensors.items()}, 2)
    assert reads == {n: 1 for n in tensors}
    want = [encode_engine(hr, tr) for hr, tr in shard_engine(header, tensors, 2)]
    assert [open(f, "rb").read() for f in files] == want and size == sum(map(len, want))

    def broken():
        yield b"\0" * 8
        raise OSError(28, "No space left on device")

    last = sorted(tensors)[-1]
    parts = {**tensors, last: TensorPart(tensors[last].dtype, tensors[last].shape, broken)}
    with pytest.raises(DejavuError, match="cannot write engine shards .*No space left on device"):
        write_shards(tmp_path / "x.engine", header, parts, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["one.engine", *(p.split("/")[-1] for p in files)])

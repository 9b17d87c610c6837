"""benchmarks/e2e_llama.py's driver on its CPU path (tiny shape, reference ops, HF eager on CPU)."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
_spec = importlib.util.spec_from_file_location(
    "e2e_llama", Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_llama.py")
e2e_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e_llama)


def test_cpu_dry_run_writes_every_system_with_its_floor(tmp_path):
    from dejavu.compiler.build_llama import density_for_skip, step_bytes
    from dejavu.models.llama import LlamaConfig

    out = tmp_path / "r.json"
    assert e2e_llama.main(["--device", "cpu", "--out", str(out), "--prompt-len", "8", "--new-tokens", "5",
                           "--calib-tokens", "96", "--skip-steps", "4", "--no-smoke",
                           "--kernel-variants", '[{"block_m": 64}]']) == 0
    d = json.loads(out.read_text())
    assert d["errors"] == [] and d["bandwidth"]["copy_GBps"] > 0
    rows = {r["system"]: r for r in d["results"]}
    assert set(rows) == {"dense_graph", "teal_s0.25", "teal_s0.4", "teal_s0.5", "teal_s0.5+block_m=64", "hf_eager"}
    assert d["skipped"] == [] and rows["teal_s0.5"]["wall_s"] > 0
    assert rows["teal_s0.5+block_m=64"]["kernel_settings"]["block_m"] == 64
    from dejavu.plugins import InputSparseSettings
    assert rows["teal_s0.5"]["kernel_settings"]["block_m"] == InputSparseSettings().block_m  # the default, recorded
    c = e2e_llama.SHAPES["tiny"]
    cfg = LlamaConfig.from_hf_dict({**e2e_llama.COMMON, **c})
    ctx = 8 + 5 // 2
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * ctx * 2
    assert rows["dense_graph"]["floor_bytes"] == step_bytes(cfg, 2)["dense"] + kv
    for s in (0.25, 0.4, 0.5):
        r = rows[f"teal_s{s:g}"]
        assert r["density"] == pytest.approx(density_for_skip(cfg, s), abs=1e-6)
        assert abs(r["skip_realized"] - s) < 0.15  # thresholds from other random tokens
        assert r["floor_bytes"] < rows["dense_graph"]["floor_bytes"] and r["ms_per_step"] > 0 and r["steps"] == 4
    assert rows["dense_graph"]["skip_realized"] == 0.0


def test_hf_static_compile_loop_generates_what_generate_does(tmp_path):
    """--hf-compile's loop (StaticCache, one token a call; here uncompiled, backend eager: inductor takes a minute
    on this CPU) gives model.generate's greedy tokens, every one of them in fp32."""
    out = tmp_path / "r.json"
    assert e2e_llama.main(["--device", "cpu", "--out", str(out), "--prompt-len", "8", "--new-tokens", "6",
                           "--calib-tokens", "64", "--skip-steps", "2", "--no-smoke", "--skips", "0.5",
                           "--kernel-variants", "[]", "--hf-compile", "--hf-compile-backend", "eager"]) == 0
    d = json.loads(out.read_text())
    rows = {r["system"]: r for r in d["results"]}
    assert d["errors"] == [] and {"hf_eager", "hf_static_compile"} <= set(rows)
    r = rows["hf_static_compile"]
    assert r["backend"] == "eager" and r["ms_per_step"] > 0 and len(r["tokens"]) == 6 and r["tokens_agree"] == 6


def test_variants_past_the_budget_are_recorded_as_skipped(tmp_path):
    out = tmp_path / "r.json"
    assert e2e_llama.main(["--device", "cpu", "--out", str(out), "--prompt-len", "4", "--new-tokens", "3",
                           "--calib-tokens", "64", "--skip-steps", "2", "--no-smoke", "--no-hf", "--skips", "0.5",
                           "--budget-s", "1e-9", "--kernel-variants", '[{"block_m": 64}, {"block_k": 64}]']) == 0
    d = json.loads(out.read_text())
    assert [r["system"] for r in d["results"]] == ["dense_graph", "teal_s0.5"]  # the defaults run regardless
    assert [r["system"] for r in d["skipped"]] == ["teal_s0.5+block_m=64", "teal_s0.5+block_k=64"]


def test_variants_reach_the_engine_header_and_bad_ones_are_one_line(tmp_path, capsys):
    """An attention variant ({"gqa_attn": {...}}) and one table for every kind ({"projections": []}) reach the
    engines' headers; the shipped VARIANTS are settings; a variant that is not (a removed field, an unknown part's
    field, a field older headers held, a kind that is not one) is one argparse line before anything runs, and no
    file."""
    from dejavu.plugins import DEFAULT

    out = tmp_path / "r.json"
    assert e2e_llama.main(["--device", "cpu", "--out", str(out), "--prompt-len", "4", "--new-tokens", "3",
                           "--calib-tokens", "64", "--skip-steps", "2", "--no-smoke", "--no-hf", "--skips", "0.5",
                           "--kernel-variants", '[{"gqa_attn": {"kernel": false, "block_s": 16}}, {"projections": []}]'
                           ]) == 0
    d = json.loads(out.read_text())
    rows = {r["system"]: r for r in d["results"]}
    assert d["errors"] == [] and rows["teal_s0.5+projections=[]"]["kernel_settings"]["projections"] == []
    want = [list(p) for p in DEFAULT.input_sparse.projections]
    assert want and rows["teal_s0.5"]["kernel_settings"]["projections"] == want
    assert rows["teal_s0.5+gqa_attn={'kernel': False, 'block_s': 16}"]["kernel_settings"]["projections"] == want
    assert e2e_llama.check_variants(e2e_llama.VARIANTS) is None
    got = e2e_llama.with_variant(DEFAULT.to_dict(), {"gqa_attn": {"block_s": 16}, "block_m": 32})  # over the defaults
    assert got["gqa_attn"] == {**DEFAULT.to_dict()["gqa_attn"], "block_s": 16}
    assert got["input_sparse"] == {**DEFAULT.to_dict()["input_sparse"], "block_m": 32}
    assert got["pdl"] == DEFAULT.to_dict()["pdl"]
    capsys.readouterr()
    for bad, why in (('[{"prefetch_w": true}]', "input_sparse: unknown key.s. prefetch_w"),
                     ('[{"gqa_attn": {"chunks": 4}}]', "gqa_attn: unknown key.s. chunks"),
                     ('[{"gqa_attn": {"chunk": 16}}]', "gqa_attn.chunk not kept"),
                     ('[{"loop_stages": null}]', "input_sparse.loop_stages not kept"),
                     ('[{"projections": [["mlp", "block_k", 64]]}]', "not a projection kind"),
                     ('{"block_m": 32}', "expected a JSON list of objects")):
        with pytest.raises(SystemExit) as e:
            e2e_llama.main(["--device", "cpu", "--out", str(tmp_path / "bad.json"), "--kernel-variants", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and "--kernel-variants" in err[-1] and re.search(why, err[-1]), err[-1]
    assert not (tmp_path / "bad.json").exists()


def test_layer_anchor_is_a_kernel_launched_once_per_layer():
    pick = e2e_llama._layer_anchor(32)
    rows = [["gemv", 90.0, 128.0], ["elementwise", 40.0, 352.0], ["fmha_cutlassF_f16", 30.0, 32.0],
            ["index_put", 5.0, 32.0], ["lm_head", 9.0, 1.0]]
    assert pick(rows) == "fmha_cutlassF_f16"  # the attention where several run once per layer
    assert pick([r for r in rows if not r[0].startswith("fmha")]) == "index_put"
    assert pick([["gemv", 1.0, 3.0]]) == ""

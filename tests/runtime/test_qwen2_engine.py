"""Qwen2 checkpoints (the Llama layout with q/k/v biases and no o bias) through `dejavu-compile` and the Llama
runtime: the dense engine against transformers' Qwen2ForCausalLM on the same folder, the sparse engine against
the compiler's simulation, the Triton decode step (bias added before RoPE in the q/k/v sum kernel) under the
interpreter against the reference ops, and the biases' tensor-parallel split."""
from __future__ import annotations

import pytest
import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_engine
from dejavu.errors import DejavuError
from dejavu.runtime import Engine
from llama_helpers import write_tiny_llama

ATOL = 1e-4
CALIB = dict(calib_tokens=512, calib_window=128, dtype="float32")
QWEN2 = dict(model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(folder, {density: engine path}) for a tiny random Qwen2 (6 query / 2 KV heads, tied head)."""
    root = tmp_path_factory.mktemp("qwen2")
    folder = write_tiny_llama(root / "tiny", seed=7, **QWEN2)
    paths = {}
    for d in (1.0, 0.6):
        paths[d] = root / f"d{d}.engine"
        build_engine(folder, BuildConfig(density=d, **CALIB), paths[d], progress=False)
    return folder, paths


def _ids(n=2, s=24, seed=0):
    return torch.randint(0, 320, (n, s), generator=torch.Generator().manual_seed(seed))


def test_dense_engine_equals_transformers_qwen2(built):
    transformers = pytest.importorskip("transformers")
    folder, paths = built
    hf = transformers.Qwen2ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert hf.model.layers[0].self_attn.q_proj.bias is not None and hf.model.layers[0].self_attn.o_proj.bias is None
    eng = Engine.load(paths[1.0])
    assert eng.header["model_config"]["model_type"] == "qwen2"
    h, t = read_engine(paths[1.0])
    b = t["layers.1.attn.bqkv"]
    at = hf.model.layers[1].self_attn
    assert torch.equal(b, torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]).detach())
    ids = _ids()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert ref.std() > 0.1
    assert (eng.logits(ids) - ref).abs().max() <= ATOL
    assert (eng.decode_logits(ids) - ref).abs().max() <= ATOL  # cached decode steps, bias before RoPE


def test_sparse_engine_equals_the_compilers_simulation(built):
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
    from dejavu.models.auto import load_llama

    folder, paths = built
    eng = Engine.load(paths[0.6])
    model = load_llama(folder)[0]
    ids = _ids(seed=1)
    sp = eng.header["sparsity"]
    with torch.no_grad(), gated_sparsity(model, sp["thresholds"], GatedSparsity(skip=sp["skip"])) as reads:
        sim = model(ids)
    assert 0.3 < reads.skipped < 0.7
    assert (eng.logits(ids) - sim).abs().max() <= ATOL
    assert (eng.decode_logits(ids) - sim).abs().max() <= ATOL
    with torch.no_grad():
        assert (model(ids) - sim).abs().max() > 100 * ATOL
    # the biases are fixed bytes: density counts them read every step
    from dejavu.compiler.build_llama import step_bytes

    cfg = model.config
    nb = cfg.num_hidden_layers * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert step_bytes(cfg, 1)["fixed"] == step_bytes(
        type(cfg).from_hf_dict({**cfg.to_hf_dict(), "model_type": "llama"}), 1)["fixed"] + nb


def test_triton_decode_under_the_interpreter_equals_the_reference(built):
    """The decode step's q/k/v sum kernel adds the biases before RoPE: batched steps' logits and greedy tokens
    through plugins/input_sparse (small blocks, several splits; and the engine's own settings) equal the reference
    ops', in a subprocess (TRITON_INTERPRET set before triton is imported)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = f"""
import json, torch
from dejavu.plugins import InputSparseSettings, KernelSettings
from dejavu.runtime import Engine
path = {str(built[1][0.6])!r}
ref = Engine.load(path)
ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(5))
prompts = [[0, 9, 4], [7, 1, 3, 8, 2]]
a, want = ref.decode_logits(ids), ref.generate(prompts, 5, stop_at_eos=False)
for ks in (KernelSettings(input_sparse=InputSparseSettings(block_m=16, block_k=8, min_split_inputs=8)), None):
    tri = Engine.load(path, backend="triton", kernel_settings=ks)
    print(json.dumps({{"diff": float((a - tri.decode_logits(ids)).abs().max()),
                      "same": want == tri.generate(prompts, 5, stop_at_eos=False)}}))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.strip().splitlines()[-2:]]
    assert len(rows) == 2 and all(r["diff"] <= ATOL and r["same"] for r in rows)


def test_biases_split_with_their_columns_across_ranks(built):
    from dejavu.compiler.tensor_parallel import shard_engine

    _, paths = built
    h, t = read_engine(paths[0.6])
    hd, H, Hkv = 8, 6, 2
    for r, (hr, tr) in enumerate(shard_engine(h, t, 2)):
        for l in range(2):
            w, b = t[f"layers.{l}.attn.wqkv_t"], t[f"layers.{l}.attn.bqkv"]
            wb = torch.cat([w, b[None]])  # the bias as one more input row: split as the weight's columns
            assert torch.equal(torch.cat([tr[f"layers.{l}.attn.wqkv_t"], tr[f"layers.{l}.attn.bqkv"][None]]),
                               shard_engine(h, {**t, f"layers.{l}.attn.wqkv_t": wb}, 2)[r][1][f"layers.{l}.attn.wqkv_t"])
        assert tr["layers.0.attn.bqkv"].shape == ((H + 2 * Hkv) * hd // 2,)


def test_o_and_mlp_biases_are_refused_in_one_line(tmp_path):
    folder = write_tiny_llama(tmp_path / "b", attention_bias=True)
    with pytest.raises(DejavuError, match="o_proj or MLP biases"):
        build_engine(folder, BuildConfig(density=0.6, **CALIB), tmp_path / "x.engine", progress=False)
    assert not (tmp_path / "x.engine").exists()

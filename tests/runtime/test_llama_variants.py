"""Llama-family checkpoints with per-layer vectors beyond Llama-2/3's through `dejavu-compile` and the Llama runtime:
Qwen2 (q/k/v biases, no o bias), Llama's attention_bias + mlp_bias (q/k/v, o, gate/up, down) and Qwen3 (an RMSNorm
over each query and key head before RoPE; head_dim 16 with a hidden of 48). The dense engine against transformers'
model on the same folder, the sparse engine against the compiler's simulation, the Triton decode step (q/k/v's
bias and the heads' norm before RoPE in their sum kernel, gate/up's bias into the first split's partials, o's and
down's after their GEMVs) under the interpreter against the reference ops, and the vectors' tensor-parallel
split. Also Phi-3 (q/k/v and gate/up fused in its checkpoint, split on load), a Phi-4-mini-like partial rotary,
SmolLM3 (a layer without RoPE), Granite (its multipliers folded on load), a Qwen2 with YaRN rope scaling and a Llama
with Phi-3's LongRoPE built from folders."""
from __future__ import annotations

import pytest
import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_engine
from dejavu.runtime import Engine
from llama_helpers import write_tiny_llama

ATOL = 1e-4
CALIB = dict(calib_tokens=512, calib_window=128, dtype="float32")
VARIANTS = {"qwen2": dict(model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6),
            "llama_biases": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
            "qwen3": dict(model_type="qwen3", head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6)}
VECTORS = {"qwen2": ["attn.bqkv"], "llama_biases": ["attn.bqkv", "attn.bo", "mlp.bgu", "mlp.bd"],
           "qwen3": ["attn.k_norm", "attn.q_norm"]}
PROJECTIONS = ("attn_norm", "mlp_norm", "attn.wqkv_t", "attn.wo_t", "mlp.wgu_t", "mlp.wd_t")


@pytest.fixture(scope="module", params=list(VARIANTS))
def built(tmp_path_factory, request):
    """(variant, folder, {density: engine path}) for a tiny random checkpoint (6 query / 2 KV heads) of each
    variant."""
    root = tmp_path_factory.mktemp(request.param)
    folder = write_tiny_llama(root / "tiny", seed=7, **VARIANTS[request.param])
    paths = {}
    for d in (1.0, 0.6):
        paths[d] = root / f"d{d}.engine"
        build_engine(folder, BuildConfig(density=d, **CALIB), paths[d], progress=False)
    return request.param, folder, paths


def _ids(n=2, s=24, seed=0):
    return torch.randint(0, 320, (n, s), generator=torch.Generator().manual_seed(seed))


def test_dense_engine_equals_transformers(built):
    transformers = pytest.importorskip("transformers")
    variant, folder, paths = built
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}.get(
        variant, transformers.LlamaForCausalLM)
    hf = cls.from_pretrained(folder, attn_implementation="eager").eval()
    at, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    assert (at.q_proj.bias is None) == (variant == "qwen3") and (at.o_proj.bias is None) == (variant != "llama_biases")
    eng = Engine.load(paths[1.0])
    assert eng.header["model_config"]["model_type"] == VARIANTS[variant].get("model_type", "llama")
    h, t = read_engine(paths[1.0])
    extra = [k.split(".", 2)[2] for k in t if k.startswith("layers.1.")]
    assert sorted(set(extra) - set(PROJECTIONS)) == sorted(VECTORS[variant])
    if variant == "qwen3":
        assert torch.equal(t["layers.1.attn.q_norm"], at.q_norm.weight.detach())
        assert torch.equal(t["layers.1.attn.k_norm"], at.k_norm.weight.detach())
        assert t["layers.1.attn.wqkv_t"].shape == (48, (6 + 2 * 2) * 16)
    else:
        assert torch.equal(t["layers.1.attn.bqkv"], torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]))
    if variant == "llama_biases":
        assert torch.equal(t["layers.1.mlp.bgu"], torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]).detach())
        assert torch.equal(t["layers.1.attn.bo"], at.o_proj.bias.detach())
    ids = _ids()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert ref.std() > 0.1
    assert (eng.logits(ids) - ref).abs().max() <= ATOL
    assert (eng.decode_logits(ids) - ref).abs().max() <= ATOL  # cached decode steps, bias and norm before RoPE


def test_sparse_engine_equals_the_compilers_simulation(built):
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
    from dejavu.models.auto import load_llama

    variant, folder, paths = built
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
    # the vectors are fixed bytes: density counts them read every step
    from dejavu.compiler.build_llama import step_bytes

    cfg = model.config
    nb = sum(t.numel() for n, t in read_engine(paths[0.6])[1].items() if n.split(".", 2)[-1] in VECTORS[variant])
    plain = type(cfg).from_hf_dict({**cfg.to_hf_dict(), "model_type": "llama", "attention_bias": False,
                                    "mlp_bias": False})
    assert nb > 0 and step_bytes(cfg, 1)["fixed"] == step_bytes(plain, 1)["fixed"] + nb


def test_triton_decode_under_the_interpreter_equals_the_reference(built):
    """The decode step's q/k/v sum kernel adds the biases and normalises the q and k heads before RoPE: batched
    steps' logits and greedy tokens through plugins/input_sparse (small blocks, several splits; and the engine's
    own settings) equal the reference ops', and so do the dense engine's (its dense q/k/v product through the same
    sum kernel), in a subprocess (TRITON_INTERPRET set before triton is imported)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = f"""
import json, torch
from dejavu.plugins import InputSparseSettings, KernelSettings
from dejavu.runtime import Engine
path = {str(built[2][0.6])!r}
ref = Engine.load(path)
ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(5))
prompts = [[0, 9, 4], [7, 1, 3, 8, 2]]
a, want = ref.decode_logits(ids), ref.generate(prompts, 5, stop_at_eos=False)
for ks in (KernelSettings(input_sparse=InputSparseSettings(block_m=16, block_k=8, min_split_inputs=16)), None):
    tri = Engine.load(path, backend="triton", kernel_settings=ks)
    print(json.dumps({{"diff": float((a - tri.decode_logits(ids)).abs().max()),
                      "same": want == tri.generate(prompts, 5, stop_at_eos=False)}}))
dense = {str(built[2][1.0])!r}
ref, tri = Engine.load(dense), Engine.load(dense, backend="triton")
print(json.dumps({{"diff": float((ref.decode_logits(ids) - tri.decode_logits(ids)).abs().max()), "same": True}}))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.strip().splitlines()[-3:]]
    assert len(rows) == 3 and all(r["diff"] <= ATOL and r["same"] for r in rows)


def test_vectors_split_with_their_columns_across_ranks(built):
    """q/k/v's and gate/up's biases split as their weights' columns (the bias as one more input row gives the
    same shard); o's and down's replicated (added once, after the all-reduce), and the q and k heads' norm
    weights (one for every head)."""
    from dejavu.compiler.tensor_parallel import shard_engine

    _, _, paths = built
    h, t = read_engine(paths[0.6])
    shards = shard_engine(h, t, 2)
    for l in range(2):
        for w_name, b_name in (("attn.wqkv_t", "attn.bqkv"), ("mlp.wgu_t", "mlp.bgu")):
            w, b = t.get(f"layers.{l}.{w_name}"), t.get(f"layers.{l}.{b_name}")
            if b is None:
                continue
            with_row = shard_engine(h, {**t, f"layers.{l}.{w_name}": torch.cat([w, b[None]])}, 2)
            for (_, tr), (_, wr) in zip(shards, with_row):
                got = torch.cat([tr[f"layers.{l}.{w_name}"], tr[f"layers.{l}.{b_name}"][None]])
                assert torch.equal(got, wr[f"layers.{l}.{w_name}"]) and got.shape[1] == w.shape[1] // 2
        for name in ("attn.bo", "mlp.bd", "attn.q_norm", "attn.k_norm"):
            if f"layers.{l}.{name}" in t:
                assert all(torch.equal(tr[f"layers.{l}.{name}"], t[f"layers.{l}.{name}"]) for _, tr in shards)


def _hf_folder(folder, family="Phi3", **config):
    """A random tiny Phi3ForCausalLM (family "Granite": a GraniteForCausalLM) (6 query / 2 KV heads of 8 unless config
    says otherwise) saved as a folder with the tests' tokenizer; (model, folder)."""
    transformers = pytest.importorskip("transformers")
    from tiny_tokenizer import tiny_tokenizer_json

    base = dict(vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(3)
    cls, config_cls = getattr(transformers, f"{family}ForCausalLM"), getattr(transformers, f"{family}Config")
    hf = cls(config_cls(**{**base, **config}, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    return hf.eval(), folder


def _engines_equal_their_references(folder, hf, ids, tmp_path) -> dict:
    """Build a dense and a 0.6 engine of `folder`: the dense one's logits, token-parallel and through cached decode
    steps, equal transformers' model `hf`; the sparse one's the compiler's simulation (which the thresholds move
    away from the dense model). Returns {density: engine}."""
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
    from dejavu.models.auto import load_llama

    engines = {}
    for d in (1.0, 0.6):
        build_engine(folder, BuildConfig(density=d, **CALIB), tmp_path / f"d{d}.engine", progress=False)
        eng = engines[d] = Engine.load(tmp_path / f"d{d}.engine")
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
            if d < 1.0:
                sp = eng.header["sparsity"]
                model = load_llama(folder)[0]
                with gated_sparsity(model, sp["thresholds"], GatedSparsity(skip=sp["skip"])):
                    sim = model(ids)
                assert (sim - ref).abs().max() > 100 * ATOL  # the thresholds change the logits
                ref = sim
        assert (eng.logits(ids) - ref).abs().max() <= ATOL and (eng.decode_logits(ids) - ref).abs().max() <= ATOL
    return engines


def _interpreter_decode_equals_the_reference(tmp_path):
    # the d0.6 and d1.0 engines in tmp_path: the Triton decode step under the interpreter (a subprocess: the
    # variable must be set before triton is imported) against the reference ops, over 12 positions of 2 rows
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = f"""
import json, torch
from dejavu.runtime import Engine
ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(5))
for d in (0.6, 1.0):
    path = {str(tmp_path)!r} + f"/d{{d}}.engine"
    ref, tri = Engine.load(path), Engine.load(path, backend="triton")
    print(json.dumps({{"diff": float((ref.decode_logits(ids) - tri.decode_logits(ids)).abs().max())}}))
"""
    p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.strip().splitlines()[-2:]]
    assert len(rows) == 2 and all(r["diff"] <= ATOL for r in rows)


def test_phi3_folder_builds_and_its_engines_equal_transformers_and_the_simulation(tmp_path):
    """`dejavu-compile` on a Phi3ForCausalLM folder (fused qkv_proj and gate_up_proj, split on load): the dense
    engine equals transformers' model, the sparse one the compiler's simulation, cached decode steps included."""
    hf, folder = _hf_folder(tmp_path / "phi3")
    engines = _engines_equal_their_references(folder, hf, _ids(seed=2), tmp_path)
    assert all(e.header["model_config"]["model_type"] == "phi3" for e in engines.values())


def test_partial_rotary_folder_engines_equal_transformers_and_the_simulation_and_triton(tmp_path):
    """A Phi-4-mini-like folder (Phi3ForCausalLM, rotary positions over 12 of a head's 16 dimensions): the dense
    engine equals transformers' model, token-parallel and through cached decode steps, the sparse one the compiler's
    simulation; the Triton decode step of both (the q/k/v sum kernel pairing each rotary column with the one 6 away
    and passing the last 4 through) equals the reference ops' under the interpreter."""
    hf, folder = _hf_folder(tmp_path / "phi4mini", hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.75)
    assert hf.model.rotary_emb.inv_freq.numel() == 6
    engines = _engines_equal_their_references(folder, hf, _ids(seed=2), tmp_path)
    assert all(e.spec.config.rotary_dim == 12 for e in engines.values())
    _interpreter_decode_equals_the_reference(tmp_path)


def test_smollm3_folder_engines_equal_transformers_and_the_simulation_and_triton(tmp_path):
    """A SmolLM3 folder (layer 0 without RoPE, layer 1 with it): the dense engine equals transformers'
    SmolLM3ForCausalLM, token-parallel and through cached decode steps, the sparse one the compiler's simulation;
    the Triton decode step of both (the NoPE layer's q and k through the sum kernel with cos 1 and sin 0) equals the
    reference ops' under the interpreter."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_llama(tmp_path / "smollm3", seed=4, model_type="smollm3", no_rope_layers=[0, 1])
    hf = transformers.SmolLM3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert [layer.self_attn.use_rope for layer in hf.model.layers] == [0, 1]
    engines = _engines_equal_their_references(folder, hf, _ids(seed=2), tmp_path)
    assert all(e.spec.config.nope_layers == (0,) for e in engines.values())
    assert all(e.header["model_config"]["no_rope_layers"] == [0, 1] for e in engines.values())
    _interpreter_decode_equals_the_reference(tmp_path)


def test_granite_folder_engines_equal_transformers_and_the_simulation(tmp_path):
    """A Granite folder (embedding, residual, attention and logit multipliers, folded into the weights as they load;
    a tied head untied): the dense engine equals transformers' GraniteForCausalLM, token-parallel and through cached
    decode steps, the sparse one the compiler's simulation; the header's config is the folded model's."""
    hf, folder = _hf_folder(tmp_path / "granite", family="Granite", embedding_multiplier=12.0,
                              residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
                              tie_word_embeddings=True)
    engines = _engines_equal_their_references(folder, hf, _ids(seed=2), tmp_path)
    for e in engines.values():
        mc = e.header["model_config"]
        assert (mc["model_type"], mc["residual_multiplier"], mc["tie_word_embeddings"]) == ("granite", 1.0, False)
        assert "lm_head" in read_engine(tmp_path / f"d{e.header['build_config']['density']}.engine")[1]


def test_yarn_folder_builds_and_its_engines_equal_transformers_and_the_simulation(tmp_path):
    """A Qwen2 folder with YaRN rope scaling (frequencies ramped over an original context of 16, cos and sin scaled by
    its attention factor): the dense engine equals transformers' model, the sparse one the compiler's simulation,
    token-parallel and through cached decode steps over 40 positions (past the original context)."""
    transformers = pytest.importorskip("transformers")
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    folder = write_tiny_llama(tmp_path / "yarn", seed=5, model_type="qwen2", rope_scaling=yarn)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert hf.model.rotary_emb.attention_scaling > 1.1  # the factor is in play
    _engines_equal_their_references(folder, hf, _ids(s=40, seed=3), tmp_path)


def test_longrope_engines_decode_as_transformers_and_the_simulation_do(tmp_path):
    """A folder with Phi-3's LongRoPE (short factors while a call stays inside the original context of 16, long ones
    past it, cos and sin scaled): the dense engine's decode steps equal transformers' cached decode one token at a
    time over 24 positions, its token-parallel logits transformers' forward; the sparse engine's equal the
    compiler's simulation run the same two ways."""
    transformers = pytest.importorskip("transformers")
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
    from dejavu.models.auto import load_llama

    rope = dict(rope_type="longrope", original_max_position_embeddings=16, short_factor=[1.0, 1.2, 1.5, 2.0],
                long_factor=[1.0, 2.0, 6.0, 16.0])  # head_dim 8: 4 frequencies
    folder = write_tiny_llama(tmp_path / "longrope", seed=5, rope_scaling=rope)
    ids = _ids(s=24, seed=3)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert hf.model.rotary_emb.attention_scaling > 1.1
    for d in (1.0, 0.6):
        build_engine(folder, BuildConfig(density=d, **CALIB), tmp_path / f"d{d}.engine", progress=False)
        eng = Engine.load(tmp_path / f"d{d}.engine")
        with torch.no_grad():
            if d == 1.0:  # transformers' cached decode, one token a step from an empty cache
                whole, steps, cache = hf(input_ids=ids).logits, [], None
                for t in range(ids.shape[1]):
                    out = hf(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
                    steps.append(out.logits)
                    cache = out.cache
            else:  # the simulation, token-parallel and one token a step through its cache
                sp = eng.header["sparsity"]
                model = load_llama(folder)[0]
                with gated_sparsity(model, sp["thresholds"], GatedSparsity(skip=sp["skip"])):
                    whole = model(ids)
                    model.setup_caches(2, 24)
                    steps = [model(ids[:, t:t + 1], t) for t in range(ids.shape[1])]
                    model.clear_caches()
            steps = torch.cat(steps, 1)
            assert (steps[:, 16:] - whole[:, 16:]).abs().max() > 100 * ATOL  # the two ways differ past the switch
            assert (eng.logits(ids) - whole).abs().max() <= ATOL
            assert (eng.decode_logits(ids) - steps).abs().max() <= ATOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_rope_variants_triton_decode_on_the_gpu_equals_the_cpu_reference(tmp_path):
    """On the GPU: sparse engines of a partial rotary (Phi-4-mini-like), YaRN, LongRoPE and SmolLM3 folder decode (the
    q/k/v sum kernel's partial pairing; cos and sin scaled; LongRoPE's switch on the device inside the CUDA graph, over
    24 positions past its original context of 16; a NoPE layer's cos 1 and sin 0) as the CPU reference engine does."""
    pytest.importorskip("triton")
    longrope = dict(rope_type="longrope", original_max_position_embeddings=16, short_factor=[1.0, 1.2, 1.5, 2.0],
                    long_factor=[1.0, 2.0, 6.0, 16.0])
    folders = [_hf_folder(tmp_path / "partial", hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.75)[1],
               write_tiny_llama(tmp_path / "yarn", seed=5, model_type="qwen2",
                                rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
               write_tiny_llama(tmp_path / "longrope", seed=5, rope_scaling=longrope),
               write_tiny_llama(tmp_path / "smollm3", seed=4, model_type="smollm3", no_rope_layers=[0, 1])]
    ids = _ids(s=24, seed=3)
    prompts = [[0, 9, 4], [7, 1, 3, 8, 2]]
    for i, folder in enumerate(folders):
        build_engine(folder, BuildConfig(density=0.6, **CALIB), tmp_path / f"{i}.engine", progress=False)
        path = tmp_path / f"{i}.engine"
        ref, tri = Engine.load(path), Engine.load(path, "cuda", backend="triton")
        assert (tri.decode_logits(ids).cpu() - ref.decode_logits(ids)).abs().max() <= 1e-3, folder.name
        assert tri.generate(prompts, 20, stop_at_eos=False) == ref.generate(prompts, 20, stop_at_eos=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_triton_decode_on_the_gpu_equals_the_cpu_reference(built):
    """On the GPU: the sparse and the dense engine's Triton decode steps (the q/k/v sum kernel with the biases or the
    heads' norm compiled for the device, after the sliced GEMV or the dense product) and their CUDA-graph generate
    equal the CPU reference engine's logits and tokens."""
    pytest.importorskip("triton")
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(5))
    prompts = [[0, 9, 4], [7, 1, 3, 8, 2]]
    for path in (built[2][0.6], built[2][1.0]):
        ref, tri = Engine.load(path), Engine.load(path, "cuda", backend="triton")
        assert (tri.decode_logits(ids).cpu() - ref.decode_logits(ids)).abs().max() <= 1e-3
        assert tri.generate(prompts, 8, stop_at_eos=False) == ref.generate(prompts, 8, stop_at_eos=False)

"""Our dense Llama equals transformers.LlamaForCausalLM (Qwen2ForCausalLM / Qwen3ForCausalLM / SmolLM3ForCausalLM /
GraniteForCausalLM for model_type qwen2 / qwen3 / smollm3 / granite) on the same weights (fp32, max abs <= 1e-4)."""
from __future__ import annotations

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.models.generate import generate
from dejavu.models.llama import LlamaConfig, LlamaForCausalLM

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BASE = dict(vocab_size=97, num_hidden_layers=2, max_position_embeddings=64, hidden_act="silu")
CONFIGS = {
    # GQA 6 query heads / 2 KV heads, tied head, a large rope_theta (SmolLM2-like)
    "gqa_tied": dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2,
                     tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5),
    # multi-head (no GQA), untied head, biases, explicit head_dim != hidden / heads
    "mha_bias_headdim": dict(hidden_size=40, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                             head_dim=12, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                             num_hidden_layers=3),
    # Llama-3.1 rope scaling, 4 query heads per KV head
    "llama3_rope": dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                        rope_theta=500000.0, tie_word_embeddings=False,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=16)),
    "linear_rope": dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1,
                        rope_scaling=dict(type="linear", factor=2.0)),
    # Phi-3's LongRoPE: a factor per frequency, short ones while a call stays inside the original context of 16,
    # long ones past it; cos and sin scaled by sqrt(1 + ln(64 / 16) / ln 16)
    "longrope": dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                     original_max_position_embeddings=16,
                     rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0],
                                       long_factor=[1.0, 2.0, 6.0, 16.0])),
    # Qwen2 with YaRN (the long-context setting Qwen's model cards give): frequencies ramped between interpolated
    # and extrapolated over an original context of 16, cos and sin scaled by the attention factor
    "qwen2_yarn": dict(model_type="qwen2", hidden_size=48, intermediate_size=72, num_attention_heads=6,
                       num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
                       rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16)),
    # Qwen2: q/k/v biases without o's, untied head, rope_theta 1e6, a window it does not use
    "qwen2": dict(model_type="qwen2", hidden_size=48, intermediate_size=72, num_attention_heads=6,
                  num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
                  use_sliding_window=False, sliding_window=32, bos_token_id=0, eos_token_id=0),
    # Qwen3: per-head q/k RMSNorm before RoPE, head_dim 16 with 6 heads in a hidden of 64 (q is 96 wide), tied
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=80, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0),
    # Qwen3 with attention_bias (q/k/v and o biases) and a window it does not use
    "qwen3_bias": dict(model_type="qwen3", hidden_size=48, intermediate_size=72, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=8, attention_bias=True, tie_word_embeddings=False,
                       use_sliding_window=False, sliding_window=32),
    # SmolLM3: layers 1 and 3 without RoPE (NoPE), GQA, tied, rope_theta 2e6
    "smollm3": dict(model_type="smollm3", hidden_size=48, intermediate_size=72, num_attention_heads=6,
                    num_key_value_heads=2, num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], rope_theta=2000000.0,
                    tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None),
}



def make_pair(overrides: dict, seed: int = 0):
    """(hf_model, our_model) with the same random weights (norm weights included)."""
    over = dict(overrides)
    family = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
              "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
              "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM)}[over.pop("model_type", "llama")]
    hf_cfg = family[0](**{**BASE, **over}, attn_implementation="eager")
    torch.manual_seed(seed)
    hf = family[1](hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1 if p.dim() == 1 else 0.15)
    ours = LlamaForCausalLM(LlamaConfig.from_hf_dict(hf_cfg.to_dict())).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request):
    return make_pair(CONFIGS[request.param])


@torch.no_grad()
def test_prefill_matches_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (2, 37), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    out = ours(ids)
    assert out.shape == ref.shape == (2, 37, 97)
    assert (out - ref).abs().max().item() <= ATOL
    assert ref.std() > 0.1  # not a degenerate comparison


@torch.no_grad()
def test_left_padded_batch_matches_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    out = ours(ids, 0, mask)
    assert (out[0] - ref[0]).abs().max().item() <= ATOL
    assert (out[1, 4:] - ref[1, 4:]).abs().max().item() <= ATOL


@torch.no_grad()
def test_cached_decode_equals_full_recompute(pair):
    _, ours = pair
    if ours.long_after is not None:
        pytest.skip("LongRoPE rotates a call's every position by the long factors once it passes the original "
                    "context, cached keys not: test_longrope_cached_decode_equals_transformers_cached_decode")
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    full = ours(ids)
    ours.setup_caches(2, 20)
    try:
        steps = [ours(ids[:, :8], 0)] + [ours(ids[:, t:t + 1], t) for t in range(8, 20)]
    finally:
        ours.clear_caches()
    assert (torch.cat(steps, 1) - full).abs().max().item() <= ATOL


@torch.no_grad()
def test_longrope_cached_decode_equals_transformers_cached_decode():
    """LongRoPE through a cache, one token a step across the switch to the long factors (positions 16 and on), as
    transformers' own cached decode runs it; the full recompute differs (the cached keys keep their short factors)."""
    hf, ours = make_pair(CONFIGS["longrope"], seed=9)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    out = hf(input_ids=ids[:, :8], use_cache=True)
    ref, past = [out.logits], out.cache
    for t in range(8, 24):
        out = hf(input_ids=ids[:, t:t + 1], cache=past, use_cache=True)
        ref.append(out.logits)
        past = out.cache
    ref = torch.cat(ref, 1)
    ours.setup_caches(2, 24)
    try:
        steps = torch.cat([ours(ids[:, :8], 0)] + [ours(ids[:, t:t + 1], t) for t in range(8, 24)], 1)
    finally:
        ours.clear_caches()
    assert (steps - ref).abs().max().item() <= ATOL
    assert (ours(ids)[:, 16:] - ref[:, 16:]).abs().max().item() > 100 * ATOL  # the full recompute is not this


@torch.no_grad()
def test_greedy_generate_matches_transformers():
    hf, ours = make_pair(CONFIGS["gqa_tied"], seed=4)
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                      pad_token_id=0)[0, 6:].tolist()
    assert generate(ours, prompt, 10) == [ref]


@pytest.mark.parametrize("change, match", [
    ({"model_type": "opt"}, "model_type"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"num_key_value_heads": 4, "num_attention_heads": 6}, "multiple"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"hidden_size": 0}, "positive"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5"),  # more than the head
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.1}}, "0.1"),  # 0.8
    ({"partial_rotary_factor": 0.375}, "an even number of a head's 8"),  # 3 dimensions
    ({"model_type": "smollm3", "no_rope_layers": [1, 0, 1]}, "must list 2 flags"),
    ({"model_type": "smollm3", "no_rope_layers": None, "no_rope_layer_interval": 0}, "positive integer"),
    ({"model_type": "granite", "residual_multiplier": -0.5}, "'residual_multiplier' must be a positive number"),
])
def test_bad_config_is_one_clear_error(change, match):
    d = transformers.LlamaConfig(**{**BASE, **CONFIGS["gqa_tied"]}).to_dict()
    d.update(change)
    with pytest.raises(DejavuError, match=match):
        LlamaConfig.from_hf_dict(d)


def test_num_params_counts_the_state_dict():
    for over in CONFIGS.values():
        _, ours = make_pair(over)
        n = sum(p.numel() for p in ours.parameters())  # tied weights counted once
        assert ours.config.num_params() == n


@torch.no_grad()
@pytest.mark.parametrize("name", ["gqa_tied", "llama3_rope", "qwen2", "qwen3", "smollm3"])
def test_hf_folder_loads_through_the_family_dispatch(tmp_path, name):
    """save_pretrained's folder (safetensors, config.json of this transformers) -> load_any equal."""
    from tiny_tokenizer import tiny_tokenizer_json

    from dejavu.models.auto import load_any, load_text_tokenizer, model_type

    hf, _ = make_pair(CONFIGS[name], seed=6)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json(97 + 263))
    assert model_type(tmp_path) == CONFIGS[name].get("model_type", "llama")
    model, cfg = load_any(tmp_path)
    assert cfg.qkv_bias == (name == "qwen2") and cfg.qk_norm == (name == "qwen3") and cfg.sliding_window is None
    assert cfg.nope_layers == ((1, 3) if name == "smollm3" else ())
    assert isinstance(model, LlamaForCausalLM) and not any(p.is_meta for p in model.parameters())
    ids = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(7))
    assert (model(ids) - hf(input_ids=ids).logits).abs().max().item() <= ATOL
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    tok = load_text_tokenizer(tmp_path)
    assert tok.encode("hello", add_bos=True)[0] == cfg.bos_token_id


def test_folder_with_missing_tensor_is_one_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from dejavu.models.auto import load_any

    hf, _ = make_pair(CONFIGS["gqa_tied"], seed=8)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DejavuError, match="missing from the checkpoint: model.layers.1.mlp.up_proj.weight"):
        load_any(tmp_path)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_compute_in_fp32_keeps_the_stored_bytes_and_equals_fp32(tmp_path, half):
    """A half checkpoint loaded as stored (load_llama dtype None) and read through compute_in_fp32: its
    parameters take the half bytes (the tied head shares the embedding's), and its logits, cached decode
    included, equal those of the same checkpoint loaded in fp32, bit for bit."""
    from llama_helpers import write_tiny_llama
    from safetensors.torch import load_file, save_file

    from dejavu.models.auto import load_llama
    from dejavu.models.llama import compute_in_fp32

    folder = write_tiny_llama(tmp_path / "m", seed=5)
    sd = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(half) for k, v in sd.items()}, str(folder / "model.safetensors"))
    ref, _ = load_llama(folder, dtype=torch.float32)
    model, _ = load_llama(folder, dtype=None)
    assert {p.dtype for p in model.parameters()} == {half}
    compute_in_fp32(model)
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stored * 2 == sum(p.numel() * p.element_size() for p in ref.parameters())
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.randint(3, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
        for m in (model, ref):
            m.setup_caches(2, 24)
        a = [model(ids[:, :12]), model(ids[:, 12:13], start_pos=12)]
        b = [ref(ids[:, :12]), ref(ids[:, 12:13], start_pos=12)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name, family", [("qwen2", "Qwen2"), ("qwen3_bias", "Qwen3")])
def test_qwen_window_only_where_it_is_used_and_the_config_round_trips(name, family):
    """Qwen2's and Qwen3's config.json write a sliding_window either way; it applies where use_sliding_window
    is set, and our config.json (an engine header's model_config) reads back the same config."""
    over = {k: v for k, v in CONFIGS[name].items() if k != "model_type"}
    d = getattr(transformers, f"{family}Config")(**{**BASE, **over}).to_dict()
    d["sliding_window"] = 32  # transformers drops it when unused; checkpoints keep it
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.sliding_window is None and cfg.qkv_bias == (family == "Qwen2")
    assert cfg.attention_bias == (family == "Qwen3") and cfg.qk_norm == (family == "Qwen3")
    used = LlamaConfig.from_hf_dict({**d, "use_sliding_window": True})
    assert used.sliding_window == 32
    for c in (cfg, used):
        assert LlamaConfig.from_hf_dict(c.to_hf_dict()) == c
        assert c.to_hf_dict()["architectures"] == [f"{family}ForCausalLM"]
    with pytest.raises(DejavuError, match="sliding_window"):
        LlamaConfig.from_hf_dict({**d, "use_sliding_window": True, "sliding_window": "x"})


@torch.no_grad()
def test_phi3_folder_splits_its_fused_projections_and_equals_transformers(tmp_path):
    """A Phi3ForCausalLM folder (q/k/v fused in qkv_proj, gate/up in gate_up_proj; GQA 6 / 2, a window longer than
    the text) loads split into this model's projections and equals transformers', cached decode included."""
    from dejavu.models.auto import load_any

    cfg = transformers.Phi3Config(**BASE, hidden_size=48, intermediate_size=80, num_attention_heads=6,
                                  num_key_value_heads=2, sliding_window=48, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(9)
    hf = transformers.Phi3ForCausalLM(cfg).eval()
    for name, p in hf.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, ours = load_any(tmp_path)
    assert (ours.model_type, ours.sliding_window, ours.num_key_value_heads) == ("phi3", 48, 2)
    qkv = hf.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(model.model.layers[1].self_attn.k_proj.weight, qkv[48:64])
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, hf.model.layers[1].mlp.gate_up_proj.weight[80:])
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= ATOL and ref.std() > 0.1
    model.setup_caches(2, 21)
    steps = torch.cat([model(ids[:, :9], 0)] + [model(ids[:, t:t + 1], t) for t in range(9, 21)], 1)
    assert (steps - ref).abs().max().item() <= ATOL
    assert LlamaConfig.from_hf_dict(ours.to_hf_dict()) == ours


def test_smollm3_nope_layers_from_the_interval_and_the_config_round_trips():
    """Without no_rope_layers, every no_rope_layer_interval-th layer takes no RoPE (transformers' default, what
    llama.cpp hard-codes); to_hf_dict writes the flags back, and transformers' SmolLM3Config reads the same."""
    d = transformers.SmolLM3Config(**{**BASE, **CONFIGS["smollm3"], "num_hidden_layers": 9, "no_rope_layers": None,
                                      "no_rope_layer_interval": 3}).to_dict()
    d.pop("no_rope_layers", None)
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.nope_layers == (2, 5, 8)
    back = cfg.to_hf_dict()
    assert back["no_rope_layers"] == [1, 1, 0, 1, 1, 0, 1, 1, 0] and back["architectures"] == ["SmolLM3ForCausalLM"]
    assert transformers.SmolLM3Config(**back).no_rope_layers == back["no_rope_layers"]
    assert LlamaConfig.from_hf_dict(back) == cfg
    assert LlamaConfig.from_hf_dict({**d, "model_type": "llama"}).nope_layers == ()  # a Llama rotates every layer


GRANITE = dict(hidden_size=48, intermediate_size=72, num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0,
               embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
               logits_scaling=8.0, bos_token_id=0, eos_token_id=0, pad_token_id=None)


@torch.no_grad()
@pytest.mark.parametrize("tied, bias", [(True, False), (False, True)], ids=["tied", "untied_bias"])
def test_granite_folder_folds_its_multipliers_and_equals_transformers(tmp_path, tied, bias):
    """A GraniteForCausalLM folder (embedding, residual, attention and logit multipliers far from 1): load_any folds
    them into the weights (a tied head untied: the embedding is scaled, the head is not) and equals transformers,
    token-parallel, through cached decode steps and greedy; the folded config is a Granite config transformers
    reads as the same model; a Llama model is never built with the multipliers still to apply."""
    from tiny_tokenizer import tiny_tokenizer_json

    from dejavu.models.auto import load_any

    hf_cfg = transformers.GraniteConfig(**{**BASE, **GRANITE}, tie_word_embeddings=tied, attention_bias=bias,
                                        mlp_bias=bias, attn_implementation="eager")
    torch.manual_seed(4)
    hf = transformers.GraniteForCausalLM(hf_cfg).eval()
    for name, p in hf.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1 if p.dim() == 1 else 0.15)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json(97 + 263))
    model, cfg = load_any(tmp_path)
    assert (cfg.model_type, cfg.multipliers, cfg.tie_word_embeddings) == ("granite", (), False)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(7))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= ATOL and ref.std() > 0.05
    model.setup_caches(2, 19)
    try:
        steps = [model(ids[:, :7], 0)] + [model(ids[:, t:t + 1], t) for t in range(7, 19)]
    finally:
        model.clear_caches()
    assert (torch.cat(steps, 1) - ref).abs().max().item() <= ATOL
    assert generate(model, [[3, 5, 7]], 8) == [hf.generate(torch.tensor([[3, 5, 7]]), max_new_tokens=8,
                                                           do_sample=False, min_new_tokens=8)[0, 3:].tolist()]
    folded = transformers.GraniteForCausalLM(transformers.GraniteConfig(**cfg.to_hf_dict(),
                                                                        attn_implementation="eager")).eval()
    folded.load_state_dict(model.state_dict())
    assert (folded(input_ids=ids).logits - ref).abs().max().item() <= ATOL
    raw = LlamaConfig.from_hf_dict(hf_cfg.to_dict())
    assert raw.multipliers == (12.0, 0.22, 0.0078125, 8.0)
    with pytest.raises(DejavuError, match="folded into the weights"):
        LlamaForCausalLM(raw)

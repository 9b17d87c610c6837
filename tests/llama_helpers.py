"""A tiny random Llama written as a Hugging Face folder (config.json, safetensors, tokenizer.json),
for compiler, runtime and benchmark tests (a module of its own, imported by name)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, rope_theta=100000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True, model_type="llama", hidden_act="silu", bos_token_id=0, eos_token_id=2,
            pad_token_id=1)


def tiny_llama(seed: int = 0, **overrides):
    """A LlamaForCausalLM (fp32, eval) with random weights (norm weights around 1)."""
    from dejavu.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_hf_dict({**TINY, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def write_tiny_llama(folder, seed: int = 0, **overrides) -> Path:
    """`folder` holding a tiny random Llama checkpoint with the tests' small BPE tokenizer."""
    from safetensors.torch import save_file
    from tiny_tokenizer import tiny_tokenizer_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(seed, **overrides)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()
          if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    return folder

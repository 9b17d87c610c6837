"""Small stand-ins shared by the compiler tests (a tiny random OPT, random predictors)."""
from __future__ import annotations

import torch

from dejavu.models.opt import OPTConfig, OPTForCausalLM


def tiny_config(**over) -> OPTConfig:
    d = dict(model_type="opt", vocab_size=67, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, ffn_dim=48, max_position_embeddings=64,
             word_embed_proj_dim=32, do_layer_norm_before=True)
    d.update(over)
    return OPTConfig.from_hf_dict(d)


def tiny_model(seed: int = 0, **over) -> tuple[OPTForCausalLM, OPTConfig]:
    cfg = tiny_config(**over)
    torch.manual_seed(seed)
    model = OPTForCausalLM(cfg).float().eval()
    with torch.no_grad():  # LayerNorm weights away from 1/0 so they matter
        for n, p in model.named_parameters():
            if "layer_norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model, cfg


def random_predictors(cfg: OPTConfig, rank: int = 8, rank_attn: int = 4, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    D, F, H = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads
    out = {}
    for l in range(cfg.num_hidden_layers):
        for kind, n, r in (("pred_mlp", F, rank), ("pred_attn", H, rank_attn)):
            out[f"layers.{l}.{kind}.a"] = torch.randn(r, D, generator=g) / D**0.5
            out[f"layers.{l}.{kind}.b"] = torch.randn(n, r, generator=g) / r**0.5
            out[f"layers.{l}.{kind}.bias"] = 0.1 * torch.randn(n, generator=g)
    return out

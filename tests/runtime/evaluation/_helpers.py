"""Engines for the accuracy tests, written with `dejavu.engine_file.write_engine` straight from
a model folder (kernel layout per docs/ARCHITECTURE.md), so these tests need no compiler."""
from __future__ import annotations

from pathlib import Path

import torch

from dejavu.engine_file import write_engine


def engine_tensors(model) -> dict[str, torch.Tensor]:
    """Kernel-layout tensors of a dense `OPTForCausalLM` (wq scaled, fused wkv, wo_t, w2_t)."""
    cfg = model.config
    sd = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    dec = "model.decoder."
    t = {"embed_tokens": sd[dec + "embed_tokens.weight"], "embed_positions": sd[dec + "embed_positions.weight"]}
    if cfg.has_final_layer_norm:
        t["final_ln.weight"], t["final_ln.bias"] = sd[dec + "final_layer_norm.weight"], sd[dec + "final_layer_norm.bias"]
    scale = cfg.head_dim ** -0.5
    for l in range(cfg.num_hidden_layers):
        s, p, a = f"{dec}layers.{l}.", f"layers.{l}.", f"{dec}layers.{l}.self_attn."
        t.update({
            p + "ln_attn.weight": sd[s + "self_attn_layer_norm.weight"], p + "ln_attn.bias": sd[s + "self_attn_layer_norm.bias"],
            p + "ln_mlp.weight": sd[s + "final_layer_norm.weight"], p + "ln_mlp.bias": sd[s + "final_layer_norm.bias"],
            p + "attn.wq": sd[a + "q_proj.weight"] * scale, p + "attn.bq": sd[a + "q_proj.bias"] * scale,
            p + "attn.wkv": torch.cat([sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]),
            p + "attn.bkv": torch.cat([sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]),
            p + "attn.wo_t": sd[a + "out_proj.weight"].t(), p + "attn.bo": sd[a + "out_proj.bias"],
            p + "mlp.w1": sd[s + "fc1.weight"], p + "mlp.b1": sd[s + "fc1.bias"],
            p + "mlp.w2_t": sd[s + "fc2.weight"].t(), p + "mlp.b2": sd[s + "fc2.bias"],
        })
    return {k: v.contiguous() for k, v in t.items()}


def random_predictors(cfg, rank: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    D, out = cfg.hidden_size, {}
    for l in range(cfg.num_hidden_layers):
        for kind, n in (("pred_mlp", cfg.ffn_dim), ("pred_attn", cfg.num_attention_heads)):
            out[f"layers.{l}.{kind}.a"] = torch.randn(rank, D, generator=g) / D**0.5
            out[f"layers.{l}.{kind}.b"] = torch.randn(n, rank, generator=g) / rank**0.5
            out[f"layers.{l}.{kind}.bias"] = 0.1 * torch.randn(n, generator=g)
    return out


def write_test_engine(model_dir: Path, path: Path, density: float = 1.0, perturb: float = 0.0,
                      record_source: bool = True) -> Path:
    """An engine of the model in `model_dir`: dense (no predictors) at density 1.0, otherwise
    random predictors with K = round(density * N); `perturb` adds noise to every fc1 weight."""
    from dejavu.models.loader import load_model

    model, cfg = load_model(model_dir)
    t = engine_tensors(model)
    if perturb:
        g = torch.Generator().manual_seed(7)
        for l in range(cfg.num_hidden_layers):
            w = t[f"layers.{l}.mlp.w1"]
            t[f"layers.{l}.mlp.w1"] = w + perturb * torch.randn(w.shape, generator=g)
    L, F, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    sparse = density < 1.0
    if sparse:
        t.update(random_predictors(cfg))
    bc = {"density": density, "mlp_density": density, "attn_density": density,
          "mlp_k": [max(1, round(density * F))] * L, "attn_k": [max(1, round(density * H))] * L,
          "predictors": sparse, "predictor_input": {"source": "attn_in", "lookahead": 1}}
    if record_source:
        bc["source_model"] = str(model_dir)
    header = {"format": "dejavu-engine", "format_version": 1, "model_config": cfg.to_hf_dict(),
              "build_config": bc, "dtype": "float32",
              "target": {"device": "cpu", "arch": None, "kernel_settings": {}},
              "tokenizer_json": (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")}
    write_engine(path, header, t)
    return path

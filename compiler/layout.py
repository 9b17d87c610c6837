"""Dense weights in the engine's kernel layout (docs/ARCHITECTURE.md), one layer at a time.

Transforms run in fp32 and the result is cast once to the engine dtype (so the folded
1/sqrt(hd) rounds once): wq·1/√hd, bq·1/√hd, wkv = [wk; wv], wo_t = out_projᵀ, w2_t = fc2ᵀ.
"""
from __future__ import annotations

import torch

from dejavu.models.opt import OPTConfig


def _f(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32)


def _ln(m, D: int):
    return (_f(m.weight) if m.weight is not None else torch.ones(D),
            _f(m.bias) if m.bias is not None else torch.zeros(D))


def _bias(lin, n: int) -> torch.Tensor:
    return _f(lin.bias) if lin.bias is not None else torch.zeros(n)


class _Out(dict):
    """A dict that casts each fp32 value to the engine dtype as it is set (one fp32 tensor
    alive at a time, not a whole fp32 copy of the layer; the bytes are the same)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __setitem__(self, key, value):
        super().__setitem__(key, value.to(self.dtype).contiguous())


def shell_layout(dec, cfg: OPTConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Embeddings, project_in/out and the final LayerNorm of a decoder (its layers aside)."""
    out = _Out(dtype)
    out["embed_tokens"], out["embed_positions"] = _f(dec.embed_tokens.weight), _f(dec.embed_positions.weight)
    if dec.project_in is not None:
        out["project_in"] = _f(dec.project_in.weight)  # [D, E]
        out["project_out"] = _f(dec.project_out.weight)  # [E, D]
    if dec.final_layer_norm is not None:
        out["final_ln.weight"], out["final_ln.bias"] = _ln(dec.final_layer_norm, cfg.hidden_size)
    return dict(out)


def layer_layout(layer, l: int, cfg: OPTConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The `layers.{l}.*` engine tensors of one OPTDecoderLayer."""
    D, p, a = cfg.hidden_size, f"layers.{l}.", layer.self_attn
    scale = cfg.head_dim**-0.5
    out = _Out(dtype)
    out[p + "ln_attn.weight"], out[p + "ln_attn.bias"] = _ln(layer.self_attn_layer_norm, D)
    out[p + "ln_mlp.weight"], out[p + "ln_mlp.bias"] = _ln(layer.final_layer_norm, D)
    out[p + "attn.wq"] = _f(a.q_proj.weight) * scale
    out[p + "attn.bq"] = _bias(a.q_proj, D) * scale
    out[p + "attn.wkv"] = torch.cat([_f(a.k_proj.weight), _f(a.v_proj.weight)])  # [2D, D]
    out[p + "attn.bkv"] = torch.cat([_bias(a.k_proj, D), _bias(a.v_proj, D)])
    out[p + "attn.wo_t"] = _f(a.out_proj.weight).T
    out[p + "attn.bo"] = _bias(a.out_proj, D)
    out[p + "mlp.w1"] = _f(layer.fc1.weight)  # [F, D]
    out[p + "mlp.b1"] = _bias(layer.fc1, cfg.ffn_dim)
    out[p + "mlp.w2_t"] = _f(layer.fc2.weight).T  # [F, D]
    out[p + "mlp.b2"] = _bias(layer.fc2, D)
    return dict(out)


def kernel_layout(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every dense engine tensor of a whole in-memory model (tests, small models)."""
    out = shell_layout(model.decoder, model.config, dtype)
    for l, layer in enumerate(model.decoder.layers):
        out.update(layer_layout(layer, l, model.config, dtype))
    return out

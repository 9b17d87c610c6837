"""Dense OPT decoder in plain PyTorch (gpt-fast style), parameter names as in Hugging Face.

Covers every released OPT variant: pre-LayerNorm blocks (125m, 1.3b ... 175b) and the
post-LayerNorm blocks of 350m, ReLU MLP, learned positions with OPT's offset of 2, a tied
LM head, and `project_in` / `project_out` when `word_embed_proj_dim != hidden_size`.
Sparsity is never written here: the compiler applies it from outside (hooks, rewrites).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dejavu.errors import DejavuError

POSITION_OFFSET = 2  # OPT's learned positions are shifted by 2 (fairseq padding legacy)


@dataclass(frozen=True)
class OPTConfig:
    """Model dimensions, read from a checkpoint's config.json (never typed by hand)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    ffn_dim: int
    max_position_embeddings: int
    word_embed_proj_dim: int
    do_layer_norm_before: bool = True
    remove_final_layer_norm: bool = False
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = 2
    eos_token_id: int | None = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> "OPTConfig":
        """Validate a Hugging Face `config.json` dict and keep the fields OPT needs."""
        if not isinstance(d, dict):
            raise DejavuError("config.json does not hold a JSON object")
        mt = d.get("model_type")
        if mt != "opt":
            raise DejavuError(f"config.json field 'model_type' is {mt!r}, expected 'opt'")
        act = d.get("activation_function", "relu")
        if act != "relu":
            raise DejavuError(f"config.json field 'activation_function' is {act!r}; dejavu needs 'relu'")
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "ffn_dim", "max_position_embeddings"]
        for k in required:
            v = d.get(k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise DejavuError(f"config.json field {k!r} must be a positive integer, got {v!r}")
        if d["hidden_size"] % d["num_attention_heads"]:
            raise DejavuError("config.json field 'hidden_size' is not divisible by 'num_attention_heads'")
        eos = d.get("eos_token_id", 2)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            ffn_dim=d["ffn_dim"],
            max_position_embeddings=d["max_position_embeddings"],
            word_embed_proj_dim=d.get("word_embed_proj_dim") or d["hidden_size"],
            do_layer_norm_before=bool(d.get("do_layer_norm_before", True)),
            remove_final_layer_norm=bool(d.get("_remove_final_layer_norm", False)),
            enable_bias=bool(d.get("enable_bias", True)),
            layer_norm_elementwise_affine=bool(d.get("layer_norm_elementwise_affine", True)),
            pad_token_id=d.get("pad_token_id", 1),
            bos_token_id=d.get("bos_token_id", 2),
            eos_token_id=eos,
        )

    def to_hf_dict(self) -> dict:
        """The config.json that transformers' OPTForCausalLM reads."""
        d = dataclasses.asdict(self)
        d["_remove_final_layer_norm"] = d.pop("remove_final_layer_norm")
        d.update(model_type="opt", architectures=["OPTForCausalLM"], activation_function="relu",
                 dropout=0.0, attention_dropout=0.0, layerdrop=0.0, tie_word_embeddings=True,
                 torch_dtype="float16")
        return d

    @property
    def has_final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    def num_params(self) -> int:
        d, f, L = self.hidden_size, self.ffn_dim, self.num_hidden_layers
        b = 1 if self.enable_bias else 0
        layer = 4 * (d * d + b * d) + (d * f + b * f) + (f * d + b * d) + 4 * d
        emb = self.vocab_size * self.word_embed_proj_dim + (self.max_position_embeddings + 2) * d
        proj = 2 * d * self.word_embed_proj_dim if self.word_embed_proj_dim != d else 0
        return L * layer + emb + proj + (2 * d if self.has_final_layer_norm else 0)


class KVCache(nn.Module):
    """Static key/value cache for one layer: k, v: [B, H, S_max, hd] (H: the KV heads; the Llama model's too)."""

    def __init__(self, batch: int, max_seq: int, heads: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (batch, heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v: [B, H, S, hd] at positions pos: [S]; return the full cache."""
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k, self.v


class OPTAttention(nn.Module):
    def __init__(self, cfg: OPTConfig):
        super().__init__()
        d, b = cfg.hidden_size, cfg.enable_bias
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=b)
        self.k_proj = nn.Linear(d, d, bias=b)
        self.v_proj = nn.Linear(d, d, bias=b)
        self.out_proj = nn.Linear(d, d, bias=b)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache_pos: torch.Tensor | None) -> torch.Tensor:
        # x: [B, S, D]; mask: [B, 1, S, T] boolean (True = attend) or None (causal); cache_pos: [S] or None
        B, S, D = x.shape
        H, hd = self.n_heads, self.head_dim
        q = (self.q_proj(x) * hd**-0.5).view(B, S, H, hd).transpose(1, 2)  # [B, H, S, hd]
        k = self.k_proj(x).view(B, S, H, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, H, hd).transpose(1, 2)
        if self.cache is not None and cache_pos is not None:
            k, v = self.cache.update(cache_pos, k, v)  # [B, H, S_max, hd]
        if mask is None:  # plain causal prefill without cache or padding (training)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)  # [B, H, S, hd]
        y = y.transpose(1, 2).reshape(B, S, D)  # heads concatenated: the out_proj input
        return self.out_proj(y)


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: OPTConfig):
        super().__init__()
        d, aff = cfg.hidden_size, cfg.layer_norm_elementwise_affine
        self.pre_ln = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(d, elementwise_affine=aff)
        self.fc1 = nn.Linear(d, cfg.ffn_dim, bias=cfg.enable_bias)
        self.activation_fn = nn.ReLU()
        self.fc2 = nn.Linear(cfg.ffn_dim, d, bias=cfg.enable_bias)
        self.final_layer_norm = nn.LayerNorm(d, elementwise_affine=aff)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cache_pos: torch.Tensor | None) -> torch.Tensor:
        # x: [B, S, D]
        h = self.self_attn_layer_norm(x) if self.pre_ln else x
        x = x + self.self_attn(h, mask, cache_pos)
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_ln else x
        x = x + self.fc2(self.activation_fn(self.fc1(h)))  # fc1: [B, S, F]
        if not self.pre_ln:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, cfg: OPTConfig):
        super().__init__()
        d, e = cfg.hidden_size, cfg.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, e, cfg.pad_token_id)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, d)
        self.project_in = nn.Linear(e, d, bias=False) if e != d else None
        self.project_out = nn.Linear(d, e, bias=False) if e != d else None
        self.final_layer_norm = (nn.LayerNorm(d, elementwise_affine=cfg.layer_norm_elementwise_affine)
                                 if cfg.has_final_layer_norm else None)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class _Model(nn.Module):
    def __init__(self, cfg: OPTConfig):
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(nn.Module):
    """OPT with a tied LM head. State-dict keys equal transformers' `OPTForCausalLM`."""

    def __init__(self, cfg: OPTConfig):
        super().__init__()
        self.config = cfg
        self.model = _Model(cfg)
        self.lm_head = nn.Linear(cfg.word_embed_proj_dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.decoder.embed_tokens.weight  # tied

    @property
    def decoder(self) -> OPTDecoder:
        return self.model.decoder

    def setup_caches(self, batch: int, max_seq: int, dtype=None, device=None) -> None:
        """Allocate a static KV cache of [batch, heads, max_seq, head_dim] per layer."""
        cfg = self.config
        if max_seq > cfg.max_position_embeddings:
            raise DejavuError(f"max sequence {max_seq} exceeds the model's "
                              f"max_position_embeddings {cfg.max_position_embeddings}")
        p = self.lm_head.weight
        for layer in self.decoder.layers:
            layer.self_attn.cache = KVCache(batch, max_seq, cfg.num_attention_heads, cfg.head_dim,
                                            dtype or p.dtype, device or p.device)

    def clear_caches(self) -> None:
        for layer in self.decoder.layers:
            layer.self_attn.cache = None

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V] for input_ids [B, S] placed at positions start_pos .. start_pos+S-1.

        With caches set up (`setup_caches`), keys/values are written at those positions and
        attention reads the whole cache (causal up to the current position). attention_mask
        [B, start_pos+S] (1 = real token, 0 = left padding) gives padded batches OPT's
        positions (cumsum of the mask) and hides the padding.
        """
        B, S = input_ids.shape
        dec = self.decoder
        device = input_ids.device
        cached = dec.layers[0].self_attn.cache is not None
        T = dec.layers[0].self_attn.cache.k.shape[2] if cached else S
        if start_pos + S > T:
            raise DejavuError(f"sequence of {start_pos + S} tokens exceeds the cache of {T}")
        q_pos = torch.arange(start_pos, start_pos + S, device=device)  # [S]
        k_pos = torch.arange(T, device=device)  # [T]
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, S, T]
        if attention_mask is not None:
            am = attention_mask.to(device=device, dtype=torch.long)  # [B, start_pos+S]
            positions = (torch.cumsum(am, 1) * am - 1)[:, start_pos:start_pos + S]  # [B, S]
            key_ok = torch.zeros(B, T, dtype=torch.bool, device=device)
            key_ok[:, :am.shape[1]] = am.bool()
            mask = mask & key_ok[:, None, None, :]
            mask = mask | (~mask.any(-1, keepdim=True))  # fully padded query rows: avoid NaN
        else:
            positions = q_pos[None, :].expand(B, S)
            if not cached:
                mask = None  # causal over the S new tokens: lets SDPA pick its fused kernels
        x = dec.embed_tokens(input_ids)  # [B, S, E]
        if dec.project_in is not None:
            x = dec.project_in(x)
        x = x + dec.embed_positions(positions.clamp(min=-1) + POSITION_OFFSET)  # [B, S, D]
        cache_pos = q_pos if cached else None
        for layer in dec.layers:
            x = layer(x, mask, cache_pos)
        if dec.final_layer_norm is not None:
            x = dec.final_layer_norm(x)
        if dec.project_out is not None:
            x = dec.project_out(x)
        return self.lm_head(x)  # [B, S, V]

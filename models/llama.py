"""Dense Llama-family decoder in plain PyTorch (gpt-fast style), parameter names as in Hugging Face.

Covers Llama-2/3 and SmolLM2-like checkpoints (`model_type` llama; mistral; qwen2, whose q/k/v projections
carry biases; qwen3, whose queries and keys get a per-head RMSNorm before RoPE; phi3, whose checkpoints fuse
q/k/v and gate/up (split on load: `unfuse`); smollm3, whose no_rope_layers take no rotary positions; granite,
whose embedding, residual, attention and logit multipliers are folded into the weights on load: `fold_multipliers`;
a sequence stays inside the sliding window where they have one):
RMSNorm, rotary positions (rope_theta; "linear", Llama-3 "llama3", "yarn" and Phi-3 "longrope" rope_scaling; over
part of each head where partial_rotary_factor says so), grouped-query attention, SwiGLU MLP, optional tied LM
head. Same calling convention as `dejavu.models.opt.OPTForCausalLM` (static KV cache, `forward(ids, start_pos,
attention_mask)`), so `dejavu.models.generate` drives both.
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
from dejavu.models.opt import KVCache  # one static cache layer for both families: [B, H_kv, S_max, hd]
from dejavu.models.tokenizer import end_ids, eos_field

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "granite": "GraniteForCausalLM"}
GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class LlamaConfig:
    """Model dimensions, read from a checkpoint's config.json (never typed by hand)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # sorted (key, value) pairs of config.json's dict
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v and o biases (Llama's attention_bias)
    mlp_bias: bool = False
    qkv_bias: bool = False  # q, k and v biases, o none (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    sliding_window: int | None = None
    rotary_dim: int | None = None  # RoPE over a head's first rotary_dim dimensions (Phi-4-mini); None: all
    nope_layers: tuple = ()  # the layers whose attention takes no rotary positions (SmolLM3's NoPE layers)
    # Granite's (embedding, residual, attention, logits) multipliers where they are not the Llama's own; the loader
    # folds them into the weights (fold_multipliers) and the model it builds has none left
    multipliers: tuple = ()
    model_type: str = "llama"
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | tuple | None = 2  # one id, or every id that ends a generation (Llama 3.1: three)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LlamaConfig":
        """Validate a Hugging Face `config.json` dict and keep the fields the model needs."""
        if not isinstance(d, dict):
            raise DejavuError("config.json does not hold a JSON object")
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise DejavuError(f"config.json field 'model_type' is {mt!r}, expected one of {MODEL_TYPES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise DejavuError(f"config.json field 'hidden_act' is {act!r}; dejavu needs 'silu'")
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "max_position_embeddings"):
            v = d.get(k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise DejavuError(f"config.json field {k!r} must be a positive integer, got {v!r}")
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads") or heads
        if not isinstance(kv, int) or heads % kv:
            raise DejavuError(f"config.json: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv!r}")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if head_dim % 2 or (d.get("head_dim") is None and d["hidden_size"] % heads):
            raise DejavuError("config.json: the head dimension must be even and divide hidden_size")
        # transformers >= 5 writes rope_theta and the scaling into one "rope_parameters" object
        params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or None
        partial = d.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        if partial is None:
            partial = 1.0
        rotary = int(round(head_dim * partial, 6)) if type(partial) in (int, float) and 0 < partial <= 1 else -1
        if rotary <= 0 or rotary % 2:
            raise DejavuError(f"config.json: partial_rotary_factor {partial!r} does not give an even number of a "
                              f"head's {head_dim} dimensions")
        if isinstance(scaling, dict):
            scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"} or None
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise DejavuError(f"config.json field 'rope_scaling' must be an object, got {scaling!r}")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise DejavuError(f"config.json: rope_scaling type {kind!r} is not supported "
                                  f"(supported: {', '.join(ROPE_TYPES)})")
            if kind in ("yarn", "longrope"):  # transformers: the config's own original_max_position_embeddings first
                old = d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                scaling = {**scaling, "original_max_position_embeddings": old or d["max_position_embeddings"]}
                if scaling.get("factor") is None:
                    scaling["factor"] = d["max_position_embeddings"] / scaling["original_max_position_embeddings"]
            if kind == "longrope":
                for key in ("short_factor", "long_factor"):
                    v = scaling.get(key)
                    if not (isinstance(v, (list, tuple)) and len(v) == rotary // 2
                            and all(type(f) in (int, float) and f > 0 for f in v)):
                        raise DejavuError(f"config.json: longrope rope_scaling needs {key!r}, {rotary // 2} positive "
                                          "numbers (one per rotary frequency)")
                    scaling[key] = tuple(float(f) for f in v)
            scaling = tuple(sorted({**scaling, "rope_type": kind}.items()))
        bos, eos = d.get("bos_token_id", 1), eos_field(end_ids(d.get("eos_token_id", 2)))  # several: a tuple
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=kv, intermediate_size=d["intermediate_size"],
            max_position_embeddings=d["max_position_embeddings"], head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta), rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
            qkv_bias=mt == "qwen2", qk_norm=mt == "qwen3", sliding_window=_sliding_window(d, mt), model_type=mt,
            rotary_dim=None if rotary == head_dim else rotary, nope_layers=_nope_layers(d, mt),
            multipliers=_granite_multipliers(d, mt, head_dim),
            pad_token_id=d.get("pad_token_id"), bos_token_id=bos, eos_token_id=eos,
        )

    def to_hf_dict(self) -> dict:
        """The config.json that transformers' LlamaForCausalLM reads."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        if d.pop("rotary_dim") is not None:
            d["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        if d.pop("nope_layers") or self.model_type == "smollm3":
            d["no_rope_layers"] = [int(l not in self.nope_layers) for l in range(self.num_hidden_layers)]
        if d.pop("multipliers") or self.model_type == "granite":
            d.update(zip(GRANITE_MULTIPLIERS, self.multipliers or (1.0, 1.0, self.head_dim ** -0.5, 1.0)))
        d.update(architectures=[ARCHITECTURES[self.model_type]], hidden_act="silu", attention_dropout=0.0)
        if self.model_type in ("qwen2", "qwen3", "smollm3"):
            d["use_sliding_window"] = self.sliding_window is not None
        return d

    @property
    def rope_dim(self) -> int:
        """The rotary dimensions of a head (head_dim but for a partial rotary)."""
        return self.rotary_dim or self.head_dim

    def num_params(self) -> int:
        d, f, L, hd = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.head_dim
        qo, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        layer = d * (2 * qo + 2 * kv) + 3 * d * f + 2 * d
        layer += (qo + 2 * kv + d if self.attention_bias else qo + 2 * kv if self.qkv_bias else 0)
        layer += 2 * f + d if self.mlp_bias else 0
        layer += 2 * hd if self.qk_norm else 0
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return L * layer + self.vocab_size * d + head + d


def _sliding_window(d: dict, model_type: str) -> int | None:
    # Mistral's and Phi-3's window, or Qwen2's / Qwen3's where use_sliding_window turns it on (their config.json
    # writes a window either way)
    if model_type in ("mistral", "phi3") or (model_type in ("qwen2", "qwen3", "smollm3")
                                             and d.get("use_sliding_window")):
        w = d.get("sliding_window")
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
            raise DejavuError(f"config.json field 'sliding_window' must be a positive integer or null, got {w!r}")
        return w
    return None


def _nope_layers(d: dict, model_type: str) -> tuple:
    # SmolLM3's layers without RoPE: config.json's no_rope_layers (1: RoPE, 0: none, one per layer), else every
    # no_rope_layer_interval-th layer (transformers' default: the 4th, 8th, ...)
    if model_type != "smollm3":
        return ()
    L, flags = d["num_hidden_layers"], d.get("no_rope_layers")
    if flags is None:
        step = d.get("no_rope_layer_interval", 4)
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise DejavuError(f"config.json field 'no_rope_layer_interval' must be a positive integer, got {step!r}")
        flags = [int((l + 1) % step != 0) for l in range(L)]
    if not (isinstance(flags, list) and len(flags) == L and all(f in (0, 1) and type(f) in (int, bool) for f in flags)):
        raise DejavuError(f"config.json field 'no_rope_layers' must list {L} flags (1: RoPE, 0: none)")
    return tuple(l for l, f in enumerate(flags) if not f)


def _granite_multipliers(d: dict, model_type: str, head_dim: int) -> tuple:
    # Granite's four multipliers (transformers' defaults 1.0); () where they are the Llama's own (1, 1, hd^-0.5, 1)
    if model_type != "granite":
        return ()
    m = tuple(d.get(k, 1.0) for k in GRANITE_MULTIPLIERS)
    for k, v in zip(GRANITE_MULTIPLIERS, m):
        if type(v) not in (int, float) or not v > 0:
            raise DejavuError(f"config.json field {k!r} must be a positive number, got {v!r}")
    m = tuple(float(v) for v in m)
    return () if m == (1.0, 1.0, head_dim ** -0.5, 1.0) else m


def fold_multipliers(pairs, cfg: LlamaConfig):
    """((Hugging Face name, tensor) pairs, config) with Granite's multipliers folded into the weights, so the Llama
    model computes what GraniteForCausalLM does: the embedding times its multiplier (a tied head keeps the table as
    it was: the pair is untied), q_proj (weight and bias) times attention_multiplier * sqrt(head_dim) (RoPE is
    linear; the attention then scales by head_dim^-0.5 as every Llama's), o_proj's and down_proj's outputs times
    residual_multiplier, the final norm's weight over logits_scaling. Each product in fp32, rounded once to the
    tensor's dtype. Every other config: the pairs as they come."""
    if not cfg.multipliers:
        return pairs, cfg
    emb, res, att, logits = cfg.multipliers
    q = att * math.sqrt(cfg.head_dim)
    # a layer's tensor (the name after "model.layers.N.") -> its factor
    layer = {f"{proj}.{kind}": f for proj, f in (("self_attn.q_proj", q), ("self_attn.o_proj", res),
                                                 ("mlp.down_proj", res)) for kind in ("weight", "bias")}
    top = {"model.embed_tokens.weight": emb, "model.norm.weight": 1.0 / logits}
    untie = cfg.tie_word_embeddings and emb != 1.0

    def folded():
        for name, t in pairs:
            f = layer.get(name.split(".", 3)[-1], 1.0) if name.startswith("model.layers.") else top.get(name, 1.0)
            if untie and name == "model.embed_tokens.weight":
                yield "lm_head.weight", t
            yield name, t if f == 1.0 else (t.float() * f).to(t.dtype)

    return folded(), dataclasses.replace(cfg, multipliers=(), tie_word_embeddings=cfg.tie_word_embeddings and not untie)


def unfuse(pairs, cfg: LlamaConfig):
    """(Hugging Face name, tensor) pairs with fused projections split into this module's names: Phi-3's
    `self_attn.qkv_proj` [(H + 2 Hkv) hd, D] into q/k/v_proj and `mlp.gate_up_proj` [2 F, D] into gate/up_proj
    (gate first, as Phi3MLP chunks it); every other pair as it comes."""
    qo, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, t in pairs:
        if name.endswith(".self_attn.qkv_proj.weight") and t.shape[0] == qo + 2 * kv:
            stem = name[:-len("qkv_proj.weight")]
            yield from ((stem + f"{p}_proj.weight", w) for p, w in zip("qkv", t.split([qo, kv, kv])))
        elif name.endswith(".mlp.gate_up_proj.weight") and t.shape[0] == 2 * cfg.intermediate_size:
            stem = name[:-len("gate_up_proj.weight")]
            yield from ((stem + f"{p}_proj.weight", w) for p, w in zip(("gate", "up"), t.chunk(2)))
        else:
            yield name, t


def rope_inv_freq(cfg: LlamaConfig, long: bool = False) -> torch.Tensor:
    """Rotary frequencies [head_dim / 2] in fp32, with the config's rope_scaling applied (longrope: its short
    factors' frequencies, or with `long` its long factors'); over the rotary dimensions (cfg.rope_dim)."""
    hd = cfg.rope_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    s = dict(cfg.rope_scaling or ())
    kind = s.get("rope_type", "default")
    if kind == "longrope":  # Phi-3's LongRoPE: a factor per frequency
        factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if kind == "linear":
        return inv / float(s["factor"])
    if kind == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones, blend between
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, blended, scaled)
    if kind == "yarn":  # YaRN: interpolated below the ramp's low end, extrapolated above its high end, linear between
        factor, old = float(s["factor"]), float(s["original_max_position_embeddings"])
        fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def dim_of(rotations):  # the dimension that turns `rotations` times over the original context
            return hd * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        lo, hi = dim_of(fast), dim_of(slow)
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, hd - 1)
        ramp = ((torch.arange(hd // 2, dtype=torch.float32) - lo) / (hi - lo if hi != lo else 0.001)).clamp(0, 1)
        pos_freqs = cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        extrapolated = 1 - ramp
        return 1.0 / (factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated
    return inv


def rope_long_after(cfg: LlamaConfig) -> int | None:
    """LongRoPE's original context: a call whose furthest position is past it rotates every position by the long
    factors' frequencies, else by the short ones' (transformers' choice, per call: a cache written before the
    switch keeps its keys as they were rotated); None for every other rope type."""
    s = dict(cfg.rope_scaling or ())
    return int(s["original_max_position_embeddings"]) if s.get("rope_type") == "longrope" else None


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, inv_long: torch.Tensor | None = None,
                long_after: int | None = None) -> torch.Tensor:
    """Angles [..., hd / 2] (fp32) of positions [...]; with inv_long (LongRoPE), its frequencies where the furthest
    position is past long_after (on the device: no host sync, a CUDA graph can hold it)."""
    if inv_long is not None:
        inv_freq = torch.where(positions.max() + 1 > long_after, inv_long, inv_freq)
    return positions[..., None].float() * inv_freq


def rope_attention_factor(cfg: LlamaConfig) -> float:
    """The factor cos and sin are scaled by (YaRN's attention temperature, LongRoPE's; 1.0 for every other rope
    type)."""
    s = dict(cfg.rope_scaling or ())
    if s.get("rope_type") not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s["rope_type"] == "longrope":
        factor, old = float(s["factor"]), float(s["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D]; normalised in fp32 as the reference does, scaled in the input dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(ang: torch.Tensor, scale: float, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] in dtype from the angles [..., rotary_dim / 2] (fp32): Hugging Face's half-split
    layout over the rotary dimensions, scaled by `scale` (YaRN, LongRoPE); past them (a partial rotary) cos 1 and
    sin 0, so x * cos + rotate_half(x) * sin passes those dimensions through exactly."""
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos(), ang.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    pad = head_dim - ang.shape[-1]
    if pad:
        cos = torch.cat((cos, cos.new_ones(*cos.shape[:-1], pad)), -1)
        sin = torch.cat((sin, sin.new_zeros(*sin.shape[:-1], pad)), -1)
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor, rot: int | None = None) -> torch.Tensor:
    """Hugging Face's rotate_half over x's first `rot` dimensions (None: all of them), the rest as they are."""
    rot = rot or x.shape[-1]
    return torch.cat((-x[..., rot // 2:rot], x[..., :rot // 2], x[..., rot:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int | None = None) -> torch.Tensor:
    # x: [B, H, S, hd]; cos, sin: [B, 1, S, hd] (rope_cos_sin's layout); rot: the rotary dimensions
    return x * cos + rotate_half(x, rot) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, rope: bool = True):
        super().__init__()
        self.rope = rope  # False: no rotary positions (a NoPE layer)
        d, hd = cfg.hidden_size, cfg.head_dim
        b = cfg.attention_bias or cfg.qkv_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.rot = cfg.rope_dim  # the rotary dimensions of a head (a partial rotary: fewer than hd)
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=b)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=b)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=b)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=cfg.attention_bias)
        if cfg.qk_norm:  # over each head's hd values, one weight for all heads (Qwen3)
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache_pos: torch.Tensor | None) -> torch.Tensor:
        # x: [B, S, D]; mask: [B, 1, S, T] boolean (True = attend) or None (causal); cache_pos: [S] or None
        B, S, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv, self.head_dim
        q, k = self.q_proj(x).view(B, S, H, hd), self.k_proj(x).view(B, S, Hkv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, hd], [B, Hkv, S, hd]
        if self.rope:
            q, k = apply_rope(q, cos, sin, self.rot), apply_rope(k, cos, sin, self.rot)
        v = self.v_proj(x).view(B, S, Hkv, hd).transpose(1, 2)
        if self.cache is not None and cache_pos is not None:
            k, v = self.cache.update(cache_pos, k, v)  # [B, Hkv, S_max, hd]
        # query head h reads KV head h // (H / Hkv), as transformers' repeat_kv
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=H != Hkv)  # [B, H, S, hd]
        return self.o_proj(y.transpose(1, 2).reshape(B, S, H * hd))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=b)
        self.up_proj = nn.Linear(d, f, bias=b)
        self.down_proj = nn.Linear(f, d, bias=b)
        self.act_fn = nn.SiLU()  # a module, so the compiler can hook the gate activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, D] -> gate, up: [B, S, F] -> [B, S, D]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rope=layer not in cfg.nope_layers)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin, mask, cache_pos):
        # x: [B, S, D]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, l) for l in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _ReadInFp32(nn.Module):
    """A parametrization (compute_in_fp32): the tensor as stored, read as fp32."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.float()


def compute_in_fp32(model: nn.Module) -> nn.Module:
    """Keep `model`'s weights in the dtype they were loaded in and compute in fp32: every floating parameter
    that is not fp32 is cast to fp32 where it is used (torch.nn.utils.parametrize), one tensor at a time. A
    bf16 or fp16 value is an fp32 value, so every forward equals the fp32-loaded model's bit for bit while a
    half checkpoint takes its own bytes in memory, not twice them. For reading only: training or rewriting
    the weights (distillation, rotation) wants them loaded in fp32. In place; returns model."""
    from torch.nn.utils import parametrize

    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != torch.float32:
                parametrize.register_parametrization(module, name, _ReadInFp32(), unsafe=True)
    return model


class LlamaForCausalLM(nn.Module):
    """Llama with an LM head (tied when the config says so). State-dict keys equal transformers'."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.multipliers:
            raise DejavuError("Granite's multipliers are folded into the weights as they load (models.auto.load_llama, "
                              "models.llama.fold_multipliers); this model is built from the folded config")
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_scale = rope_attention_factor(cfg)  # cos and sin scaled by it (YaRN, LongRoPE)
        self.long_after = rope_long_after(cfg)  # LongRoPE: its long factors' frequencies past this context
        self.register_buffer("inv_freq", None, persistent=False)
        self.register_buffer("inv_freq_long", None, persistent=False)
        self.rope_to(None)

    def rope_to(self, device) -> None:
        """The rotary frequencies (non-persistent buffers: a model built on meta gets them here) on `device`."""
        self.inv_freq = rope_inv_freq(self.config).to(device)
        if self.long_after is not None:
            self.inv_freq_long = rope_inv_freq(self.config, long=True).to(device)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def setup_caches(self, batch: int, max_seq: int, dtype=None, device=None) -> None:
        """Allocate a static KV cache of [batch, kv_heads, max_seq, head_dim] per layer."""
        cfg = self.config
        if max_seq > cfg.max_position_embeddings:
            raise DejavuError(f"max sequence {max_seq} exceeds the model's "
                              f"max_position_embeddings {cfg.max_position_embeddings}")
        p = self.lm_head.weight
        for layer in self.layers:
            layer.self_attn.cache = KVCache(batch, max_seq, cfg.num_key_value_heads, cfg.head_dim,
                                            dtype or p.dtype, device or p.device)

    def clear_caches(self) -> None:
        for layer in self.layers:
            layer.self_attn.cache = None

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, S] -> cos, sin: [B, 1, S, hd], angles in fp32
        inv_long = None if self.inv_freq_long is None else self.inv_freq_long.to(positions.device)
        ang = rope_angles(positions, self.inv_freq.to(positions.device), inv_long, self.long_after)  # [B, S, rot/2]
        return rope_cos_sin(ang[:, None], self.rope_scale, self.config.head_dim, dtype)

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V] for input_ids [B, S] placed at positions start_pos .. start_pos+S-1.

        With caches set up (`setup_caches`), keys/values are written at those positions and
        attention reads the whole cache (causal up to the current position). attention_mask
        [B, start_pos+S] (1 = real token, 0 = left padding) gives padded batches positions
        counted from each row's first real token and hides the padding.
        """
        B, S = input_ids.shape
        device = input_ids.device
        cache = self.layers[0].self_attn.cache
        T = cache.k.shape[2] if cache is not None else S
        if start_pos + S > T:
            raise DejavuError(f"sequence of {start_pos + S} tokens exceeds the cache of {T}")
        sw = self.config.sliding_window
        if sw is not None and start_pos + S > sw:
            raise DejavuError(f"sequence of {start_pos + S} tokens exceeds the sliding window {sw} "
                              "(not supported)")
        q_pos = torch.arange(start_pos, start_pos + S, device=device)  # [S]
        mask = (torch.arange(T, device=device)[None, :] <= q_pos[:, None])[None, None]  # [1, 1, S, T]
        if attention_mask is not None:
            am = attention_mask.to(device=device, dtype=torch.long)  # [B, start_pos+S]
            positions = ((torch.cumsum(am, 1) - 1).clamp(min=0))[:, start_pos:start_pos + S]  # [B, S]
            key_ok = torch.zeros(B, T, dtype=torch.bool, device=device)
            key_ok[:, :am.shape[1]] = am.bool()
            mask = mask & key_ok[:, None, None, :]
            mask = mask | (~mask.any(-1, keepdim=True))  # fully padded query rows: avoid NaN
        else:
            positions = q_pos[None, :].expand(B, S)
            if cache is None:
                mask = None  # causal over the S new tokens: lets SDPA pick its fused kernels
        x = self.model.embed_tokens(input_ids)  # [B, S, D]
        cos, sin = self._rope(positions, x.dtype)
        cache_pos = q_pos if cache is not None else None
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache_pos)
        return self.lm_head(self.model.norm(x))  # [B, S, V]

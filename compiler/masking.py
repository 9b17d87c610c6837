"""Masked-dense simulation: the exact sparsity semantics on the dense model, through hooks.

Inside `masked_sparsity(model, ...)` every token (every position of a full-sequence
forward: its own selection, which equals token-by-token decode) keeps, in layer l:
  - MLP: the K_mlp[l] selected neurons of relu(fc1(.)); the rest are zeroed before fc2;
  - attention: the K_attn[l] selected heads' slices of the out_proj input; the rest zeroed
    (Q/K/V are computed for all heads, so the KV cache stays complete).
Selection modes:
  predicted  top-K of the predictor scores on src[l - lookahead] (docs/ARCHITECTURE.md); with
             `token_k` (compiler/token_k.py) each token keeps its own count of the top-k_max MLP
             rows instead of K_mlp[l]
  oracle     top-K of the true post-ReLU activation / of the heads' contributions ||W_o[:, h] y_h||
  random     K uniformly random outputs per token (seeded)
A kind whose K equals N for a layer is left untouched (density 1.0 is the dense model).
"""
from __future__ import annotations

import contextlib

import torch

from dejavu.errors import DejavuError

MODES = ("predicted", "oracle", "random")


def _mask_from_idx(shape, idx: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=idx.device).scatter_(-1, idx, 1.0)


@contextlib.contextmanager
def masked_sparsity(model, mlp_k: list[int], attn_k: list[int], mode: str = "predicted",
                    predictors=None, seed: int = 0, token_k=None):
    """Apply selection semantics to `model` (an OPTForCausalLM) while the context is open.

    mlp_k / attn_k: [L] ints. `predictors` (a `Predictors`) is needed for mode "predicted"
    and carries its `predictor_input` ({"source", "lookahead"}). token_k: a `TokenK` (mode
    "predicted" only): in the layers with K_mlp[l] < F, each token keeps its predicted-mass count.
    """
    from dejavu.compiler.calibrate import head_contribution, head_gram

    cfg = model.config
    L, Fd, H, hd = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads, cfg.head_dim
    if mode not in MODES:
        raise DejavuError(f"selection mode must be one of {MODES}, got {mode!r}")
    if len(mlp_k) != L or len(attn_k) != L:
        raise DejavuError(f"mlp_k and attn_k need {L} entries (one per layer)")
    for name, ks, n in (("mlp_k", mlp_k, Fd), ("attn_k", attn_k, H)):
        if any(not 1 <= k <= n for k in ks):
            raise DejavuError(f"{name} entries must be in [1, {n}], got {ks}")
    if mode == "predicted" and predictors is None:
        raise DejavuError("selection mode 'predicted' needs trained predictors")
    if token_k is not None and (mode != "predicted" or len(token_k.k_max) != L):
        raise DejavuError(f"a per-token K needs mode 'predicted' and {L} layers")
    gen = torch.Generator().manual_seed(seed)
    src: dict = {}  # ("attn_in"|"mlp_in", layer) -> residual [B, S, D] of the current forward
    handles = []

    def pred_input(l):
        pi = predictors.predictor_input
        j = l - pi["lookahead"]
        return src[("attn_in", 0)] if j < 0 else src[(pi["source"], j)]

    def select(kind, l, k, value):
        # value: [B, S, N] true activity (oracle) -> idx [B, S, k]
        if mode == "oracle":
            return value.topk(k, dim=-1).indices
        if mode == "random":
            r = torch.rand(value.shape, generator=gen).to(value.device)
            return r.topk(k, dim=-1).indices
        x = pred_input(l)
        return predictors.scores(kind, l, x.float()).topk(k, dim=-1).indices

    def mlp_hook(m, args, out, l):
        if token_k is not None:
            s = predictors.scores("mlp", l, pred_input(l).float())
            return out * token_k.mask(l, s).to(out.dtype)
        idx = select("mlp", l, mlp_k[l], out)
        return out * _mask_from_idx(out.shape, idx, out.dtype)

    def attn_hook(m, args, l, gram):
        y = args[0]  # [B, S, H*hd], heads concatenated
        yh = y.unflatten(-1, (H, hd))  # [B, S, H, hd]
        # [B, S, H]: the oracle ranks by contribution; random reads only the shape, predicted nothing
        value = head_contribution(y, gram) if gram is not None else yh[..., 0]
        idx = select("attn", l, attn_k[l], value)
        mask = _mask_from_idx(yh.shape[:-1], idx, y.dtype)  # [B, S, H]
        return ((yh * mask[..., None]).flatten(-2),) + tuple(args[1:])

    def keep(name, l):
        def hook(m, args, out=None):
            src[(name, l)] = (out if out is not None else args[0]).detach()
        return hook

    try:
        for l, layer in enumerate(model.decoder.layers):
            if mode == "predicted":
                handles.append(layer.register_forward_pre_hook(keep("attn_in", l)))
                if cfg.do_layer_norm_before:
                    handles.append(layer.final_layer_norm.register_forward_pre_hook(keep("mlp_in", l)))
                else:
                    handles.append(layer.self_attn_layer_norm.register_forward_hook(keep("mlp_in", l)))
            if mlp_k[l] < Fd:
                handles.append(layer.activation_fn.register_forward_hook(
                    lambda m, a, o, l=l: mlp_hook(m, a, o, l)))
            if attn_k[l] < H:
                gram = head_gram(layer.self_attn.out_proj.weight, H) if mode == "oracle" else None  # once per layer
                handles.append(layer.self_attn.out_proj.register_forward_pre_hook(
                    lambda m, a, l=l, g=gram: attn_hook(m, a, l, g)))
        yield model
    finally:
        for h in handles:
            h.remove()
        src.clear()


@contextlib.contextmanager
def fixed_selection(layer, mlp_idx: torch.Tensor | None = None, attn_idx: torch.Tensor | None = None,
                    mlp_mask: torch.Tensor | None = None):
    """Keep only the given neurons / heads of one decoder layer while the context is open.

    mlp_idx: [B, S, K_mlp] neuron indices, attn_idx: [B, S, K_attn] head indices (per token);
    mlp_mask: [B, S, F] 0/1 instead of mlp_idx (a per-token K); None leaves that kind dense. The same semantics as `masked_sparsity`, for callers that
    hold one layer at a time (dejavu.compiler.allocate)."""
    handles = []
    if mlp_idx is not None:
        handles.append(layer.activation_fn.register_forward_hook(
            lambda m, a, out: out * _mask_from_idx(out.shape, mlp_idx, out.dtype)))
    if mlp_mask is not None:
        handles.append(layer.activation_fn.register_forward_hook(lambda m, a, out: out * mlp_mask.to(out.dtype)))
    if attn_idx is not None:
        H = layer.self_attn.n_heads

        def attn_hook(m, args):
            yh = args[0].unflatten(-1, (H, -1))  # [B, S, H, hd]
            mask = _mask_from_idx(yh.shape[:-1], attn_idx, yh.dtype)
            return ((yh * mask[..., None]).flatten(-2),) + tuple(args[1:])

        handles.append(layer.self_attn.out_proj.register_forward_pre_hook(attn_hook))
    try:
        yield layer
    finally:
        for h in handles:
            h.remove()

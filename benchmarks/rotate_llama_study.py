"""Function-preserving orthogonal rotation of a Llama-family model before TEAL thresholds.

TEAL skips the input entries of smallest magnitude. An orthogonal change of basis of an input
(x' = R^T x, W' = W R, so W' x' = W x) leaves the dense model's function unchanged but changes
which entries are small: in the principal-component basis of the calibration activations a
token's energy sits in fewer coordinates (LaRoSa / SliceGPT's PCA basis). Folded into the
weights at build time: the same shapes, the same bytes read per token.

Two rotations are free in a Llama block:
- the residual stream, one d x d Q for the whole model: every RMSNorm weight is first folded
  into the weights that read its output (W <- W diag(g), g <- 1), since RMSNorm without a weight
  commutes with Q (rms(Q^T x) = rms(x)); then embed <- embed Q, W_q/k/v/gate/up/lm_head <- W Q,
  W_o/down <- Q^T W (and their biases). The LM head is untied from the embedding.
- o_proj's input per KV head j: W_v rows of head j <- R_j^T W_v_j and W_o columns of every query
  head h reading KV head j <- W_o_h R_j (attention mixes positions, not head dimensions).
down_proj's input (SiLU(gate) * up) has no free rotation and is left alone.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dejavu.errors import DejavuError


def _orthogonal(m: torch.Tensor, what: str) -> torch.Tensor:
    """m as float64 after checking it is a square orthogonal matrix (|m^T m - I| <= 1e-6)."""
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise DejavuError(f"{what} must be a square matrix, got shape {tuple(m.shape)}")
    m = m.double()
    err = float((m.T @ m - torch.eye(m.shape[0], dtype=m.dtype, device=m.device)).abs().max())
    if not err <= 1e-6:
        raise DejavuError(f"{what} is not orthogonal (max |R^T R - I| = {err:.3g})")
    return m


def pca_basis(second_moment: torch.Tensor) -> torch.Tensor:
    """Eigenvectors [n, n] (columns, by descending eigenvalue) of a symmetric second moment [n, n]."""
    if second_moment.ndim != 2 or second_moment.shape[0] != second_moment.shape[1]:
        raise DejavuError(f"second moment must be a square matrix, got shape {tuple(second_moment.shape)}")
    if not bool(torch.isfinite(second_moment).all()):
        raise DejavuError("second moment has non-finite entries")
    m = second_moment.double()
    vals, vecs = torch.linalg.eigh((m + m.T) / 2)
    return vecs.flip(-1)


def _set(lin: nn.Linear, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    lin.weight.data = w.to(lin.weight.dtype).contiguous()
    if b is not None:
        lin.bias.data = b.to(lin.bias.dtype)


@torch.no_grad()
def fold_norms(model) -> None:
    """In place: every RMSNorm weight folded into the weights reading its output, the norms set to 1,
    the LM head untied (the function is unchanged)."""
    m = model.model
    for layer in model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for norm, lins in ((layer.input_layernorm, (at.q_proj, at.k_proj, at.v_proj)),
                           (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
            g = norm.weight.double()
            for lin in lins:
                _set(lin, lin.weight.double() * g)
            norm.weight.data.fill_(1.0)
    head = model.lm_head.weight.double() * m.norm.weight.double()
    model.lm_head.weight = nn.Parameter(head.to(model.lm_head.weight.dtype))  # untied from the embedding
    m.norm.weight.data.fill_(1.0)
    model.config = dataclasses.replace(model.config, tie_word_embeddings=False)


@torch.no_grad()
def rotate_residual(model, q: torch.Tensor) -> None:
    """In place: the residual stream x -> Q^T x (q: [D, D] orthogonal). Needs fold_norms first."""
    m = model.model
    d = model.config.hidden_size
    if tuple(q.shape) != (d, d):
        raise DejavuError(f"residual rotation must be [{d}, {d}], got {tuple(q.shape)}")
    q = _orthogonal(q, "residual rotation").to(model.lm_head.weight.device)
    norms = [m.norm] + [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(bool((n.weight != 1).any()) for n in norms):
        raise DejavuError("the RMSNorm weights must be folded (fold_norms) before rotating the residual stream")
    m.embed_tokens.weight.data = (m.embed_tokens.weight.double() @ q).to(m.embed_tokens.weight.dtype)
    _set(model.lm_head, model.lm_head.weight.double() @ q)
    for layer in model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
            _set(lin, lin.weight.double() @ q)
        for lin in (at.o_proj, mlp.down_proj):
            _set(lin, q.T @ lin.weight.double(), None if lin.bias is None else q.T @ lin.bias.double())


@torch.no_grad()
def rotate_heads(model, rotations: list[torch.Tensor]) -> None:
    """In place: o_proj's input of each KV head j of layer l rotated, y -> R^T y, by rotations[l][j]
    (rotations: L tensors [Hkv, hd, hd], each R orthogonal)."""
    cfg = model.config
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if len(rotations) != len(model.layers):
        raise DejavuError(f"need one head rotation per layer ({len(model.layers)}), got {len(rotations)}")
    for l, (layer, r) in enumerate(zip(model.layers, rotations)):
        if tuple(r.shape) != (Hkv, hd, hd):
            raise DejavuError(f"layer {l}: head rotations must be [{Hkv}, {hd}, {hd}], got {tuple(r.shape)}")
        r = torch.stack([_orthogonal(rj, f"layer {l} head {j} rotation") for j, rj in enumerate(r)])
        at = layer.self_attn
        r = r.to(at.v_proj.weight.device)
        wv = at.v_proj.weight.double().view(Hkv, hd, -1)  # [Hkv, hd, D]
        bv = None if at.v_proj.bias is None else (r.transpose(1, 2) @ at.v_proj.bias.double().view(Hkv, hd, 1)).reshape(-1)
        _set(at.v_proj, (r.transpose(1, 2) @ wv).reshape(Hkv * hd, -1), bv)
        wo = at.o_proj.weight.double().view(-1, H, hd).transpose(0, 1)  # [H, D, hd]
        per_q = r.repeat_interleave(H // Hkv, dim=0)  # query head h reads KV head h // (H / Hkv)
        _set(at.o_proj, (wo @ per_q).transpose(0, 1).reshape(-1, H * hd))


@torch.no_grad()
def residual_moment(model, ids: torch.Tensor) -> torch.Tensor:
    """E[x x^T] [D, D] (float64) of the RMS-normalised residual stream where each norm reads it
    (every layer's two norms and the final norm), over the tokens of ids [B, S]."""
    d = model.config.hidden_size
    acc = torch.zeros(d, d, dtype=torch.float64)
    count = [0]

    def record(mod, args):
        x = args[0].double().reshape(-1, d)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps)
        acc.add_((x.T @ x).cpu())
        count[0] += x.shape[0]

    norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    handles = [n.register_forward_pre_hook(record) for n in norms + [model.model.norm]]
    try:
        for w in ids:
            model(w[None])
    finally:
        for h in handles:
            h.remove()
    return acc / count[0]


@torch.no_grad()
def head_moments(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer [Hkv, hd, hd] (float64): E[y y^T] of the attention outputs (o_proj's input) of the
    query heads reading each KV head, over the tokens of ids [B, S]."""
    cfg = model.config
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    acc = [torch.zeros(Hkv, hd, hd, dtype=torch.float64) for _ in model.layers]
    count = [0]

    def record(l, args):
        y = args[0].double().reshape(-1, Hkv, H // Hkv, hd).transpose(0, 1).reshape(Hkv, -1, hd)  # [Hkv, N*G, hd]
        acc[l].add_((y.transpose(1, 2) @ y).cpu())
        if l == 0:
            count[0] += y.shape[1]

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, l=l: record(l, a))
               for l, layer in enumerate(model.layers)]
    try:
        for w in ids:
            model(w[None])
    finally:
        for h in handles:
            h.remove()
    return [a / count[0] for a in acc]


def rotate_llama(model, ids: torch.Tensor, heads: bool = True) -> dict:
    """In place: fold the norms, rotate the residual stream into the PCA basis of its normalised
    states on ids [B, S] (calibration tokens), then (heads) each KV head's o_proj input into the
    PCA basis of its attention outputs. Returns {"residual": Q [D, D], "heads": [L x [Hkv, hd, hd]] | None}."""
    fold_norms(model)
    q = pca_basis(residual_moment(model, ids))
    rotate_residual(model, q)
    r = None
    if heads:
        r = [torch.stack([pca_basis(mj) for mj in m]) for m in head_moments(model, ids)]
        rotate_heads(model, r)
    return {"residual": q, "heads": r}

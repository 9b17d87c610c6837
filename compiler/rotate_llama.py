"""Function-preserving rotation of a Llama's residual stream before TEAL thresholds (build time).

TEAL skips the input entries of smallest magnitude. An orthogonal change of basis of the
residual stream (x' = Q^T x) leaves the dense model's function unchanged but changes which
entries are small. Folded into the weights at build time: the same shapes, the same bytes read
per token. Every RMSNorm weight is first folded into the weights that read its output
(W <- W diag(g), g <- 1), since RMSNorm without a weight commutes with Q (rms(Q^T x) = rms(x));
then embed <- embed Q, W_q/k/v/gate/up/lm_head <- W Q, W_o/down <- Q^T W (and their biases); the
LM head is untied from the embedding. attn_in and mlp_in (q/k/v's and gate/up's input) change
basis; o_in and down_in do not.

Q: the `keep` coordinates of largest mean square (the massive-activation channels) stay as they
are, the others are rotated into the principal components (eigenvectors of E[x x^T]) of the
RMS-normalised residual at every norm over the calibration tokens. Rotating the massive
channels too, a per-KV-head PCA of o_proj's input, the PCA of the raw residual and a rotation
fitted to the thresholding (orthogonal Procrustes) all lost (commit cb96df8; docs/llama.md).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dejavu.errors import DejavuError


def pca_basis(moment: torch.Tensor, keep: int) -> torch.Tensor:
    """Orthogonal Q [D, D] (float64) from a second moment [D, D]: the `keep` coordinates of largest
    mean square (diagonal) map to themselves, the others to their subspace's eigenvectors (by
    descending eigenvalue, in the others' order of rows)."""
    if moment.ndim != 2 or moment.shape[0] != moment.shape[1]:
        raise DejavuError(f"the second moment must be a square matrix, got shape {tuple(moment.shape)}")
    if not bool(torch.isfinite(moment).all()):
        raise DejavuError("the second moment has non-finite entries")
    d = moment.shape[0]
    if type(keep) is not int or not 0 <= keep < d:
        raise DejavuError(f"rotation keep must be an integer in [0, {d}), got {keep!r}")
    m = moment.double()
    m = (m + m.T) / 2
    top = m.diagonal().argsort(descending=True)[:keep]
    rest = torch.ones(d, dtype=torch.bool)
    rest[top] = False
    rest = rest.nonzero().flatten()
    q = torch.zeros(d, d, dtype=torch.float64)
    q[top, top] = 1.0
    q[rest[:, None], rest[None, :]] = torch.linalg.eigh(m[rest][:, rest])[1].flip(-1)
    return q


def _set(lin: nn.Linear, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    lin.weight.data = w.to(lin.weight.dtype).contiguous()
    if b is not None:
        lin.bias.data = b.to(lin.bias.dtype)


@torch.no_grad()
def fold_norms(model) -> None:
    """In place: every RMSNorm weight folded into the weights reading its output, the norms set to 1,
    the LM head untied (model.config says so); the function is unchanged."""
    for layer in model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for norm, lins in ((layer.input_layernorm, (at.q_proj, at.k_proj, at.v_proj)),
                           (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
            for lin in lins:
                _set(lin, lin.weight.double() * norm.weight.double())
            norm.weight.data.fill_(1.0)
    norm = model.model.norm
    head = model.lm_head.weight.double() * norm.weight.double()
    model.lm_head.weight = nn.Parameter(head.to(model.lm_head.weight.dtype))  # its own tensor: untied
    norm.weight.data.fill_(1.0)
    model.config = dataclasses.replace(model.config, tie_word_embeddings=False)


@torch.no_grad()
def rotate_residual(model, q: torch.Tensor) -> None:
    """In place: the residual stream x -> Q^T x (q: [D, D] orthogonal). The norms must be folded."""
    d = model.config.hidden_size
    if tuple(q.shape) != (d, d):
        raise DejavuError(f"the residual rotation must be [{d}, {d}], got {tuple(q.shape)}")
    q = q.double()
    err = float((q.T @ q - torch.eye(d, dtype=torch.float64, device=q.device)).abs().max())
    if not err <= 1e-6:
        raise DejavuError(f"the residual rotation is not orthogonal (max |Q^T Q - I| = {err:.3g})")
    m = model.model
    norms = [m.norm] + [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(bool((n.weight != 1).any()) for n in norms) or model.config.tie_word_embeddings:
        raise DejavuError("fold the RMSNorm weights (fold_norms) before rotating the residual stream")
    q = q.to(model.lm_head.weight.device)
    m.embed_tokens.weight.data = (m.embed_tokens.weight.double() @ q).to(m.embed_tokens.weight.dtype)
    _set(model.lm_head, model.lm_head.weight.double() @ q)
    for layer in model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
            _set(lin, lin.weight.double() @ q)
        for lin in (at.o_proj, mlp.down_proj):
            _set(lin, q.T @ lin.weight.double(), None if lin.bias is None else q.T @ lin.bias.double())


@torch.no_grad()
def residual_moment(model, ids: torch.Tensor) -> torch.Tensor:
    """E[x x^T] [D, D] (float64, on the CPU) of the RMS-normalised residual stream where each norm
    reads it (every layer's two norms and the final norm), over the windows of ids [B, S]."""
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
        for w in ids:  # one window at a time: [1, S, V] logits, never [B, S, V]
            model(w[None])
    finally:
        for h in handles:
            h.remove()
    return acc / count[0]


def rotate_llama(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """In place: fold the norms and rotate the residual stream into pca_basis(moment, keep) of its
    normalised states on the calibration windows ids [B, S]. Returns Q [D, D] (float64)."""
    if type(keep) is not int or not 0 <= keep < model.config.hidden_size:
        raise DejavuError(f"rotation keep must be an integer in [0, {model.config.hidden_size}), got {keep!r}")
    q = pca_basis(residual_moment(model, ids), keep)
    fold_norms(model)
    rotate_residual(model, q)
    return q

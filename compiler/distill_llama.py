"""Sparsity-aware distillation of a TEAL-sparse Llama to its own dense outputs (build time).

The TEAL masks stay as the build chose them: per-layer thresholds fixed, masks recomputed every
forward by gated_sparsity's hooks and constant for autograd (the gradient flows through the kept
entries only). Every block weight and RMSNorm of the model is trained with Adam to minimise
KL(dense model's next-token distribution || the masked model's) on calibration text. The target
is the dense model's own output, not the text's next token: the model learns to work around its
masks, not the text (on SmolLM2-135M the trained model scored dense is 1.3% worse than the original).
Same shapes, same masks' rule: the engine reads the same bytes a token and stores the trained
weights; its thresholds are calibrated again on the trained model (compiler/build_llama.py).

Measured on SmolLM2-135M (docs/llama.md, "Sparsity-aware distillation"): the RMSNorm weights
alone gained nothing on held-out text; every block weight and norm, 120 windows of 256 tokens, took
the refined 40% skips from +8.53% to +3.57% over dense on 8,176 WikiText-2 test tokens; 1,000 steps
(3 minutes on an H100) took an engine at 40% to +2.28%, and to +1.33% with eight windows a step ("A thousand
steps and more, on a GPU").
"""
from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn.functional as F

from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
from dejavu.errors import DejavuError

LR_WEIGHT = 1e-5  # Adam's step on projection weights (SmolLM2's mean |w| ~0.1: ~1e-4 of it a step)
LR_NORM = 1e-4  # on RMSNorm weights (SmolLM2's are 0.03-0.3; 1e-3 drifted the dense model)
WINDOW = 256  # tokens per training window (`batch` of them a step)


def kl_to_dense(teacher, student, thresholds: dict, ids: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of ids [B, S] of KL(p_teacher || p_student), the student masked by
    TEAL `thresholds` ({key: [L]}); differentiable in the student's parameters."""
    with torch.no_grad():
        logp_t = F.log_softmax(teacher(ids).float(), -1)  # [B, S, V]
    with gated_sparsity(student, thresholds, GatedSparsity(), count=False):
        logp_s = F.log_softmax(student(ids).float(), -1)
    return (logp_t.exp() * (logp_t - logp_s)).sum(-1).mean()


def trained_parameters(model) -> list[torch.nn.Parameter]:
    """Every parameter of the decoder blocks and the final norm (not the embedding / LM head)."""
    return [p for n, p in model.named_parameters() if ".layers." in n or n == "model.norm.weight"]


def distill_llama(model, thresholds: dict, ids: torch.Tensor, steps: int, lr_weight: float = LR_WEIGHT,
                  lr_norm: float = LR_NORM, progress=None, batch: int = 1) -> dict:
    """Train `model` in place for `steps` steps, `batch` windows of ids [B, S] a step (in order,
    cycled), to its own dense outputs under the TEAL `thresholds` ({key: [L]}). Returns {"steps",
    "batch", "tokens", "first_kl", "last_kl" (mean of the first / last min(10, steps) steps' KL), "seconds"}.
    progress: called with a line every 10 steps and after the last (the mean KL since the last line)."""
    if type(steps) is not int or steps < 1:
        raise DejavuError(f"distillation steps must be a positive integer, got {steps!r}")
    if type(batch) is not int or batch < 1:
        raise DejavuError(f"distillation batch must be a positive integer, got {batch!r}")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 \
            or ids.dtype != torch.long:
        raise DejavuError(f"distillation ids must be a long tensor [windows, tokens >= 2], got "
                          f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
    for name, lr in (("lr_weight", lr_weight), ("lr_norm", lr_norm)):
        if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
            raise DejavuError(f"distillation {name} must be a positive number, got {lr!r}")
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    params = trained_parameters(model)
    was = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam([{"params": [p for p in params if p.dim() == 1], "lr": lr_norm},
                            {"params": [p for p in params if p.dim() > 1], "lr": lr_weight}], betas=(0.9, 0.99))
    ids = ids.to(next(model.parameters()).device)
    losses, t0 = [], time.perf_counter()
    try:
        with torch.enable_grad():
            for step in range(steps):
                rows = torch.arange(step * batch, (step + 1) * batch, device=ids.device) % ids.shape[0]
                loss = kl_to_dense(teacher, model, thresholds, ids[rows])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                if progress is not None and ((step + 1) % 10 == 0 or step + 1 == steps):
                    recent = losses[-((step % 10) + 1):]
                    progress(f"distill step {step + 1}/{steps}: KL {sum(recent) / len(recent):.5f}, "
                             f"{time.perf_counter() - t0:.0f} s")
    finally:
        for p in model.parameters():
            p.requires_grad_(was[id(p)])
            p.grad = None
    n = min(10, steps)
    return {"steps": steps, "batch": batch, "tokens": steps * batch * ids.shape[1],
            "first_kl": round(sum(losses[:n]) / n, 6), "last_kl": round(sum(losses[-n:]) / n, 6),
            "seconds": round(time.perf_counter() - t0, 1)}

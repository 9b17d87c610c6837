"""Masked-dense simulation of sparsity for Llama-family blocks (SwiGLU MLP, GQA attention).

SwiGLU has no exact zeros, so what is skipped is chosen by magnitude. Three methods, each
given a byte budget: `skip` = the fraction of a decode step's block projection weight bytes
(q, k, v, o, gate, up, down; not the embeddings, the LM head or the norms) left unread:

  teal     input sparsity (TEAL): each projection reads only the columns W[:, i] whose input
           |x_i| exceeds a per-layer threshold. Inputs: attn_in (-> q, k, v), o_in (-> o),
           mlp_in (-> gate, up), down_in (-> down). Every input skips the same fraction.
  cats     CATS: gate dense; neurons with |SiLU(gate)| under a threshold are dropped, so up
           and down read only the kept rows / columns. Attention as in teal at `skip`; the MLP
           keeps k = 1 - 1.5 * skip of its neurons (gate is a third of the MLP bytes).
  lowrank  DejaVu-style predictor: a rank-r least-squares fit of the gate pre-activation
           (x A B, fitted on calibration activations) picks the top-k neurons by |SiLU(x A B)|;
           gate, up and down read only them; the predictor's own bytes are counted. Attention
           as in teal.
Thresholds are quantiles of the dense model's activations on calibration text (never the
evaluation text), per layer and input. The decision is per token (a threshold, or a top-k).
Bytes actually skipped on the evaluated text are counted (`Reads`), since a threshold
calibrated on one text skips a slightly different fraction on another.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dejavu.errors import DejavuError

METHODS = ("teal", "cats", "lowrank")
LEVELS = torch.linspace(0.0, 0.99, 100)  # quantile grid of the calibration tables


@dataclass(frozen=True)
class GatedSparsity:
    """One sparsity setting: method and the target fraction of block weight bytes skipped."""

    method: str = "teal"
    skip: float = 0.4
    rank: int = 64  # lowrank only

    def __post_init__(self):
        if self.method not in METHODS:
            raise DejavuError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 0.0 <= self.skip < 1.0:
            raise DejavuError(f"skip must be in [0, 1), got {self.skip}")


def projection_bytes(cfg) -> dict[str, int]:
    """Weight elements read per layer and decode step, by projection input (see module doc)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    qo, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"attn_in": d * (qo + 2 * kv), "o_in": qo * d, "gate": d * f, "up": d * f, "down": f * d}


def mlp_keep(s: GatedSparsity, cfg) -> float:
    """Fraction of MLP neurons kept by cats / lowrank so the layer skips s.skip of its bytes."""
    b = projection_bytes(cfg)
    mlp = b["gate"] + b["up"] + b["down"]
    if s.method == "cats":  # gate always read: skipped = (1 - k) * (up + down) = skip * mlp
        k = 1.0 - s.skip * mlp / (b["up"] + b["down"])
    else:  # lowrank: skipped = (1 - k) * mlp - predictor
        pred = s.rank * (cfg.hidden_size + cfg.intermediate_size)
        k = 1.0 - s.skip - pred / mlp
    if not 0.0 < k <= 1.0:
        raise DejavuError(f"{s.method} cannot skip {s.skip:.0%} of the block bytes (would keep {k:.2f} "
                          "of the MLP neurons)")
    return k


@dataclass
class Calibration:
    """Per-layer quantile tables of |activation| (key -> [L, len(LEVELS)]) and rank-r gate fits."""

    tables: dict[str, torch.Tensor]
    predictors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (A [D, r], B [r, F])

    def threshold(self, key: str, layer: int, fraction: float) -> float:
        """The magnitude below which `fraction` of the calibration activations fall."""
        if not 0.0 <= fraction <= float(LEVELS[-1]):
            raise DejavuError(f"fraction {fraction} is outside the calibrated range [0, {float(LEVELS[-1])}]")
        table = self.tables[key][layer]
        pos = fraction / float(LEVELS[1] - LEVELS[0])  # linear between the grid's quantiles
        i = min(int(pos), len(LEVELS) - 2)
        w = pos - i
        return float(table[i] * (1 - w) + table[i + 1] * w)


@torch.no_grad()
def calibrate(model, ids: torch.Tensor, rank: int = 64) -> Calibration:
    """Quantile tables of every projection input and |SiLU(gate)|, and rank-r gate predictors,
    from one dense forward of ids [B, S] (calibration text)."""
    L = len(model.layers)
    tables = {k: torch.zeros(L, len(LEVELS)) for k in ("attn_in", "o_in", "mlp_in", "down_in", "act")}
    preds: list = [None] * L
    handles = []

    def record(key, l, x):
        a = x.detach().float().abs().flatten()
        if a.numel() > 4_000_000:  # torch.quantile's size limit: a fixed stride subsample
            a = a[:: a.numel() // 4_000_000 + 1]
        tables[key][l] = torch.quantile(a, LEVELS.to(a.device)).cpu()

    def fit(l, mlp, x):
        # Reduced-rank least squares of Y = X Wg^T: project onto Y's top-r right singular vectors.
        # Y^T Y = W C W^T with C = X^T X = Q diag(e) Q^T, so they are the left singular vectors of
        # W Q diag(sqrt(e)) [F, D]: an SVD of F x D instead of N x F.
        X = x.detach().float().flatten(0, -2)  # [N, D]
        W = mlp.gate_proj.weight.float()  # [F, D]
        e, Q = torch.linalg.eigh(X.T @ X)
        U, _, _ = torch.linalg.svd(W @ (Q * e.clamp(min=0).sqrt()), full_matrices=False)
        V = U[:, :rank]  # [F, r]
        preds[l] = ((W.T @ V).cpu(), V.T.contiguous().cpu())  # A [D, r], B [r, F]

    for l, layer in enumerate(model.layers):
        at, mlp = layer.self_attn, layer.mlp
        handles += [
            at.q_proj.register_forward_pre_hook(lambda m, a, l=l: record("attn_in", l, a[0])),
            at.o_proj.register_forward_pre_hook(lambda m, a, l=l: record("o_in", l, a[0])),
            mlp.gate_proj.register_forward_pre_hook(lambda m, a, l=l: record("mlp_in", l, a[0])),
            mlp.down_proj.register_forward_pre_hook(lambda m, a, l=l: record("down_in", l, a[0])),
            mlp.act_fn.register_forward_hook(lambda m, a, o, l=l: record("act", l, o)),
        ]
        if rank > 0:
            handles.append(mlp.gate_proj.register_forward_pre_hook(lambda m, a, l=l, mlp=mlp: fit(l, mlp, a[0])))
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return Calibration(tables, preds if rank > 0 else [])


@dataclass
class Reads:
    """Weight elements read vs dense, summed over tokens and layers (for the realized skip)."""

    read: float = 0.0
    dense: float = 0.0

    @property
    def skipped(self) -> float:
        return 1.0 - self.read / self.dense if self.dense else 0.0


def _input_mask(x: torch.Tensor, t: float, reads: Reads, nbytes: int) -> torch.Tensor:
    keep = x.abs() > t  # [B, S, N]
    reads.read += float(keep.float().mean(-1).sum()) * nbytes
    reads.dense += keep.shape[0] * keep.shape[1] * nbytes
    return x * keep


@contextlib.contextmanager
def gated_sparsity(model, calib: Calibration, s: GatedSparsity):
    """Apply setting `s` to a LlamaForCausalLM while the context is open; yields a `Reads`."""
    cfg = model.config
    b = projection_bytes(cfg)
    reads = Reads()
    handles = []
    k_frac = 1.0 if s.method == "teal" else mlp_keep(s, cfg)
    n_keep = max(1, round(k_frac * cfg.intermediate_size))
    if s.method == "lowrank" and (not calib.predictors or calib.predictors[0][0].shape[1] != s.rank):
        raise DejavuError(f"lowrank needs a calibration with rank {s.rank} predictors")
    mlp_x: dict[int, torch.Tensor] = {}

    def pre(key, l, nbytes):
        t = calib.threshold(key, l, s.skip)
        return lambda m, a: (_input_mask(a[0], t, reads, nbytes),) + tuple(a[1:])

    def act_hook(l):
        t = calib.threshold("act", l, 1.0 - k_frac)
        mlp_bytes = b["up"] + b["down"] + (0 if s.method == "cats" else b["gate"])

        def hook(m, a, out):  # out: SiLU(gate) [B, S, F]
            if s.method == "cats":
                keep = out.abs() > t
            else:
                A, B = calib.predictors[l]
                score = F.silu(mlp_x.pop(l).float() @ A.to(out.device) @ B.to(out.device)).abs()
                keep = torch.zeros_like(out, dtype=torch.bool).scatter_(-1, score.topk(n_keep, -1).indices, True)
            tokens = keep.shape[0] * keep.shape[1]
            fixed = b["gate"] if s.method == "cats" else s.rank * (cfg.hidden_size + cfg.intermediate_size)
            reads.read += float(keep.float().mean(-1).sum()) * mlp_bytes + tokens * fixed
            reads.dense += tokens * (b["gate"] + b["up"] + b["down"])
            return out * keep
        return hook

    if s.skip > 0:
        for l, layer in enumerate(model.layers):
            at, mlp = layer.self_attn, layer.mlp
            handles += [at.q_proj.register_forward_pre_hook(pre("attn_in", l, b["attn_in"]))]
            # k and v read the same masked input as q: one mask, counted once (above)
            for proj in (at.k_proj, at.v_proj):
                t = calib.threshold("attn_in", l, s.skip)
                handles.append(proj.register_forward_pre_hook(
                    lambda m, a, t=t: (a[0] * (a[0].abs() > t),) + tuple(a[1:])))
            handles.append(at.o_proj.register_forward_pre_hook(pre("o_in", l, b["o_in"])))
            if s.method == "teal":
                handles.append(mlp.gate_proj.register_forward_pre_hook(pre("mlp_in", l, b["gate"] + b["up"])))
                t = calib.threshold("mlp_in", l, s.skip)
                handles.append(mlp.up_proj.register_forward_pre_hook(
                    lambda m, a, t=t: (a[0] * (a[0].abs() > t),) + tuple(a[1:])))
                handles.append(mlp.down_proj.register_forward_pre_hook(pre("down_in", l, b["down"])))
            else:
                if s.method == "lowrank":
                    handles.append(mlp.gate_proj.register_forward_pre_hook(
                        lambda m, a, l=l: mlp_x.__setitem__(l, a[0].detach())))
                handles.append(mlp.act_fn.register_forward_hook(act_hook(l)))
    try:
        yield reads
    finally:
        for h in handles:
            h.remove()
        mlp_x.clear()

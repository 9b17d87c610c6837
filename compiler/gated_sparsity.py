"""Masked-dense simulation of input sparsity (TEAL) for Llama-family blocks (SwiGLU, GQA).

SwiGLU has no exact zeros, so what is skipped is chosen by magnitude: each projection reads
only the columns W[:, i] whose input |x_i| exceeds a per-layer threshold, per token. Inputs:
attn_in (-> q, k, v), o_in (-> o), mlp_in (-> gate, up), down_in (-> down); every input
skips the same target fraction `skip`, which is then the fraction of a decode step's block
projection weight bytes (q, k, v, o, gate, up, down; not the embeddings, the LM head or the
norms) left unread. Thresholds are quantiles of the dense model's activations on calibration
text (never the evaluation text), per layer and input. Bytes actually skipped on the evaluated
text are counted (`Reads`): a threshold calibrated on one text skips a slightly different
fraction on another.

Measured against two other methods on SmolLM2-135M (docs/llama.md): CATS (thresholds on
|SiLU(gate)|, up/down sparse) and a rank-64 least-squares gate predictor picking top-k
neurons; both lost at every budget and were removed (commit ab41bba holds them). A greedy
allocation of the budget over layers and inputs (TEAL's, from per-input error curves measured at
calibration) lost to the uniform level on held-out calibration text and was removed (commit
7896f4d holds it; docs/llama.md). The shipped allocation prices each input kind by the model's
end-to-end held-out loss instead (compiler/allocate_llama.py). Two other criteria than |x_i|
lost at equal bytes and were removed: WINA's |x_i| * ||W[:, i]||_2 (commit fee06a2) and a
per-channel gradient scale |x_i| * E|dL/dx_i| (commit 94eab8d); docs/llama.md. Attention head
selection by KV group lost to TEAL's attention inputs at equal bytes even as an oracle (commit
19563f2; docs/llama.md). A function-preserving rotation of the residual stream into its principal
components, the massive channels kept, is an option of the build (compiler/rotate_llama.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dejavu.errors import DejavuError

METHODS = ("teal",)
KEYS = ("attn_in", "o_in", "mlp_in", "down_in")  # the projection inputs, in layer order
LEVELS = torch.linspace(0.0, 0.99, 100)  # quantile grid of the calibration tables


@dataclass(frozen=True)
class GatedSparsity:
    """One sparsity setting: method and the target fraction of block weight bytes skipped."""

    method: str = "teal"
    skip: float = 0.4

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


@dataclass
class Calibration:
    """Per-layer quantile tables of |projection input| (key -> [L, len(LEVELS)])."""

    tables: dict[str, torch.Tensor]

    def threshold(self, key: str, layer: int, fraction: float) -> float:
        """The magnitude below which `fraction` of the calibration activations fall."""
        if not 0.0 <= fraction <= float(LEVELS[-1]):
            raise DejavuError(f"fraction {fraction} is outside the calibrated range [0, {float(LEVELS[-1])}]")
        table = self.tables[key][layer]
        pos = fraction / float(LEVELS[1] - LEVELS[0])  # linear between the grid's quantiles
        i = min(int(pos), len(LEVELS) - 2)
        w = pos - i
        return float(table[i] * (1 - w) + table[i + 1] * w)


def quantiles(a: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """torch.quantile(a, q) (linear interpolation) for a 1-D CPU tensor a, from the two order
    statistics around each rank, selected by np.partition instead of sorting all of a: the same
    arithmetic as torch's (ranks q * (n - 1) in a's dtype, lerp of the neighbours), the same
    values, 2.5x faster on a calibration input of 3 M activations."""
    import numpy as np

    if bool(a.isnan().any()):  # torch.quantile's answer: every quantile NaN
        return torch.full(q.shape, float("nan"), dtype=a.dtype)
    ranks = q.to(a.dtype) * (a.numel() - 1)
    below, above = ranks.long(), ranks.ceil().long()
    part = torch.from_numpy(np.partition(a.numpy(), np.unique(torch.cat([below, above]).numpy())))
    return part[below].lerp(part[above], ranks - below)


@contextlib.contextmanager
def input_hooks(model, hook):
    """Forward pre-hooks on the first projection of each input (q for attn_in, o, gate for mlp_in, down) of every
    layer: hook(key, layer) gives the one for that input, called with the module and its args; removed on exit."""
    handles = []
    try:
        for l, layer in enumerate(model.layers):
            at, mlp = layer.self_attn, layer.mlp
            for key, mod in (("attn_in", at.q_proj), ("o_in", at.o_proj), ("mlp_in", mlp.gate_proj),
                             ("down_in", mlp.down_proj)):
                handles.append(mod.register_forward_pre_hook(hook(key, l)))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def calibrate(model, ids: torch.Tensor) -> Calibration:
    """Quantile tables of every projection input from one dense forward of ids [B, S]."""
    L = len(model.layers)
    tables = {k: torch.zeros(L, len(LEVELS)) for k in KEYS}

    def record(key, l):
        def f(m, args):
            a = args[0].detach().float().abs().flatten()
            if a.numel() > 4_000_000:  # torch.quantile's size limit: a fixed stride subsample
                a = a[:: a.numel() // 4_000_000 + 1]
            tables[key][l] = quantiles(a.cpu(), LEVELS)
        return f

    with input_hooks(model, record):
        model(ids)
    return Calibration(tables)


def thresholds(calib: Calibration, skip: float) -> dict[str, list[float]]:
    """Per-layer magnitude thresholds of each input for a target `skip`: {key in KEYS: [L]}.

    A token's entry x_i with |x_i| <= threshold is skipped (the column W[:, i] of every
    projection reading that input is left unread); 0.0 (skip 0) keeps every non-zero entry.
    Every input skips the fraction `skip` of its calibration activations."""
    if not 0.0 <= skip < 1.0:
        raise DejavuError(f"skip must be in [0, 1), got {skip}")
    L = calib.tables[KEYS[0]].shape[0]
    return {k: [calib.threshold(k, l, skip) if skip > 0 else 0.0 for l in range(L)] for k in KEYS}


@dataclass
class Reads:
    """Weight elements read vs dense, summed over tokens and layers (for the realized skip)."""

    read: float = 0.0
    dense: float = 0.0

    @property
    def skipped(self) -> float:
        return 1.0 - self.read / self.dense if self.dense else 0.0


def _hooks(t: float, n: int, reads: Reads | None, nbytes: int) -> list:
    """Pre-hooks for the n projections reading one input (q, k, v; gate, up; o; down): the first
    zeroes the entries with |x| <= t and counts the columns read into `reads` (None: not counted);
    the others take the first's masked tensor when they read the same input, as they do (held
    until the last of them has it)."""
    last = {}

    def first(m, a):
        x = a[0]
        keep = x.abs() > t  # [B, S, N]
        if reads is not None:
            reads.read += float(keep.float().mean(-1).sum()) * nbytes
            reads.dense += keep.shape[0] * keep.shape[1] * nbytes
        y = x * keep
        if n > 1:
            last.update(x=x, y=y, left=n - 1)
        return (y,) + tuple(a[1:])

    def rest(m, a):
        if a[0] is not last.get("x"):
            return (a[0] * (a[0].abs() > t),) + tuple(a[1:])
        y, last["left"] = last["y"], last["left"] - 1
        if last["left"] == 0:
            last.clear()
        return (y,) + tuple(a[1:])

    return [first] + [rest] * (n - 1)


@contextlib.contextmanager
def gated_sparsity(model, calib: Calibration | dict, s: GatedSparsity, count: bool = True):
    """Apply setting `s` to a LlamaForCausalLM while the context is open; yields a `Reads`.

    calib: a Calibration (the thresholds of s.skip are taken from it), or thresholds already
    chosen, {key in KEYS: [L]} (an engine header's `sparsity.thresholds`). count=False: the
    Reads stay empty and an input whose threshold is 0 is left alone (x * (|x| > 0) is x), for
    callers that only want the model's output (the allocation's held-out losses)."""
    b = projection_bytes(model.config)
    reads = Reads()
    handles = []
    if s.skip > 0:
        t = calib if isinstance(calib, dict) else thresholds(calib, s.skip)
        for l, layer in enumerate(model.layers):
            at, mlp = layer.self_attn, layer.mlp
            # q, k, v read one masked input (counted once, at q); so do gate and up (at gate)
            for key, mods, nbytes in (("attn_in", (at.q_proj, at.k_proj, at.v_proj), b["attn_in"]),
                                      ("o_in", (at.o_proj,), b["o_in"]),
                                      ("mlp_in", (mlp.gate_proj, mlp.up_proj), b["gate"] + b["up"]),
                                      ("down_in", (mlp.down_proj,), b["down"])):
                if count or t[key][l] > 0:
                    hooks = _hooks(t[key][l], len(mods), reads if count else None, nbytes)
                    handles += [m.register_forward_pre_hook(h) for m, h in zip(mods, hooks)]
    try:
        yield reads
    finally:
        for h in handles:
            h.remove()

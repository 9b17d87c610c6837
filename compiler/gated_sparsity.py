"""Masked-dense simulation of input sparsity (TEAL) for Llama-family blocks (SwiGLU, GQA).

SwiGLU has no exact zeros, so what is skipped is chosen by magnitude: each projection reads
only the columns W[:, i] whose input |x_i| exceeds a per-layer, per-input threshold, per
token. Inputs: attn_in (-> q, k, v), o_in (-> o), mlp_in (-> gate, up), down_in (-> down).
`skip` is the fraction of a decode step's block projection weight bytes (q, k, v, o, gate,
up, down; not the embeddings, the LM head or the norms) left unread.

How a budget is spread over layers and inputs (`fractions`): calibration measures, for every
layer and input, how much the residual stream changes (mean squared, relative to the
residual's own mean square) when only that input skips a fraction f of its entries; the
budget is then filled greedily with the cheapest error per byte skipped (TEAL's greedy
allocation, here over all layers at once, on the lower convex hull of each error curve).
Thresholds are quantiles of the dense model's activations on calibration text (never the
evaluation text). Bytes actually skipped on the evaluated text are counted (`Reads`): a
threshold calibrated on one text skips a slightly different fraction on another.

Measured against two other methods on SmolLM2-135M (docs/llama.md): CATS (thresholds on
|SiLU(gate)|, up/down sparse) and a rank-64 least-squares gate predictor picking top-k
neurons; both lost at every budget and were removed (commit ab41bba holds them).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dejavu.errors import DejavuError

METHODS = ("teal",)
ALLOCATIONS = ("global", "layer", "uniform", "global_raw")
KEYS = ("attn_in", "o_in", "mlp_in", "down_in")
LEVELS = torch.linspace(0.0, 0.99, 100)  # quantile grid of the calibration tables
ERROR_LEVELS = torch.linspace(0.05, 0.95, 19)  # fractions at which each input's error is measured


@dataclass(frozen=True)
class GatedSparsity:
    """One sparsity setting: method and the target fraction of block weight bytes skipped."""

    method: str = "teal"
    skip: float = 0.4
    allocation: str = "global"

    def __post_init__(self):
        if self.method not in METHODS:
            raise DejavuError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 0.0 <= self.skip < 1.0:
            raise DejavuError(f"skip must be in [0, 1), got {self.skip}")
        if self.allocation not in ALLOCATIONS:
            raise DejavuError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")


def projection_bytes(cfg) -> dict[str, int]:
    """Weight elements read per layer and decode step, by projection (see module doc)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    qo, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"attn_in": d * (qo + 2 * kv), "o_in": qo * d, "gate": d * f, "up": d * f, "down": f * d}


def input_bytes(cfg) -> dict[str, int]:
    """Weight elements per layer read through each input (KEYS): the columns one entry gates."""
    b = projection_bytes(cfg)
    return {"attn_in": b["attn_in"], "o_in": b["o_in"], "mlp_in": b["gate"] + b["up"], "down_in": b["down"]}


def _interp(table: torch.Tensor, fraction: float) -> float:
    """table: [len(LEVELS)] quantiles -> the magnitude at `fraction`, linear between grid points."""
    pos = fraction / float(LEVELS[1] - LEVELS[0])
    i = min(int(pos), len(LEVELS) - 2)
    w = pos - i
    return float(table[i] * (1 - w) + table[i + 1] * w)


@dataclass
class Calibration:
    """What calibration measured, per layer: quantile tables of |input| (key -> [L, len(LEVELS)]),
    error curves (key -> [L, len(ERROR_LEVELS)]: mean squared change of the residual stream per
    token when only that input skips each fraction) and the residual's mean square where the
    attention and the MLP add ("attn", "mlp" -> [L]); bytes: input_bytes of the model."""

    tables: dict[str, torch.Tensor]
    errors: dict[str, torch.Tensor]
    norms: dict[str, torch.Tensor]
    bytes: dict[str, int]

    def threshold(self, key: str, layer: int, fraction: float) -> float:
        """The magnitude below which `fraction` of the calibration activations fall."""
        if not 0.0 <= fraction <= float(LEVELS[-1]):
            raise DejavuError(f"fraction {fraction} is outside the calibrated range [0, {float(LEVELS[-1])}]")
        return _interp(self.tables[key][layer], fraction)


def _quantiles(a: torch.Tensor) -> torch.Tensor:
    a = a.detach().float().abs().flatten()
    if a.numel() > 4_000_000:  # torch.quantile's size limit: a fixed stride subsample
        a = a[:: a.numel() // 4_000_000 + 1]
    return torch.quantile(a, LEVELS.to(a.device)).cpu()


def _msq(d: torch.Tensor) -> float:
    return float(d.float().pow(2).sum(-1).mean())  # mean over tokens of the squared norm


def _measure_layer(layer, l: int, args, rows: int, c: Calibration) -> None:
    """Quantile tables and error curves of layer l, from its dense input args (x, cos, sin, mask, pos)."""
    x, cos, sin, mask, pos = args
    at, mlp = layer.self_attn, layer.mlp
    got = {}
    hook = at.o_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("y", a[0]))
    try:
        h = layer.input_layernorm(x)  # [B, S, D]
        a = at(h, cos, sin, mask, pos)
    finally:
        hook.remove()
    y = got["y"]  # [B, S, H * hd]
    x2 = x + a
    g = layer.post_attention_layernorm(x2)
    u = mlp.act_fn(mlp.gate_proj(g)) * mlp.up_proj(g)  # [B, S, F]
    for key, v in (("attn_in", h), ("o_in", y), ("mlp_in", g), ("down_in", u)):
        c.tables[key][l] = _quantiles(v)
    r = slice(0, rows)  # the error curves on the first rows only (cost: 19 partial forwards each)
    h, y, g, u, a, x, x2 = h[r], y[r], g[r], u[r], a[r], x[r], x2[r]
    cos, sin = cos[r], sin[r]
    mask = mask[r] if mask is not None and mask.shape[0] > 1 else mask
    m = mlp.down_proj(u)
    c.norms["attn"][l], c.norms["mlp"][l] = _msq(x), _msq(x2)
    for i, f in enumerate(ERROR_LEVELS.tolist()):
        t = {k: _interp(c.tables[k][l], f) for k in KEYS}
        c.errors["attn_in"][l, i] = _msq(at(h * (h.abs() > t["attn_in"]), cos, sin, mask, pos) - a)
        c.errors["o_in"][l, i] = _msq(F.linear(y * (y.abs() <= t["o_in"]), at.o_proj.weight))
        c.errors["mlp_in"][l, i] = _msq(mlp(g * (g.abs() > t["mlp_in"])) - m)
        c.errors["down_in"][l, i] = _msq(F.linear(u * (u.abs() <= t["down_in"]), mlp.down_proj.weight))


@torch.no_grad()
def calibrate(model, ids: torch.Tensor, error_tokens: int = 4096) -> Calibration:
    """Quantile tables of every projection input from one dense forward of ids [B, S], and each
    input's error curve on the first rows of ids holding about `error_tokens` tokens."""
    L, n = len(model.layers), len(LEVELS)
    c = Calibration({k: torch.zeros(L, n) for k in KEYS}, {k: torch.zeros(L, len(ERROR_LEVELS)) for k in KEYS},
                    {"attn": torch.zeros(L), "mlp": torch.zeros(L)}, input_bytes(model.config))
    rows = max(1, error_tokens // ids.shape[1])
    handles = [layer.register_forward_pre_hook(lambda m, a, l=l: _measure_layer(m, l, a, rows, c))
               for l, layer in enumerate(model.layers)]
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return c


def _hull(f: list[float], e: list[float]) -> list[tuple[float, float]]:
    """Lower convex hull of the points (f, e), f increasing from 0: the vertices, in order."""
    out: list[tuple[float, float]] = []
    for p in zip(f, e):
        while len(out) >= 2 and ((out[-1][1] - out[-2][1]) * (p[0] - out[-2][0])
                                 >= (p[1] - out[-2][1]) * (out[-1][0] - out[-2][0])):
            out.pop()
        out.append(p)
    return out


def _fill(curves: dict, budget: float) -> dict:
    """Greedy fill: curves {item: (bytes, f_points, e_points)}; take hull segments cheapest error
    per byte first until `budget` bytes are skipped (the last one in part). -> {item: fraction}."""
    segs = []
    for item, (b, fs, es) in curves.items():
        hull = _hull(fs, es)
        for (f0, e0), (f1, e1) in zip(hull, hull[1:]):
            segs.append(((e1 - e0) / ((f1 - f0) * b), f0, item, f1 - f0, b))
    segs.sort(key=lambda s: (s[0], s[1]))
    out = {item: 0.0 for item in curves}
    for _, _, item, df, b in segs:
        if budget <= 0:
            break
        take = min(df, budget / b)
        out[item] += take
        budget -= take * b
    return out


def fractions(calib: Calibration, skip: float, allocation: str = "global") -> dict[str, list[float]]:
    """The fraction of entries each input skips, per layer ({key: [L]}), spending `skip` of the
    block projection bytes (see the module doc)."""
    L = calib.tables["attn_in"].shape[0]
    if allocation == "uniform" or skip == 0:
        return {k: [skip] * L for k in KEYS}
    f = [0.0] + ERROR_LEVELS.tolist()
    curves = {}
    for l in range(L):
        for k in KEYS:
            e = calib.errors[k][l].tolist()
            if allocation == "global":
                e = [v / float(calib.norms["attn" if k in ("attn_in", "o_in") else "mlp"][l]) for v in e]
            curves[(l, k)] = (calib.bytes[k], f, [0.0] + e)
    per_layer = sum(calib.bytes.values())
    if allocation == "layer":
        got = {}
        for l in range(L):
            got.update(_fill({i: c for i, c in curves.items() if i[0] == l}, skip * per_layer))
    else:
        got = _fill(curves, skip * per_layer * L)
    return {k: [got[(l, k)] for l in range(L)] for k in KEYS}


def thresholds(calib: Calibration, skip: float, allocation: str = "global") -> dict[str, list[float]]:
    """Per-layer magnitude thresholds of each input ({key: [L]}) for a target `skip`: an entry
    |x_i| <= threshold is skipped (its weight column left unread). 0.0 where an input skips
    nothing."""
    fr = fractions(calib, skip, allocation)
    return {k: [calib.threshold(k, l, f) if f > 0 else 0.0 for l, f in enumerate(fr[k])] for k in KEYS}


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


def _masked(t: float):
    """A pre-hook giving a projection the input with |x| <= t zeroed (q's mask, for k and v)."""
    return lambda m, a: (a[0] * (a[0].abs() > t),) + tuple(a[1:])


@contextlib.contextmanager
def gated_sparsity(model, calib: Calibration, s: GatedSparsity):
    """Apply setting `s` to a LlamaForCausalLM while the context is open; yields a `Reads`."""
    b = calib.bytes
    reads = Reads()
    handles = []

    def pre(key, t):
        return lambda m, a: (_input_mask(a[0], t, reads, b[key]),) + tuple(a[1:])

    if s.skip > 0:
        t = thresholds(calib, s.skip, s.allocation)
        for l, layer in enumerate(model.layers):
            at, mlp = layer.self_attn, layer.mlp
            # q, k, v read one masked input (counted once, at q); so do gate and up (at gate)
            handles += [at.q_proj.register_forward_pre_hook(pre("attn_in", t["attn_in"][l])),
                        at.k_proj.register_forward_pre_hook(_masked(t["attn_in"][l])),
                        at.v_proj.register_forward_pre_hook(_masked(t["attn_in"][l])),
                        at.o_proj.register_forward_pre_hook(pre("o_in", t["o_in"][l])),
                        mlp.gate_proj.register_forward_pre_hook(pre("mlp_in", t["mlp_in"][l])),
                        mlp.up_proj.register_forward_pre_hook(_masked(t["mlp_in"][l])),
                        mlp.down_proj.register_forward_pre_hook(pre("down_in", t["down_in"][l]))]
    try:
        yield reads
    finally:
        for h in handles:
            h.remove()

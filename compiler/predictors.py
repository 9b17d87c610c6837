"""Low-rank predictors of the active MLP neurons and important attention heads, per layer.

`scores = (x @ A.T) @ B.T + bias` with A [r, D], B [N, r], bias [N]; x is the raw residual
`src[l - lookahead]` (docs/ARCHITECTURE.md, "Lookahead convention"). Since the map is
linear, a rank above min(D, N) buys nothing: the head predictor's default rank is H. MLP ranks
may differ per layer (`mlp_ranks`); the runtime reads each layer's rank from its tensors.

Targets (PREDICTOR_TARGETS, recorded in the engine): MLP neuron j of a token weighs its
contribution relu(fc1(x))_j * ||W2[:, j]|| (`mlp_contributions`); head h its contribution to the
layer output, ||W_o[:, h] y_h|| (calibration's `head_contribution`).

Head predictors are a ridge least-squares fit of the log contribution (`_fit_heads`): heads are
ranked by the prediction. MLP training (`_fit`): a reduced-rank least-squares start on the
active-neuron labels (one streamed pass, closed form), then a listwise loss (softmax cross entropy
of the scores against each token's normalised contributions), Adam, mini-batches of tokens,
early stopping on the held-out contribution mass kept at `stop_density` of the neurons over the
tail of the stream (whole windows), seeded. Inputs are standardised during training and the
affine map is folded into A and bias afterwards, so the stored predictor reads the raw residual.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from dejavu.compiler.calibrate import Calibration
from dejavu.compiler.config import PredictorSettings
from dejavu.errors import DejavuError
from dejavu.models.opt import OPTConfig

# What the engine records (build_config.predictor_form / predictor_targets): the scoring form
# and what each kind was fitted to (docs/predictors.md, "MLP targets").
PREDICTOR_FORM = "lowrank"
PREDICTOR_TARGETS = {"mlp": "contribution_listwise", "attn": "log_contribution_lstsq"}
PREDICTOR_TENSORS = ("a", "b", "bias", "a_scale", "b_scale")  # the scales: int8 predictors only
CANDIDATE_INPUTS = [{"source": "attn_in", "lookahead": 0},
                    {"source": "attn_in", "lookahead": 1},
                    {"source": "mlp_in", "lookahead": 1}]


def _budget_rank(budget: float, dense_bytes: int, d: int, n: int, multiple: int = 8) -> int:
    r = int((budget * dense_bytes - n) // (d + n))  # r*(D+N) + N <= budget * dense
    return max(1, r // multiple * multiple) if r >= multiple else max(1, r)


def mlp_rank_bytes(cfg: OPTConfig, dtype: str) -> tuple[int, int, int]:
    """(bytes a rank adds, fixed bytes, dense bytes) of one layer's MLP predictor against the fc1 + fc2
    it governs, counted as stored with a 2-byte engine dtype: float A, B, bias = 2 r (D + F) + 2 F;
    int8 A, B with an fp16 scale a row and the bias = r (D + F) + 2 (r + F) + 2 F."""
    D, Fd = cfg.hidden_size, cfg.ffn_dim
    dense = 2 * (2 * D * Fd + Fd + D)
    return (D + Fd + 2, 4 * Fd, dense) if dtype == "int8" else (2 * (D + Fd), 2 * Fd, dense)


def _rank_cap(cfg: OPTConfig, settings: PredictorSettings) -> int:
    # max_auto_rank counts the bytes of that rank in float: int8 rows pay for twice the rank
    return min(cfg.hidden_size, settings.max_auto_rank * (2 if settings.dtype == "int8" else 1))


def default_ranks(cfg: OPTConfig, settings: PredictorSettings) -> tuple[int, int]:
    """(mlp_rank, attn_rank): the settings' values, else the largest within the budget (the MLP's
    counted in the bytes `settings.dtype` stores, `mlp_rank_bytes`)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    per_rank, fixed, dense = mlp_rank_bytes(cfg, settings.dtype)
    r = int((settings.cost_budget * dense - fixed) // per_rank)
    mlp = settings.mlp_rank or min(_rank_cap(cfg, settings), max(1, r // 8 * 8) if r >= 8 else max(1, r))
    attn = settings.attn_rank or min(H, _budget_rank(settings.cost_budget, 4 * D * D + 4 * D, D, H, 1))
    return mlp, attn


def mlp_ranks(cfg: OPTConfig, settings: PredictorSettings) -> list[int]:
    """Per-layer MLP predictor ranks [L]: `settings.mlp_rank` everywhere when given; else every
    layer gets the uniform budget rank (`default_ranks`) and layer 0 also gets what rounding to
    multiples of 8 left of the whole budget (L layers' bytes), capped at D and max_auto_rank.
    opt-mini: 88 / 56 in float, 160 / 112 in int8.

    Layer 0 reads the embedding output and fires most neurons (22% on opt-mini, 2-7% elsewhere):
    it loses the most contribution at small K, and more rank there lowers perplexity at MLP 0.1
    (docs/predictors.md, "Rank per layer")."""
    L = cfg.num_hidden_layers
    base, _ = default_ranks(cfg, settings)
    if settings.mlp_rank:
        return [base] * L
    per_rank, fixed, dense = mlp_rank_bytes(cfg, settings.dtype)
    total = L * (settings.cost_budget * dense - fixed) / per_rank  # ranks the budget pays for
    first = min(_rank_cap(cfg, settings), max(base, int(total - (L - 1) * base) // 8 * 8))
    return [first] + [base] * (L - 1)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (q [R, C] int8, scale [R] fp16): symmetric per row, w ~ q * scale[:, None], |q| <= 127.
    Idempotent on its own dequantized output (the row's largest |value| is 127 scale)."""
    scale = (w.float().abs().amax(1) / 127).clamp_min(2 ** -24).half()  # fp16's least subnormal: never 0
    q = (w.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_rows(p: dict) -> dict:
    """An MLP predictor {a, b, bias} as the int8 engine stores it: a and b dequantized (fp32, exact:
    q * scale) beside a_scale [r] and b_scale [N] (fp16); bias unchanged. The engine writer takes q back
    as a / scale (exact), so the allocator, the per-token K and the ONNX graphs see the engine's values."""
    from dejavu.plugins.predictor import dequantize_rows

    out = dict(p)
    for n in ("a", "b"):
        q, scale = quantize_rows(p[n])
        out[n], out[n + "_scale"] = dequantize_rows(q, scale, torch.float32), scale
    return out


def predictor_cost(cfg: OPTConfig, mlp_rank: int | list[int], attn_rank: int, dtype: str = "float") -> dict:
    """Parameter counts of predictors vs the dense layers they govern, and ratios of bytes as stored (a 2-byte
    engine dtype; `dtype` "int8": the MLP predictors' int8 rows and fp16 scales, `mlp_rank_bytes`).
    mlp_rank: one rank for every layer or a list of per-layer ranks (ratios over all layers)."""
    D, Fd, H, L = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads, cfg.num_hidden_layers
    rs = list(mlp_rank) if isinstance(mlp_rank, (list, tuple)) else [mlp_rank] * L
    mlp_p, mlp_d = sum(r * (D + Fd) + Fd for r in rs) / L, 2 * D * Fd + Fd + D  # A, B, bias vs fc1+fc2
    per_rank, fixed, _ = mlp_rank_bytes(cfg, dtype)
    mlp_b = sum(per_rank * r + fixed for r in rs) / L  # bytes a layer, as stored
    attn_p, attn_d = attn_rank * (D + H) + H, 4 * D * D + 4 * D  # vs q, k, v, out_proj
    return {"mlp_rank": mlp_rank, "attn_rank": attn_rank, "mlp_dtype": dtype,
            "mlp_predictor_params": round(L * mlp_p), "mlp_dense_params": L * mlp_d, "mlp_ratio": mlp_b / (2 * mlp_d),
            "attn_predictor_params": L * attn_p, "attn_dense_params": L * attn_d,
            "attn_ratio": attn_p / attn_d, "total_ratio": (mlp_b + 2 * attn_p) / (2 * (mlp_d + attn_d))}


@dataclass
class Predictors:
    """Trained predictors: per layer {"a": [r, D], "b": [N, r], "bias": [N]} for mlp and attn; an int8
    predictor (`int8_rows`) also holds "a_scale" [r] and "b_scale" [N] (fp16), a and b its dequantized values."""

    mlp: list[dict[str, torch.Tensor]]
    attn: list[dict[str, torch.Tensor]]
    predictor_input: dict
    metrics: dict = field(default_factory=dict)
    # {"mlp"|"attn": [np.ndarray[N]] per layer}: held-out share of the MLP neurons' contribution /
    # of the head norm captured by the predicted top-k, k = 1..N
    recall_curves: dict = field(default_factory=dict)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Engine tensor names: layers.{l}.pred_mlp.a/.b/.bias(/.a_scale/.b_scale), layers.{l}.pred_attn.*
        (a and b as floats: an int8 predictor's dequantized values)."""
        out = {}
        for kind, layers in (("pred_mlp", self.mlp), ("pred_attn", self.attn)):
            for l, p in enumerate(layers):
                for name in PREDICTOR_TENSORS:
                    if name in p:
                        out[f"layers.{l}.{kind}.{name}"] = p[name].contiguous()
        return out

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], predictor_input: dict) -> "Predictors":
        L = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers.") and ".pred_" in k)
        get = lambda kind: [{n: sd[f"layers.{l}.{kind}.{n}"] for n in PREDICTOR_TENSORS  # noqa: E731
                             if f"layers.{l}.{kind}.{n}" in sd} for l in range(L)]
        return cls(get("pred_mlp"), get("pred_attn"), dict(predictor_input))

    def scores(self, kind: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Predictor scores [..., N] for residual x [..., D] (kind "mlp" or "attn")."""
        p = (self.mlp if kind == "mlp" else self.attn)[layer]
        a, b, bias = (p[n].to(device=x.device, dtype=x.dtype) for n in ("a", "b", "bias"))
        return (x @ a.T) @ b.T + bias

    def to(self, device=None, dtype=None) -> "Predictors":
        conv = lambda ps: [{n: t.to(device=device, dtype=t.dtype if n.endswith("_scale") else dtype)  # noqa: E731
                            for n, t in p.items()} for p in ps]
        return Predictors(conv(self.mlp), conv(self.attn), self.predictor_input, self.metrics,
                          self.recall_curves)


def _head_labels(norms: torch.Tensor, k: int) -> torch.Tensor:
    # norms: [T, H] -> bool [T, H], True for the top-k heads of each token
    idx = norms.topk(k, dim=-1).indices
    return torch.zeros_like(norms, dtype=torch.bool).scatter_(-1, idx, True)


@contextlib.contextmanager
def _one_thread():
    """Run LAPACK on one thread: MKL's threaded SVD of [384, 1536] float64 (opt-mini's rank
    start) took 0.35-14 s with two threads on the shared 2-core CPU and 0.12-0.16 s with one
    (2026-12-05); the solves also ran faster on one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def top_right_singular(m: torch.Tensor, rank: int, rtol: float = 1e-4) -> torch.Tensor:
    """The top `rank` right singular vectors of m [D, N] (float64), as rows [r, N] (r = min(rank, D, N)),
    each up to its sign: where D <= N, from the eigenvectors U of the D x D Gram matrix m mᵀ, v_i =
    mᵀ u_i / s_i; where the kept singular values span more than 1 / rtol (the Gram matrix squares the
    spread) or D > N, from the SVD itself. The same subspace as the SVD's (projectors equal to ~1e-15 on
    2048 x 8192), without gesvd's cost on the whole [D, N] (one thread, 2-core CPU, 2026-12-05: 18 s
    instead of 77 s at 2048 x 8192)."""
    D, N = m.shape
    r = min(rank, D, N)
    if D <= N:
        g = m @ m.T
        with _one_thread():
            ev, u = torch.linalg.eigh(g)  # ascending
        ev, u = ev.flip(0)[:r], u.flip(1)[:, :r]
        if ev[-1] > 0 and ev[-1] >= ev[0] * rtol ** 2:
            return ((m.T @ u) / ev.sqrt()).T
    with _one_thread():
        return torch.linalg.svd(m, full_matrices=False).Vh[:r]


def _rrr_init(x, y, mu, sd, rank: int, ridge: float, chunk: int = 8192):
    """Reduced-rank ridge regression of the ±1 labels on standardised x: A' [r, D], B' [N, r].

    One streamed pass for XᵀX and XᵀY; then W = (XᵀX + λI)⁻¹ XᵀY, and the rank-r map with
    the least fitted error is W V_r V_rᵀ, V_r the top right singular vectors of Lᵀ W
    (L Lᵀ = XᵀX + λI). A good start makes a few BCE epochs enough.
    """
    D, N = x.shape[1], y.shape[1]
    xtx = torch.zeros(D, D, dtype=torch.float64, device=x.device)
    xty = torch.zeros(D, N, dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], chunk):
        xn = (x[i:i + chunk] - mu) / sd  # fp32 products per chunk, fp64 sums across chunks
        xtx += (xn.T @ xn).double()
        xty += (xn.T @ torch.where(y[i:i + chunk], 1.0, -1.0)).double()  # ±1 labels, float32
    reg = xtx + ridge * x.shape[0] * torch.eye(D, dtype=torch.float64, device=x.device)
    with _one_thread():
        chol = torch.linalg.cholesky(reg)
        w = torch.cholesky_solve(xty, chol)  # [D, N]
    vh = top_right_singular(chol.T @ w, rank)  # [r, N]
    a = (w @ vh.T).T  # [r, D]
    scale = 1.0 / (a.norm(dim=1, keepdim=True).clamp_min(1e-12))  # balance the factors
    return (a * scale).float(), (vh.T / scale.T).float()


def mlp_contributions(layer, mlp_in, chunk: int = 8192) -> torch.Tensor:
    """c [T, F] fp32: neuron j's contribution relu(fc1(.))_j * ||fc2.weight[:, j]|| for the
    recorded `mlp_in` [T, D] of `layer` (an OPTDecoderLayer): a bound on the norm its removal
    takes from the MLP output, the quantity a top-K selection should keep."""
    w = next(layer.parameters())
    w2n = layer.fc2.weight.detach().float().norm(dim=0).to(w.device)  # [F]
    out = []
    with torch.no_grad():
        for i in range(0, len(mlp_in), chunk):
            x = torch.as_tensor(mlp_in[i:i + chunk]).to(w.device, w.dtype)  # a memory map's rows or a tensor
            h = layer.final_layer_norm(x) if layer.pre_ln else x  # post-LN: mlp_in is normalised
            out.append((F.relu(layer.fc1(h)).float() * w2n).cpu())
    return torch.cat(out)


def _fit(x_tr, y_tr, x_va, y_va, rank: int, k_eval: int, s: PredictorSettings, gen: torch.Generator,
         w_tr=None, w_va=None) -> dict:
    """Fit one low-rank predictor; x: [T, D] float32, y: [T, N] bool. Returns folded a/b/bias.

    With weights w [T, N] (the MLP's neuron contributions) the loss is listwise: softmax cross
    entropy of the scores against w / sum(w) per token, and early stopping keeps the epoch
    with the most held-out contribution in the top k_eval. Without (heads): class-weighted BCE
    on y, stopped on held-out recall at k_eval. Epoch 0 is the least-squares start.
    """
    dev = x_tr.device
    D, N = x_tr.shape[1], y_tr.shape[1]
    mu = x_tr.mean(0)
    sd = x_tr.std(0).clamp_min(1e-6)
    p = (y_tr.sum(0, dtype=torch.float32) / len(y_tr)).clamp(1e-4, 1 - 1e-4)  # [N] label frequency
    pos_weight = ((1 - p) / p).clamp(1.0 / s.max_pos_weight, s.max_pos_weight)
    a0, b0 = _rrr_init(x_tr, y_tr, mu, sd, rank, s.ridge)
    a, b = a0.requires_grad_(), b0.requires_grad_()
    bias = torch.log(p / (1 - p)).to(dev).requires_grad_()
    opt = torch.optim.Adam([a, b, bias], lr=s.lr)
    listwise = w_tr is not None
    # Row-wise work done once per fit, not per step or epoch (each row's values are the same):
    # the standardised inputs, the held-out targets in float32 and their sum.
    xn_tr, xn_va = (x_tr - mu) / sd, (x_va - mu) / sd
    target_va = (w_va if listwise else y_va).to(dev).float()
    total_va = max(1e-12, target_va.sum(dtype=torch.float32).item())

    def loss_on(rows):
        # index_select: the rows' copy, 4-8x faster than x[rows] on the CPU (2026-12-05)
        scores = (xn_tr.index_select(0, rows) @ a.T) @ b.T + bias
        if listwise:
            w = w_tr.index_select(0, rows.to(w_tr.device)).to(dev)
            # tokens with no active neuron: 0; in float32 once (the product and its backward read it)
            t = (w / w.sum(-1, keepdim=True).clamp_min(1e-12)).float()
            return -(t * F.log_softmax(scores, -1)).sum(-1).mean()
        return F.binary_cross_entropy_with_logits(scores, y_tr.index_select(0, rows).float(), pos_weight=pos_weight)

    def val_loss() -> float:  # minus the held-out share of the target in the top k_eval
        with torch.no_grad():
            got = sum(target_va[i:i + 4096].gather(
                -1, ((xn_va[i:i + 4096] @ a.T) @ b.T + bias).topk(k_eval, dim=-1).indices).sum().item()
                for i in range(0, len(x_va), 4096))
        return -got / total_va

    snapshot = lambda: (a.detach().clone(), b.detach().clone(), bias.detach().clone())
    best, best_state, bad = val_loss(), snapshot(), 0  # the least-squares start counts as epoch 0
    T = x_tr.shape[0]
    for _ in range(s.max_epochs):
        perm = torch.randperm(T, generator=gen).to(dev)
        for i in range(0, T, s.batch_tokens):
            opt.zero_grad(set_to_none=True)
            loss_on(perm[i:i + s.batch_tokens]).backward()
            opt.step()
        val = val_loss()
        if val < best - 1e-5:
            best, best_state, bad = val, snapshot(), 0
        else:
            bad += 1
            if bad >= s.patience:
                break
    a_, b_, bias_ = (t.double() for t in best_state)
    a_fold = a_ / sd.double()  # scores = B A' (x - mu)/sd + bias = B (A'/sd) x + (bias - B A' mu/sd)
    bias_fold = bias_ - b_ @ (a_ @ (mu.double() / sd.double()))
    return {"a": a_fold.float().cpu().contiguous(), "b": b_.float().cpu().contiguous(),
            "bias": bias_fold.float().cpu().contiguous(),
            "val_loss": best}


def _fit_heads(x_tr, imp_tr, x_va, y_va, rank: int, k_eval: int, ridge: float) -> dict:
    """Head predictor: ridge least squares of log contribution (imp [T, H]) on x [T, D], rank r.

    Heads are ranked by the predicted log contribution. On opt-mini (heads 0.5, WikiText-2 test)
    this beat class-weighted BCE on top-50% labels: 49.51 vs 50.13 (docs/predictors.md).
    Rank < H keeps the top singular directions of the fitted map. Returns folded a/b/bias and
    val_loss = minus the held-out recall of the top-k_eval labels."""
    x, y = x_tr.double(), torch.log(imp_tr.double() + 1e-6)
    mu, ym = x.mean(0), y.mean(0)
    xc = x - mu
    reg, xty = xc.T @ xc + ridge * len(x) * torch.eye(x.shape[1], dtype=torch.float64, device=x.device), xc.T @ (y - ym)
    with _one_thread():
        w = torch.linalg.solve(reg, xty)  # [D, H]
        u, sv, vh = torch.linalg.svd(w, full_matrices=False)
    r = min(rank, w.shape[1])
    a, b = (u[:, :r] * sv[:r]).T, vh[:r].T  # a: [r, D], b: [H, r]; b a = W^T at full rank
    p = {"a": a.float().cpu().contiguous(), "b": b.float().cpu().contiguous(),
         "bias": (ym - mu @ w).float().cpu().contiguous()}
    with torch.no_grad():
        sc = (x_va.cpu() @ p["a"].T) @ p["b"].T + p["bias"]
        p["val_loss"] = -_evaluate(sc, y_va.cpu(), k_eval)[0]
    return p


def _evaluate(scores: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[float, float]:
    """(recall, precision) of top-k of scores [T, N] against bool labels [T, N]."""
    hits = labels.gather(-1, scores.topk(k, dim=-1).indices).sum().item()
    return hits / max(1, labels.sum().item()), hits / (k * labels.shape[0])


def _curve(scores: torch.Tensor, weight: torch.Tensor) -> np.ndarray:
    """Captured fraction of `weight` [T, N] (labels or norms) by predicted top-k, k = 1..N."""
    order = scores.argsort(dim=-1, descending=True)
    got = weight.float().gather(-1, order).sum(0).cumsum(0)  # [N]
    return (got / got[-1].clamp_min(1e-12)).double().cpu().numpy()


def holdout_split(n_tokens: int, n_windows: int, window: int, s: PredictorSettings) -> int:
    """The first held-out token: the tail round(holdout * windows) whole windows (at least one)."""
    n_val_windows = max(1, round(n_windows * s.holdout))
    return min(n_tokens - 1, (n_windows - n_val_windows) * window)


def _layer_data(cal: Calibration, l: int, s: PredictorSettings, dev, layer):
    split = holdout_split(cal.n_tokens, cal.n_windows, cal.window, s)
    x = torch.from_numpy(np.array(cal.predictor_input(l, s.source, s.lookahead), dtype=np.float32)).to(dev)
    y_mlp = torch.from_numpy(cal.mlp_labels(l)).to(dev)
    contrib = mlp_contributions(layer, cal.source("mlp_in", l))  # [T, F] on the CPU
    norms = torch.from_numpy(np.array(cal.head_importance(l))).to(dev)
    return x, y_mlp, contrib, norms, split


def _check_model(cal: Calibration, model) -> None:
    from dejavu.compiler.calibrate import model_fingerprint

    if model is None:
        raise DejavuError("train_predictors needs the model the calibration was taken of "
                          "(the MLP predictors are fitted to its neurons' contributions)")
    if model_fingerprint(model, cal.manifest.get("model_id", "")) != cal.manifest.get("model_fingerprint"):
        raise DejavuError(f"the model given is not the one calibrated in {cal.folder}")


def train_layer(x: torch.Tensor, y_mlp: torch.Tensor, contrib: torch.Tensor, norms: torch.Tensor, split: int,
                ranks: tuple[int, int], report_k: tuple[int, int], s: PredictorSettings, gen: torch.Generator):
    """Train one layer's MLP and head predictors -> (mlp params, attn params, metrics, curves).

    x: [T, D] float32 predictor input; y_mlp: [T, F] bool; contrib: [T, F] float32 neuron
    contributions (`mlp_contributions`, the MLP targets); norms: [T, H] float32 head norms;
    tokens [:split] train, [split:] are held out. `gen` carries the shuffling state from layer
    to layer (the streamed build saves it with each finished layer)."""
    (mlp_rank, attn_rank), (mk, ak) = ranks, report_k
    Fd, H = y_mlp.shape[1], norms.shape[1]
    k_lab = max(1, math.ceil(s.attn_label_density * H))
    y_att = _head_labels(norms, k_lab)
    k_stop = max(1, round(s.stop_density * Fd))
    pm = _fit(x[:split], y_mlp[:split], x[split:], y_mlp[split:], mlp_rank, k_stop, s, gen,
              contrib[:split], contrib[split:])
    pa = _fit_heads(x[:split], norms[:split], x[split:], y_att[split:], attn_rank, k_lab, s.ridge)
    with torch.no_grad():
        xv = x[split:].cpu()
        sm = (xv @ pm["a"].T) @ pm["b"].T + pm["bias"]  # [Tv, F]
        sa = (xv @ pa["a"].T) @ pa["b"].T + pa["bias"]  # [Tv, H]
        yv, nv = y_mlp[split:].cpu(), norms[split:].cpu()
        m_rec, m_prec = _evaluate(sm, yv, mk)
        a_rec, _ = _evaluate(sa, _head_labels(nv, ak), ak)
        a_mass = nv.gather(-1, sa.topk(ak, -1).indices).sum().item() / nv.sum().item()
        c = slice(0, s.curve_tokens)
        # MLP: the share of the neurons' contribution kept (what the masked output loses), by
        # which the density allocator spreads K: at MLP 0.2 on opt-mini it beat the share of the
        # active neurons (+2.32% vs +2.86% perplexity, docs/predictors.md)
        curves = {"mlp": _curve(sm[c], contrib[split:][c].cpu()), "attn": _curve(sa[c], nv[c])}
    row = {"mlp_k": mk, "mlp_recall": m_rec, "mlp_precision": m_prec,
           "mlp_active_fraction": yv.float().mean().item(), "mlp_val_mass": -pm.pop("val_loss"),
           "attn_k": ak, "attn_recall": a_rec, "attn_precision": a_rec,
           "attn_norm_mass": a_mass, "attn_val_label_recall": -pa.pop("val_loss")}
    return pm, pa, row, curves


def train_predictors(cal: Calibration, settings: PredictorSettings | None = None, progress: bool = True,
                     mlp_k: list[int] | None = None, attn_k: list[int] | None = None, *,
                     model=None) -> Predictors:
    """Train MLP and head predictors for every layer from a complete calibration of `model`
    (an OPTForCausalLM: its MLP weights give the neurons' contributions, the MLP targets).

    Metrics (per layer: recall, precision at the K used, validation loss) are reported at
    `mlp_k` / `attn_k` when given, else at `settings.report_density`.
    """
    s = settings or PredictorSettings()
    if not cal.complete:
        raise DejavuError(f"calibration in {cal.folder} is incomplete ({cal.windows_done}/"
                          f"{cal.n_windows} windows); run it again to resume")
    _check_model(cal, model)
    cfg = cal.cfg
    L, Fd, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    dev = torch.device(s.device)
    _, attn_rank = default_ranks(cfg, s)
    ranks = mlp_ranks(cfg, s)
    mlp_k = mlp_k or [max(1, round(s.report_density * Fd))] * L
    attn_k = attn_k or [max(1, round(s.report_density * H))] * L
    gen = torch.Generator().manual_seed(s.seed)
    mlp, attn, per_layer = [], [], []
    curves = {"mlp": [], "attn": []}
    it = range(L)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="predictors", unit="layer")
    for l in it:
        x, y_mlp, contrib, norms, split = _layer_data(cal, l, s, dev, model.decoder.layers[l])
        pm, pa, row, curve = train_layer(x, y_mlp, contrib, norms, split, (ranks[l], attn_rank),
                                         (mlp_k[l], attn_k[l]), s, gen)
        per_layer.append({"layer": l, **row})
        mlp.append(pm)
        attn.append(pa)
        curves["mlp"].append(curve["mlp"])
        curves["attn"].append(curve["attn"])
    mean = lambda key: float(np.mean([m[key] for m in per_layer]))
    metrics = {"per_layer": per_layer, "mlp_recall_mean": mean("mlp_recall"),
               "mlp_precision_mean": mean("mlp_precision"), "attn_recall_mean": mean("attn_recall"),
               "cost": predictor_cost(cfg, ranks, attn_rank, s.dtype), "settings": asdict(s),
               "holdout_tokens": cal.n_tokens - holdout_split(cal.n_tokens, cal.n_windows, cal.window, s)}
    return Predictors(mlp, attn, s.predictor_input, metrics, curves)


def evaluate_predictors(cal: Calibration, predictors: Predictors, mlp_k: list[int],
                        attn_k: list[int]) -> dict:
    """Recall/precision at K of trained predictors on every token of another calibration
    (e.g. held-out text). Per layer and mean; head recall = overlap with the true top-K heads."""
    pi = predictors.predictor_input
    rows = []
    for l in range(cal.cfg.num_hidden_layers):
        x = torch.from_numpy(np.array(cal.predictor_input(l, pi["source"], pi["lookahead"]), dtype=np.float32))
        norms = torch.from_numpy(np.array(cal.head_importance(l)))
        with torch.no_grad():
            m_rec, m_prec = _evaluate(predictors.scores("mlp", l, x), torch.from_numpy(cal.mlp_labels(l)), mlp_k[l])
            a_rec, _ = _evaluate(predictors.scores("attn", l, x), _head_labels(norms, attn_k[l]), attn_k[l])
        rows.append({"layer": l, "mlp_k": mlp_k[l], "mlp_recall": m_rec, "mlp_precision": m_prec,
                     "attn_k": attn_k[l], "attn_recall": a_rec})
    mean = lambda key: float(np.mean([r[key] for r in rows]))
    return {"per_layer": rows, "mlp_recall_mean": mean("mlp_recall"), "mlp_precision_mean": mean("mlp_precision"),
            "attn_recall_mean": mean("attn_recall"), "tokens": cal.n_tokens}


def measure_lookahead(cal: Calibration, settings: PredictorSettings | None = None,
                      candidates: list[dict] | None = None, progress: bool = True, *, model=None) -> list[dict]:
    """Train predictors on each candidate input; mean and per-layer recall at the report K."""
    base = settings or PredictorSettings()
    out = []
    for c in candidates or CANDIDATE_INPUTS:
        s = PredictorSettings(**{**asdict(base), **c})
        m = train_predictors(cal, s, progress=progress, model=model).metrics
        out.append({**c, "mlp_recall_mean": m["mlp_recall_mean"], "attn_recall_mean": m["attn_recall_mean"],
                    "mlp_recall": [r["mlp_recall"] for r in m["per_layer"]],
                    "attn_recall": [r["attn_recall"] for r in m["per_layer"]],
                    "mlp_precision_mean": m["mlp_precision_mean"]})
    return out

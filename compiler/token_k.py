"""A per-token MLP K from the predicted share, capped (docs/predictors.md, "MLP-only budgets").

The MLP predictors are trained with a listwise loss, so softmax(scores) over a layer's F
neurons is each token's predicted share of the neurons' contribution. Two forms, each with one
threshold per layer, k in [1, k_max_l]:
  mass   the smallest k whose predicted top-k share reaches tau_l (a sort and a cumulative sum);
  share  the rows whose own predicted share is >= theta_l (no sort: a softmax and a compare;
         plugins.share_keep). The form engines carry (`dejavu-compile --token-k share`).
Tokens whose contribution is spread keep more rows, concentrated ones fewer. k_max is static
(the shapes of a CUDA graph); the threshold is fitted so the mean k over held-out tokens equals
the layer's budget K_l. `masking.masked_sparsity(token_k=)` is the masked-dense reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


FORMS = ("mass", "share")
CAP = 2.0  # k_max = CAP * K_l: cap 3 measured the same as 2 (docs/predictors.md, "MLP-only budgets")


@dataclass(frozen=True)
class TokenK:
    """Per layer [L]: k_max (the static cap), threshold (tau of the form "mass", theta of "share")
    and k_mean (the budget K the threshold was fitted to)."""

    k_max: tuple[int, ...]
    threshold: tuple[float, ...]
    k_mean: tuple[int, ...]
    form: str = "mass"

    def mask(self, l: int, scores: torch.Tensor) -> torch.Tensor:
        """0/1 mask [..., F] (scores' dtype) of the rows layer l keeps for MLP scores [..., F]."""
        if self.form == "mass":
            return token_mask(scores, self.threshold[l], self.k_max[l])
        return share_mask(scores, self.threshold[l], self.k_max[l])


def cap_rows(k: int, n: int, cap: float = CAP) -> int:
    """k_max of a layer with budget K = k of n rows: cap * k, at least k, at most n."""
    return min(n, max(k, int(cap * k)))


def token_counts(scores: torch.Tensor, tau: float, k_max: int) -> torch.Tensor:
    """k per token [...] for MLP scores [..., F]: the smallest k whose share of softmax(scores)
    in the top-k reaches tau, clamped to [1, k_max]."""
    p = torch.softmax(scores.float(), -1).sort(-1, descending=True).values  # [..., F]
    return ((p.cumsum(-1) < tau).sum(-1) + 1).clamp(1, k_max)


def token_mask(scores: torch.Tensor, tau: float, k_max: int) -> torch.Tensor:
    """0/1 mask [..., F] (scores' dtype): each token's top-k rows by score, k = token_counts."""
    k = token_counts(scores, tau, k_max)  # [...]
    idx = scores.topk(k_max, dim=-1).indices  # [..., k_max], best first
    keep = (torch.arange(k_max, device=scores.device) < k[..., None]).to(scores.dtype)
    return torch.zeros_like(scores).scatter_(-1, idx, keep)


def share_counts(scores: torch.Tensor, theta: float, k_max: int) -> torch.Tensor:
    """k per token [...] for MLP scores [..., F]: the rows whose share of softmax(scores) is >= theta,
    clamped to [1, k_max]."""
    return (torch.softmax(scores.float(), -1) >= theta).sum(-1).clamp(1, k_max)


def share_mask(scores: torch.Tensor, theta: float, k_max: int) -> torch.Tensor:
    """0/1 mask [..., F] (scores' dtype): the top-k_max rows the engine's rule keeps (plugins.share_keep)."""
    from dejavu.plugins import share_keep

    idx = scores.topk(k_max, dim=-1).indices  # [..., k_max]
    return torch.zeros_like(scores).scatter_(-1, idx, share_keep(scores, idx, theta).to(scores.dtype))


def fit_theta(scores: torch.Tensor, k_mean: int, k_max: int, steps: int = 40) -> float:
    """The smallest theta whose mean share_counts over the tokens of scores [T, F] is <= k_mean (the
    count falls as theta grows; bisection on log theta in [-40, 0])."""
    lo, hi = -40.0, 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if share_counts(scores, math.exp(mid), k_max).float().mean().item() <= k_mean else (mid, hi)
    return math.exp(hi)


def fit_tau(scores: torch.Tensor, k_mean: int, k_max: int, steps: int = 40) -> float:
    """The largest tau whose mean count over the tokens of scores [T, F] is <= k_mean (the
    count grows with tau; bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if token_counts(scores, mid, k_max).float().mean().item() <= k_mean else (lo, mid)
    return lo


def fit_token_k(scores_of, mlp_k: list[int], cap: float = CAP, n: int | None = None, form: str = "mass") -> TokenK:
    """TokenK for per-layer budgets mlp_k [L]: k_max = min(F, cap * K_l), the threshold fitted on
    the held-out scores `scores_of(l)` -> [T, F] of each layer (n: F; default from the scores).
    A dense layer (K_l = F) records threshold 1.0 (mass) / 0.0 (share): every row."""
    k_max, ths = [], []
    for l, k in enumerate(mlp_k):
        s = scores_of(l)
        f = n or s.shape[-1]
        k_max.append(cap_rows(k, f, cap))
        if k >= f:
            ths.append(1.0 if form == "mass" else 0.0)
        else:
            ths.append(fit_tau(s, k, k_max[-1]) if form == "mass" else fit_theta(s, k, k_max[-1]))
    return TokenK(tuple(k_max), tuple(ths), tuple(int(k) for k in mlp_k), form)


# ------------------------------------------------------------------------------ the build's stage

def _engine_pass(parts, predictors, ids, mlp_k, attn_k, tk: TokenK | None, cap: float):
    """The combined engine (per-token MLP K, predicted heads) over held-out ids [B, S], layer by layer:
    (mean NLL, TokenK, mean kept rows [L]). tk None: each sparse layer's theta is fitted on its own
    inputs as this engine feeds them (earlier layers already at their per-token K)."""
    from dejavu.compiler.allocate import _nll, _order, _Sources
    from dejavu.compiler.masking import fixed_selection

    layers, embed, head = parts()
    x = embed(ids)
    srcs = _Sources(predictors.predictor_input)
    k_max, ths, rows = [], [], []
    for l, layer in enumerate(layers):
        n_f, n_h = layer.fc1.out_features, layer.self_attn.n_heads
        srcs.enter(l, x)
        sel = {}
        k_max.append(cap_rows(mlp_k[l], n_f, cap) if tk is None else tk.k_max[l])
        ths.append(0.0 if tk is None else tk.threshold[l])
        rows.append(float(n_f))
        if mlp_k[l] < n_f or attn_k[l] < n_h:
            xp = srcs.predictor_input(l)
            if mlp_k[l] < n_f:
                s = predictors.scores("mlp", l, xp.float())  # [B, S, F]
                if tk is None:
                    ths[l] = fit_theta(s.flatten(0, -2), mlp_k[l], k_max[l])
                sel["mlp_mask"] = share_mask(s, ths[l], k_max[l])
                rows[l] = sel["mlp_mask"].sum(-1).mean().item()
            if attn_k[l] < n_h:
                sel["attn_idx"] = _order(predictors, "attn", l, xp, attn_k[l])
        with fixed_selection(layer, **sel):
            x = srcs.run(l, layer, x)
    return _nll(head, x, ids), TokenK(tuple(k_max), tuple(ths), tuple(mlp_k), "share"), rows


def resolve_token_k(parts, cfg, config, predictors, tokenizer, mlp_k, attn_k, allocation: dict) -> tuple[TokenK, dict]:
    """The build's per-token K ("share"): theta_l fitted on the first held-out set (the one the
    sensitivity reads), the engine measured on the second (the recorded figure). Returns the TokenK
    and the header's `token_k` record, whose bytes count each layer's held-out mean kept rows."""
    from dejavu.compiler.allocate import engine_costs, heldout_source, heldout_windows

    corpus, skip = heldout_source(config)
    window, n_held = min(config.calib_window, cfg.max_position_embeddings), config.heldout_tokens
    fit_ids, fit_source = heldout_windows(tokenizer, corpus, skip, n_held, window, cfg.bos_token_id)
    ids, source = heldout_windows(tokenizer, corpus, skip + n_held, n_held, window, cfg.bos_token_id)
    with torch.no_grad():
        _, tk, _ = _engine_pass(parts, predictors, fit_ids, mlp_k, attn_k, None, CAP)
        nll, _, rows = _engine_pass(parts, predictors, ids, mlp_k, attn_k, tk, CAP)
    costs = engine_costs(cfg, config, predictors)
    # a layer reads its predictor wherever K_l < F, and fc1 / fc2 rows for the rows it keeps
    engine = round(costs.fixed + sum(r * costs.neuron + (costs.pred_mlp if k < cfg.ffn_dim else 0) + costs.kind("attn", a)
                                     for r, k, a in zip(rows, mlp_k, attn_k)))
    dense_ppl = (allocation.get("heldout") or {}).get("dense_ppl")
    ppl = math.exp(nll)
    return tk, {
        "form": tk.form, "threshold": list(tk.threshold), "k_max": list(tk.k_max), "k_mean": list(tk.k_mean),
        "fitted_on": fit_source,
        "heldout": {"source": source, "mean_rows": [round(r, 3) for r in rows], "engine_ppl": round(ppl, 4),
                    **({"increase_pct": round(100 * (ppl / dense_ppl - 1), 4)} if dense_ppl else {})},
        "bytes_per_token": {"engine": engine, "dense": costs.dense, "fraction": round(engine / costs.dense, 6),
                            "rows": "each sparse layer's held-out mean kept MLP rows"},
    }

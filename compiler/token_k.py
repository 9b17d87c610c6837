"""A per-token MLP K from the predicted share, capped (docs/predictors.md, "MLP-only budgets").

The MLP predictors are trained with a listwise loss, so softmax(scores) over a layer's F
neurons is each token's predicted share of the neurons' contribution. Two forms, each with one
threshold per layer, k in [1, k_max_l]:
  mass   the smallest k whose predicted top-k share reaches tau_l (a sort and a cumulative sum);
  share  the rows whose own predicted share is >= theta_l (no sort: a softmax and a compare;
         plugins.share_keep). The form engines carry (`dejavu-compile --token-k share`).
Tokens whose contribution is spread keep more rows, concentrated ones fewer. k_max is static
(the shapes of a CUDA graph); the threshold is fitted on held-out tokens to the layer's budget, in
one of two measures (`BuildConfig.token_k_rows`):
  selected  the mean kept rows equal K_l (fc1 and fc2 are counted as reading every kept row);
  read      the mean rows read equal 2 K_l: fc1's kept rows + fc2's kept rows whose h_j != 0 (fc2 runs
            over h's nonzero rows, compacted by compact_rows), a W1 row and a W2 row counted alike (2 F:
            the dense layer). The default (BuildConfig.token_k_rows).
`masking.masked_sparsity(token_k=)` is the masked-dense reference (the same output for both: fc2's
skipped rows have h_j = 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


FORMS = ("mass", "share")
# k_max = CAP * K_l: cap 3 measured the same as 2 (docs/predictors.md, "MLP-only budgets"); fitted to rows
# read (1.4-1.8 K_l kept rows on average), cap 4 measured the same as 2 ("Per-token K fitted to rows read")
CAP = 2.0


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


def smallest_theta(count, target: float, steps: int = 40) -> float:
    """The smallest theta with count(theta) <= target, for a count that falls as theta grows: bisection
    on log theta in [-40, 0]; the result is within a factor exp(40 / 2**steps) of that theta (e^-40:
    every row kept, where no theta reaches the target)."""
    lo, hi = -40.0, 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if count(math.exp(mid)) <= target else (mid, hi)
    return math.exp(hi)


def fit_theta(scores: torch.Tensor, k_mean: int, k_max: int, steps: int = 40) -> float:
    """The smallest theta whose mean share_counts over the tokens of scores [T, F] is <= k_mean."""
    return smallest_theta(lambda t: share_counts(scores, t, k_max).float().mean().item(), k_mean, steps)


def read_rows(mask: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, nonzero) per token [...]: the rows of a 0/1 mask [..., F] (share_mask), and those of them
    whose activation h [..., F] (relu(fc1), dense) is not 0: fc1 reads the first, fc2 the second."""
    m = mask.bool()
    return m.sum(-1), (m & (h != 0)).sum(-1)


def fit_theta_read(scores: torch.Tensor, h: torch.Tensor, rows: float, k_max: int, steps: int = 40) -> float:
    """The smallest theta whose mean rows read (read_rows: kept + nonzero kept) over the tokens of
    scores, h [T, F] is <= rows (2 K_l)."""
    from dejavu.plugins import share_keep

    idx = scores.topk(k_max, dim=-1).indices  # [T, k_max], the selection does not depend on theta
    nz = h.gather(-1, idx) != 0

    def count(theta):
        keep = share_keep(scores, idx, theta)
        return (keep.sum() + (keep & nz).sum()).item() / keep.shape[0]

    return smallest_theta(count, rows, steps)


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

def _engine_pass(parts, predictors, ids, mlp_k, attn_k, tk: TokenK | None, cap: float, rows: str = "selected"):
    """The combined engine (per-token MLP K, predicted heads) over held-out ids [B, S], layer by layer:
    (mean NLL, TokenK, mean kept rows [L], mean kept rows with h != 0 [L]: what fc2 reads). tk None:
    each sparse layer's theta is fitted on its own inputs as this engine feeds them (earlier layers
    already at their per-token K), to `rows` (module docstring)."""
    from dejavu.compiler.allocate import _nll, _order, _Sources
    from dejavu.compiler.masking import fixed_selection

    layers, embed, head = parts()
    x = embed(ids)
    srcs = _Sources(predictors.predictor_input)
    k_max, ths, kept, nonzero = [], [], [], []
    for l, layer in enumerate(layers):
        n_f, n_h = layer.fc1.out_features, layer.self_attn.n_heads
        srcs.enter(l, x)
        sel, hooks = {}, []
        k_max.append(cap_rows(mlp_k[l], n_f, cap) if tk is None else tk.k_max[l])
        ths.append(0.0 if tk is None else tk.threshold[l])
        kept.append(float(n_f)), nonzero.append(float(n_f))
        xp = srcs.predictor_input(l) if mlp_k[l] < n_f or attn_k[l] < n_h else None
        if mlp_k[l] < n_f:
            s = predictors.scores("mlp", l, xp.float())  # [B, S, F]

            def mlp_hook(m, a, h, l=l, s=s):  # h = relu(fc1(x)) [B, S, F], dense
                if tk is None:
                    ths[l] = fit_theta(s.flatten(0, -2), mlp_k[l], k_max[l]) if rows == "selected" else \
                        fit_theta_read(s.flatten(0, -2), h.flatten(0, -2), 2 * mlp_k[l], k_max[l])
                keep = share_mask(s, ths[l], k_max[l]).to(h.dtype)
                r1, r2 = read_rows(keep, h)
                kept[l], nonzero[l] = r1.float().mean().item(), r2.float().mean().item()
                return h * keep

            hooks.append(layer.activation_fn.register_forward_hook(mlp_hook))
        if attn_k[l] < n_h:
            sel["attn_idx"] = _order(predictors, "attn", l, xp, attn_k[l])
        try:
            with fixed_selection(layer, **sel):
                x = srcs.run(l, layer, x)
        finally:
            for hd in hooks:
                hd.remove()
    return _nll(head, x, ids), TokenK(tuple(k_max), tuple(ths), tuple(mlp_k), "share"), kept, nonzero


# what bytes_per_token counts, by BuildConfig.token_k_rows (a header without `counts` counts "selected")
ROWS_COUNTED = {"selected": "each sparse layer's held-out mean kept MLP rows, a W1 row and a W2 column each",
                "read": "each sparse layer's held-out mean MLP rows read: fc1's kept rows (W1 rows) + fc2's kept "
                        "rows with h != 0 (W2 columns)"}


def resolve_token_k(parts, cfg, config, predictors, tokenizer, mlp_k, attn_k, allocation: dict) -> tuple[TokenK, dict]:
    """The build's per-token K ("share"): theta_l fitted on the first held-out set (the one the
    sensitivity reads) to `config.token_k_rows`, the engine measured on the second (the recorded
    figure). Returns the TokenK and the header's `token_k` record, whose bytes count the rows of
    that measure (ROWS_COUNTED)."""
    from dejavu.compiler.allocate import engine_costs, heldout_source, heldout_windows

    rows = config.token_k_rows
    corpus, skip = heldout_source(config)
    window, n_held = min(config.calib_window, cfg.max_position_embeddings), config.heldout_tokens
    fit_ids, fit_source = heldout_windows(tokenizer, corpus, skip, n_held, window, cfg.bos_token_id)
    ids, source = heldout_windows(tokenizer, corpus, skip + n_held, n_held, window, cfg.bos_token_id)
    with torch.no_grad():
        _, tk, _, _ = _engine_pass(parts, predictors, fit_ids, mlp_k, attn_k, None, CAP, rows)
        nll, _, kept, nonzero = _engine_pass(parts, predictors, ids, mlp_k, attn_k, tk, CAP)
    costs = engine_costs(cfg, config, predictors)
    # a layer reads its predictor wherever K_l < F; rows "selected": a W1 row and a W2 column for each
    # kept row; "read": a W1 row (with its bias) for each kept row, a W2 column for each nonzero one
    col = costs.neuron * cfg.hidden_size // (2 * cfg.hidden_size + (1 if cfg.enable_bias else 0))
    mlp = (lambda r1, r2: r1 * costs.neuron) if rows == "selected" else \
        (lambda r1, r2: r1 * (costs.neuron - col) + r2 * col)
    engine = round(costs.fixed + sum(mlp(r1, r2) + (costs.pred_mlp if k < cfg.ffn_dim else 0) + costs.kind("attn", a)
                                     for r1, r2, k, a in zip(kept, nonzero, mlp_k, attn_k)))
    dense_ppl = (allocation.get("heldout") or {}).get("dense_ppl")
    ppl = math.exp(nll)
    return tk, {
        "form": tk.form, "rows": rows, "threshold": list(tk.threshold), "k_max": list(tk.k_max),
        "k_mean": list(tk.k_mean), "fitted_on": fit_source,
        "heldout": {"source": source, "mean_rows": [round(r, 3) for r in kept],
                    "mean_rows_fc2": [round(r, 3) for r in nonzero], "engine_ppl": round(ppl, 4),
                    **({"increase_pct": round(100 * (ppl / dense_ppl - 1), 4)} if dense_ppl else {})},
        "bytes_per_token": {"engine": engine, "dense": costs.dense, "fraction": round(engine / costs.dense, 6),
                            "counts": rows, "rows": ROWS_COUNTED[rows]},
    }

"""Byte budget → one TEAL skip per projection input, by measured end-to-end loss (Llama family).

The OPT side's design (compiler/allocate.py) applied to TEAL thresholds. On held-out windows
(never the evaluation text), `measure_sensitivity` measures the model's loss increase when every
layer's input of one kind (attn_in, o_in, mlp_in, down_in) skips the fraction s of its
calibration activations, s in LEVELS, the other kinds dense. `allocate_skips` spends the byte
budget on the kinds cheapest in loss per byte skipped (greedy on each curve's lower convex hull,
the last step filled partially, so the budget is met exactly and never exceeded). The separate
curves miss how the kinds interact, so `refine_skips` then moves bytes between pairs of kinds,
scoring the joint skips on the same windows (BuildConfig.refine_evals evaluations). The combined
engine is then measured on a second, disjoint set of held-out windows: the refinement is kept only
where it beats its start there too, and the result only where it beats the uniform level (every
input at the same skip) at the same bytes. The sensitivity table does not depend on the budget: it
is cached across builds under $DEJAVU_CACHE/sensitivity (`_sensitivity_cached`).

One skip per kind, not per (layer, kind): on SmolLM2-135M a single layer's input at 40% moves
the held-out loss by 1e-3 to 1e-2 nats on 1,022 tokens, the size of the noise of that many
tokens (most single-layer increases measured negative), while a kind across all layers moves it
by 0.01 to 1 nats (docs/llama.md).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dejavu.compiler.gated_sparsity import KEYS, Calibration, GatedSparsity, gated_sparsity, projection_bytes
from dejavu.errors import DejavuError

LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # skips measured per kind
SEARCH_STEPS = 10  # bisection steps of --max-ppl-increase over the block skip
MAX_SKIP = 0.95  # the largest skip a kind may reach in the joint refinement
SENSITIVITY_VERSION = 1  # of the cached sensitivity tables (_sensitivity_cached)


def input_bytes(cfg) -> dict[str, int]:
    """Weight elements per layer read through each input kind: {key in KEYS: n}."""
    b = projection_bytes(cfg)
    return {"attn_in": b["attn_in"], "o_in": b["o_in"], "mlp_in": b["gate"] + b["up"], "down_in": b["down"]}


def kind_thresholds(calib: Calibration, skips: dict[str, float]) -> dict[str, list[float]]:
    """Per-layer thresholds {key: [L]} with every layer's input `key` at the skip skips[key]."""
    L = calib.tables[KEYS[0]].shape[0]
    return {k: [calib.threshold(k, l, skips[k]) if skips[k] > 0 else 0.0 for l in range(L)] for k in KEYS}


@torch.no_grad()
def heldout_nll(model, ids: torch.Tensor, thresholds: dict | None = None) -> float:
    """Mean next-token NLL of windows ids [B, S] (one window at a time), with TEAL thresholds
    {key: [L]} applied by gated_sparsity's hooks, or dense (None)."""
    total, count = 0.0, 0
    sparse = thresholds is not None and any(t > 0 for ts in thresholds.values() for t in ts)
    # given thresholds, GatedSparsity's skip only switches the hooks on
    with (gated_sparsity(model, thresholds, GatedSparsity(), count=False) if sparse else contextlib.nullcontext()):
        for w in ids:
            logits = model(w[None])[0, :-1]  # [S-1, V]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            total += float(F.cross_entropy(logits, w[1:].to(logits.device), reduction="sum"))
            count += w.numel() - 1
    return total / count


@dataclass
class Sensitivity:
    """Held-out loss increase (nats/token) of each input kind at each of `levels`: {key: [len(levels)]}."""

    levels: tuple
    delta: dict
    dense_nll: float

    def to_dict(self) -> dict:
        return {"levels": list(self.levels), "delta": {k: [round(v, 6) for v in d] for k, d in self.delta.items()},
                "dense_nll": round(self.dense_nll, 6)}


def measure_sensitivity(model, calib: Calibration, ids: torch.Tensor, levels=LEVELS, progress=None) -> Sensitivity:
    """For every kind and level: the held-out NLL with that kind's inputs at the level in every
    layer, the other kinds dense, minus the dense NLL (len(KEYS) * len(levels) + 1 passes)."""
    dense = heldout_nll(model, ids)
    delta = {k: [] for k in KEYS}
    for k in KEYS:
        for s in levels:
            skips = {kk: (s if kk == k else 0.0) for kk in KEYS}
            delta[k].append(heldout_nll(model, ids, kind_thresholds(calib, skips)) - dense)
            if progress is not None:
                progress(k, s, delta[k][-1])
    return Sensitivity(tuple(levels), delta, dense)


def _sensitivity_cached(model, calib: Calibration, ids: torch.Tensor, progress=None) -> Sensitivity:
    """measure_sensitivity, cached as JSON under $DEJAVU_CACHE/sensitivity by (model, calibration
    tables, held-out tokens, levels): it does not depend on the budget, so builds of one model at
    several budgets measure it once. Stored at full precision (the allocation reads it as measured)."""
    import hashlib
    import json

    from dejavu.compiler.allocate import cached_sensitivity
    from dejavu.compiler.calibrate import model_fingerprint

    h = hashlib.sha256(json.dumps({"v": SENSITIVITY_VERSION, "family": "llama", "levels": LEVELS,
                                   "model": model_fingerprint(model), "device": ids.device.type}).encode())
    for k in KEYS:
        h.update(calib.tables[k].numpy().tobytes())
    h.update(ids.cpu().numpy().tobytes())
    return cached_sensitivity(f"llama-{h.hexdigest()[:24]}",
                              lambda t: {"levels": list(t.levels), "delta": t.delta, "dense_nll": t.dense_nll},
                              lambda d: Sensitivity(tuple(d["levels"]), d["delta"], d["dense_nll"]),
                              lambda: measure_sensitivity(model, calib, ids, progress=progress))


def _hull(xs: list[float], ys: list[float]) -> list[tuple[float, float]]:
    """Lower convex hull of the points (xs ascending)."""
    pts: list[tuple[float, float]] = []
    for p in zip(xs, ys):
        while len(pts) >= 2 and ((pts[-1][1] - pts[-2][1]) * (p[0] - pts[-2][0])
                                 >= (p[1] - pts[-2][1]) * (pts[-1][0] - pts[-2][0])):
            pts.pop()
        pts.append(p)
    return pts


def allocate_skips(sens: Sensitivity, weights: dict[str, int], skip: float) -> dict[str, float]:
    """One skip per kind whose bytes, sum_k weights[k] * s_k, equal skip * sum(weights) (the block
    budget), chosen cheapest loss increase per byte first. Measured increases are made
    non-negative and non-decreasing in the skip first (noise); between levels the loss is linear.
    A budget past the measured levels (skip > max(levels)) cannot be priced: every kind gets `skip`."""
    if not 0.0 <= skip < 1.0:
        raise DejavuError(f"skip must be in [0, 1), got {skip}")
    if skip > max(sens.levels):
        return {k: skip for k in KEYS}
    xs = [0.0, *sens.levels]
    segments = []  # (loss per byte, kind, from, to)
    for k in KEYS:
        ys, run = [0.0], 0.0
        for d in sens.delta[k]:
            run = max(run, d)
            ys.append(run)
        h = _hull(xs, ys)
        segments += [((y1 - y0) / ((x1 - x0) * weights[k]), i, k, x0, x1)
                     for i, ((x0, y0), (x1, y1)) in enumerate(zip(h, h[1:]))]
    segments.sort()  # ties: the earlier segment of a kind first (its hull order)
    want, got = skip * sum(weights.values()), 0.0
    skips = {k: 0.0 for k in KEYS}
    for _, _, k, x0, x1 in segments:
        if got >= want:
            break
        step = min(x1 - x0, (want - got) / weights[k])
        skips[k] = x0 + step
        got += step * weights[k]
    return skips


def refine_skips(nll, skips: dict[str, float], weights: dict[str, int], evals: int, step: float = 0.05,
                 progress=None) -> tuple[dict[str, float], float, float, int, int]:
    """Joint coordinate search from `skips`: move the bytes of `step` skip of the smaller of two
    kinds from one to the other (bytes unchanged), keep a move when nll(joint skips) drops, repeat
    a kept move, halve the step after a pass without one; at most `evals` candidates, the start's
    included. Returns (skips, nll at the start, nll at the end, candidates, calls of nll).

    A candidate met before (the reverse of a kept move, a move retried from an unchanged best) is
    not measured again: its nll was at least the best's when measured and the best only drops, so
    it is rejected as it would be on a second measurement. It still counts toward `evals`, so the
    search, and the skips it returns, are the same as when every candidate was measured."""
    seen: dict[tuple, float] = {}

    def measure(s):
        key = _key(s)
        if key not in seen:
            seen[key] = nll(s)
        return seen[key]

    best = dict(skips)
    start = best_nll = measure(best)
    used = 1
    while used < evals and step > 1e-3:
        kept = False
        for a in KEYS:
            for b in KEYS:
                while a != b and used < evals:
                    cand = dict(best)
                    moved = step * min(weights[a], weights[b])
                    cand[a] += moved / weights[a]
                    cand[b] -= moved / weights[b]
                    if cand[a] > MAX_SKIP or cand[b] < 0.0:
                        break
                    again = _key(cand) in seen
                    got = measure(cand)
                    used += 1
                    if progress is not None:
                        progress(cand, got, got < best_nll, again)
                    if got >= best_nll:
                        break
                    best, best_nll, kept = cand, got, True
        if not kept:
            step /= 2
    return best, start, best_nll, used, len(seen)


def _key(skips: dict[str, float]) -> tuple:
    """A skips vector as a memo key. A move changes a skip by step * (ratio of two kinds' bytes),
    above 1e-5 for any model; the float rounding of sums of moves is ~1e-16: 9 digits tell the
    candidates apart and join the same candidate reached by different sums."""
    return tuple(round(skips[k], 9) for k in KEYS)


def block_skip(skips: dict[str, float], weights: dict[str, int]) -> float:
    """The fraction of the block projection bytes skipped by per-kind skips."""
    return sum(weights[k] * skips[k] for k in KEYS) / sum(weights.values())


def _rounded(skips: dict[str, float], digits: int = 6) -> dict[str, float]:
    return {k: round(v, digits) for k, v in skips.items()}


def _pct(nll: float, dense: float) -> float:
    return round(100.0 * (math.exp(nll - dense) - 1.0), 4)


def heldout_in_calib(config) -> bool:
    """Whether the build's held-out text is its calibration corpus (then held-out windows start past the
    calibration stream, and the distillation's training text past both held-out sets)."""
    return config.heldout is not None and config.heldout == config.calib


def heldout_set(tokenizer, config, calib_tokens: int, max_len: int, which: int) -> tuple[torch.Tensor, str]:
    """The build's held-out windows ([B, S], source): set 0 (sensitivity, refinement) or set 1 (every
    combined engine's score), config.heldout_tokens each, of config.heldout, past the first
    `calib_tokens` where that is the calibration corpus (never scored on text it was fitted to)."""
    from dejavu.compiler.allocate import heldout_windows

    corpus, n = config.heldout, config.heldout_tokens
    first = calib_tokens if heldout_in_calib(config) else 0  # past the calibration stream
    return heldout_windows(tokenizer.tokenizer, corpus, first + which * n, n, min(config.calib_window, max_len),
                           tokenizer.bos_id)


def resolve_skips(model, calib: Calibration, tokenizer, config, skip: float | None, calib_tokens: int,
                  progress=None) -> tuple[dict[str, float], dict]:
    """The build's allocation: ({key: skip}, report for the header's build_config.heldout).

    skip: the block skip of --density (None: --max-ppl-increase searches it). config: a
    BuildConfig (allocation, max_ppl_increase, heldout, heldout_tokens, refine_evals, calib, calib_window).
    Sensitivity and the joint refinement (refine_evals) use the first `heldout_tokens` held-out
    tokens, every combined engine is scored on the next ones (a choice is never scored on the
    windows it was fitted to). progress: called with one line per measurement, or None."""
    cfg, weights = model.config, input_bytes(model.config)
    device = next(model.parameters()).device
    sens_ids, sens_source = heldout_set(tokenizer, config, calib_tokens, cfg.max_position_embeddings, 0)
    ids, source = heldout_set(tokenizer, config, calib_tokens, cfg.max_position_embeddings, 1)
    ids = ids.to(device)
    uniform = lambda s: {k: s for k in KEYS}  # noqa: E731
    sens = None
    if config.allocation == "sensitivity" and (skip is None or skip > 0):
        sens = _sensitivity_cached(model, calib, sens_ids.to(device), progress=(
            (lambda k, s, d: progress(f"sensitivity {k} {s:g}: {d:+.5f} nats")) if progress is not None else None))
        source += f"; sensitivity on {sens_source}"
    alloc = (lambda s: allocate_skips(sens, weights, s)) if sens is not None else uniform
    dense = heldout_nll(model, ids)
    scored = {_key(uniform(0.0)): dense}  # the second set's nll by skips: the checks revisit the search's

    def nll(skips):
        key = _key(skips)
        if key not in scored:
            scored[key] = heldout_nll(model, ids, kind_thresholds(calib, skips))
        return scored[key]

    if skip is None:  # --max-ppl-increase: the largest block skip within P (bisection)
        limit = dense + math.log1p(config.max_ppl_increase / 100.0)
        lo, hi = 0.0, max(LEVELS)
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if nll(alloc(mid)) <= limit else (lo, mid)
        skip = lo
    skips = alloc(skip)
    refined = None
    if sens is not None and skip > 0 and config.refine_evals > 1:  # the kinds together, on the sensitivity windows
        t0, start, sens_ids = time.perf_counter(), skips, sens_ids.to(device)
        say = (lambda s, v, kept, again: progress(f"refine {_rounded(s, 4)}: {_pct(v, sens.dense_nll):+.2f}%"
                                                  + (" kept" if kept else "") + (" (measured before)" if again else ""))
               ) if progress is not None else None
        skips, first, last, used, calls = refine_skips(
            lambda s: heldout_nll(model, sens_ids, kind_thresholds(calib, s)), start, weights, config.refine_evals,
            progress=say)
        refined = {"start": _rounded(start), "evals": used, "measured": calls, "start_pct": _pct(first, sens.dense_nll),
                   "refined_pct": _pct(last, sens.dense_nll), "seconds": round(time.perf_counter() - t0, 1)}
    got = nll(skips)
    if refined is not None and skips != start:  # kept only where the second set agrees
        was = nll(start)
        refined.update(check_start_pct=_pct(was, dense), check_refined_pct=_pct(got, dense),
                       kept=got <= was)
        if was < got:
            skips, got = start, was
    check = None
    if sens is not None and skip > 0:  # the measured allocation against the uniform level at the same bytes
        flat = nll(uniform(skip))
        check = {"sensitivity_pct": _pct(got, dense), "uniform_pct": _pct(flat, dense),
                 "kept": "sensitivity" if got <= flat else "uniform"}
        if flat < got:
            skips, got = uniform(skip), flat
    report = {"source": source, "windows": int(ids.shape[0]), "tokens": int(ids.shape[0] * (ids.shape[1] - 1)),
              "dense_ppl": round(math.exp(dense), 4), "engine_ppl": round(math.exp(got), 4),
              "increase_pct": _pct(got, dense), "skips": _rounded(skips),
              **({"allocation_check": check} if check else {}),
              **({"refinement": refined} if refined else {}),
              **({"sensitivity": sens.to_dict()} if sens is not None else {})}
    return skips, report

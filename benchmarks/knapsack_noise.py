"""Does the knapsack lose at byte density 0.6-0.8 because of noise in its sensitivity table?

    python benchmarks/knapsack_noise.py --predictors preds --densities 0.6,0.7,0.8 --out knapsack_noise.json

With the saved default predictors (`byte_budget.py --predictors`), the sensitivity table is
measured as the build measures it (each candidate K of each (layer, kind) applied alone, on
held-out WikiText-2 validation windows) but keeping every token's loss increase, so each entry
has a standard error (paired: the same tokens with and without the cut). Allocations at each
byte density, all scored by masked dense (fp32, the predicted selections) on WikiText-2 test
(first --ppl-tokens) and on the build's check windows (validation tokens [2048, 4096)):
  knapsack             the shipped table: mean increase over the first 2,048 tokens
  knapsack_ucb{z}      mean + z standard errors (a cut that measures within noise of zero costs
                       its noise): the knapsack stops taking many "free" cuts at once
  knapsack_{n}tok      the mean over n sensitivity tokens (tokens [0, 2048) and from 4096 on),
                       and with z standard errors (knapsack_{n}tok_ucb{z})
  uniform, heads_dense the two simple allocations the build's check compares against
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))


def token_nll(head, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token next-token NLL [B * (S-1)] (float64); x: [B, S, D]."""
    out = []
    for b in range(x.shape[0]):
        logp = F.log_softmax(head(x[b:b + 1, :-1]).float(), dim=-1)[0]
        out.append(-logp.gather(-1, ids[b, 1:, None])[:, 0].double())
    return torch.cat(out)


@torch.no_grad()
def sensitivity_per_token(layers, embed, head, ids, predictors, ks: dict) -> dict:
    """{(l, kind, k): per-token increase [T]} and "dense": per-token NLL; as measure_sensitivity."""
    from dejavu.compiler.allocate import sensitivity_states

    x, branches, _ = sensitivity_states(layers, embed, ids, predictors, ks)
    dense = token_nll(head, x, ids)
    return {"dense": dense, **{key: token_nll(head, v, ids) - dense for key, v in branches.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-mini")
    p.add_argument("--predictors", required=True, help="PATH (PATH.safetensors + PATH.json), byte_budget.py's")
    p.add_argument("--densities", default="0.6,0.7,0.8")
    p.add_argument("--ucb", default="1,2", help="z values")
    p.add_argument("--more-tokens", type=int, default=8192, help="0: skip the larger table")
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default="", help="comma list: score only these allocations")
    p.add_argument("--out", default="knapsack_noise.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from byte_budget import _load_predictors
    from dejavu.compiler.allocate import (KINDS, ByteCosts, Sensitivity, allocate_heads_dense, allocate_knapsack,
                                          allocate_uniform, candidate_ks, heldout_nll, heldout_windows, model_parts)
    from dejavu.compiler.text import encode_text
    from dejavu.datafiles import WIKITEXT2_TEST
    from dejavu.fileio import write_json
    from dejavu.models.loader import load_model, load_tokenizer
    from dejavu.models.presets import resolve
    from dejavu.runtime.evaluation.evaluate import read_text

    t0 = time.perf_counter()
    folder = resolve(a.model)
    model, cfg = load_model(folder)
    tok = load_tokenizer(folder)
    preds = _load_predictors(Path(a.predictors))
    L, n = cfg.num_hidden_layers, {"mlp": cfg.ffn_dim, "attn": cfg.num_attention_heads}
    ranks = tuple(-(-sum(int(q["a"].shape[0]) for q in ps) // len(ps)) for ps in (preds.mlp, preds.attn))
    costs = ByteCosts.of(cfg, ranks, 2)
    ks = {kind: candidate_ks(n[kind]) for kind in KINDS}
    parts = lambda: model_parts(model)
    held = lambda skip, m: heldout_windows(tok, None, skip, m, 512, cfg.bos_token_id)[0]
    check_ids = held(2048, 2048)
    test = torch.from_numpy(encode_text(tok, read_text(WIKITEXT2_TEST), cfg.bos_token_id,
                                        a.ppl_tokens).astype(np.int64))[:a.ppl_tokens]
    test = test[:len(test) // 512 * 512].view(-1, 512)
    res = {"model": a.model, "predictors": a.predictors, "test_tokens": int(test.numel() - test.shape[0]),
           "check": "validation head tokens [2048, 4096)", "tables": {}, "rows": []}

    def table(per_tok: dict, z: float, name: str, tokens: int) -> Sensitivity:
        delta = {kind: [[float(per_tok[(l, kind, k)].mean() + z * per_tok[(l, kind, k)].std() /
                               math.sqrt(len(per_tok[(l, kind, k)]))) for k in ks[kind]] for l in range(L)]
                 for kind in KINDS}
        res["tables"][name] = delta
        return Sensitivity(ks, delta, float(per_tok["dense"].mean()), tokens)

    base = sensitivity_per_token(*parts(), held(0, 2048), preds, ks)
    tables = {"knapsack": table(base, 0.0, "knapsack", 2047 * 4)}
    for z in [float(v) for v in a.ucb.split(",") if v]:
        tables[f"knapsack_ucb{z:g}"] = table(base, z, f"knapsack_ucb{z:g}", 2047 * 4)
    if a.more_tokens:
        more = sensitivity_per_token(*parts(), held(4096, a.more_tokens - 2048), preds, ks)
        both = {key: torch.cat([base[key], more[key]]) for key in base}
        for z in [0.0] + [float(v) for v in a.ucb.split(",") if v]:
            name = f"knapsack_{a.more_tokens}tok" + (f"_ucb{z:g}" if z else "")
            tables[name] = table(both, z, name, len(both["dense"]))
    print(f"tables measured ({time.perf_counter() - t0:.0f} s)", flush=True)
    dense_test, dense_check = (heldout_nll(*parts(), ids, None, [n["mlp"]] * L, [n["attn"]] * L)
                               for ids in (test, check_ids))
    res["dense_test_ppl"], res["dense_check_ppl"] = math.exp(dense_test), math.exp(dense_check)
    for d in [float(v) for v in a.densities.split(",")]:
        budget = math.floor(d * costs.dense)
        allocs = {name: allocate_knapsack(costs, sens, budget) for name, sens in tables.items()}
        allocs["uniform"] = allocate_uniform(costs, budget)
        hd = allocate_heads_dense(costs, budget, preds.recall_curves.get("mlp"))
        if hd is not None:
            allocs["heads_dense"] = hd
        for name, (mk, ak) in allocs.items():
            if a.only and name not in a.only.split(","):
                continue
            t = math.exp(heldout_nll(*parts(), test, preds, mk, ak))
            c = math.exp(heldout_nll(*parts(), check_ids, preds, mk, ak))
            row = {"density": d, "allocation": name, "mlp_k": list(mk), "attn_k": list(ak),
                   "bytes": costs.report(mk, ak)["fraction"], "test_ppl": t,
                   "test_increase_pct": 100 * (t / res["dense_test_ppl"] - 1), "check_ppl": c,
                   "check_increase_pct": 100 * (c / res["dense_check_ppl"] - 1)}
            res["rows"].append(row)
            print(f"{d} {name:20s} test {t:.3f} ({row['test_increase_pct']:+.2f}%) check "
                  f"{row['check_increase_pct']:+.2f}% mlp_k {list(mk)} attn_k {list(ak)}", flush=True)
            write_json(a.out, res, indent=1)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(a.out, res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sensitivity pass in float32 vs under bfloat16 autocast (`BuildConfig.sensitivity_dtype`).

    python benchmarks/sensitivity_dtype.py --engine opt-mini.engine --out sensitivity_dtype.json

With the predictors of an opt-mini engine (its header's predictor input), the build's first
held-out set (WikiText-2 validation tokens [0, 2048)) and the build's candidate K, each
(layer, kind, K) cut is applied alone as `allocate.measure_sensitivity` applies it, keeping every
token's loss increase: its mean (the table entry) and paired standard error. Both dtypes run in
this process on --threads threads (one: CPU time that the machine's other load moves least);
the report gives each one's CPU seconds, how far the bfloat16 entries lie from the float32
ones (in nats and in standard errors), and the knapsack's K from either table at each --densities.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from knapsack_noise import token_nll  # noqa: E402


@torch.no_grad()
def table(parts, ids, preds, ks, dtype: str) -> dict:
    """{"l,kind,k": [mean, standard error]} of the per-token increases, as measure_sensitivity."""
    from dejavu.compiler.allocate import _amp, sensitivity_states

    layers, embed, head = parts()
    x, br, _ = sensitivity_states(layers, embed, ids, preds, ks, dtype=dtype)
    with _amp("cpu", dtype):
        dense = token_nll(head, x, ids)
        out = {}
        for (l, kind, k), s in br.items():
            d = token_nll(head, s, ids) - dense
            out[f"{l},{kind},{k}"] = [d.mean().item(), (d.std() / len(d) ** 0.5).item()]
    return {"dense_nll": dense.mean().item(), "entries": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="an opt-mini engine (its predictors are used)")
    ap.add_argument("--densities", default="0.35,0.4,0.5,0.6,0.7,0.8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from dejavu.compiler.allocate import (KINDS, Sensitivity, allocate_knapsack, candidate_ks, engine_costs,
                                          heldout_source, heldout_windows)
    from dejavu.compiler.build import _streamed_parts
    from dejavu.compiler.config import BuildConfig
    from dejavu.compiler.predictors import Predictors
    from dejavu.engine_file import read_engine
    from dejavu.fileio import write_json
    from dejavu.models.loader import Checkpoint, load_tokenizer
    from dejavu.models.presets import resolve

    folder = resolve("opt-mini")
    ckpt, config = Checkpoint(folder), BuildConfig(density=0.7)
    cfg = ckpt.cfg
    header, tensors = read_engine(a.engine)
    preds = Predictors.from_state_dict({n: t.float() for n, t in tensors.items() if ".pred_" in n},
                                       header["build_config"]["predictor_input"])
    corpus, skip = heldout_source(config)
    ids, source = heldout_windows(load_tokenizer(folder), corpus, skip, config.heldout_tokens,
                                  min(config.calib_window, cfg.max_position_embeddings), cfg.bos_token_id)
    ks = {"mlp": candidate_ks(cfg.ffn_dim), "attn": candidate_ks(cfg.num_attention_heads)}
    res = {"engine": a.engine, "heldout": source, "threads": a.threads, "ks": ks}
    for dtype in ("float32", "bfloat16"):
        t0 = time.process_time()
        res[dtype] = table(_streamed_parts(ckpt, "cpu"), ids, preds, ks, dtype)
        res[dtype]["cpu_seconds"] = round(time.process_time() - t0, 1)
        print(dtype, res[dtype]["cpu_seconds"], "s CPU", flush=True)
    ref, got = res["float32"]["entries"], res["bfloat16"]["entries"]
    err = sorted(abs(got[k][0] - ref[k][0]) for k in ref)
    in_se = sorted(abs(got[k][0] - ref[k][0]) / ref[k][1] for k in ref)
    res["summary"] = {"entries": len(ref), "median_abs_nats": err[len(err) // 2], "max_abs_nats": err[-1],
                      "median_in_se": in_se[len(in_se) // 2], "max_in_se": in_se[-1],
                      "median_se": sorted(v[1] for v in ref.values())[len(ref) // 2]}
    costs = engine_costs(cfg, config, preds)
    sens = {d: Sensitivity(ks, {kind: [[res[d]["entries"][f"{l},{kind},{k}"][0] for k in ks[kind]]
                                       for l in range(cfg.num_hidden_layers)] for kind in KINDS},
                           res[d]["dense_nll"], int(ids.numel() - ids.shape[0])) for d in ("float32", "bfloat16")}
    res["knapsack"] = {}
    for d in (float(v) for v in a.densities.split(",")):
        got_k = {t: allocate_knapsack(costs, s, math.floor(d * costs.dense)) for t, s in sens.items()}
        res["knapsack"][str(d)] = {**got_k, "same": got_k["float32"] == got_k["bfloat16"]}
    print(json.dumps(res["summary"]), {d: v["same"] for d, v in res["knapsack"].items()})
    write_json(a.out, res, indent=1)


if __name__ == "__main__":
    main()

"""How much of a token's TEAL kept set the token before it kept too: what a GEMV could read before its wait
by speculating on the previous token's rows.

    python benchmarks/llama_mask_overlap.py --skips 0.25 0.5 --out benchmarks/results/llama_mask_overlap_2026-12-06.json

A decode GEMV learns which weight rows it reads only when the select before it has run, so its reads start
after a dependent launch (benchmarks/launch_chain.py measures that cost). Reads issued before the wait would
have to guess the rows; the previous token's kept rows of the same projection are the guess at hand. Here,
with one TEAL level --skip for every projection input (thresholds calibrated on the first --calib-tokens
tokens of the shipped calibration text, windows of --window, as the build calibrates) applied masked dense on
--windows windows of WikiText-2 test: per input kind (q/k/v's attn_in, o_in, gate/up's mlp_in, down_in) and
layer, over every position s > 0 of a window, `reuse` = |K_s ∩ K_(s-1)| / |K_s| (the share of this token's
kept inputs that the guess covers) and `waste` = |K_(s-1) \\ K_s| / |K_(s-1)| (the share of the guess not
needed), against `kept` = |K_s| / N, what reuse would be if the two sets were independent.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dejavu.compiler.gated_sparsity import KEYS, GatedSparsity, calibrate, gated_sparsity, input_hooks, thresholds
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import write_json
from dejavu.provenance import tree_commit
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids


class OverlapCounter:
    """`hook` for gated_sparsity.input_hooks, after the masking hooks: per kind and layer, sums over consecutive
    positions of |K_s|, |K_(s-1)|, |K_s ∩ K_(s-1)| and N."""

    def __init__(self, model, t: dict):
        self.model, self.t = model, t
        L = len(model.layers)
        self.sums = {k: torch.zeros(L, 4, dtype=torch.float64) for k in KEYS}  # now, before, both, entries

    def hook(self, key: str, l: int):
        def f(m, a):
            keep = a[0].abs() > self.t[key][l]  # [B, S, N]: masked inputs keep exactly the kept entries
            now, before = keep[:, 1:], keep[:, :-1]
            self.sums[key][l] += torch.tensor([now.sum(), before.sum(), (now & before).sum(), now.numel()],
                                              dtype=torch.float64)
        return f

    def summary(self) -> dict:
        out = {}
        for key, s in self.sums.items():
            per = {"reuse": s[:, 2] / s[:, 0], "waste": 1 - s[:, 2] / s[:, 1], "kept": s[:, 0] / s[:, 3]}
            tot = s.sum(0)
            out[key] = {"reuse": round(float(tot[2] / tot[0]), 4), "waste": round(float(1 - tot[2] / tot[1]), 4),
                        "kept": round(float(tot[0] / tot[3]), 4),
                        "by_layer": {k: [round(float(x), 4) for x in v] for k, v in per.items()}}
        return out


@torch.no_grad()
def measure(model, t: dict, skip: float, batches) -> dict:
    counter = OverlapCounter(model, t)
    with gated_sparsity(model, t, GatedSparsity("teal", skip)), input_hooks(model, counter.hook):
        for ids in batches:  # the counter's hooks after the masking hooks: they see the masked inputs
            model(ids)
    return counter.summary()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--skips", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", type=int, default=8, help="WikiText-2 test windows")
    p.add_argument("--out")
    args = p.parse_args(argv)
    sm = load_scoring_model(args.model)
    model, w = sm.info["model"], args.window
    calib_ids = text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens)
    calib = calibrate(model, calib_ids[:calib_ids.numel() // w * w].view(-1, w))
    test = text_ids(sm, read_text(WIKITEXT2_TEST), args.windows * w).view(-1, w)
    res = {"model": args.model, "window": w, "windows": test.shape[0], "calib_tokens": args.calib_tokens,
           "commit": tree_commit(Path(__file__)), "machine": platform.node(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "levels": []}
    for skip in args.skips:
        row = {"skip": skip, "kinds": measure(model, thresholds(calib, skip), skip, test.split(2))}
        res["levels"].append(row)
        print(json.dumps({"skip": skip, **{k: {m: v[m] for m in ("reuse", "waste", "kept")}
                                            for k, v in row["kinds"].items()}}), flush=True)
    if args.out:
        write_json(args.out, res, indent=1)
    return res


if __name__ == "__main__":
    main()

"""Token-parallel TEAL (the uniform level) with some positions of each window reading their inputs whole.

    python benchmarks/llama_dense_positions.py --skip 0.25 --ranges 0-0 0-1 0-4 0-64 0-256 1-16 1-256

WikiText-2 test, --windows windows of --window (512); thresholds from the first --calib-tokens (8,192) calibration
tokens in windows of --window; the perplexity of each window's second half against the dense model's, with the positions
[a, b) of each `--ranges` entry a-b read whole (0-0: none, every position thresholded). What a prompt
prefilled dense would give the tokens decoded after it (docs/llama.md, "The prompt's first position").
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import dejavu.compiler.gated_sparsity as G
from dejavu.compiler.gated_sparsity import GatedSparsity, calibrate, gated_sparsity
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids


def _hooks_reading_whole(a: int, b: int):
    # gated_sparsity's pre-hooks with positions [a, b) of every row left unmasked
    def hooks(t, n, reads, nbytes):
        def hook(m, args):
            keep = args[0].abs() > t
            keep[:, a:b] = True
            return (args[0] * keep,) + tuple(args[1:])
        return [hook] * n
    return hooks


@torch.no_grad()
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--skip", type=float, default=0.25)
    p.add_argument("--ranges", nargs="+", default=["0-0", "0-1", "1-256", "0-256"])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=8192)
    args = p.parse_args(argv)
    w, h = args.window, args.window // 2
    sm = load_scoring_model(args.model)
    model = sm.info["model"]
    calib = calibrate(model, text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens).view(-1, w))
    ids = text_ids(sm, read_text(WIKITEXT2_TEST), args.windows * w).view(-1, w)

    def nll() -> float:
        lp = torch.cat([F.log_softmax(model(b).float(), -1) for b in ids.split(4)])
        return float(-lp[:, h - 1:-1].gather(-1, ids[:, h:, None]).mean())

    dense = nll()
    out = {"dense": math.exp(dense), "skip": args.skip, "ranges": {}}
    print("dense", round(math.exp(dense), 3), flush=True)
    plain = G._hooks
    for r in args.ranges:
        a, b = (int(v) for v in r.split("-"))
        G._hooks = _hooks_reading_whole(a, b) if b > a else plain
        try:
            with gated_sparsity(model, calib, GatedSparsity("teal", args.skip), count=False):
                v = nll()
        finally:
            G._hooks = plain
        out["ranges"][r] = {"ppl": math.exp(v), "vs_dense_pct": 100 * (math.exp(v - dense) - 1)}
        print(args.skip, "positions", r, "read whole:", round(math.exp(v), 3), f"{out['ranges'][r]['vs_dense_pct']:+.2f}%",
              flush=True)
    return out


if __name__ == "__main__":
    main()

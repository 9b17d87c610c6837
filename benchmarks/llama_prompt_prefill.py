"""Decoded-token perplexity of a Llama engine after a prompt, by how the prompt is prefilled.

    python benchmarks/llama_prompt_prefill.py E --model smollm2-135m --prompt 256 \
        --out benchmarks/results/llama_prompt_prefill_E.json

WikiText-2 test, --windows windows of --window tokens: each window's first --prompt tokens are the prompt,
the rest are decoded one step at a time (Engine.decode_logits, the loop `generate` runs; CPU reference ops
here) and scored. Prefills: "engine" (LlamaDecoder.prefill as shipped: dense, the first position
thresholded), "thresholded" (every prompt position thresholded: the token-parallel quantity), "dense" (no
threshold in the prompt, the prefill before 2026-12-06). The dense source model (--model) scores the same
tokens for the reference.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids

PREFILLS = ("engine", "thresholded", "dense")


def _prefill(dec, sparse: bool):
    # the prompt through forward_tokens with every position thresholded (sparse) or none
    def prefill(ids, lengths, rows=None, start=0):
        return dec.forward_tokens(ids, sparse=sparse, write_cache=True, last=lengths - 1, rows=rows, start=start)
    return prefill


@torch.no_grad()
def decoded_nll(engine, ids: torch.Tensor, prompt: int, prefill: str, batch: int = 4) -> float:
    """Mean NLL of the tokens after the first `prompt` of each row of ids [N, S], decoded after a prefill."""
    dec = engine.decoder
    if prefill != "engine":
        dec.prefill = _prefill(dec, prefill == "thresholded")
    try:
        total = 0.0
        for w in ids.split(batch):
            lp = F.log_softmax(engine.decode_logits(w, prompt).float(), -1)
            total += float(-lp[:, prompt - 1:-1].gather(-1, w[:, prompt:, None]).sum())
    finally:
        dec.__dict__.pop("prefill", None)
    return total / (ids.shape[0] * (ids.shape[1] - prompt))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine")
    p.add_argument("--model", required=True, help="the dense source model (preset, folder, .gguf)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--prefills", nargs="+", default=list(PREFILLS), choices=PREFILLS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not 1 <= args.prompt < args.window:
        p.error("--prompt must be in [1, --window)")
    sm = load_scoring_model(args.engine, dtype="float32")
    ids = text_ids(sm, read_text(WIKITEXT2_TEST), args.windows * args.window).view(-1, args.window)
    dense = load_scoring_model(args.model)
    with torch.no_grad():
        lp = torch.cat([F.log_softmax(dense.info["model"](w).float(), -1) for w in ids.split(4)])
    ref = float(-lp[:, args.prompt - 1:-1].gather(-1, ids[:, args.prompt:, None]).mean())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    res = {"engine": Path(args.engine).name, "model": args.model, "prompt": args.prompt, "window": args.window,
           "windows": ids.shape[0], "scored_tokens": ids.shape[0] * (args.window - args.prompt),
           "ppl_dense": math.exp(ref), "prefills": {}, "commit": commit, "machine": platform.node(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name in args.prefills:
        ppl = math.exp(decoded_nll(sm.info["engine"], ids, args.prompt, name))
        res["prefills"][name] = {"ppl": ppl, "vs_dense_pct": 100 * (ppl / res["ppl_dense"] - 1)}
        print(name, round(ppl, 4), f"{res['prefills'][name]['vs_dense_pct']:+.2f}%", flush=True)
    if args.out:
        with atomic_path(Path(args.out)) as tmp:
            tmp.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return res


if __name__ == "__main__":
    main()

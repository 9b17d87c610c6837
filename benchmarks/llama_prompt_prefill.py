"""Decoded-token perplexity of a Llama engine after a prompt, by how the prompt is prefilled.

    python benchmarks/llama_prompt_prefill.py E --model smollm2-135m --prompt 256 \
        --out benchmarks/results/llama_prompt_prefill_E.json

WikiText-2 test, --windows windows of --window tokens: each window's first --prompt tokens are the prompt,
the rest are decoded one step at a time (Engine.decode_logits, the loop `generate` runs; CPU reference ops
here) and scored; the first of them, scored from the prefill's last logits, also on its own (its NLL, the
KL from the dense model's next-token distribution, how often greedy's first token is the dense model's; with
`--window` one more than `--prompt`, many prompts' first tokens and little else). Prefills: "engine"
(LlamaDecoder.prefill as shipped: dense, the first position thresholded), "thresholded" (every prompt
position thresholded: the token-parallel quantity), "dense" (no threshold in the prompt, the prefill before
2026-12-06), "sink" (dense, its logits kept, then the first position's K/V written again from its
thresholded inputs: the dense model's first token, the decoded ones reading a thresholded sink). The dense
source model (--model) scores the same tokens for the reference.
"""
from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import write_json
from dejavu.provenance import tree_commit
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids

PREFILLS = ("engine", "thresholded", "dense", "sink")


def _prefill(dec, kind: str):
    # the prompt through forward_tokens with every position thresholded ("thresholded") or none ("dense");
    # "sink": dense, its logits returned, then the first position's K/V written again from its thresholded
    # inputs (one more token's forward), which the decoded tokens read
    def prefill(ids, lengths, rows=None, start=0):
        out = dec.forward_tokens(ids, sparse=kind == "thresholded", write_cache=True, last=lengths - 1, rows=rows,
                                 start=start)
        if kind == "sink" and start == 0:
            dec.forward_tokens(ids[:, :1], sparse=True, write_cache=True, last=torch.zeros_like(lengths), rows=rows)
        return out
    return prefill


@torch.no_grad()
def decoded_scores(engine, ids: torch.Tensor, prompt: int, prefill: str, batch: int = 4) -> tuple[float, torch.Tensor]:
    """(mean NLL of the tokens after the first `prompt` of each row of ids [N, S], decoded after a prefill;
    the log-probabilities [N, V] the prefill's last position gives the first of them)."""
    dec = engine.decoder
    if prefill != "engine":
        dec.prefill = _prefill(dec, prefill)
    try:
        total, first = 0.0, []
        for w in ids.split(batch):
            lp = F.log_softmax(engine.decode_logits(w, prompt).float(), -1)
            total += float(-lp[:, prompt - 1:-1].gather(-1, w[:, prompt:, None]).sum())
            first.append(lp[:, prompt - 1])
    finally:
        dec.__dict__.pop("prefill", None)
    return total / (ids.shape[0] * (ids.shape[1] - prompt)), torch.cat(first)


def decoded_nll(engine, ids: torch.Tensor, prompt: int, prefill: str, batch: int = 4) -> float:
    """Mean NLL of the tokens after the first `prompt` of each row of ids [N, S], decoded after a prefill."""
    return decoded_scores(engine, ids, prompt, prefill, batch)[0]


def first_token(lp: torch.Tensor, dense_lp: torch.Tensor, target: torch.Tensor) -> dict:
    """The first decoded token, scored from the prefill's last logits: its NLL, KL(dense || engine) of the
    two next-token distributions, and how often the two argmaxes (greedy's first token) agree; lp,
    dense_lp [N, V] log-probabilities, target [N]."""
    kl = (dense_lp.exp() * (dense_lp - lp)).sum(-1)
    return {"nll": float(-lp.gather(-1, target[:, None]).mean()),
            "nll_dense": float(-dense_lp.gather(-1, target[:, None]).mean()), "kl": float(kl.mean()),
            "argmax_agrees": float((lp.argmax(-1) == dense_lp.argmax(-1)).float().mean())}


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
    nll, dense_first = 0.0, []
    with torch.no_grad():
        for w in ids.split(4):
            lp = F.log_softmax(dense.info["model"](w).float(), -1)
            nll += float(-lp[:, args.prompt - 1:-1].gather(-1, w[:, args.prompt:, None]).sum())
            dense_first.append(lp[:, args.prompt - 1])
    ref, dense_first = nll / (ids.shape[0] * (args.window - args.prompt)), torch.cat(dense_first)
    res = {"engine": Path(args.engine).name, "model": args.model, "prompt": args.prompt, "window": args.window,
           "windows": ids.shape[0], "scored_tokens": ids.shape[0] * (args.window - args.prompt),
           "ppl_dense": math.exp(ref), "prefills": {}, "commit": tree_commit(Path(__file__)),
           "machine": platform.node(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name in args.prefills:
        nll, first = decoded_scores(sm.info["engine"], ids, args.prompt, name)
        ppl = math.exp(nll)
        res["prefills"][name] = {"ppl": ppl, "vs_dense_pct": 100 * (ppl / res["ppl_dense"] - 1),
                                 "first_token": first_token(first, dense_first, ids[:, args.prompt])}
        f = res["prefills"][name]["first_token"]
        print(name, round(ppl, 4), f"{res['prefills'][name]['vs_dense_pct']:+.2f}%; first token: NLL "
              f"{f['nll']:.4f} (dense {f['nll_dense']:.4f}), KL {f['kl']:.4f}, argmax agrees {f['argmax_agrees']:.3f}",
              flush=True)
    if args.out:
        write_json(args.out, res, indent=2)
    return res


if __name__ == "__main__":
    main()

"""TEAL on the LM head's input: perplexity when only the final hidden state is thresholded (blocks dense).

    python benchmarks/llama_lm_head_sparsity.py --levels 0.25 0.4 0.5 --ppl-tokens 2048

Thresholds: quantiles of |x| at the LM head's input over --calib-tokens tokens of the calibration file
(WikiText-2 train head), never the evaluation text; perplexity on WikiText-2 test, windows of 512.
"""
from __future__ import annotations

import argparse
import json

import torch

from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids


@torch.no_grad()
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--levels", nargs="+", type=float, default=[0.25, 0.4, 0.5])
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--calib-tokens", type=int, default=2048)
    a = p.parse_args(argv)
    sm = load_scoring_model(a.model)
    model = sm.info["model"]
    ids = text_ids(sm, read_text(CALIB_TEXT), a.calib_tokens)
    ids = ids[:ids.numel() // 512 * 512].view(-1, 512)
    seen = []
    hook = model.lm_head.register_forward_pre_hook(lambda m, x: seen.append(x[0].abs().flatten().float()))
    model(ids)
    hook.remove()
    mags = torch.cat(seen)
    t = {"value": 0.0}
    model.lm_head.register_forward_pre_hook(lambda m, x: (x[0] * (x[0].abs() > t["value"]),))
    rows = []
    for skip in [0.0, *a.levels]:
        t["value"] = float(torch.quantile(mags[:1 << 24], skip)) if skip else 0.0
        r = eval_perplexity(sm, read_text(WIKITEXT2_TEST), 512, a.ppl_tokens, batch=8, progress=False)
        rows.append({"skip": skip, "threshold": t["value"], "perplexity": r["perplexity"], "tokens": r["tokens"]})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()

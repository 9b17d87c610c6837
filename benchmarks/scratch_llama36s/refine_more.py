"""Study: does the 40% joint refinement gain from more evaluations? (24 ran out mid-pass at step 0.05)

    python benchmarks/scratch_llama36s/refine_more.py --evals 25 --calib-cache C.pt --out F.json

Continues compiler/allocate_llama.refine_skips from the refined 40% skips of
benchmarks/results/llama_refine_2026-12-05.json (33 / 45 / 31.25 / 60) on the same windows
(calibration file tokens [8192, 10240)); checks start / continued on [10240, 12288); WikiText-2
test, the first 8,192 tokens, for the continued skips when they differ from the start.
"""
import argparse
import json
import time

import torch

from dejavu.compiler.allocate_llama import block_skip, heldout_nll, input_bytes, kind_thresholds, refine_skips
from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids

p = argparse.ArgumentParser()
p.add_argument("--evals", type=int, default=25)
p.add_argument("--step", type=float, default=0.05)
p.add_argument("--calib-cache", required=True)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
sm = load_scoring_model("smollm2-135m")
model = sm.info["model"]
calib = torch.load(args.calib_cache, weights_only=False)
w = input_bytes(model.config)
start = json.load(open("benchmarks/results/llama_refine_2026-12-05.json"))["runs"][1]["refined"]
ids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 4096)[8192:]
sens_ids, check_ids = ids[:2048].view(-1, 512), ids[2048:4096].view(-1, 512)
nll = lambda ids, s: heldout_nll(model, ids, kind_thresholds(calib, s))  # noqa: E731
res = {"argv": vars(args), "start": start}
with torch.no_grad():
    dense_s, dense_c = heldout_nll(model, sens_ids), heldout_nll(model, check_ids)
    t0 = time.perf_counter()
    log = []
    best, a, b, used = refine_skips(lambda s: nll(sens_ids, s), start, w, args.evals, args.step,
                                    lambda s, v, k: (log.append([{k2: round(x, 4) for k2, x in s.items()}, v, k]),
                                                     print({k2: round(x, 3) for k2, x in s.items()}, round(v - dense_s, 5), k, flush=True)))
    res.update(continued=best, evals=used, seconds=round(time.perf_counter() - t0, 1), log=log,
               block_skip=[block_skip(start, w), block_skip(best, w)], dense_sens=dense_s, dense_check=dense_c,
               sens_delta=[a - dense_s, b - dense_s])
    json.dump(res, open(args.out, "w"), indent=1)
    if best != start:
        res["check_delta"] = {"start": nll(check_ids, start) - dense_c, "continued": nll(check_ids, best) - dense_c}
        print(res["check_delta"], flush=True)
        with gated_sparsity(model, kind_thresholds(calib, best), GatedSparsity("teal", 0.4)) as reads:
            r = eval_perplexity(sm, read_text(WIKITEXT2_TEST), 512, 8192, batch=8, progress=False)
        res["test_continued"] = {"perplexity": r["perplexity"], "tokens": r["tokens"], "realized_skip": reads.skipped}
        print(res["test_continued"], flush=True)
    json.dump(res, open(args.out, "w"), indent=1)

"""Study: joint refinement of the per-kind allocation (compiler/allocate_llama.refine_skips).

    python benchmarks/scratch_llama36j/refine.py --levels 0.4 --evals 24 --calib-cache C.pt \
        --sensitivity-cache S.json --out /tmp/x.json

Start: allocate_skips on the sensitivity table (calibration file tokens [8192, 10240), windows
of 512); refine on the same windows; check start / refined / uniform on tokens [10240, 12288)
(resolve_skips' second set); then WikiText-2 test, the first --ppl-tokens tokens.
"""
import argparse
import json
import time

import torch

from dejavu.compiler.allocate_llama import (KEYS, Sensitivity, allocate_skips, block_skip, heldout_nll, input_bytes,
                                            kind_thresholds, refine_skips)
from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids

p = argparse.ArgumentParser()
p.add_argument("--levels", nargs="+", type=float, default=[0.4])
p.add_argument("--evals", type=int, default=24)
p.add_argument("--step", type=float, default=0.05)
p.add_argument("--ppl-tokens", type=int, default=8192)
p.add_argument("--test", action=argparse.BooleanOptionalAction, default=True)
p.add_argument("--calib-cache", required=True)
p.add_argument("--sensitivity-cache", required=True)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
sm = load_scoring_model("smollm2-135m")
model = sm.info["model"]
calib = torch.load(args.calib_cache, weights_only=False)
sens = Sensitivity(**{k: (tuple(v) if k == "levels" else v) for k, v in json.load(open(args.sensitivity_cache)).items()})
w = input_bytes(model.config)
ids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 4096)[8192:]
sens_ids, check_ids = ids[:2048].view(-1, 512), ids[2048:4096].view(-1, 512)
res = {"argv": vars(args), "runs": []}
nll = lambda ids, s: heldout_nll(model, ids, kind_thresholds(calib, s))  # noqa: E731
with torch.no_grad():
    dense_s, dense_c = heldout_nll(model, sens_ids), heldout_nll(model, check_ids)
    res.update(dense_sens=dense_s, dense_check=dense_c)
    for level in args.levels:
        start = allocate_skips(sens, w, level)
        t0 = time.perf_counter()
        log = []
        refined, a, b, used = refine_skips(lambda s: nll(sens_ids, s), start, w, args.evals, args.step,
                                           lambda s, v, k: (log.append([{k2: round(x, 4) for k2, x in s.items()}, v, k]),
                                                            print(level, {k2: round(x, 3) for k2, x in s.items()}, round(v - dense_s, 5), k, flush=True)))
        secs = time.perf_counter() - t0
        print(level, "start", round(a - dense_s, 5), "refined", round(b - dense_s, 5), flush=True)
        row = {"level": level, "start": start, "refined": refined, "evals": used, "refine_seconds": round(secs, 1),
               "block_skip": [block_skip(start, w), block_skip(refined, w)],
               "sens_delta": [a - dense_s, b - dense_s], "log": log,
               "check_delta": {n: nll(check_ids, s) - dense_c for n, s in
                               (("start", start), ("refined", refined), ("uniform", {k: level for k in KEYS}))}}
        print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
        if args.test:
            for name, s in (("refined", refined),):
                with gated_sparsity(model, kind_thresholds(calib, s), GatedSparsity("teal", level)) as reads:
                    r = eval_perplexity(sm, read_text(WIKITEXT2_TEST), 512, args.ppl_tokens, batch=8, progress=False)
                row[f"test_{name}"] = {"perplexity": r["perplexity"], "tokens": r["tokens"], "realized_skip": reads.skipped}
                print(name, row[f"test_{name}"], flush=True)
        res["runs"].append(row)
        json.dump(res, open(args.out, "w"), indent=1)

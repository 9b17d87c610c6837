"""Joint refinement (allocate_llama.refine_skips) of the per-kind skips on the rotated SmolLM2
(--rotate-keep), as docs/llama.md "Joint refinement" did unrotated: refinement on the calibration
file's tokens [8192, 10240), check on [10240, 12288), then WikiText-2 test."""
import argparse, json, time
import torch
from dejavu.compiler.allocate_llama import (Sensitivity, allocate_skips, block_skip, heldout_nll, input_bytes,
                                            kind_thresholds, refine_skips)
from dejavu.compiler.gated_sparsity import GatedSparsity, calibrate, gated_sparsity
from dejavu.compiler.rotate_llama import rotate_llama
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids

p = argparse.ArgumentParser()
p.add_argument("--levels", nargs="+", type=float, required=True)
p.add_argument("--rotate-keep", type=int, default=4)
p.add_argument("--sensitivity-cache", required=True)
p.add_argument("--evals", type=int, default=24)
p.add_argument("--ppl-tokens", type=int, default=8192)
p.add_argument("--out", required=True)
a = p.parse_args()
torch.set_num_threads(2)
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 4096)
cal_ids = ids[:8192].view(-1, 512)
with torch.no_grad():
    if a.rotate_keep >= 0:
        rotate_llama(model, cal_ids, a.rotate_keep)
    calib = calibrate(model, cal_ids)
ref_ids, chk_ids = ids[8192:10240].view(-1, 512), ids[10240:12288].view(-1, 512)
w = input_bytes(model.config)
d = json.load(open(a.sensitivity_cache))
sens = Sensitivity(tuple(d["levels"]), d["delta"], d["dense_nll"])
text = read_text(WIKITEXT2_TEST)
res = {"argv": vars(a), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
nll = lambda s: heldout_nll(model, ref_ids, kind_thresholds(calib, s))
for lv in a.levels:
    t0 = time.perf_counter()
    start = allocate_skips(sens, w, lv)
    best, n0, n1, used, calls = refine_skips(nll, start, w, a.evals)
    dense_chk = heldout_nll(model, chk_ids)
    row = {"level": lv, "start": start, "refined": best, "refine_nll": [n0, n1], "evals": used,
           "check_dense": dense_chk, "check_start": heldout_nll(model, chk_ids, kind_thresholds(calib, start)),
           "check_refined": heldout_nll(model, chk_ids, kind_thresholds(calib, best))}
    for name, s in (("start", start), ("refined", best)):
        with gated_sparsity(model, kind_thresholds(calib, s), GatedSparsity("teal", block_skip(s, w))) as reads:
            r = eval_perplexity(sm, text, 512, a.ppl_tokens, batch=8, progress=False)
        row[f"test_{name}"] = {"perplexity": r["perplexity"], "tokens": r["tokens"], "realized_skip": round(reads.skipped, 4)}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    res["runs"].append(row); print(json.dumps(row), flush=True)
    json.dump(res, open(a.out, "w"), indent=1)

"""Scratch: each criterion with the other criterion's per-kind skips (criterion vs allocation), WikiText-2 test."""
import json, sys, time, torch
from dejavu.compiler.allocate_llama import kind_thresholds
from dejavu.compiler.gated_sparsity import GatedSparsity, calibrate, gated_sparsity
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids
torch.set_num_threads(1)
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 8192)
cals = {"abs": calibrate(model, ids.view(-1, 512)), "wina": torch.load("/tmp/36w/C_wina.pt", weights_only=False)}
skips = {"abs": {0.25: [0.4, 0.5, 0.1813, 0.2], 0.4: [0.4, 0.6, 0.2625, 0.6], 0.5: [0.4, 0.6667, 0.4, 0.7]},
         "wina": {0.25: [0.34, 0.5, 0.2, 0.2], 0.4: [0.4, 0.5, 0.3, 0.5625], 0.5: [0.44, 0.6, 0.4, 0.7]}}
text = read_text(WIKITEXT2_TEST)
out = []
for lvl in [float(x) for x in sys.argv[1:]]:
    for crit, other in (("abs", "wina"), ("wina", "abs")):
        sk = dict(zip(("attn_in", "o_in", "mlp_in", "down_in"), skips[other][lvl]))
        c = cals[crit]
        with gated_sparsity(model, kind_thresholds(c, sk), GatedSparsity(), c.scales) as reads:
            r = eval_perplexity(sm, text, 512, 8192, batch=8, progress=False)
        row = {"criterion": crit, "skips_of": other, "level": lvl, "skips": sk, "perplexity": r["perplexity"], "tokens": r["tokens"], "realized_skip": round(reads.skipped, 4)}
        out.append(row); print(json.dumps(row), flush=True)
        json.dump(out, open("/tmp/36w/swap.json", "w"), indent=1)

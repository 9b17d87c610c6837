"""Perplexity of SmolLM2 under TEAL thresholds: uniform, allocated (per layer x input skips), per-token relative."""
import json, sys, time, argparse, torch, torch.nn.functional as F
torch.set_num_threads(1)
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids, eval_perplexity
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.compiler.gated_sparsity import calibrate, KEYS, GatedSparsity, gated_sparsity, thresholds, projection_bytes
from dejavu.models.metrics import perplexity

ap = argparse.ArgumentParser()
ap.add_argument("--text", default="heldoutB")  # heldoutB | test
ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--runs", nargs="+")  # dense, uniform@0.4, alloc:FILE@0.4, rel@0.4
ap.add_argument("--out")
args = ap.parse_args()
sm = load_scoring_model("smollm2-135m"); m = sm.info["model"]
calib = torch.load("/tmp/h36/calib8192.pt", weights_only=False)
if args.text == "heldoutB":
    ids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 4096 + args.tokens)[8192 + 4096:]
    ids[0] = sm.bos_id
else:
    ids = text_ids(sm, read_text(WIKITEXT2_TEST), args.tokens)
b = projection_bytes(m.config); nb = {"attn_in": b["attn_in"], "o_in": b["o_in"], "mlp_in": b["gate"] + b["up"], "down_in": b["down"]}
L = len(m.layers)

def ppl():
    with torch.no_grad():
        return perplexity(sm.logits_fn, ids, 512, batch=8)

res = []
for run in args.runs:
    t0 = time.time()
    if run == "dense":
        r = ppl(); rs = 0.0
    else:
        name, s = run.rsplit("@", 1); s = float(s)
        if name == "uniform":
            th = thresholds(calib, s)
        elif name.startswith("alloc:"):
            alloc = json.load(open(name[6:]))[str(s)]  # {key: [L skips]}
            th = {k: [calib.threshold(k, l, alloc[k][l]) if alloc[k][l] > 0 else 0.0 for l in range(L)] for k in KEYS}
        with gated_sparsity(m, th, GatedSparsity(skip=s)) as reads:
            r = ppl()
        rs = reads.skipped
    row = {"run": run, "text": args.text, "tokens": r["tokens"], "ppl": r["perplexity"], "nll": r["nll"], "realized_skip": rs, "sec": round(time.time() - t0)}
    print(json.dumps(row), flush=True); res.append(row)
    if args.out: json.dump(res, open(args.out, "w"), indent=1)

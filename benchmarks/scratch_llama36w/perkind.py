import math, sys, time, torch
from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1)
W = 512
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 14336)
ho = ids[12288:14336].view(-1, W)
cals = {c: torch.load(f"/tmp/36w/calib_{c}.pt", weights_only=False) for c in ("abs", "wina")}
for k in KEYS:
    n = torch.stack(cals["wina"].scales[k])
    cv = (n.std(1) / n.mean(1))
    print(k, "column-norm cv per layer: min %.3f median %.3f max %.3f" % (cv.min(), cv.median(), cv.max()), "max/min ratio median %.1f" % (n.max(1).values / n.min(1).values).median())
dense = heldout_nll(model, ho)
s = float(sys.argv[1])
for k in sys.argv[2:] or KEYS:
    for crit, c in cals.items():
        nll = heldout_nll(model, ho, kind_thresholds(c, {kk: (s if kk == k else 0.0) for kk in KEYS}), c.scales)
        print(f"{k} {crit} {s}: {nll - dense:+.4f} nats", flush=True)

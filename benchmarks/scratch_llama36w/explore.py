import math, sys, time, torch
from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, calibrate, column_norms
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1)
W = 512
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 14336)
cal_ids = ids[:8192].view(-1, W)
ho = ids[12288:14336].view(-1, W)
levels = [float(x) for x in sys.argv[1:]] or [0.25, 0.4, 0.5]
t0 = time.time()
dense = heldout_nll(model, ho); print("dense", math.exp(dense), time.time() - t0, flush=True)
cals = {}
for crit in ("abs", "wina"):
    cals[crit] = calibrate(model, cal_ids, column_norms(model) if crit == "wina" else None)
    torch.save(cals[crit], f"/tmp/36w/calib_{crit}.pt")
for s in levels:
    for crit, c in cals.items():
        nll = heldout_nll(model, ho, kind_thresholds(c, {k: s for k in KEYS}), c.scales)
        print(f"{crit} uniform {s}: ppl {math.exp(nll):.3f} {100*(math.exp(nll-dense)-1):+.2f}%  ({time.time()-t0:.0f}s)", flush=True)

"""Exploration of the refit study: held-out NLL (calibration file tokens [8192, 9216)) at 40% uniform.

    python explore.py CALIB_TOKENS ALPHA,SKIP_FIRST,own|dense(thresholds),sparse|dense(target) ...
"""
import sys, time, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
from llama_refit_study import refit_model, _proj_state
from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, calibrate
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1)
torch.set_grad_enabled(False)
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
C = int(sys.argv[1]); H = 1024
ids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 2048)
cal = ids[:C].view(-1, 512); held = ids[8192:8192 + H].view(-1, 512)
calib = calibrate(model, cal)
d0 = _proj_state(model)
skips = {k: 0.4 for k in KEYS}
base = kind_thresholds(calib, skips)
print("dense", heldout_nll(model, held), "base", heldout_nll(model, held, base), flush=True)
for spec in sys.argv[2:]:
    alpha, sf, own, tgt = spec.split(",")
    t0 = time.time()
    thr = refit_model(model, cal, skips, float(alpha), tgt, None if own == "own" else base, skip_first=int(sf), log=lambda s: None)
    print(spec, heldout_nll(model, held, thr), round(time.time() - t0), flush=True)
    model.load_state_dict(d0, strict=False)

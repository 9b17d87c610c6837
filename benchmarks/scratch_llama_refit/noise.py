"""Exploration of the refit study: held-out NLL at 40% uniform with N(0, 3e-5) noise on every projection weight."""
import sys, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
from llama_refit_study import _proj_state
from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, calibrate
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1); torch.set_grad_enabled(False)
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 2048)
cal = ids[:2048].view(-1, 512); held = ids[8192:8192 + 1024].view(-1, 512)
calib = calibrate(model, cal); d0 = _proj_state(model)
base = kind_thresholds(calib, {k: 0.4 for k in KEYS})
print("base", heldout_nll(model, held, base), flush=True)
for seed in range(3):
    g = torch.Generator().manual_seed(seed)
    for k, v in model.state_dict().items():
        if k in d0: v.add_(torch.randn(v.shape, generator=g) * 3e-5)
    print("noise", seed, heldout_nll(model, held, base), flush=True)
    model.load_state_dict(d0, strict=False)

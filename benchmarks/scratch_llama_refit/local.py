"""Exploration of the refit study: relative output error of TEAL at 40% with and without the refit,
per input kind of layers 3 / 15 / 27, dense inputs, 8,192 calibration tokens vs held-out [8192, 10240)."""
import sys, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
from llama_refit_study import refit_weight, _gram, _run_layer, _mods
from dejavu.compiler.gated_sparsity import KEYS, quantiles
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1); torch.set_grad_enabled(False)
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 2048)
cal = ids[:8192].view(-1, 512); held = ids[8192:10240].view(-1, 512)
def inputs(w, L):
    B, S = w.shape
    rope = model._rope(torch.arange(S)[None].expand(B, S), torch.float32)
    h = model.model.embed_tokens(w)
    for l in range(L): h = _run_layer(model.layers[l], h, rope, {})
    return {k: _run_layer(model.layers[L], h, rope, {}, capture=k) for k in KEYS}
for L in (3, 15, 27):
    xc, xh = inputs(cal, L), inputs(held, L)
    for k in KEYS:
        W = torch.cat([m.weight for m in _mods(model.layers[L])[k]])
        a = xc[k].abs().flatten(); t = float(quantiles(a[::a.numel()//4_000_000+1], torch.tensor([0.4]))[0])
        def err(Wp, x, first=0):
            x = x.view(-1, 512, x.shape[-1])[:, first:].reshape(-1, x.shape[-1])
            m = x * (x.abs() > t); y = x @ W.T
            return float(((m @ Wp.T - y)**2).sum() / (y**2).sum())
        m = xc[k] * (xc[k].abs() > t); y = xc[k] @ W.T
        out = [f"L{L} {k}: base cal {err(W, xc[k]):.4f} held {err(W, xh[k]):.4f} (no pos0 {err(W, xh[k], 1):.4f})"]
        for alpha in (1e-3, 1e-2, 1e-1, 1):
            Wp = refit_weight(W, m, y, alpha)
            out.append(f"a{alpha:g} cal {err(Wp, xc[k]):.4f} held {err(Wp, xh[k]):.4f} ({err(Wp, xh[k], 1):.4f})")
        print(" | ".join(out), flush=True)

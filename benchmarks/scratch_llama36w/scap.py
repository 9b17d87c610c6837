"""Scratch: SCAP-style mode-centering: skip |x_i - m_i| <= t, the skipped entries read as m_i (W m folded as a bias)."""
import math, sys, time, torch
from dejavu.compiler.allocate_llama import heldout_nll
from dejavu.compiler.gated_sparsity import KEYS, LEVELS
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1)
W = 512
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 14336)
cal_ids = ids[:8192].view(-1, W)
ho = ids[12288:14336].view(-1, W)
L = len(model.layers)
mods = lambda layer: {"attn_in": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                      "o_in": [layer.self_attn.o_proj], "mlp_in": [layer.mlp.gate_proj, layer.mlp.up_proj],
                      "down_in": [layer.mlp.down_proj]}
acts = {k: [None] * L for k in KEYS}
hs = []
for l, layer in enumerate(model.layers):
    for k, ms in mods(layer).items():
        hs.append(ms[0].register_forward_pre_hook(lambda m, a, k=k, l=l: acts[k].__setitem__(l, a[0].detach().reshape(-1, a[0].shape[-1]) if acts[k][l] is None else torch.cat([acts[k][l], a[0].detach().reshape(-1, a[0].shape[-1])]))))
with torch.no_grad():
    for w in cal_ids:
        model(w[None])
for h in hs: h.remove()
print("collected", flush=True)
centers = {}
for how in sys.argv[1].split(","):
    centers[how] = {k: [] for k in KEYS}
    for k in KEYS:
        for l in range(L):
            a = acts[k][l]
            c = {"zero": torch.zeros(a.shape[1]), "mean": a.mean(0), "median": a.median(0).values}[how]
            centers[how][k].append(c)
def thresholds(cent, s):
    t = {k: [] for k in KEYS}
    for k in KEYS:
        for l in range(L):
            d = (acts[k][l] - cent[k][l]).abs().flatten()
            d = d[:: d.numel() // 4_000_000 + 1]
            t[k].append(float(torch.quantile(d, s)))
    return t
dense = heldout_nll(model, ho)
print("dense", math.exp(dense), flush=True)
for s in [float(x) for x in sys.argv[2:]]:
    for how, cent in centers.items():
        t = thresholds(cent, s)
        hs = []
        for l, layer in enumerate(model.layers):
            for k, ms in mods(layer).items():
                m_, tt = cent[k][l], t[k][l]
                for mod in ms:
                    hs.append(mod.register_forward_pre_hook(lambda mm, a, m_=m_, tt=tt: (m_ + (a[0] - m_) * ((a[0] - m_).abs() > tt),)))
        try:
            nll = heldout_nll(model, ho)
        finally:
            for h in hs: h.remove()
        print(f"{how} uniform {s}: ppl {math.exp(nll):.3f} {100*(math.exp(nll-dense)-1):+.2f}%", flush=True)

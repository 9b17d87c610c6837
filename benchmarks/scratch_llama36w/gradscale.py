"""Scratch: per-channel scale of the threshold from the loss gradient: keep |x_i| * c_i > t,
c_i = RMS over calibration tokens of dL/dx_i (the input's total gradient: q, k, v summed)."""
import math, sys, time, torch
import torch.nn.functional as F
from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, calibrate
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1)
W = 512
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]
ids = text_ids(sm, read_text(CALIB_TEXT), 14336)
cal_ids = ids[:8192].view(-1, W)
ho = ids[12288:14336].view(-1, W)
L = len(model.layers)
ngrad = int(sys.argv[1])
sq = {k: [0.0] * L for k in KEYS}; ab = {k: [0.0] * L for k in KEYS}
mods = lambda layer: {"attn_in": layer.self_attn.q_proj, "o_in": layer.self_attn.o_proj, "mlp_in": layer.mlp.gate_proj, "down_in": layer.mlp.down_proj}
def grab(k, l):
    def pre(m, a):
        def h(g):
            g = g.detach().float().reshape(-1, g.shape[-1])
            sq[k][l] = sq[k][l] + (g * g).sum(0); ab[k][l] = ab[k][l] + g.abs().sum(0)
        a[0].register_hook(h)
    return pre
hs = [m.register_forward_pre_hook(grab(k, l)) for l, layer in enumerate(model.layers) for k, m in mods(layer).items()]
for p in model.parameters(): p.requires_grad_(False)
hs.append(model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.requires_grad_()))
t0 = time.time()
n = 0
for w in cal_ids[:ngrad]:
    with torch.enable_grad():
        emb = model  # inputs need grad: the hooks' tensors are non-leaf only if something upstream requires grad
        logits = model(w[None])[0, :-1]
        loss = F.cross_entropy(logits.float(), w[1:], reduction="sum")
    n += w.numel() - 1
    loss.backward()
for h in hs: h.remove()
print("grads", time.time() - t0, flush=True)
variants = {"rms": {k: [(sq[k][l] / n).sqrt() for l in range(L)] for k in KEYS},
            "mabs": {k: [ab[k][l] / n for l in range(L)] for k in KEYS},
            "mabs_sqrt": {k: [(ab[k][l] / n).sqrt() for l in range(L)] for k in KEYS}}
torch.save({"mabs": variants["mabs"], "n": n}, f"/tmp/36w/gradscales_{ngrad}.pt")
for k in KEYS:
    c = torch.stack(variants["rms"][k]); print(k, "grad-rms cv median %.3f" % (c.std(1) / c.mean(1)).median(), flush=True)
dense = heldout_nll(model, ho)
for v in sys.argv[2].split(","):
    cal = calibrate(model, cal_ids, variants[v]); torch.save(cal, f"/tmp/36w/calib_g{v}.pt")
    for s in [float(x) for x in sys.argv[3:]]:
        nll = heldout_nll(model, ho, kind_thresholds(cal, {k: s for k in KEYS}), cal.scales)
        print(f"grad-{v} uniform {s}: ppl {math.exp(nll):.3f} {100*(math.exp(nll-dense)-1):+.2f}%", flush=True)

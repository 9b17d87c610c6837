"""Variants: sink (position 0 dense), rel (per-token threshold alpha*rms(x_t))."""
import json, sys, time, argparse, torch
torch.set_num_threads(1)
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.compiler.gated_sparsity import KEYS, LEVELS, thresholds, projection_bytes
from dejavu.models.metrics import perplexity

ap = argparse.ArgumentParser()
ap.add_argument("--text", default="heldoutB"); ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--runs", nargs="+"); ap.add_argument("--out")
args = ap.parse_args()
sm = load_scoring_model("smollm2-135m"); m = sm.info["model"]
calib = torch.load("/tmp/h36/calib8192.pt", weights_only=False)
allids = text_ids(sm, read_text(CALIB_TEXT), 8192 + 4096 + args.tokens)
if args.text == "heldoutB":
    ids = allids[8192 + 4096:].clone(); ids[0] = sm.bos_id
else:
    ids = text_ids(sm, read_text(WIKITEXT2_TEST), args.tokens)
b = projection_bytes(m.config); nb = {"attn_in": b["attn_in"], "o_in": b["o_in"], "mlp_in": b["gate"] + b["up"], "down_in": b["down"]}
L = len(m.layers)
def projs(layer, k):
    at, mlp = layer.self_attn, layer.mlp
    return {"attn_in": [at.q_proj, at.k_proj, at.v_proj], "o_in": [at.o_proj], "mlp_in": [mlp.gate_proj, mlp.up_proj], "down_in": [mlp.down_proj]}[k]
def rms(x): return x.pow(2).mean(-1, keepdim=True).sqrt()

# relative tables: quantiles of |x|/rms(x_t) on the calibration tokens
reltab = None
def rel_calib():
    tabs = {k: torch.zeros(L, len(LEVELS)) for k in KEYS}; hs = []
    for l, layer in enumerate(m.layers):
        for k in KEYS:
            def f(mod, a, l=l, k=k):
                x = a[0]; r = (x.abs() / rms(x)).flatten()
                r = r[:: r.numel() // 4_000_000 + 1]
                tabs[k][l] = torch.quantile(r, LEVELS)
            hs.append(projs(layer, k)[0].register_forward_pre_hook(f))
    with torch.no_grad(): m(allids[:8192].view(-1, 512))
    for h in hs: h.remove()
    return tabs
def q(tab, s):
    pos = s / 0.01; i = min(int(pos), len(LEVELS) - 2); w = pos - i
    return float(tab[i] * (1 - w) + tab[i + 1] * w)

res = []
for run in args.runs:
    t0 = time.time(); read = [0.0, 0.0]; hs = []
    if run != "dense":
        name, s = run.rsplit("@", 1); s = float(s)
        if name == "rel" and reltab is None:
            reltab = rel_calib()
        th = thresholds(calib, s)
        for l, layer in enumerate(m.layers):
            for k in KEYS:
                t = q(reltab[k][l], s) if name == "rel" else th[k][l]
                def pre(mod, a, t=t, k=k, first=[True], name=name):
                    x = a[0]
                    keep = x.abs() > (t * rms(x) if name == "rel" else t)
                    if name == "sink": keep[:, 0] = True
                    return (x * keep,)
                def count(mod, a, t=t, k=k, name=name):
                    x = a[0]; keep = x.abs() > (t * rms(x) if name == "rel" else t)
                    if name == "sink": keep[:, 0] = True
                    read[0] += float(keep.float().mean(-1).sum()) * nb[k]; read[1] += keep.shape[0] * keep.shape[1] * nb[k]
                ps = projs(layer, k)
                hs.append(ps[0].register_forward_pre_hook(count))
                hs += [p.register_forward_pre_hook(pre) for p in ps]
    with torch.no_grad():
        r = perplexity(sm.logits_fn, ids, 512, batch=8)
    for h in hs: h.remove()
    row = {"run": run, "text": args.text, "tokens": r["tokens"], "ppl": r["perplexity"], "realized_skip": 1 - read[0] / read[1] if read[1] else 0, "sec": round(time.time() - t0)}
    print(json.dumps(row), flush=True); res.append(row)
    if args.out: json.dump(res, open(args.out, "w"), indent=1)

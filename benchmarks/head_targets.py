"""Head predictors fitted to other targets (least squares), heads only at K = 6, WikiText-2 test.

    python benchmarks/head_targets.py ls,tgt_sqrt,tgt_logeps,tgt_logeps2 4096

On the 65,536-token calibration of the default build (cached): ls = the shipped `_fit_heads`
(log contribution); tgt_sqrt / tgt_lin / tgt_logeps (log(c + 0.05 mean c)) / tgt_logeps2
(0.3 mean c) / tgt_rank; ridgeR; suffix _la0 = same-layer input. Measured worse or no better
than ls (docs/predictors.md); kept in git history only."""
import sys, math, json, time
import numpy as np, torch, torch.nn.functional as F
torch.set_num_threads(2)
from dejavu.compiler.calibrate import CalibSettings, calibrate
from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.predictors import (PredictorSettings, Predictors, _fit_heads, _head_labels, _fit,
                                        holdout_split)
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.presets import resolve
from dejavu.runtime.evaluate import DEFAULT_PPL_FILE, read_text
from dejavu.compiler.text import encode_text

variants = sys.argv[1].split(",")
EVAL = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
folder = resolve("opt-mini"); model, cfg = load_model(folder); tok = load_tokenizer(folder)
L, H, Fd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.ffn_dim
cal = calibrate(model, tok, CalibSettings(calib_tokens=65536), model_id="opt-mini", progress=False)
s = PredictorSettings()
split = holdout_split(cal.n_tokens, cal.n_windows, cal.window, s)
k = 6
window = 512
ids = torch.from_numpy(encode_text(tok, read_text(DEFAULT_PPL_FILE), cfg.bos_token_id, EVAL).astype(np.int64))[:EVAL]
B = len(ids) // window; ids = ids[:B * window].view(B, window)

def ppl(ctx):
    nll = 0.0
    with torch.no_grad():
        for b in range(B):
            with ctx():
                logp = torch.log_softmax(model(ids[b:b + 1])[0, :-1].float(), -1)
            nll -= logp.gather(-1, ids[b, 1:, None]).sum().item()
    return math.exp(nll / (B * (window - 1)))

def data(l, lookahead=1, source="attn_in"):
    x = torch.from_numpy(np.array(cal.predictor_input(l, source, lookahead), dtype=np.float32))
    c = torch.from_numpy(np.array(cal.head_importance(l)))
    return x, c

def fit_variant(v, l):
    la = 0 if v.endswith("_la0") else 1
    x, c = data(l, la)
    yv = _head_labels(c[split:], k)
    name = v.replace("_la0", "")
    if name == "ls":
        return _fit_heads(x[:split], c[:split], x[split:], yv, H, k, s.ridge)
    if name == "ls_share":  # least squares onto the share c / sum c
        sh = c / c.sum(-1, keepdim=True)
        return _fit_heads(x[:split], torch.exp(sh[:split]) - 1e-6, x[split:], yv, H, k, s.ridge)
    if name == "ls_logshare":  # identical ranking to ls in theory (per-token shift) - sanity
        return _fit_heads(x[:split], c[:split] / c[:split].sum(-1, keepdim=True), x[split:], yv, H, k, s.ridge)
    if name.startswith("listwise"):  # softmax CE against contribution (power p) shares, Adam from RRR start
        p = float(name.split("p")[-1]) if "p" in name[8:] else 1.0
        w = c.pow(p)
        gen = torch.Generator().manual_seed(0)
        y = _head_labels(c, k)
        return _fit(x[:split], y[:split], x[split:], y[split:], H, k, s, gen, w[:split], w[split:])
    if name.startswith("ridge"):
        r = float(name[5:])
        return _fit_heads(x[:split], c[:split], x[split:], yv, H, k, r)
    if name.startswith("tgt_"):  # least squares onto another target of c, ranked by it
        t = name[4:]
        cd = c.double()
        m = cd[:split].mean()
        y = {"sqrt": cd.sqrt(), "lin": cd, "logeps": torch.log(cd + 0.05 * m), "logeps2": torch.log(cd + 0.3 * m),
             "rank": cd.argsort(-1).argsort(-1).double()}[t]
        return _fit_heads(x[:split], torch.exp(y[:split]) - 1e-6, x[split:], yv, H, k, s.ridge)  # its log is y
    raise ValueError(v)

out = {"eval_tokens": B * (window - 1)}
for v in variants:
    t = time.perf_counter()
    if v in ("oracle", "dense"):
        out[v] = ppl(lambda: masked_sparsity(model, [Fd] * L, [k] * L, "oracle") if v == "oracle" else torch.no_grad())
    else:
        layers = []
        for l in range(L):
            p = fit_variant(v, l); p.pop("val_loss", None); layers.append(p)
        la = 0 if v.endswith("_la0") else 1
        pr = Predictors(layers, layers, {"source": "attn_in", "lookahead": la})
        out[v] = ppl(lambda: masked_sparsity(model, [Fd] * L, [k] * L, "predicted", pr))
    print(v, round(out[v], 3), f"{time.perf_counter() - t:.0f}s", flush=True)
print(json.dumps(out))

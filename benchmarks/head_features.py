"""Head predictors: which inputs carry what the linear map on attn_in of l-1 misses (opt-mini).

    python benchmarks/head_features.py --calib-tokens 65536 --out head_features.json

Per layer, ridge least squares of log ||W_o[:, h] y_h|| on each feature set, fitted on the
calibration stream (tail 10% of the windows held out); reported: the held-out share of the heads'
contribution kept by the predicted top K (K = 6 of 12), against the oracle top K:
  x(l-1)                 attn_in of layer l-1 (the shipped input)
  x(l)                   attn_in of layer l (lookahead 0)
  x(l-1) + x_prev(l-1)   and the previous token's attn_in of l-1 (both available at decode)
  x(l-1) + c(l-1)        and this token's head contributions of layer l-1 (known only after
                         layer l-1's attention: the predictor could not run a layer ahead)
  x(l-1) + c_prev(l)     and the previous token's head contributions of layer l, all 12 heads
                         (a dense quantity: a sparse decode computes only the selected heads)
  recurrent              x(l-1), the previous token's selection mask of layer l and its
                         log contributions on the selected heads (what a sparse decode has);
                         the selection is the predictor's own (fitted to a fixed point, 3 rounds)
and WikiText-2 test perplexity (first --eval-tokens) with K heads per layer, every MLP neuron
kept, for "x(l-1)" and "recurrent" (the recurrent selection made token by token in the hook).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch


def lstsq(f: torch.Tensor, y: torch.Tensor, split: int, ridge: float = 1e-3):
    """Ridge least squares on rows [:split]: scores = f @ w + b. f: [T, P], y: [T, H] (float64)."""
    f = f.double()
    mu, ym = f[:split].mean(0), y[:split].mean(0)
    fc = f[:split] - mu
    w = torch.linalg.solve(fc.T @ fc + ridge * split * torch.eye(f.shape[1], dtype=torch.float64),
                           fc.T @ (y[:split] - ym))
    return w, ym - mu @ w


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--heads-k", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="head_features.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from dejavu.compiler.calibrate import calibrate, head_contribution, head_gram
    from dejavu.compiler.config import CalibSettings, PredictorSettings
    from dejavu.compiler.predictors import holdout_split
    from dejavu.compiler.text import encode_text
    from dejavu.datafiles import WIKITEXT2_TEST
    from dejavu.models.loader import load_model, load_tokenizer
    from dejavu.models.presets import resolve
    from dejavu.runtime.evaluation.evaluate import read_text

    folder = resolve("opt-mini")
    model, cfg = load_model(folder)
    tok = load_tokenizer(folder)
    cal = calibrate(model, tok, CalibSettings(calib_tokens=a.calib_tokens), model_id="opt-mini", progress=False)
    split = holdout_split(cal.n_tokens, cal.n_windows, cal.window, PredictorSettings())
    W, K, L, H, hd = cal.window, a.heads_k, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim

    def prev(t):  # the previous token's row in its window (zeros at a window's first token)
        q = t.roll(1, 0)
        q[::W] = 0
        return q

    sel = lambda sc: torch.zeros_like(sc).scatter_(-1, sc.topk(K, -1).indices, 1.0)
    mass = lambda sc, c: (c.gather(-1, sc.topk(K, -1).indices).sum() / c.sum()).item()
    arr = lambda m: torch.from_numpy(np.array(m, dtype=np.float32))
    rows, lin, rec = [], [], []
    for l in range(L):
        x1, x0 = arr(cal.predictor_input(l, "attn_in", 1)), arr(cal.predictor_input(l, "attn_in", 0))
        c = arr(cal.head_importance(l))
        y = torch.log(c.double() + 1e-6)
        c_before = arr(cal.head_importance(max(l - 1, 0)))
        feats = {"x(l-1)": x1, "x(l)": x0, "x(l-1) + x_prev(l-1)": torch.cat([x1, prev(x1)], 1),
                 "x(l-1) + c(l-1)": torch.cat([x1, torch.log(c_before + 1e-6)], 1) if l else x1,
                 "x(l-1) + c_prev(l)": torch.cat([x1, prev(y.float())], 1)}
        row = {"layer": l}
        for name, f in feats.items():
            w, b = lstsq(f, y, split)
            row[name] = mass((f[split:].double() @ w + b), c[split:])
        w, b = lstsq(x1, y, split)
        lin.append((w.float(), b.float()))
        yc = y[:split].mean().item()
        m = sel(x1.double() @ w + b)
        for _ in range(3):  # the previous token's selection is the predictor's own
            f = torch.cat([x1, prev(m.float()), prev(((y - yc) * m).float())], 1)
            w2, b2 = lstsq(f, y, split)
            m = sel(f.double() @ w2 + b2)
        row["recurrent"] = mass((f[split:].double() @ w2 + b2), c[split:])
        rec.append((w2.float(), b2.float(), yc))
        row["oracle"] = (c[split:].topk(K, -1).values.sum() / c[split:].sum()).item()
        rows.append(row)
        print({k: round(v, 4) for k, v in row.items()}, flush=True)
    res = {"calib_tokens": cal.n_tokens, "holdout_tokens": cal.n_tokens - split, "heads_k": K, "layers": rows,
           "mean": {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if k != "layer"}}
    ids = torch.from_numpy(encode_text(tok, read_text(WIKITEXT2_TEST), cfg.bos_token_id,
                                       a.eval_tokens).astype(np.int64))[:a.eval_tokens]
    ids = ids[:len(ids) // W * W].view(-1, W)

    def ppl(form: str) -> float:
        src, hs = {}, []
        for l, layer in enumerate(model.decoder.layers):
            hs.append(layer.register_forward_pre_hook(lambda m, args, l=l: src.__setitem__(l, args[0].detach())))

            def hook(mod, args, l=l, g=head_gram(layer.self_attn.out_proj.weight, H)):
                yh = args[0].unflatten(-1, (H, hd))  # [1, S, H, hd]
                x = src[max(l - 1, 0)][0].float()  # [S, D]
                if form == "linear":
                    w, b = lin[l]
                    mask = sel(x @ w + b)
                else:  # token by token: the previous token's own selection and contributions
                    w, b, yc = rec[l]
                    D = x.shape[1]
                    base = x @ w[:D] + b
                    logc = torch.log(head_contribution(args[0][0], g).double() + 1e-6).float()  # [S, H]
                    mask, mp, lp = torch.zeros_like(base), torch.zeros(H), torch.zeros(H)
                    for t in range(x.shape[0]):
                        mp = sel(base[t] + mp @ w[D:D + H] + lp @ w[D + H:])
                        mask[t], lp = mp, (logc[t] - yc) * mp
                return ((yh * mask[None, :, :, None].to(yh.dtype)).flatten(-2),)
            hs.append(layer.self_attn.out_proj.register_forward_pre_hook(hook))
        nll = 0.0
        try:
            with torch.no_grad():
                for b in range(ids.shape[0]):
                    logp = torch.log_softmax(model(ids[b:b + 1])[0, :-1].float(), -1)
                    nll -= logp.gather(-1, ids[b, 1:, None]).sum().item()
        finally:
            for h in hs:
                h.remove()
        return math.exp(nll / (ids.shape[0] * (W - 1)))

    res["eval_tokens"] = ids.shape[0] * (W - 1)
    res["ppl"] = {form: ppl(form) for form in ("linear", "recurrent")}
    print(res["mean"], res["ppl"], flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

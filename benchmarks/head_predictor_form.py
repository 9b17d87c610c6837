"""Head predictors: a two-layer (hidden ReLU) map vs the shipped linear least squares (opt-mini, heads only).

    python benchmarks/head_predictor_form.py --calib-tokens 16384 --hidden 0,64,128 --out form.json
    python benchmarks/head_predictor_form.py --calib-tokens 65536 --heads-k alloc --oracles --out alloc.json

Per layer the head predictor reads `attn_in` of layer l-1 (the build's input) and predicts each
head's log contribution log ||W_o[:, h] y_h|| (calibration's `head_importance`):
  hidden 0   the shipped `predictors._fit_heads` (ridge least squares, rank H)
  hidden h   scores = B relu(A x + a) + b, A [h, D], B [H, h] (DejaVu's attention predictor form).
             Start: the least-squares map W written as relu(Wx) - relu(-Wx) in 2H hidden units
             (B = [I, -I]), the other h - 2H units random with zero output weights, so epoch 0 is
             the linear fit; then Adam on the per-token-centred squared error (only the ranking
             within a token matters), early stopping on the held-out contribution mass in the top K.
--heads-k alloc: K per layer by held-out loss, the same total (6 L): the loss increase of each
K applied alone in one layer, with the linear predictors (`allocate.measure_sensitivity` on the
build's held-out text, the WikiText-2 validation head, --heldout-tokens), then the least summed
increase (exact dynamic programme over layers). --oracles adds dense and the top-K oracles by the
norm of y_h and by the contribution at the same K.
Reported per layer: the held-out (tail 10% of the calibration windows) share of the heads'
contribution kept by the predicted top K and by the oracle top K; and WikiText-2 test perplexity
(first --eval-tokens) with K heads in every layer, every MLP neuron kept (masked dense, fp32).
Bytes: predictor parameters / the attention parameters they govern (q, k, v, o with biases).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

import numpy as np
import torch


class HeadScores:
    """The duck type `masked_sparsity` reads: .predictor_input and .scores("attn", l, x)."""

    def __init__(self, layers: list, predictor_input: dict):
        self.layers, self.predictor_input = layers, predictor_input

    def scores(self, kind: str, l: int, x: torch.Tensor) -> torch.Tensor:
        p = self.layers[l]
        if "a1" not in p:
            return (x @ p["a"].T) @ p["b"].T + p["bias"]
        return torch.relu(x @ p["a1"].T + p["bias1"]) @ p["b"].T + p["bias"]


def fit_two_layer(x_tr, c_tr, x_va, c_va, lin: dict, hidden: int, k: int, epochs: int, lr: float,
                  batch: int, seed: int, wd: float = 0.0) -> tuple[dict, list]:
    """x: [T, D] fp32 raw residual, c: [T, H] contributions, lin: `_fit_heads` output (a, b, bias).
    Returns the folded {a1 [h, D], bias1 [h], b [H, h], bias [H]} and the held-out mass per epoch."""
    gen = torch.Generator().manual_seed(seed)
    H, D = c_tr.shape[1], x_tr.shape[1]
    mu, sd = x_tr.mean(0), x_tr.std(0).clamp_min(1e-6)
    w = (lin["b"] @ lin["a"]).double()  # [H, D] the linear map on raw x
    w_n = (w * sd.double()).float()  # on standardised x
    b0 = (lin["bias"].double() + w @ mu.double()).float()  # scores = w_n (x - mu)/sd + b0
    n_lin = min(2 * H, hidden)
    a1 = torch.randn(hidden, D, generator=gen) / math.sqrt(D)
    bias1 = torch.zeros(hidden)
    b2 = torch.zeros(H, hidden)
    if n_lin == 2 * H:  # exact linear start: relu(z) - relu(-z) = z
        a1[:H], a1[H:2 * H] = w_n, -w_n
        b2[:, :H], b2[:, H:2 * H] = torch.eye(H), -torch.eye(H)
    else:  # too narrow for the exact start: random
        b2 = torch.randn(H, hidden, generator=gen) * 0.01
    bias2 = b0.clone()
    params = [t.requires_grad_() for t in (a1, bias1, b2, bias2)]
    opt = torch.optim.Adam(params, lr=lr, weight_decay=wd)
    y_tr = torch.log(c_tr + 1e-6)
    y_tr = y_tr - y_tr.mean(-1, keepdim=True)
    xn_tr, xn_va = (x_tr - mu) / sd, (x_va - mu) / sd
    fwd = lambda xn: torch.relu(xn @ a1.T + bias1) @ b2.T + bias2

    def mass() -> float:
        with torch.no_grad():
            s = fwd(xn_va)
            return (c_va.gather(-1, s.topk(k, -1).indices).sum() / c_va.sum()).item()

    snap = lambda: [t.detach().clone() for t in params]
    best, best_state, hist, bad = mass(), snap(), [], 0
    hist.append(best)
    for _ in range(epochs):
        perm = torch.randperm(len(x_tr), generator=gen)
        for i in range(0, len(x_tr), batch):
            rows = perm[i:i + batch]
            s = fwd(xn_tr[rows])
            loss = ((s - s.mean(-1, keepdim=True) - y_tr[rows]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        m = mass()
        hist.append(m)
        if m > best + 1e-5:
            best, best_state, bad = m, snap(), 0
        else:
            bad += 1
            if bad >= 3:
                break
    a1_, bias1_, b2_, bias2_ = (t.double() for t in best_state)
    # fold the standardisation: A (x - mu)/sd + a1 = (A/sd) x + (a1 - A mu/sd)
    out = {"a1": (a1_ / sd.double()).float(), "bias1": (bias1_ - a1_ @ (mu.double() / sd.double())).float(),
           "b": b2_.float(), "bias": bias2_.float()}
    return out, hist


def load_opt(name: str):
    """(model, config, tokenizer) of a preset or folder, fp32 on the CPU."""
    from dejavu.models.loader import load_model, load_tokenizer
    from dejavu.models.presets import resolve

    folder = resolve(name)
    model, cfg = load_model(folder)
    return model, cfg, load_tokenizer(folder)


def test_windows(tok, cfg, n_tokens: int) -> torch.Tensor:
    """The first n_tokens of WikiText-2 test (BOS + line-wise BPE) as windows [B, 512]."""
    from dejavu.compiler.text import encode_text
    from dejavu.datafiles import WIKITEXT2_TEST
    from dejavu.runtime.evaluation.evaluate import read_text

    window = min(512, cfg.max_position_embeddings)
    ids = torch.from_numpy(encode_text(tok, read_text(WIKITEXT2_TEST), cfg.bos_token_id,
                                       n_tokens).astype(np.int64))[:n_tokens]
    return ids[:len(ids) // window * window].view(-1, window)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, ctx_fn) -> float:
    """Perplexity over windows ids [B, S] (every position but each window's last predicts),
    one window at a time, each forward inside a fresh ctx_fn() (a selection context)."""
    nll = 0.0
    for b in range(ids.shape[0]):
        with ctx_fn():
            logp = torch.log_softmax(model(ids[b:b + 1])[0, :-1].float(), -1)
        nll -= logp.gather(-1, ids[b, 1:, None]).sum().item()
    return math.exp(nll / (ids.shape[0] * (ids.shape[1] - 1)))


@contextlib.contextmanager
def norm_oracle(model, ak: list[int]):
    """Top-K heads per token by ||y_h|| (the labels and oracle before 2026-12-05)."""
    H = model.config.num_attention_heads
    hs = []
    for l, layer in enumerate(model.decoder.layers):
        def hook(m, a, k=ak[l]):
            yh = a[0].unflatten(-1, (H, -1))  # [B, S, H, hd]
            mask = torch.zeros_like(yh[..., 0]).scatter_(-1, yh.norm(dim=-1).topk(k, -1).indices, 1.0)
            return ((yh * mask[..., None]).flatten(-2),)
        hs.append(layer.self_attn.out_proj.register_forward_pre_hook(hook))
    try:
        yield model
    finally:
        for h in hs:
            h.remove()


def allocate_heads(model, tok, pred, total: int, n_tokens: int) -> tuple[list[int], dict]:
    """K per layer within `total` heads with the least summed held-out loss increase (MLP dense):
    the build's `allocate.allocate_head_count` on its sensitivity table."""
    from dejavu.compiler.allocate import allocate_head_count, heldout_windows, measure_sensitivity, model_parts

    H = model.config.num_attention_heads
    ids, source = heldout_windows(tok, None, 0, n_tokens, 512, model.config.bos_token_id)
    sens = measure_sensitivity(*model_parts(model), ids, pred, {"attn": list(range(1, H))})
    return allocate_head_count(sens, total, H), {"source": source, "delta": sens.delta["attn"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-mini")
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--eval-tokens", type=int, default=4096, help="0: no perplexity, held-out mass only")
    p.add_argument("--heads-k", default="6", help="K in every layer, or alloc (per layer by held-out loss)")
    p.add_argument("--heldout-tokens", type=int, default=2048)
    p.add_argument("--oracles", action="store_true")
    p.add_argument("--hidden", default="0,128", help="comma list; 0 = the shipped linear least squares")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--source", default="attn_in")
    p.add_argument("--lookahead", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="head_predictor_form.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from dejavu.compiler.calibrate import calibrate
    from dejavu.compiler.config import CalibSettings, PredictorSettings
    from dejavu.compiler.masking import masked_sparsity
    from dejavu.compiler.predictors import _fit_heads, _head_labels, holdout_split
    from dejavu.fileio import write_json

    t0 = time.perf_counter()
    model, cfg, tok = load_opt(a.model)
    L, H, D, Fd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size, cfg.ffn_dim
    s = PredictorSettings(source=a.source, lookahead=a.lookahead)
    cal = calibrate(model, tok, CalibSettings(calib_tokens=a.calib_tokens), model_id=a.model, progress=False)
    split = holdout_split(cal.n_tokens, cal.n_windows, cal.window, s)
    k_lab = math.ceil(s.attn_label_density * H)
    attn_params = 4 * D * D + 4 * D
    res = {"model": a.model, "calib_tokens": cal.n_tokens, "holdout_tokens": cal.n_tokens - split,
           "source": a.source, "lookahead": a.lookahead, "epochs": a.epochs, "lr": a.lr, "wd": a.wd,
           "batch": a.batch, "forms": {}}
    data = lambda l: (torch.from_numpy(np.array(cal.predictor_input(l, s.source, s.lookahead), dtype=np.float32)),
                      torch.from_numpy(np.array(cal.head_importance(l))))
    linear = []  # the shipped fit per layer
    for l in range(L):
        x, c = data(l)
        linear.append(_fit_heads(x[:split], c[:split], x[split:], _head_labels(c[split:], k_lab), H, k_lab, s.ridge))
        linear[-1].pop("val_loss")
    if a.heads_k == "alloc":
        ak, res["sensitivity"] = allocate_heads(model, tok, HeadScores(linear, s.predictor_input), 6 * L,
                                                a.heldout_tokens)
    else:
        ak = [int(a.heads_k)] * L
    res["heads_k"] = ak
    forms = {}
    for hidden in [int(h) for h in a.hidden.split(",")]:
        layers, rows = [], []
        for l in range(L):
            x, c = data(l)
            lin, hist = linear[l], []
            if hidden:
                lin, hist = fit_two_layer(x[:split], c[:split], x[split:], c[split:], lin, hidden, ak[l],
                                          a.epochs, a.lr, a.batch, s.seed + l, a.wd)
            hs = HeadScores([lin] * (l + 1), s.predictor_input)
            with torch.no_grad():
                sc = hs.scores("attn", l, x[split:])
            cv = c[split:]
            pm = (cv.gather(-1, sc.topk(ak[l], -1).indices).sum() / cv.sum()).item()
            om = (cv.topk(ak[l], -1).values.sum() / cv.sum()).item()
            rows.append({"layer": l, "pred_mass": round(pm, 4), "oracle_mass": round(om, 4),
                         "epoch_mass": [round(v, 4) for v in hist]})
            layers.append(lin)
            print(f"hidden {hidden} layer {l}: pred {pm:.4f} oracle {om:.4f} epochs {len(hist) - 1}", flush=True)
        params = hidden * (D + 1) + H * hidden + H if hidden else H * (D + H) + H
        forms[hidden] = HeadScores(layers, s.predictor_input)
        res["forms"][str(hidden)] = {"layers": rows, "pred_mass_mean": float(np.mean([r["pred_mass"] for r in rows])),
                                     "oracle_mass_mean": float(np.mean([r["oracle_mass"] for r in rows])),
                                     "params_per_layer": params, "bytes_ratio_vs_attention": params / attn_params}
    if a.eval_tokens:
        ids = test_windows(tok, cfg, a.eval_tokens)
        ppl = lambda ctx_fn: perplexity(model, ids, ctx_fn)
        res["eval_tokens"] = ids.shape[0] * (ids.shape[1] - 1)
        mk = [Fd] * L
        if a.oracles:
            res["dense"] = ppl(lambda: torch.no_grad())
            res["oracle_norm"] = ppl(lambda: norm_oracle(model, ak))
            res["oracle_contribution"] = ppl(lambda: masked_sparsity(model, mk, ak, "oracle"))
            print({k: res[k] for k in ("dense", "oracle_norm", "oracle_contribution")}, flush=True)
        for hidden, hs in forms.items():
            v = ppl(lambda hs=hs: masked_sparsity(model, mk, ak, "predicted", hs))
            res["forms"][str(hidden)]["ppl"] = v
            print(f"hidden {hidden}: perplexity {v:.3f}", flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(a.out, res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

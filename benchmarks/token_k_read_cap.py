"""Does the cap k_max = cap * K_l bind a per-token K fitted to rows read (`--token-k-rows read`)?

Masked dense, heads dense, the build's predictors (pickled: `build_density_set.py --save-predictors`),
opt-mini fp32. For each MLP density (K_l as `--mlp-density D --attn-density 1.0` resolves it) and
each cap, theta_l is fitted as `resolve_token_k` fits it (layer by layer through the engine, on the
build's first held-out set, WikiText-2 validation tokens [0, 2048)) and the engine is scored on
WikiText-2 test: perplexity, mean fc1 (kept) and fc2 (nonzero kept) rows per layer.

    python benchmarks/token_k_read_cap.py --predictors P.pkl --eval-tokens 8192 --densities 0.1 0.2 0.3 \
        --caps 2 3 4 6 --out F
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
import pickle

import numpy as np
import torch

from dejavu.compiler.allocate import heldout_windows, model_parts
from dejavu.compiler.density import resolve_density
from dejavu.compiler.text import encode_text
from dejavu.compiler.token_k import _engine_pass
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.models.loader import load_model, load_tokenizer


def score(parts, preds, windows, mlp_k, attn_k, tk, cap, batch: int = 4):
    """(perplexity, fc1 rows [L], fc2 rows [L]) over windows [B, S], `batch` windows a pass."""
    nll, r1, r2, n = 0.0, 0.0, 0.0, 0
    for i in range(0, windows.shape[0], batch):
        b = windows[i:i + batch]
        v, _, a, c = _engine_pass(parts, preds, b, mlp_k, attn_k, tk, cap)
        nll, r1, r2, n = nll + v * len(b), np.asarray(a) * len(b) + r1, np.asarray(c) * len(b) + r2, n + len(b)
    return math.exp(nll / n), (r1 / n).tolist(), (r2 / n).tolist()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predictors", required=True)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    ap.add_argument("--caps", type=float, nargs="+", default=[2.0, 3.0, 4.0, 6.0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, cfg = load_model("opt-mini")
    model = model.float().eval()
    tok = load_tokenizer("opt-mini")
    preds = pickle.loads(Path(args.predictors).read_bytes())
    parts = lambda: model_parts(model)  # noqa: E731
    L, F, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    fit_ids, fit_src = heldout_windows(tok, None, 0, 2048, 512, cfg.bos_token_id)
    test = torch.from_numpy(encode_text(tok, WIKITEXT2_TEST.read_text(encoding="utf-8"), cfg.bos_token_id,
                                        max_tokens=args.eval_tokens).astype(np.int64))
    test = test[:test.numel() // 512 * 512].view(-1, 512)
    res = {"fitted_on": fit_src, "test_tokens": test.shape[0] * 511, "runs": []}
    with torch.no_grad():
        res["dense_ppl"] = score(parts, preds, test, [F] * L, [H] * L, None, 2.0)[0]
        print("dense", res["dense_ppl"], flush=True)
        for d in args.densities:
            mk, _ = resolve_density(cfg, 1.0, d, 1.0, recall_curves=preds.recall_curves)
            for cap in args.caps:
                _, tk, fit1, fit2 = _engine_pass(parts, preds, fit_ids, mk, [H] * L, None, cap, "read")
                ppl, r1, r2 = score(parts, preds, test, mk, [H] * L, tk, cap)
                row = {"density": d, "cap": cap, "mlp_k": mk, "k_max": list(tk.k_max), "threshold": list(tk.threshold),
                       "fit_rows_read": [a + b for a, b in zip(fit1, fit2)], "test_fc1": r1, "test_fc2": r2,
                       "test_ppl": ppl, "test_pct": 100 * (ppl / res["dense_ppl"] - 1)}
                res["runs"].append(row)
                print(d, cap, "test %+.3f%%" % row["test_pct"], "rows fc1 %.0f fc2 %.0f of %d" % (sum(r1), sum(r2), 2 * sum(mk)),
                      "fit read", [round(v) for v in row["fit_rows_read"]], "2K", [2 * k for k in mk], flush=True)
    with atomic_path(Path(args.out)) as tmp:
        tmp.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()

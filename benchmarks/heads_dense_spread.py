"""`--density B --attn-density 1.0` (every head kept, neurons free): the neurons' K that the
build's `resolve_k` picks at the bytes B of `--mlp-density D`, against the curves' K of
`--mlp-density D`, masked dense on WikiText-2 test (heads dense).

Predictors: a pickled `Predictors` (benchmarks/mlp_allocation_study.py --predictors writes one).
Sensitivity tables are cached under $DEJAVU_CACHE/sensitivity as the build caches them.

    python benchmarks/heads_dense_spread.py --predictors P.pkl --eval-tokens 2048 --out F
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
from pathlib import Path

import numpy as np
import torch

from dejavu.compiler.allocate import ByteCosts, model_parts, resolve_k
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.density import resolve_density
from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.text import encode_text
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.metrics import perplexity


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predictors", required=True)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, cfg = load_model("opt-mini")
    model = model.float().eval()
    tok = load_tokenizer("opt-mini")
    preds = pickle.loads(Path(args.predictors).read_bytes())
    L = cfg.num_hidden_layers
    ids = torch.from_numpy(encode_text(tok, WIKITEXT2_TEST.read_text(encoding="utf-8"), cfg.bos_token_id,
                                       max_tokens=args.eval_tokens or None).astype(np.int64))
    ppl = lambda: perplexity(lambda x: model(x), ids, 512, batch=4)["perplexity"]  # noqa: E731
    out = {}
    with torch.no_grad():
        dense = ppl()
        for d in args.densities:
            mk, ak = resolve_density(cfg, 1.0, d, 1.0, recall_curves=preds.recall_curves)
            rank = math.ceil(sum(int(p["a"].shape[0]) for p in preds.mlp) / L)  # as resolve_k counts it
            costs = ByteCosts.of(cfg, (rank, int(preds.attn[0]["a"].shape[0])), 4)
            frac = math.ceil(costs.total(mk, ak) / costs.dense * 1e6) / 1e6
            c = BuildConfig(density=frac, attn_density=1.0, dtype="float32")
            kk, ka, rep = resolve_k(lambda: model_parts(model), cfg, c, preds, tok, "opt-mini", progress=False)
            row = {"bytes": frac, "build_k": kk, "curves_k": mk, "heldout": rep["heldout"]}
            for name, ks in (("build", kk), ("curves", mk)):
                with masked_sparsity(model, ks, ka, "predicted", preds):
                    row[f"{name}_pct"] = 100 * (ppl() / dense - 1)
            out[str(d)] = row
            print(d, json.dumps(row), flush=True)
    with atomic_path(Path(args.out)) as tmp:
        tmp.write_text(json.dumps({"dense": dense, "tokens": int(len(ids) - 1), **out}, indent=1))
    return out


if __name__ == "__main__":
    main()

"""Which calibration tokens the residual rotation's PCA and the TEAL thresholds are fitted on (study).

    python benchmarks/llama_rotation_fit.py --fits same:0:8192:0:8192 split:0:4096:4096:8192 \
        --keep 4 --levels 0.25 0.4 0.5 --ppl-tokens 2048 --out F.json

Each fit NAME:P0:P1:T0:T1 rotates a fresh copy of the model (compiler/rotate_llama.py) into the
PCA of the calibration file's tokens [P0, P1) and calibrates the thresholds on its tokens
[T0, T1) (`same`: one range, as the build does). For every fit and level it measures the
realized skip and NLL on held-out calibration-file tokens (--heldout FROM:TO, disjoint from
every fit) and the perplexity and realized skip on the first --ppl-tokens of WikiText-2 test.
--kind-levels: by-kind runs, skips from --sensitivity (a llama_sparsity.py sensitivity JSON).
--match test|heldout: a second run per level with the target moved by (level - realized skip on
that text), so fits can be compared at equal realized skip. A fit spec may end with :shrinkA (the moment
shrunk toward its diagonal by A before the eigenbasis).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import torch

from dejavu.compiler.allocate_llama import Sensitivity, allocate_skips, heldout_nll, input_bytes, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, GatedSparsity, calibrate, gated_sparsity
from dejavu.compiler.rotate_llama import fold_norms, pca_basis, residual_moment, rotate_residual
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import atomic_path
from dejavu.runtime.evaluation.evaluate import _wrap_logits, eval_perplexity, load_scoring_model, read_text, text_ids


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--fits", nargs="+", required=True, metavar="NAME:P0:P1:T0:T1[:shrinkA]")
    p.add_argument("--keep", nargs="+", type=int, default=[4])
    p.add_argument("--levels", nargs="*", type=float, default=[0.25, 0.4, 0.5])
    p.add_argument("--kind-levels", nargs="*", type=float, default=[])
    p.add_argument("--sensitivity", metavar="FILE")
    p.add_argument("--heldout", default="12288:16384", metavar="FROM:TO")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--no-test", action="store_true", help="held-out calibration tokens only")
    p.add_argument("--match", choices=["test", "heldout"], help="a second run per level, the target moved by "
                   "(level - realized skip) on that text")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _windows(ids, a, b, window):
    x = ids[a:b]
    return x[: x.numel() // window * window].view(-1, window)


@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sm = load_scoring_model(args.model)
    base = sm.info["model"]
    fits = [f.split(":") for f in args.fits]
    top = max(max(int(f[2]), int(f[4])) for f in fits)
    h0, h1 = map(int, args.heldout.split(":"))
    ids = text_ids(sm, read_text(CALIB_TEXT), max(top, h1))
    held = _windows(ids, h0, h1, args.window)
    text = read_text(WIKITEXT2_TEST)
    sens = None
    if args.sensitivity:
        d = json.loads(Path(args.sensitivity).read_text())
        sens = Sensitivity(tuple(d["levels"]), d["delta"], d["dense_nll"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res = {"model": args.model, "commit": commit, "machine": platform.node(), "argv": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "heldout_tokens": [h0, h1], "runs": []}

    def save():
        with atomic_path(Path(args.out)) as tmp:
            tmp.write_text(json.dumps(res, indent=2), encoding="utf-8")

    res["dense_heldout_nll"] = heldout_nll(base, held)
    for keep in args.keep:
        for f in fits:
            name, p0, p1, t0, t1 = f[0], *map(int, f[1:5])
            shrink = float(f[5].removeprefix("shrink")) if len(f) > 5 else 0.0
            t = time.perf_counter()
            model = copy.deepcopy(base)
            m = residual_moment(model, _windows(ids, p0, p1, args.window))
            if shrink:
                m = (1 - shrink) * m + shrink * torch.diag(m.diagonal())
            q = pca_basis(m, keep)
            fold_norms(model)
            rotate_residual(model, q)
            calib = calibrate(model, _windows(ids, t0, t1, args.window))
            msm = dataclasses.replace(sm, logits_fn=_wrap_logits(model, "cpu"))
            prep = round(time.perf_counter() - t, 1)
            todo = [("uniform", s) for s in args.levels] + [("kind", s) for s in args.kind_levels]
            for alloc, goal in todo:
                target = goal
                for attempt in range(2 if args.match else 1):
                    skips = ({k: target for k in KEYS} if alloc == "uniform"
                             else allocate_skips(sens, input_bytes(model.config), target))
                    th = kind_thresholds(calib, skips)
                    row = {"fit": name, "keep": keep, "pca_tokens": [p0, p1], "threshold_tokens": [t0, t1],
                           "shrink": shrink, "allocation": alloc, "goal": goal, "target_skip": round(target, 4),
                           "skips": {k: round(v, 4) for k, v in skips.items()}, "prep_seconds": prep}
                    with gated_sparsity(model, th, GatedSparsity(skip=0.5)) as reads:
                        nll = heldout_nll(model, held)
                    row.update(heldout_realized_skip=round(reads.skipped, 4), heldout_nll=round(nll, 5),
                               heldout_pct=round(100 * (math.exp(nll - res["dense_heldout_nll"]) - 1), 3))
                    if not args.no_test:
                        with gated_sparsity(model, th, GatedSparsity(skip=0.5)) as reads:
                            r = eval_perplexity(msm, text, args.window, args.ppl_tokens, batch=8, progress=False)
                        row.update(test_realized_skip=round(reads.skipped, 4), perplexity=r["perplexity"],
                                   ppl_tokens=r["tokens"])
                    res["runs"].append(row)
                    print(json.dumps(row), flush=True)
                    save()
                    if args.match == "test" and args.no_test:
                        break
                    target = target + (goal - row[f"{args.match}_realized_skip"]) if args.match else target
            del model


if __name__ == "__main__":
    main()

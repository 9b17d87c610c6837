"""Seconds of the MLP predictors' reduced-rank start (`compiler.predictors._rrr_init`) at a layer's shape.

    python benchmarks/rank_start_time.py --dims 2048 8192 --tokens 4096 --rank 512 [--device cpu] [--out F]

Random standardised inputs x [tokens, D] and labels (10% positive) [tokens, N]: the start's cost does
not depend on their values (the streamed XᵀX / XᵀY, the ridge solve, the top right singular vectors of
the whitened map). `--predictors-py` times another tree's compiler/predictors.py (e.g. `git show
REV:compiler/predictors.py > F`) in this process; a JSON line on stdout (and appended to --out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs=2, metavar=("D", "N"), default=(2048, 8192))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--ridge", type=float, default=1e-3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--predictors-py", default=None, help="time this file's _rrr_init instead of the installed one")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dejavu.compiler import predictors as P

    if a.predictors_py:
        import importlib.util

        spec = importlib.util.spec_from_file_location("predictors_under_test", a.predictors_py)
        P = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = P  # dataclasses look their module up
        spec.loader.exec_module(P)
    D, N = a.dims
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.tokens, D, generator=g).to(a.device)
    y = (torch.rand(a.tokens, N, generator=g) < 0.1).to(a.device)
    mu, sd = x.mean(0), x.std(0)
    secs = []
    for _ in range(a.repeats):
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        P._rrr_init(x, y, mu, sd, a.rank, a.ridge)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        secs.append(round(time.perf_counter() - t, 6))
    from dejavu.provenance import tree_commit

    commit = tree_commit(Path(__file__))
    row = {"D": D, "N": N, "tokens": a.tokens, "rank": a.rank, "device": a.device, "threads": torch.get_num_threads(),
           "seconds": secs, "min_s": min(secs), "predictors": a.predictors_py or "installed", "commit": commit,
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

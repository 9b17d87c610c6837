"""Quality per byte of gated-MLP sparsity methods on a Llama-family model (CPU, masked dense).

    python benchmarks/llama_sparsity.py --model smollm2-135m --out benchmarks/results/llama_sparsity.json

For each method of `dejavu.compiler.gated_sparsity` (teal; cats and lowrank were measured with
commit ab41bba's version of this script and removed) and each target
fraction of block weight bytes skipped (--levels), the WikiText-2 test perplexity over the first
--ppl-tokens tokens in windows of --window, and the realized fraction skipped on that text.
Thresholds come from --calib-tokens tokens of the shipped calibration text
(WikiText-2 *train* head), never from the evaluation text. --task-runs names the runs that
also get the six shipped tasks (--task-limit examples each), after every run's perplexity.
--allocations: `uniform` (every input at the level; runs "teal@S") and/or `sensitivity` (runs
"teal+sens@S": one skip per input kind by the held-out loss increase of each kind,
compiler/allocate_llama.py, measured on the --heldout-tokens calibration-file tokens after the
calibration tokens, never the evaluation text).
--rotate-keep K: first rotate the model's residual stream into the principal components of the
normalised states of the --calib-tokens calibration-file tokens after the thresholds' (as the build
does; the sensitivity's tokens then follow those), the K channels of largest mean square kept
(compiler/rotate_llama.py; the dense model's function is unchanged).
The JSON is rewritten after every run, so an interrupted study keeps what it finished.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from pathlib import Path

import torch

from dejavu.compiler.allocate_llama import Sensitivity, allocate_skips, input_bytes, kind_thresholds, measure_sensitivity
from dejavu.compiler.gated_sparsity import METHODS, GatedSparsity, Reads, calibrate, gated_sparsity
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import write_json
from dejavu.provenance import tree_commit
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids
from dejavu.runtime.evaluation.tasks import TASKS, evaluate_task, load_task


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--levels", nargs="+", type=float, default=[0.25, 0.4, 0.5])
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--calib-cache", metavar="FILE", help="load the calibration from FILE if it exists, else save it there")
    p.add_argument("--allocations", nargs="+", default=["uniform"], choices=["uniform", "sensitivity"])
    p.add_argument("--heldout-tokens", type=int, default=2048, help="calibration-file tokens for the sensitivity")
    p.add_argument("--sensitivity-cache", metavar="FILE", help="load the sensitivity from FILE if it exists, else save it")
    p.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True, help="include the dense run")
    p.add_argument("--task-runs", nargs="*", default=[], metavar="METHOD@SKIP",
                   help='runs that also get the tasks, e.g. "dense teal@0.25"')
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--task-limit", type=int, default=0, help="examples per task (0: no tasks)")
    p.add_argument("--no-ppl", action="store_true", help="tasks only (with --task-limit)")
    p.add_argument("--rotate-keep", type=int, default=None, metavar="K",
                   help="rotate the residual stream first, keeping the K largest channels (default: no rotation)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _tasks(sm, names, limit, out: dict, save) -> None:
    """Each task's result into `out` as it finishes (saved each time: a long run keeps its part)."""
    for name in names:
        task = load_task(name, limit)
        r = evaluate_task(task, sm.logits_fn, sm.encode, sm.bos_id, sm.max_len, 8, False)
        out[task.name] = r.as_dict()
        save()


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sm = load_scoring_model(args.model)
    model = sm.info["model"]
    res = {"model": args.model, "commit": tree_commit(Path(__file__)), "machine": platform.node(), "argv": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}

    def save():
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, res, indent=2)

    if args.rotate_keep is not None:
        from dejavu.compiler.rotate_llama import rotate_llama

        ids = text_ids(sm, read_text(CALIB_TEXT), 2 * args.calib_tokens)[args.calib_tokens:]
        rotate_llama(model, ids[:ids.numel() // args.window * args.window].view(-1, args.window), args.rotate_keep)
        res["rotation"] = {"keep": args.rotate_keep, "tokens": [args.calib_tokens,
                                                                args.calib_tokens + ids.numel() // args.window * args.window]}
    text = read_text(WIKITEXT2_TEST)
    task_runs = set(args.task_runs)
    methods = [m if a == "uniform" else f"{m}+sens" for m in args.methods for a in args.allocations]
    runs = ([("dense", 0.0)] if args.dense else []) + [(m, s) for s in args.levels for m in methods]
    if args.no_ppl:  # only the runs that get tasks
        runs = [(m, s) for m, s in runs if ("dense" if m == "dense" else f"{m}@{s:g}") in task_runs]
    calib = None
    if any(m != "dense" for m, _ in runs):
        calib = _calibration(sm, args, res)
    if any(m.endswith("+sens") for m, _ in runs):
        calib = {"calib": calib, "sens": _sensitivity(sm, calib, args, res)}
    def ppl(row):
        r = eval_perplexity(sm, text, args.window, args.ppl_tokens, batch=8, progress=False)
        row.update(perplexity=r["perplexity"], ppl_tokens=r["tokens"], window=args.window)

    rows = {}
    for method, skip in runs:  # perplexity of every run first, then the tasks (the long part)
        name = "dense" if method == "dense" else f"{method}@{skip:g}"
        rows[name] = {"run": name, "method": method, "target_skip": skip}
        res["runs"].append(rows[name])
        if not args.no_ppl:
            _run(model, calib, method, skip, rows[name], save, ppl, "realized_skip")
    for method, skip in runs:
        name = "dense" if method == "dense" else f"{method}@{skip:g}"
        if args.task_limit and name in task_runs:
            rows[name]["tasks"] = {}
            _run(model, calib, method, skip, rows[name], save,
                 lambda row: _tasks(sm, args.tasks, args.task_limit, row["tasks"], save), "tasks_realized_skip")


def _calibration(sm, args, res: dict):
    """Calibrate on the shipped calibration text (or load --calib-cache written by an earlier run)."""
    t0 = time.perf_counter()
    calib_ids = text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens)
    n = calib_ids.numel() // args.window * args.window
    cache = Path(args.calib_cache) if args.calib_cache else None
    if cache is not None and cache.is_file():
        calib = torch.load(cache, weights_only=False)
    else:
        calib = calibrate(sm.info["model"], calib_ids[:n].view(-1, args.window))
        if cache is not None:
            torch.save(calib, cache)
    res["calib"] = {"file": "dejavu/data/calib/wikitext2-train-head.txt", "tokens": n,
                    "seconds": round(time.perf_counter() - t0, 1)}
    return calib


def _calib_end(args) -> int:
    """The calibration file's tokens used before the held-out ones: the thresholds' and the rotation's."""
    return args.calib_tokens * (1 if args.rotate_keep is None else 2)


def _sensitivity(sm, calib, args, res: dict) -> Sensitivity:
    """Per-kind held-out loss increases on the calibration file's tokens after the calibration ones."""
    t0 = time.perf_counter()
    cache = Path(args.sensitivity_cache) if args.sensitivity_cache else None
    if cache is not None and cache.is_file():
        sens = Sensitivity(**{k: (tuple(v) if k == "levels" else v) for k, v in json.loads(cache.read_text()).items()})
    else:
        first = _calib_end(args)
        ids = text_ids(sm, read_text(CALIB_TEXT), first + args.heldout_tokens)[first:]
        n = ids.numel() // args.window * args.window
        sens = measure_sensitivity(sm.info["model"], calib, ids[:n].view(-1, args.window),
                                   progress=lambda k, s, d: print(f"sensitivity {k} {s:g}: {d:+.5f}", flush=True))
        if cache is not None:
            write_json(cache, sens.to_dict(), indent=None)
    res["sensitivity"] = {**sens.to_dict(), "tokens": [_calib_end(args), _calib_end(args) + args.heldout_tokens],
                          "seconds": round(time.perf_counter() - t0, 1)}
    return sens


def _run(model, calib, method, skip, row: dict, save, body, skip_key: str) -> None:
    """body(row) with the setting applied; the realized skip on what it evaluated into row[skip_key]."""
    t0 = time.perf_counter()
    if isinstance(calib, dict):  # with a sensitivity: the allocated runs get their per-kind thresholds
        skips = allocate_skips(calib["sens"], input_bytes(model.config), skip) if method.endswith("+sens") else None
        if skips:
            row["skips"] = {k: round(v, 4) for k, v in skips.items()}
        calib = kind_thresholds(calib["calib"], skips) if skips else calib["calib"]
    s = GatedSparsity("teal" if method == "dense" else method.removesuffix("+sens"), skip)
    with (gated_sparsity(model, calib, s) if calib is not None and skip > 0 else contextlib.nullcontext(Reads())) as reads:
        body(row)
    row[skip_key] = round(reads.skipped, 4)
    row[skip_key.replace("realized_skip", "seconds")] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: v for k, v in row.items() if k != "tasks"}), flush=True)
    save()


if __name__ == "__main__":
    main()

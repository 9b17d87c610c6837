"""Each task's accuracy difference from dense, with its paired standard error, from recorded results.

    python benchmarks/task_deltas.py benchmarks/results/llama_eval_smollm2_dense_tasks500.json \
        benchmarks/results/llama_eval_smollm2_d0.8_distill1000_tasks500.json \
        A_tasks100.json+A_tasks_rest.json --out deltas.json

The first file is the dense reference, every other argument a file of runs (`dejavu-eval --json`
output: one run, or {"runs": [...]}, each run in it taken; a benchmark file whose runs hold "tasks"
the same; dense runs in them are left out unless --with-dense: the dense model in another dtype is
the control that says how far a change which leaves perplexity where it is moves a task).
Arguments joined by '+' are one run recorded in parts: a part's task named T_A_B holds examples
A..B (1-based) of the shipped task T, one named T its first n, or with the part given as FILE@K its
n from example K on. Each prediction is scored against the task file's gold answer, and a run is
compared with dense on the examples both scored: the difference in points and its paired standard
error (`tasks.paired_difference`), which is what says whether a difference of a point or two is the
model or the draw of the examples, and how many examples the run answers otherwise than dense.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from dejavu.errors import DejavuError
from dejavu.fileio import write_json
from dejavu.runtime.evaluation.tasks import TASKS, load_task, paired_difference

PART = re.compile(r"^(?P<task>.+)_(?P<a>\d+)_(?P<b>\d+)$")
NORM = " (acc_norm)"


def runs_of(path: str, dense: bool = False) -> list[dict]:
    """The runs with tasks in a file; FILE@K marks each (as "_first": K - 1) as starting at example K.
    dense=False leaves dense runs out."""
    path, _, first = path.partition("@")
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    runs = d["runs"] if isinstance(d, dict) and "runs" in d else [d]
    runs = [r for r in runs if isinstance(r, dict) and r.get("tasks")]
    if not dense:
        runs = [r for r in runs if r.get("kind") != "dense" and r.get("density", 0) is not None]
    return [{**r, "_first": int(first) - 1 if first else 0} for r in runs]


def name_of(run: dict) -> str:
    name = str(run.get("run") or run.get("model") or "?")
    return f"{name} ({run['dtype']})" if run.get("kind") == "dense" and run.get("dtype") else name


def predictions(run_parts: list[dict]) -> dict[str, dict[int, int]]:
    """{task: {example index (0-based): prediction}} over the parts of one run; a task that reports
    acc_norm (piqa, openbookqa) also as "task (acc_norm)", its length-normalised predictions."""
    out: dict[str, dict[int, int]] = {}
    for run in run_parts:
        for key, res in run["tasks"].items():
            if "preds" not in res:
                continue
            m = PART.match(key)
            task, first = (m["task"], int(m["a"]) - 1) if m and m["task"] in TASKS else (key, run["_first"])
            if m and task in TASKS and first + len(res["preds"]) != int(m["b"]):
                raise DejavuError(f"{key}: {len(res['preds'])} predictions for examples {m['a']}..{m['b']}")
            for name, preds in ((task, res["preds"]), (task + NORM, res.get("preds_norm"))):
                got = out.setdefault(name, {}) if preds is not None else {}
                for i, p in enumerate(preds or ()):
                    got[first + i] = int(p)
    return out


def deltas(dense: dict[str, dict[int, int]], run: dict[str, dict[int, int]]) -> dict[str, dict]:
    rows = {}
    for task in dense:
        base = task.removesuffix(NORM)
        if task not in run or base not in TASKS:
            continue
        idx = sorted(set(dense[task]) & set(run[task]))
        if not idx:
            continue
        gold = [ex.gold for ex in load_task(base, limit=idx[-1] + 1).examples]
        a = [int(dense[task][i] == gold[i]) for i in idx]
        b = [int(run[task][i] == gold[i]) for i in idx]
        diff, se = paired_difference(a, b)
        rows[task] = {"n": len(idx), "dense": round(100 * sum(a) / len(a), 2),
                      "run": round(100 * sum(b) / len(b), 2), "diff": round(100 * diff, 2),
                      "paired_se": None if se is None else round(100 * se, 2),
                      "changed": sum(dense[task][i] != run[task][i] for i in idx)}  # examples answered otherwise
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dense", help="the dense run's file")
    p.add_argument("runs", nargs="+", help="files of runs; FILE+FILE... for one run in parts")
    p.add_argument("--out", help="write the table as JSON there")
    p.add_argument("--with-dense", action="store_true",
                   help="keep dense runs among the runs (the dense model in another dtype: a control)")
    args = p.parse_args(argv)
    try:
        dense_runs = runs_of(args.dense, dense=True)
        if len(dense_runs) != 1:
            raise DejavuError(f"{args.dense}: expected one dense run, found {len(dense_runs)}")
        dense = predictions(dense_runs)
        out = []
        for spec in args.runs:
            files = spec.split("+")
            if len(files) > 1:
                groups = [[r for f in files for r in runs_of(f, args.with_dense)]]
            else:
                groups = [[r] for r in runs_of(spec, args.with_dense)]
            for parts in groups:
                out.append({"run": name_of(parts[0]), "files": files, "tasks": deltas(dense, predictions(parts))})
    except (OSError, ValueError, KeyError, DejavuError) as e:
        raise SystemExit(f"dejavu: error: {e}") from None
    for r in out:
        print(f"\n{r['run']} ({' + '.join(r['files'])})")
        print("| task | n | dense | run | difference ± paired SE (points) | answered otherwise |")
        print("|---|---|---|---|---|---|")
        for task, t in r["tasks"].items():
            se = "" if t["paired_se"] is None else f" ± {t['paired_se']:.1f}"
            print(f"| {task} | {t['n']} | {t['dense']:.1f} | {t['run']:.1f} | {t['diff']:+.1f}{se} | {t['changed']} |")
    if args.out:
        write_json(args.out, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

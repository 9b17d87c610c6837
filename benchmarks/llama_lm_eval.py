"""One shipped multiple-choice task through lm-evaluation-harness (the `dejavu` adapter) on a
Llama-family model, dense and with TEAL input sparsity (masked dense), beside dejavu's own scorer.

    python benchmarks/llama_lm_eval.py --task copa --skips 0 0.25 --out benchmarks/results/llama_lm_eval.json

lm_eval reads the task from a local YAML over the shipped jsonl ({"query","choices","gold"} files:
copa, piqa, openbookqa); thresholds come from --calib-tokens tokens of the calibration text, as in
benchmarks/llama_sparsity.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

from dejavu.compiler.gated_sparsity import GatedSparsity, calibrate, gated_sparsity
from dejavu.datafiles import CALIB_TEXT, TASKS_DIR
from dejavu.fileio import write_json
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
from dejavu.runtime.evaluation.tasks import TASKS, evaluate_task, load_task

CALIB_FILE = CALIB_TEXT
YAML = """task: dejavu_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="copa", choices=("copa", "piqa", "openbookqa"))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--skips", nargs="+", type=float, default=[0.0, 0.25])
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-cache", metavar="FILE", help="a calibration saved by llama_sparsity.py --calib-cache")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from dejavu.runtime.lm_eval_adapter import DejavuLM

    sm = load_scoring_model(args.model)
    model = sm.info["model"]
    calib = None
    if args.calib_cache:
        calib = torch.load(args.calib_cache, weights_only=False)
    elif any(s > 0 for s in args.skips):
        ids = text_ids(sm, read_text(CALIB_FILE), args.calib_tokens)
        n = ids.numel() // args.window * args.window
        calib = calibrate(model, ids[:n].view(-1, args.window))
    lm = DejavuLM(model=sm, batch_size=8)
    res = {"model": args.model, "task": args.task, "argv": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "t.yaml").write_text(YAML.format(name=args.task, data=TASKS_DIR / TASKS[args.task][0]))
        tm = TaskManager(include_path=tmp, include_defaults=False)
        for skip in args.skips:
            ctx = gated_sparsity(model, calib, GatedSparsity("teal", skip)) if skip > 0 else contextlib.nullcontext()
            with ctx, torch.no_grad():
                r = simple_evaluate(model=lm, tasks=[f"dejavu_{args.task}"], task_manager=tm, limit=args.limit,
                                    bootstrap_iters=0, log_samples=False)
                ours = evaluate_task(load_task(args.task, args.limit), sm.logits_fn, sm.encode, sm.bos_id,
                                     sm.max_len, 8, False)
            row = {"skip": skip, "lm_eval_acc": r["results"][f"dejavu_{args.task}"]["acc,none"],
                   "dejavu_acc": ours.acc, "n": ours.n}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
    write_json(args.out, res, indent=2)


if __name__ == "__main__":
    main()

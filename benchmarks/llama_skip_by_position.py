"""The TEAL skip a Llama-family model realizes, by token position, on WikiText-2 windows and task texts.

    python benchmarks/llama_skip_by_position.py --skip 0.25 --examples 150 \
        --out benchmarks/results/llama_skip_by_position_2026-12-06.json

Thresholds: one level `--skip` for every projection input (compiler/gated_sparsity.thresholds), calibrated on
the first --calib-tokens tokens of the shipped calibration text in windows of 512, as the build calibrates.
Then, with those thresholds applied (masked dense), the fraction of each input's weight bytes left unread,
per position bucket: on --test-windows windows of 512 tokens of WikiText-2 test, on the calibration windows
themselves, and on the first --examples examples of each task (an example's first choice, context and
continuation as the task scorer feeds them, BOS first). Why short texts skip more than the level: a
sequence's first position holds the model's attention sink, whose inputs sit in a few massive channels.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dejavu.compiler.gated_sparsity import (KEYS, GatedSparsity, calibrate, gated_sparsity, input_hooks,
                                           projection_bytes, thresholds)
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import write_json
from dejavu.provenance import tree_commit
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
from dejavu.runtime.evaluation.tasks import TASKS, load_task, tokenize_pair

BUCKETS = ((0, 1), (1, 8), (8, 32), (32, 64), (64, 128), (128, 256), (256, 512))
WINDOW = 512


class PositionCounter:
    """`hook` for gated_sparsity.input_hooks (the first projection of each input: q, o, gate, down): per position,
    the input entries kept (|x| > t) and the weight bytes they read against dense."""

    def __init__(self, model, t: dict, max_pos: int):
        b = projection_bytes(model.config)
        self.nbytes = {"attn_in": b["attn_in"], "o_in": b["o_in"], "mlp_in": b["gate"] + b["up"], "down_in": b["down"]}
        self.model, self.t, self.P = model, t, max_pos
        self.reset()

    def reset(self) -> None:
        z = lambda: torch.zeros(self.P, dtype=torch.float64)  # noqa: E731
        self.read, self.dense, self.rows = z(), z(), z()
        self.kept = {k: z() for k in KEYS}

    def hook(self, key: str, l: int):
        def f(m, a):
            keep = (a[0].abs() > self.t[key][l]).double().mean(-1)  # [B, S]: the kept fraction of the entries
            s = keep.shape[1]
            self.kept[key][:s] += keep.sum(0)
            self.read[:s] += keep.sum(0) * self.nbytes[key]
            self.dense[:s] += keep.shape[0] * self.nbytes[key]
            if key == "attn_in":
                self.rows[:s] += keep.shape[0]  # token-layers at each position
        return f

    def summary(self, name: str) -> dict:
        out = {"text": name, "skip": round(float(1 - self.read.sum() / self.dense.sum()), 4), "by_position": {}}
        for lo, hi in BUCKETS:
            n = float(self.rows[lo:hi].sum())
            if n:
                row = {"token_layers": n, "skip": round(float(1 - self.read[lo:hi].sum() / self.dense[lo:hi].sum()), 4)}
                row.update({k: round(float(1 - self.kept[k][lo:hi].sum() / n), 4) for k in KEYS})
                out["by_position"][f"{lo}-{hi}"] = row
        return out


@torch.no_grad()
def measure(model, t: dict, skip: float, name: str, batches, max_pos: int) -> dict:
    """The skip by position on one text (batches of ids [B, S], S <= max_pos) under thresholds t, with
    gated_sparsity's own count of the whole text beside it ("skip_counted")."""
    counter = PositionCounter(model, t, max_pos)
    with gated_sparsity(model, t, GatedSparsity("teal", skip)) as reads, input_hooks(model, counter.hook):
        for ids in batches:  # the counter's hooks after the masking hooks: they see the masked input (skipped 0)
            model(ids)
    return {**counter.summary(name), "skip_counted": round(reads.skipped, 4)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--skip", type=float, default=0.25)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=WINDOW, help="calibration and test window")
    p.add_argument("--test-windows", type=int, default=8)
    p.add_argument("--examples", type=int, default=150, help="examples a task (0: no tasks)")
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--out")
    args = p.parse_args(argv)
    sm = load_scoring_model(args.model)
    model, w = sm.info["model"], args.window
    calib_ids = text_ids(sm, read_text(CALIB_TEXT), args.calib_tokens)
    calib_ids = calib_ids[:calib_ids.numel() // w * w].view(-1, w)
    t = thresholds(calibrate(model, calib_ids), args.skip)
    test = text_ids(sm, read_text(WIKITEXT2_TEST), args.test_windows * w).view(-1, w)
    texts = [(f"wikitext-2 test, {test.shape[0]} x {w}", test.split(2)),
             (f"calibration, {calib_ids.shape[0]} x {w}", calib_ids.split(2))]
    for name in args.tasks if args.examples else []:
        task = load_task(name, args.examples)
        seqs = [tokenize_pair(sm.encode, *ex.pairs[0], sm.bos_id, w).ids[:-1] for ex in task.examples]
        texts.append((f"{task.name}, {len(seqs)} examples", [torch.tensor(s)[None] for s in seqs]))
    res = {"model": args.model, "skip": args.skip, "calib_tokens": calib_ids.numel(), "commit": tree_commit(Path(__file__)),
           "machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "texts": []}
    for name, batches in texts:
        res["texts"].append(measure(model, t, args.skip, name, batches, w))
        print(json.dumps(res["texts"][-1]), flush=True)
    if args.out:
        write_json(args.out, res, indent=2)
    return res


if __name__ == "__main__":
    main()

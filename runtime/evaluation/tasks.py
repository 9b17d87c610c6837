"""Zero-shot tasks: loaders for the shipped files (and a user's jsonl) and the scoring code.

Every task becomes a list of `Example`s: a few (context, continuation) pairs and a gold
index. The scorer is the same for every backend (dense PyTorch model or engine): it only
needs `logits_fn(ids[B, S]) -> logits[B, S, V]` (with `contexts_as_prompts`,
`logits_fn(ids, prompt_lens[B])`: an engine's decode loop prefills each example's context
as a prompt), so a dense run and an engine run compare the same tokens the same way.

Task formats (one JSON object per line), detected from the keys:
- `{"query", "choices", "gold"}`  multiple choice: context = query, continuation = " " + choice
  (no space is added when the query already ends with whitespace). This is the format for a
  user's own task file.
- `{"context_options", "continuation", "gold"}`  partial scoring (WinoGrande): one context per
  option, the shared continuation " " + continuation is scored after each.
- `{"context", "continuation"}`  last-word prediction (LAMBADA): correct when the greedy
  continuation equals the target tokens.
- `{"premise", "hypothesis", "label"}`  RTE: context = premise + " Question: " + hypothesis +
  " True or False? Answer:", choices " True" (entailment) and " False".
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from dejavu.datafiles import TASKS_DIR
from dejavu.errors import DejavuError

# task name -> (file under dejavu/data/tasks, metrics beyond acc, context template)
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lambada_openai": ("lambada_openai/lambada_openai_test.jsonl", ()),
    "piqa": ("piqa/piqa_valid_icl.jsonl", ("acc_norm",)),
    "copa": ("copa/copa_val_icl.jsonl", ()),
    "openbookqa": ("openbookqa/openbookqa_test_icl.jsonl", ("acc_norm",)),
    "winogrande": ("winogrande/winogrande_dev_icl.jsonl", ()),
    "rte": ("rte/rte_val.jsonl", ()),
}


@dataclass
class Example:
    """One item: score each (context, continuation) pair; `gold` indexes the right one.

    kind "choice": the pair with the highest log-likelihood wins (acc); acc_norm divides
    by the continuation's length in characters (lm-evaluation-harness convention).
    kind "greedy": one pair; correct when every continuation token is the argmax.
    """

    pairs: list[tuple[str, str]]
    gold: int
    kind: str = "choice"


@dataclass
class Task:
    name: str
    examples: list[Example]
    metrics: tuple[str, ...] = ("acc",)
    source: str = ""


def _join(context: str, continuation: str) -> tuple[str, str]:
    """Put one space between context and continuation unless one side already has it."""
    if context[-1:].isspace() or continuation[:1].isspace() or not context:
        return context, continuation
    return context, " " + continuation


def _example(row: dict, task: str, where: str) -> Example:
    keys = set(row)
    try:
        if {"query", "choices", "gold"} <= keys:
            query = row["query"]
            if task == "piqa":  # lm-evaluation-harness: "Question: {goal}\nAnswer: {sol}"
                query = query.rstrip() + "\nAnswer:"
            pairs = [_join(query, c) for c in row["choices"]]
            gold = int(row["gold"])
        elif {"context_options", "continuation", "gold"} <= keys:
            pairs = [_join(c, row["continuation"]) for c in row["context_options"]]
            gold = int(row["gold"])
        elif {"premise", "hypothesis", "label"} <= keys:
            ctx = f"{row['premise']} Question: {row['hypothesis']} True or False? Answer:"
            pairs = [(ctx, " True"), (ctx, " False")]
            label = row["label"]
            gold = 0 if label in ("entailment", 0) else 1
        elif {"context", "continuation"} <= keys:
            return Example([_join(row["context"], row["continuation"])], 0, "greedy")
        else:
            raise DejavuError(f"{where}: unknown task format with keys {sorted(keys)}; expected "
                              '{"query","choices","gold"} (see dejavu.runtime.evaluation.tasks)')
    except (TypeError, ValueError, KeyError) as e:
        raise DejavuError(f"{where}: malformed example ({e})") from None
    if not pairs or not 0 <= gold < len(pairs):
        raise DejavuError(f"{where}: gold index {gold} out of range for {len(pairs)} choices")
    return Example(pairs, gold)


def load_task(name_or_file: str, limit: int | None = None) -> Task:
    """A shipped task by name (see TASKS) or a user's jsonl file; the first `limit` examples."""
    if name_or_file in TASKS:
        rel, extra = TASKS[name_or_file]
        path, name = TASKS_DIR / rel, name_or_file
    else:
        path = Path(name_or_file)
        if not path.suffix == ".jsonl" and not path.exists():
            raise DejavuError(f"unknown task {name_or_file!r}: not one of {', '.join(TASKS)} "
                              "and not a .jsonl file")
        if not path.is_file():
            raise DejavuError(f"task file not found: {path}")
        name, extra = path.stem, ("acc_norm",)
    examples = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DejavuError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DejavuError(f"{path}:{i + 1}: expected a JSON object")
            examples.append(_example(row, name, f"{path}:{i + 1}"))
    if not examples:
        raise DejavuError(f"task {name!r} has no examples ({path})")
    kinds = {e.kind for e in examples}
    metrics = ("acc",) if kinds == {"greedy"} else ("acc",) + tuple(extra)
    return Task(name, examples, metrics, str(path))


# ----------------------------------------------------------------------------- scoring

@dataclass
class PairScore:
    logprob: float  # sum of log p(continuation token | prefix)
    greedy: bool  # every continuation token is the argmax
    n_tokens: int


@dataclass
class TokenizedPair:
    ids: list[int]  # [bos] + context + continuation, left-truncated to max_len
    n_cont: int  # the last n_cont ids are scored


def tokenize_pair(encode: Callable[[str], list[int]], context: str, continuation: str,
                  bos: int | None, max_len: int) -> TokenizedPair:
    """Context and continuation are encoded separately (clean boundary, as lm-eval does)."""
    ctx = ([bos] if bos is not None else []) + list(encode(context))
    cont = list(encode(continuation))
    if not cont:
        raise DejavuError(f"continuation {continuation!r} encodes to no tokens")
    if not ctx:
        raise DejavuError("empty context and no BOS token: the first token cannot be scored")
    ids = (ctx + cont)[-(max_len + 1):]  # the last token is never a model input
    return TokenizedPair(ids, min(len(cont), len(ids) - 1))


def score_pairs(logits_fn, pairs: Sequence[TokenizedPair], batch_size: int,
                progress: str | None = None, contexts_as_prompts: bool = False) -> list[PairScore]:
    """Log-likelihood of each pair's continuation, in input order.

    Pairs are run in batches of similar length (sorted), right-padded: the model is causal,
    so padding after a sequence never changes its logits. contexts_as_prompts: call
    logits_fn(ids, prompt_lens) with each row's context length (the tokens before its
    continuation), for an engine's `generate` path."""
    import torch

    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].ids))
    out: list[PairScore | None] = [None] * len(pairs)
    starts = range(0, len(order), batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc=progress, unit="batch")
    for s in starts:
        chunk = [pairs[i] for i in order[s:s + batch_size]]
        S = max(len(p.ids) for p in chunk) - 1
        inp = torch.zeros(len(chunk), S, dtype=torch.long)  # [B, S]
        for b, p in enumerate(chunk):
            inp[b, :len(p.ids) - 1] = torch.tensor(p.ids[:-1])
        with torch.no_grad():
            if contexts_as_prompts:
                logits = logits_fn(inp, [len(p.ids) - p.n_cont for p in chunk])
            else:
                logits = logits_fn(inp)
            logp = torch.log_softmax(logits.float(), dim=-1)  # [B, S, V]
        for b, p in enumerate(chunk):
            n, L = p.n_cont, len(p.ids) - 1
            rows = logp[b, L - n:L]  # [n, V]: predictions for the continuation tokens
            tgt = torch.tensor(p.ids[-n:])
            lp = rows.gather(1, tgt[:, None]).sum().item()
            out[order[s + b]] = PairScore(lp, bool((rows.argmax(-1) == tgt).all()), n)
    return out  # type: ignore[return-value]


@dataclass
class TaskResult:
    name: str
    n: int
    acc: float
    acc_norm: float | None = None
    details: list[dict] = field(default_factory=list)
    chance: dict | None = None  # chance_levels of the examples scored

    def as_dict(self) -> dict:
        """accuracy, its standard error (lm-eval's: sqrt(acc (1 - acc) / (n - 1))), n, what guessing
        scores on the same examples (chance_levels), and per example the prediction and whether it is
        the gold answer (what a paired comparison needs)."""
        d = {"accuracy": self.acc, "stderr": accuracy_stderr(self.acc, self.n), "n": self.n,
             "preds": [x["pred"] for x in self.details],
             "correct": [int(x["pred"] == x["gold"]) for x in self.details]}
        if self.chance is not None:
            d["chance"] = self.chance
        if self.acc_norm is not None:
            d["acc_norm"] = self.acc_norm
            d["preds_norm"] = [x["pred_norm"] for x in self.details]
            d["correct_norm"] = [int(x["pred_norm"] == x["gold"]) for x in self.details]
        return d


def chance_levels(task: Task) -> dict | None:
    """What guessing scores on a multiple-choice task's examples: "uniform", a blind guess (the mean of
    1 / choices), and "majority", always giving the most common gold index (GLUE's majority-class
    baseline). A small model's accuracy near them says its answers are close to coins that any small
    change turns; None for tasks scored by greedy continuation (lambada_openai)."""
    if not task.examples or any(ex.kind != "choice" for ex in task.examples):
        return None
    n = len(task.examples)
    most = max(Counter(ex.gold for ex in task.examples).values())
    return {"uniform": sum(1 / len(ex.pairs) for ex in task.examples) / n, "majority": most / n}


def accuracy_stderr(acc: float, n: int) -> float | None:
    """Standard error of an accuracy over n examples (None for n < 2)."""
    return math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else None


def paired_difference(a: Sequence[int], b: Sequence[int]) -> tuple[float, float | None]:
    """(mean of b - a, its standard error) over the same examples' 0/1 correctness: the accuracy
    difference of two models and how much of it the examples' draw explains. Paired, it is far
    smaller than the two accuracies' own errors combined where the models mostly agree."""
    if len(a) != len(b) or not a:
        raise DejavuError(f"a paired difference needs two equal, non-empty lists, got {len(a)} and {len(b)}")
    n = len(a)
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)


def evaluate_task(task: Task, logits_fn, encode, bos: int | None, max_len: int,
                  batch_size: int, progress: bool = True, contexts_as_prompts: bool = False) -> TaskResult:
    """Accuracy (and acc_norm where the task reports it) of one task through `logits_fn`."""
    toks = [tokenize_pair(encode, c, x, bos, max_len) for ex in task.examples for c, x in ex.pairs]
    flat = score_pairs(logits_fn, toks, batch_size, progress=task.name if progress else None,
                       contexts_as_prompts=contexts_as_prompts)
    correct = correct_norm = 0
    details = []
    pos = 0
    for ex in task.examples:
        scores = flat[pos:pos + len(ex.pairs)]
        pos += len(ex.pairs)
        if ex.kind == "greedy":
            pred = pred_norm = 0 if scores[0].greedy else -1
        else:
            lps = [s.logprob for s in scores]
            pred = max(range(len(lps)), key=lambda i: lps[i])
            norm = [s.logprob / max(1, len(ex.pairs[i][1])) for i, s in enumerate(scores)]
            pred_norm = max(range(len(norm)), key=lambda i: norm[i])
        correct += pred == ex.gold
        correct_norm += pred_norm == ex.gold
        details.append({"pred": pred, "pred_norm": pred_norm, "gold": ex.gold,
                        "logprobs": [s.logprob for s in scores]})
    n = len(task.examples)
    acc_norm = correct_norm / n if "acc_norm" in task.metrics else None
    return TaskResult(task.name, n, correct / n, acc_norm, details, chance_levels(task))


def nll_to_ppl(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / count)

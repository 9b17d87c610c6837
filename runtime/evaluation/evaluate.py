"""`dejavu-eval`: perplexity and zero-shot accuracy of a dense model or an engine.

    dejavu-eval opt-mini                              # dense model, WikiText-2 test perplexity
    dejavu-eval opt-mini-0.3.engine --task all --limit 200 --json     # tasks only
    dejavu-eval opt-mini a.engine b.engine --task piqa,copa --ppl-tokens 32768 --report docs/accuracy

Perplexity runs when no task is given, or when asked (`--ppl`, `--ppl-tokens N`, `--ppl-file F`);
with tasks alone it is skipped (the whole WikiText-2 test is ~280k tokens: minutes to an hour
on a CPU).

A model name (preset, folder, hub id) runs the dense PyTorch model; a `.engine` file runs
the engine's sparse logits, computed one of three ways (`--path`):
- parallel (default): token-parallel, every position with its own selection, through masked
  dense ops (`Engine.logits`; fast on CPU);
- decode: the same quantity through the decode loop users run, one decode step per token
  from an empty cache (`Engine.decode_logits`: on CUDA the Triton kernels in a CUDA graph
  with the predictors on the side stream; on CPU their PyTorch references), equal up to
  rounding: a rounding difference can flip an input that sits at its threshold, which moves a
  Llama engine's perplexity by a few tenths of a percent;
- generate: the decode loop as `generate` runs it: each perplexity window's first token and
  each task example's context through the dense prefill (a Llama engine thresholds the first
  position: LlamaDecoder.prefill), the rest decoded sparse.
Both go through the same tokenisation (the tokenizer stored in the engine is the model's)
and the same scoring code (`dejavu.runtime.evaluation.tasks`).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dejavu.cli_common import Parser, add_device, add_dtype, add_quiet, comma_list
from dejavu.datafiles import DATA_DIR, WIKITEXT2_TEST
from dejavu.errors import DejavuError, cli_entry
from dejavu.runtime.evaluation.tasks import TASKS, evaluate_task, load_task


@dataclass
class EvalSettings:
    """Defaults of dejavu-eval (the CLI reads them from here)."""

    ppl_file: str = str(WIKITEXT2_TEST)
    ppl_tokens: int | None = None  # cap on perplexity tokens (None: the whole file)
    window: int | None = None  # perplexity window (None: the model's max positions)
    limit: int | None = None  # examples per task (None: all)
    batch_size: int = 8
    device: str = "cpu"
    path: str = "parallel"  # how an engine's logits are computed: one of PATHS
    dtype: str | None = None  # run in this dtype (None: an engine's own, float32 for a dense model)


PATHS = ("parallel", "decode", "generate")


@dataclass
class ScoringModel:
    """What the scorers need from a dense model or an engine."""

    name: str
    kind: str  # "dense" | "engine"
    logits_fn: Callable  # (ids[B, S] (cpu, long), prompt_lens[B] or None) -> logits[B, S, V]
    tokenizer: object  # dejavu.models.tokenizer.TextTokenizer
    max_len: int
    density: float | None  # None for the dense model
    header: dict | None = None
    info: dict = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False)

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_id


def is_engine_path(spec: str) -> bool:
    p = Path(spec)
    return p.suffix == ".engine" or (p.is_file() and p.suffix != ".gguf")  # a .gguf is a dense model


def _text_tokenizer(tok, model_config: dict | None):
    from dejavu.models.tokenizer import TextTokenizer

    if isinstance(tok, TextTokenizer):
        return tok
    cfg = model_config or {}
    return TextTokenizer(tok, cfg.get("bos_token_id"), cfg.get("eos_token_id"), cfg.get("pad_token_id"))


def _wrap_logits(fn, device: str) -> Callable:
    """logits_fn(ids, prompt_lens=None) for a function of ids alone (prompt_lens is ignored)."""
    import torch

    def logits_fn(ids, prompt_lens=None):
        with torch.no_grad():
            return fn(ids.to(device)).float().cpu()

    return logits_fn


def _engine_logits(engine, path: str) -> Callable:
    """logits_fn(ids, prompt_lens=None) of an engine along `path` (module docstring)."""
    if path == "parallel":
        return _wrap_logits(engine.logits, engine.device)

    def logits_fn(ids, prompt_lens=None):
        p = 0 if path == "decode" else (1 if prompt_lens is None else prompt_lens)
        return engine.decode_logits(ids, p).cpu()

    return logits_fn


def load_scoring_model(spec: str, device: str = EvalSettings.device, path: str = EvalSettings.path,
                       dtype: str | None = EvalSettings.dtype) -> ScoringModel:
    """A dense model (preset / folder / hub id) or an engine file, ready to score text.

    path (engines only; a dense model is dense whichever): parallel | decode | generate.
    dtype: float16 | bfloat16 | float32 (None: an engine's own dtype, float32 for a dense model)."""
    if path not in PATHS:
        raise DejavuError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if is_engine_path(spec):
        if not Path(spec).is_file():
            raise DejavuError(f"engine file not found: {spec}")
        from dejavu.runtime.engine import Engine

        # the decode loop with each sequence's own selection, whatever the device's default
        engine = Engine.load(spec, device, batch_policy="per_sequence", dtype=dtype)
        header = engine.header
        mc = header.get("model_config", {})
        bc = header.get("build_config", {}) or {}
        tok = getattr(engine, "tokenizer", None)
        if tok is None:
            tok = header["tokenizer_json"]
        return ScoringModel(Path(spec).name, "engine", _engine_logits(engine, path),
                            _text_tokenizer(tok, mc), int(mc["max_position_embeddings"]),
                            float(bc.get("density", 1.0)), header,
                            {"engine": engine, "source_model": bc.get("source_model") or bc.get("model"),
                             "path": path, "dtype": _dtype_name(engine.spec.dtype)})
    import torch

    from dejavu.models.auto import load_any, load_text_tokenizer

    model, cfg = load_any(spec, dtype=getattr(torch, dtype or "float32"), device=device)
    return ScoringModel(_shown_path(spec) if Path(spec).exists() else str(spec), "dense", _wrap_logits(model, device),
                        load_text_tokenizer(spec), cfg.max_position_embeddings, None,
                        info={"model": model, "config": cfg, "dtype": _dtype_name(next(model.parameters()).dtype)})


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def read_text(path: str | Path) -> str:
    p = Path(path)
    if not p.is_file():
        raise DejavuError(f"text file not found: {p}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DejavuError(f"{p}: not UTF-8 text") from None


def text_ids(sm: ScoringModel, text: str, max_tokens: int | None = None):
    """The text as one 1-D token tensor starting with BOS, optionally its first max_tokens.

    Encoded line by line (`dejavu.models.metrics.encode_document`, how opt-mini was trained
    and how its model card measures perplexity): encoding the whole file at once merges
    runs of newlines into tokens the model never saw and scores worse (WikiText-2 test,
    opt-mini: 40.96 instead of 32.76)."""
    import torch

    from dejavu.models.metrics import encode_document

    def encode(t: str) -> list[int]:
        ids = encode_document(sm.tokenizer.tokenizer, t).astype("int64").tolist()
        ids[0] = sm.bos_id  # encode_document starts with OPT's </s> (2)
        return ids

    if max_tokens is not None:  # whole lines of a prefix only (whole WikiText-2 test: ~2 s)
        chars = 8 * max_tokens
        while True:
            cut = text.rfind("\n", 0, chars) + 1 if chars < len(text) else len(text)
            ids = encode(text[:cut] if cut > 0 else text[:chars])
            if len(ids) > max_tokens or chars >= len(text):
                break
            chars *= 2
        ids = ids[:max_tokens]
    else:
        ids = encode(text)
    if len(ids) < 2:
        raise DejavuError("the perplexity text has fewer than 2 tokens")
    return torch.tensor(ids, dtype=torch.long)


def eval_perplexity(sm: ScoringModel, text: str, window: int | None = None,
                    max_tokens: int | None = None, batch: int = 8, progress: bool = True) -> dict:
    """{"perplexity", "nll", "tokens", "window"} of `text` through the model's logits."""
    window = window or sm.max_len
    if not 2 <= window <= sm.max_len:
        raise DejavuError(f"--window must be between 2 and the model's {sm.max_len} positions, got {window}")
    ids = text_ids(sm, text, max_tokens)
    from dejavu.models.metrics import perplexity

    r = perplexity(sm.logits_fn, ids, window, batch=batch, progress=progress)
    return {**r, "window": window}


def evaluate(sm: ScoringModel, settings: EvalSettings, tasks: list[str], ppl: bool = True,
             progress: bool = True) -> dict:
    """One JSON-able result: {"model", "kind", "density", "perplexity", "tasks": {...}}."""
    out: dict = {"model": sm.name, "kind": sm.kind, "density": sm.density}
    if "dtype" in sm.info:  # what the logits were computed in (--dtype, else the engine's / float32)
        out["dtype"] = sm.info["dtype"]
    path = sm.info.get("path")
    if sm.header is not None:  # the per-kind densities (they differ with --mlp-density/--attn-density)
        bc = sm.header.get("build_config") or {}
        out.update(mlp_density=bc.get("mlp_density", sm.density), attn_density=bc.get("attn_density", sm.density),
                   path=path, device=str(sm.info["engine"].device))
    t0 = time.perf_counter()
    if ppl:
        r = eval_perplexity(sm, read_text(settings.ppl_file), settings.window, settings.ppl_tokens,
                            settings.batch_size, progress)
        out.update(perplexity=r["perplexity"], ppl_tokens=r["tokens"], ppl_window=r["window"],
                   ppl_file=_shown_path(settings.ppl_file))
    out["tasks"] = {}
    for name in tasks:
        task = load_task(name, settings.limit)
        res = evaluate_task(task, sm.logits_fn, sm.encode, sm.bos_id, sm.max_len,
                            settings.batch_size, progress, contexts_as_prompts=path == "generate")
        out["tasks"][task.name] = res.as_dict()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _expand_tasks(names: list[str] | None) -> list[str]:
    out: list[str] = []
    for n in comma_list(names):
        out.extend(TASKS if n == "all" else [n])
    return out


def _is_task(name: str) -> bool:
    return name == "all" or name in TASKS or name.endswith(".jsonl")


def split_models_and_tasks(models: list[str], tasks: list[str]) -> tuple[list[str], list[str]]:
    """`--task piqa ENGINE` puts ENGINE into the task list (argparse's nargs='+' is greedy):
    with no positional model, what follows the task names and is not one is a model. A task
    name among the models is an error that says how to give several tasks."""
    names = comma_list(tasks)
    cut = len(names)
    if not models:  # only then can the task list have swallowed them
        while cut > 0 and not _is_task(names[cut - 1]):
            cut -= 1
    models = [*models, *names[cut:]]
    for m in models:
        if _is_task(m) and not Path(m).exists():
            raise DejavuError(f"{m!r} is a task, not a model: give tasks as --task piqa,copa (or --task piqa copa) "
                              "before or after the models")
    bad = [n for n in names[:cut] if not _is_task(n)]
    if bad:
        raise DejavuError(f"unknown task {bad[0]!r} (tasks: {', '.join(TASKS)}, all, or a .jsonl file)")
    if not models:
        raise DejavuError("give at least one MODEL_OR_ENGINE (a model name or folder, or a .engine file)")
    return models, names[:cut]


def build_parser() -> Parser:
    d = EvalSettings()
    p = Parser(
        "dejavu-eval",
        "Perplexity and zero-shot accuracy of dense models and dejavu engines. Perplexity runs when no task "
        "is given, or when asked (--ppl, --ppl-tokens, --ppl-file); with tasks alone it is skipped.")
    p.add_argument("models", nargs="*", metavar="MODEL_OR_ENGINE",
                   help="model name / folder (dense PyTorch) or .engine file; several for a comparison")
    p.add_argument("--task", "--tasks", dest="task", nargs="+", action="extend", metavar="NAME",
                   help=f"tasks: {', '.join(TASKS)}, 'all', or a .jsonl file "
                        '({"query","choices","gold"} per line); several as piqa,copa or piqa copa')
    p.add_argument("--ppl", action="store_true", help="also measure perplexity when tasks are given")
    p.add_argument("--ppl-file", default=None, metavar="FILE",
                   help="UTF-8 text for perplexity (implies --ppl; default: the shipped WikiText-2 test)")
    p.add_argument("--ppl-tokens", type=int, default=d.ppl_tokens, metavar="N",
                   help="perplexity over the first N tokens of the text only (implies --ppl; default: all)")
    p.add_argument("--no-ppl", action="store_true", help="skip perplexity, also when no task is given")
    p.add_argument("--window", type=int, default=d.window, metavar="N",
                   help="perplexity window in tokens (default: the model's max positions)")
    p.add_argument("--limit", type=int, default=d.limit, metavar="N", help="first N examples per task (default: all)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, metavar="N", help="sequences per forward pass")
    add_device(p, d.device)
    add_dtype(p, d.dtype, "score in this dtype instead of the engine's (e.g. float32 on CPU, where fp16 is slow); "
              "dense models: float32 unless given")
    p.add_argument("--path", choices=PATHS, default=d.path,
                   help="how an engine's logits are computed: parallel (token-parallel masked ops), "
                        "decode (one decode step per token through the decode kernels, the same "
                        "quantity up to rounding), generate (the decode loop with each window's first token "
                        "and each example's context prefilled, as generate does)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--report", metavar="DIR",
                   help="write DIR/README.md, DIR/results.json and DIR/metrics_vs_density.png; the engines' "
                        "dense model is evaluated too when it is not among the models")
    add_quiet(p, "no progress bars")
    return p


def wants_ppl(args, tasks: list[str]) -> bool:
    if args.no_ppl:
        if args.ppl or args.ppl_file or args.ppl_tokens is not None:
            raise DejavuError("--no-ppl contradicts --ppl / --ppl-file / --ppl-tokens")
        return False
    return not tasks or args.ppl or args.ppl_file is not None or args.ppl_tokens is not None


def _shown_path(p) -> str:
    """Shipped data as `dejavu/data/...`, other files relative to the working folder when inside it
    (never this machine's install path in a report)."""
    path = Path(p).resolve()
    for root, prefix in ((DATA_DIR, "dejavu/data/"), (Path.cwd().resolve(), "")):
        try:
            return prefix + path.relative_to(root).as_posix()
        except ValueError:
            pass
    return str(p)


def _print_table(results: list[dict], file=sys.stdout) -> None:
    from dejavu.runtime.evaluation.eval_report import markdown_table

    print(markdown_table(results), file=file)


def _dense_baselines(specs: list[str]) -> list[str]:
    """For --report: the engines' dense models, when no dense model is among the specs."""
    if any(not is_engine_path(m) for m in specs):
        return []
    from dejavu.engine_file import read_header
    from dejavu.runtime.evaluation.compare import source_model

    out: list[str] = []
    for m in specs:
        src = source_model(read_header(m)) if Path(m).is_file() else None
        if src and src not in out:
            out.append(src)
    return out


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name, v in (("--limit", args.limit), ("--ppl-tokens", args.ppl_tokens), ("--batch-size", args.batch_size)):
        if v is not None and v <= 0:
            raise DejavuError(f"{name} must be positive, got {v}")
    models, names = split_models_and_tasks(args.models, args.task or [])
    tasks = _expand_tasks(names)
    for t in tasks:  # fail on a bad task name or file before loading any model
        load_task(t, limit=1)
    ppl = wants_ppl(args, tasks)
    ppl_file = args.ppl_file or EvalSettings.ppl_file
    if ppl:
        read_text(ppl_file)
    for m in models:
        if is_engine_path(m) and not Path(m).is_file():
            raise DejavuError(f"engine file not found: {m}")
    settings = EvalSettings(ppl_file, args.ppl_tokens, args.window, args.limit, args.batch_size, args.device,
                            args.path, args.dtype)
    if args.report:
        extra = _dense_baselines(models)
        if extra and not args.quiet:
            print(f"dejavu-eval: --report: adding the dense model {', '.join(extra)} for the comparison",
                  file=sys.stderr)
        models = extra + models
    results = []
    for spec in models:
        sm = load_scoring_model(spec, args.device, args.path, args.dtype)
        results.append(evaluate(sm, settings, tasks, ppl=ppl, progress=not args.quiet))
    if args.report:
        from dejavu.runtime.evaluation.eval_report import write_report

        write_report(results, args.report, settings, tasks)
    if args.json:
        obj = results[0] if len(results) == 1 else {"runs": results}
        print(json.dumps(obj, indent=2, sort_keys=True))
    else:
        _print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

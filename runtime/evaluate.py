"""`dejavu-eval`: perplexity and zero-shot accuracy of a dense model or an engine.

    dejavu-eval opt-mini                              # dense model, WikiText-2 test perplexity
    dejavu-eval opt-mini-0.3.engine --task all --limit 200 --json
    dejavu-eval opt-mini a.engine b.engine --task piqa copa --report docs/accuracy

A model name (preset, folder, hub id) runs the dense PyTorch model; a `.engine` file runs
the engine's sparse logits, computed one of three ways (`--path`):
- parallel (default): token-parallel, every position with its own selection, through masked
  dense ops (`Engine.logits`; fast on CPU);
- decode: the same quantity through the decode loop users run, one decode step per token
  from an empty cache (`Engine.decode_logits`: on CUDA the Triton kernels in a CUDA graph
  with the predictors on the side stream; on CPU their PyTorch references);
- generate: the decode loop as `generate` runs it: each perplexity window's first token and
  each task example's context through the dense prefill, the rest decoded sparse.
Both go through the same tokenisation (the tokenizer stored in the engine is the model's)
and the same scoring code (`dejavu.runtime.tasks`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dejavu.errors import DejavuError, cli_entry
from dejavu.runtime.tasks import TASKS, evaluate_task, load_task

DEFAULT_PPL_FILE = Path(__file__).resolve().parent.parent / "dejavu" / "data" / "wikitext-2" / "test.txt"


@dataclass
class EvalSettings:
    """Defaults of dejavu-eval (the CLI reads them from here)."""

    ppl_file: str = str(DEFAULT_PPL_FILE)
    ppl_tokens: int | None = None  # cap on perplexity tokens (None: the whole file)
    window: int | None = None  # perplexity window (None: the model's max positions)
    limit: int | None = None  # examples per task (None: all)
    batch_size: int = 8
    device: str = "cpu"
    path: str = "parallel"  # how an engine's logits are computed: one of PATHS


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


def load_scoring_model(spec: str, device: str = "cpu", path: str = "parallel") -> ScoringModel:
    """A dense model (preset / folder / hub id) or an engine file, ready to score text.

    path (engines only; a dense model is dense whichever): parallel | decode | generate."""
    if path not in PATHS:
        raise DejavuError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if is_engine_path(spec):
        if not Path(spec).is_file():
            raise DejavuError(f"engine file not found: {spec}")
        from dejavu.runtime.engine import Engine

        # the decode loop with each sequence's own selection, whatever the device's default
        engine = Engine.load(spec, device, batch_policy="per_sequence")
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
                             "path": path})
    from dejavu.models.auto import load_any, load_text_tokenizer

    model, cfg = load_any(spec, device=device)
    return ScoringModel(str(spec), "dense", _wrap_logits(model, device),
                        load_text_tokenizer(spec), cfg.max_position_embeddings, None,
                        info={"model": model, "config": cfg})


def _perplexity_fn():
    try:
        from dejavu.models.metrics import perplexity
    except ImportError:  # the lead's shared helper is not there: same definition, kept here
        perplexity = _perplexity
    return perplexity


def _perplexity(logits_fn, ids, window, batch=8, progress=False):
    """exp(mean NLL) over non-overlapping windows (same definition as dejavu.models.metrics)."""
    import math

    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    chunks = [ids[i:i + window] for i in range(0, ids.numel(), window) if ids[i:i + window].numel() > 1]
    for c in chunks:
        logits = logits_fn(c[None]).float()  # [1, S, V]
        total += F.cross_entropy(logits[0, :-1], c[1:], reduction="sum").item()
        count += c.numel() - 1
    nll = total / max(count, 1)
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": count}


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
    r = _perplexity_fn()(sm.logits_fn, ids, window, batch=batch, progress=progress)
    return {**r, "window": window}


def evaluate(sm: ScoringModel, settings: EvalSettings, tasks: list[str], ppl: bool = True,
             progress: bool = True) -> dict:
    """One JSON-able result: {"model", "kind", "density", "perplexity", "tasks": {...}}."""
    out: dict = {"model": sm.name, "kind": sm.kind, "density": sm.density}
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
                   ppl_file=str(settings.ppl_file))
    out["tasks"] = {}
    for name in tasks:
        task = load_task(name, settings.limit)
        res = evaluate_task(task, sm.logits_fn, sm.encode, sm.bos_id, sm.max_len,
                            settings.batch_size, progress, contexts_as_prompts=path == "generate")
        out["tasks"][task.name] = res.as_dict()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _expand_tasks(names: list[str] | None) -> list[str]:
    if not names:
        return []
    out: list[str] = []
    for n in names:
        out.extend(TASKS if n == "all" else [n])
    return out


def build_parser() -> argparse.ArgumentParser:
    d = EvalSettings()
    p = argparse.ArgumentParser(
        prog="dejavu-eval",
        description="Perplexity and zero-shot accuracy of dense models and dejavu engines.")
    p.add_argument("models", nargs="+", metavar="MODEL_OR_ENGINE",
                   help="model name / folder (dense PyTorch) or .engine file; several for a comparison")
    p.add_argument("--ppl", default=d.ppl_file, metavar="FILE",
                   help="text file for perplexity (default: WikiText-2 test shipped with dejavu)")
    p.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    p.add_argument("--ppl-tokens", type=int, default=d.ppl_tokens, metavar="N",
                   help="use only the first N tokens of the text (default: all)")
    p.add_argument("--window", type=int, default=d.window, metavar="N",
                   help="perplexity window in tokens (default: the model's max positions)")
    p.add_argument("--task", nargs="+", metavar="NAME|FILE",
                   help=f"tasks: {', '.join(TASKS)}, 'all', or a .jsonl file "
                        '({"query","choices","gold"} per line)')
    p.add_argument("--limit", type=int, default=d.limit, metavar="N", help="first N examples per task")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--device", default=d.device, help="cpu or cuda (default: cpu)")
    p.add_argument("--path", choices=PATHS, default=d.path,
                   help="how an engine's logits are computed: parallel (token-parallel masked ops, the "
                        "default), decode (one decode step per token through the decode kernels, the same "
                        "quantity), generate (the decode loop with each window's first token and each "
                        "example's context prefilled dense, as generate does)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--report", metavar="DIR", help="write DIR/README.md and DIR/*.png (metric vs density)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


# ----------------------------------------------------------------------------- report

def _metric_columns(results: list[dict]) -> list[tuple[str, str | None, str]]:
    """(column title, task or None for perplexity, key) in a stable order."""
    cols: list[tuple[str, str | None, str]] = []
    if any("perplexity" in r for r in results):
        cols.append(("ppl", None, "perplexity"))
    tasks: list[str] = []
    for r in results:
        tasks += [t for t in r["tasks"] if t not in tasks]
    for t in tasks:
        cols.append((t, t, "accuracy"))
        if any("acc_norm" in r["tasks"].get(t, {}) for r in results):
            cols.append((f"{t} (norm)", t, "acc_norm"))
    return cols


def _value(r: dict, task: str | None, key: str):
    return r.get(key) if task is None else r["tasks"].get(task, {}).get(key)


def agreement_table(results: list[dict]) -> str | None:
    """Per task, the fraction of examples where each engine predicts what the dense run
    predicts: a paired statistic, far less noisy than an accuracy difference on few examples."""
    dense = next((r for r in results if r["density"] is None), None)
    if dense is None:
        return None
    tasks = [t for t in dense["tasks"] if "preds" in dense["tasks"][t]]
    lines = ["| model | density | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    for r in results:
        if r is dense:
            continue
        cells = []
        for t in tasks:
            a, b = dense["tasks"][t]["preds"], r["tasks"].get(t, {}).get("preds")
            ok = b is not None and len(a) == len(b)
            cells.append(f"{100 * sum(x == y for x, y in zip(a, b)) / len(a):.1f}" if ok else "")
        lines.append(f"| {r['model']} | {_density_label(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _density_label(r: dict) -> str:
    if r["density"] is None:
        return "dense"
    m, a = r.get("mlp_density", r["density"]), r.get("attn_density", r["density"])
    label = f"{r['density']:g}" if m == a else f"mlp {m:g} / heads {a:g}"
    path = r.get("path")
    return label if path in (None, "parallel") else f"{label} ({path} path)"


def markdown_table(results: list[dict]) -> str:
    """Rows = runs, columns = perplexity and per-task accuracy (percent)."""
    cols = _metric_columns(results)
    lines = ["| model | density | " + " | ".join(c[0] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for r in results:
        cells = []
        for _, task, key in cols:
            v = _value(r, task, key)
            cells.append("" if v is None else (f"{v:.3f}" if task is None else f"{100 * v:.1f}"))
        dens = _density_label(r)
        lines.append(f"| {r['model']} | {dens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _shown_path(p) -> str:
    """Shipped data as `dejavu/data/...` (not this machine's install path)."""
    try:
        return "dejavu/data/" + Path(p).resolve().relative_to(DEFAULT_PPL_FILE.parents[1].resolve()).as_posix()
    except ValueError:
        return str(p)


def write_report(results: list[dict], folder: str | Path, settings: EvalSettings, tasks: list[str]) -> Path:
    """folder/README.md (table + settings) and folder/metrics_vs_density.png; returns the md path."""
    from dejavu.fileio import atomic_path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    png = folder / "metrics_vs_density.png"
    plot_metrics(results, png)
    first = results[0]
    lim = "all" if settings.limit is None else str(settings.limit)
    md = ["# dejavu-eval report", "",
          markdown_table(results), "",
          "Accuracy in percent; `(norm)` = length-normalised (acc_norm). "
          "`dense` = the dense PyTorch model.", ""]
    agree = agreement_table(results)
    if agree:
        md += ["Agreement with the dense model's prediction, per example (percent):", "", agree, ""]
    md += [
          f"- perplexity: `{_shown_path(settings.ppl_file)}`, "
          f"{first.get('ppl_tokens', 'n/a')} tokens, window {first.get('ppl_window', 'n/a')}",
          f"- tasks: {', '.join(tasks) or 'none'}; examples per task: {lim}",
          f"- engine logits: `--path {settings.path}` on `{settings.device}` (`dejavu-eval --help`)",
          "", f"![metrics vs density]({png.name})", ""]
    out = folder / "README.md"
    with atomic_path(out) as tmp:
        tmp.write_text("\n".join(md), encoding="utf-8")
    (folder / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True), encoding="utf-8")
    _readable(out, png)
    return out


def _readable(*paths: Path) -> None:
    """Temporary files are created 0600; a report is for everyone (the umask decides)."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for p in paths:
        os.chmod(p, 0o666 & ~umask)


def _series(results: list[dict], task: str | None, key: str) -> dict[str, list[tuple[float, float]]]:
    """Engine points per series: same density for MLP and heads, or MLP only (heads 1.0)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        v = _value(r, task, key)
        if r["density"] is None or v is None:
            continue
        m, a = r.get("mlp_density", r["density"]), r.get("attn_density", r["density"])
        label = "engine" if m == a else ("engine, MLP only" if a == 1.0 else None)
        if label:
            out.setdefault(label, []).append((m, v))
    return {k: sorted(v) for k, v in out.items()}


def plot_metrics(results: list[dict], path: Path) -> None:
    """One panel per metric: engines as a line over density, the dense model as a dashed level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dejavu.fileio import atomic_path

    cols = _metric_columns(results)
    n = max(1, len(cols))
    ncol = min(4, n)
    nrow = (n + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol, 2.8 * nrow), squeeze=False)
    for ax, (title, task, key) in zip(axes.flat, cols):
        scale = 1 if task is None else 100
        for label, pts in _series(results, task, key).items():
            ax.plot([p[0] for p in pts], [scale * p[1] for p in pts], "o-", label=label)
        for r in results:
            v = _value(r, task, key)
            if r["density"] is None and v is not None:
                ax.axhline(scale * v, ls="--", color="gray", label="dense")
        ax.set_title(title if task is None else f"{title} (%)")
        ax.set_xlabel("density")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(cols):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _print_table(results: list[dict], file=sys.stdout) -> None:
    print(markdown_table(results), file=file)


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name, v in (("--limit", args.limit), ("--ppl-tokens", args.ppl_tokens), ("--batch-size", args.batch_size)):
        if v is not None and v <= 0:
            raise DejavuError(f"{name} must be positive, got {v}")
    tasks = _expand_tasks(args.task)
    for t in tasks:  # fail on a bad task name before loading any model
        load_task(t, limit=1)
    if not args.no_ppl:
        read_text(args.ppl)
    settings = EvalSettings(args.ppl, args.ppl_tokens, args.window, args.limit, args.batch_size, args.device,
                            args.path)
    results = []
    for spec in args.models:
        sm = load_scoring_model(spec, args.device, args.path)
        results.append(evaluate(sm, settings, tasks, ppl=not args.no_ppl, progress=not args.quiet))
    if args.report:
        write_report(results, args.report, settings, tasks)
    if args.json:
        obj = results[0] if len(results) == 1 else {"runs": results}
        print(json.dumps(obj, indent=2, sort_keys=True))
    else:
        _print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

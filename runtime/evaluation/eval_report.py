"""`dejavu-eval --report DIR`: README.md (tables against the dense run), results.json and a
metric-vs-density plot, from the result dicts `dejavu.runtime.evaluation.evaluate.evaluate` returns."""
from __future__ import annotations

from pathlib import Path

from dejavu.runtime.evaluation.evaluate import EvalSettings, _shown_path
from dejavu.runtime.evaluation.tasks import paired_difference

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


def _dense_of(results: list[dict]) -> dict | None:
    return next((r for r in results if r["density"] is None), None)


def agreement_table(results: list[dict]) -> str | None:
    """Per task (and its acc_norm), the fraction of examples where each engine predicts what the
    dense run predicts: a paired statistic, far less noisy than an accuracy difference on few
    examples."""
    dense = _dense_of(results)
    if dense is None:
        return None
    cols = [(t, key, f"{t} (norm)" if key == "preds_norm" else t)
            for t in dense["tasks"] for key in ("preds", "preds_norm") if key in dense["tasks"][t]]
    if not cols:
        return None
    lines = ["| model | density | " + " | ".join(c[2] for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in results:
        if r is dense:
            continue
        cells = []
        for t, key, _ in cols:
            a, b = dense["tasks"][t][key], r["tasks"].get(t, {}).get(key)
            ok = b is not None and len(a) == len(b) and len(a) > 0
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


def _vs_dense(r: dict, dense: dict, task: str, key: str, diff: float) -> str:
    """" (+d)" in points, " (+d ± se)" where both runs hold the same examples' correctness (the
    paired standard error of the difference)."""
    ck = "correct_norm" if key == "acc_norm" else "correct"
    a, b = dense["tasks"][task].get(ck), r["tasks"].get(task, {}).get(ck)
    if a and b and len(a) == len(b):
        _, se = paired_difference(a, b)
        if se is not None:
            return f" ({100 * diff:+.1f} ± {100 * se:.1f})"
    return f" ({100 * diff:+.1f})"


def markdown_table(results: list[dict]) -> str:
    """Rows = runs, columns = perplexity (and its change vs the dense run) and per-task accuracy
    (percent; in parentheses the difference from the dense run, in points, ± its paired standard
    error where both runs record each example's correctness)."""
    cols = _metric_columns(results)
    dense = _dense_of(results)
    with_vs = dense is not None and dense.get("perplexity") is not None
    titles = [c[0] for c in cols]
    if with_vs:
        titles.insert(1, "ppl vs dense")
    lines = ["| model | density | " + " | ".join(titles) + " |", "|---|---|" + "---|" * len(titles)]
    for r in results:
        cells = []
        for _, task, key in cols:
            v = _value(r, task, key)
            ref = _value(dense, task, key) if dense is not None and r is not dense else None
            if v is None:
                cells.append("")
            elif task is None:
                cells.append(f"{v:.3f}")
            else:
                cells.append(f"{100 * v:.1f}" + (_vs_dense(r, dense, task, key, v - ref) if ref is not None else ""))
        if with_vs:
            v = r.get("perplexity")
            vs = "" if v is None else ("dense" if r is dense else f"{100 * (v / dense['perplexity'] - 1):+.2f}%")
            cells.insert(1, vs)
        lines.append(f"| {r['model']} | {_density_label(r)} | " + " | ".join(cells) + " |")
    chance = [_chance(results, task) if task is not None else "" for _, task, _ in cols]
    if any(chance):  # what guessing scores on the same examples: a blind guess / always the most common answer
        if with_vs:
            chance.insert(1, "")
        lines.append("| chance: blind / most common answer | | " + " | ".join(chance) + " |")
    return "\n".join(lines)


def _chance(results: list[dict], task: str) -> str:
    c = next((r["tasks"][task]["chance"] for r in results if "chance" in r["tasks"].get(task, {})), None)
    return "" if c is None else f"{100 * c['uniform']:.1f} / {100 * c['majority']:.1f}"


def write_report(results: list[dict], folder: str | Path, settings: EvalSettings, tasks: list[str]) -> Path:
    """folder/README.md (table + settings) and folder/metrics_vs_density.png; returns the md path."""
    from dejavu.fileio import atomic_path, write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    png = folder / "metrics_vs_density.png"
    plot_metrics(results, png)
    lim = "all" if settings.limit is None else str(settings.limit)
    md = ["# dejavu-eval report", "",
          markdown_table(results), "",
          "Accuracy in percent, in parentheses the difference from the dense model in points; "
          "`(norm)` = length-normalised (acc_norm). `dense` = the dense PyTorch model.", ""]
    agree = agreement_table(results)
    if agree:
        md += ["Agreement with the dense model's prediction, per example (percent):", "", agree, ""]
    ppl_runs = [r for r in results if r.get("ppl_tokens") is not None]
    if ppl_runs:
        md.append(f"- perplexity: `{_shown_path(settings.ppl_file)}`, {ppl_runs[0]['ppl_tokens']} tokens, "
                  f"window {ppl_runs[0]['ppl_window']}")
    else:
        md.append("- perplexity: not measured (`--ppl` / `--ppl-tokens N` to add it)")
    if _dense_of(results) is None:
        md.append("- no dense run: nothing to compare with (add the model name to the command)")
    md += [
          f"- tasks: {', '.join(tasks) or 'none'}; examples per task: {lim}",
          f"- engine logits: `--path {settings.path}` on `{settings.device}` (`dejavu-eval --help`)",
          "", f"![metrics vs density]({png.name})", ""]
    out = folder / "README.md"
    with atomic_path(out) as tmp:
        tmp.write_text("\n".join(md), encoding="utf-8")
    saved = [{**r, **{k: _relative_to(r[k], folder) for k in ("model", "ppl_file") if k in r}} for r in results]
    write_json(folder / "results.json", saved, indent=2, sort_keys=True)
    return out


def _relative_to(p: str, folder: Path) -> str:
    """A path that exists, relative to the report folder (a report moves with its files); names
    that are not paths (a preset, `dejavu/data/...`) unchanged."""
    import os

    if p.startswith("dejavu/data/") or not Path(p).exists():
        return p
    return Path(os.path.relpath(Path(p).resolve(), folder.resolve())).as_posix()


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
            if r["density"] is None and v is not None:  # the dense model: density 1.0, and a level
                ax.axhline(scale * v, ls="--", color="gray", label="dense")
                ax.plot([1.0], [scale * v], "s", color="gray")
        ax.set_xlim(0.0, 1.05)  # density is a fraction: the whole range, whatever was run
        lo, hi = ax.get_ylim()
        if hi - lo < 0.02 * max(abs(hi), abs(lo), 1e-9):  # one value (or equal ones): a readable band
            pad = 0.05 * max(abs(hi), 1.0)
            ax.set_ylim(lo - pad, hi + pad)
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

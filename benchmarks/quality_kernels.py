"""Quality of trained engines through the kernels users run: perplexity and zero-shot accuracy of
`opt-mini` engines along each `dejavu-eval --path`, on each device, beside the dense model.

    python3 benchmarks/quality_kernels.py --devices cuda,cpu --out quality.json     # on the H200
    python3 benchmarks/quality_kernels.py --devices cpu --ppl-tokens 4096 --limit 10 # here, smaller

Engines are built here with `dejavu-compile`'s defaults (calibration and predictor training on
the CPU; each engine's sha256 is recorded: a build is deterministic on one machine, not bit-equal
across machines), one per `--engines` entry: `d0.7` is `--density 0.7`, `0.3/1.0` MLP/heads densities. Then for every device and path (`parallel`: token-parallel
masked ops; `decode`: the decode loop from an empty cache, on CUDA the Triton kernels in a CUDA
graph with the side-stream predictors; `generate`: the decode loop with prompts prefilled dense,
as `generate` runs it) the perplexity over the first --ppl-tokens of the shipped WikiText-2 test
and the accuracy on --tasks (first --limit examples each), and per task the fraction of examples
whose prediction equals the CPU `parallel` run's on the same engine. Prints a table; JSON to --out.
Asserts nothing. Quality, on a trained model: say so beside the numbers (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import hashlib
import platform
import sys
import time
from pathlib import Path

import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.fileio import write_json
from dejavu.runtime.evaluation.evaluate import PATHS, EvalSettings, _expand_tasks, evaluate, load_scoring_model


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_engine(spec: str) -> dict:
    """`d0.7`: `dejavu-compile --density 0.7` (the byte budget, sensitivity allocation);
    `0.3/1.0`: MLP / head densities fixed as fractions of N."""
    if spec.startswith("d"):
        return {"name": f"d{float(spec[1:]):g}", "density": float(spec[1:])}
    m, a = (float(x) for x in spec.split("/"))
    return {"name": f"m{m:g}-a{a:g}", "mlp_density": m, "attn_density": a}


def build(model: str, specs: list[dict], dtype: str, folder: Path) -> list[dict]:
    """One engine per spec, built as `dejavu-compile` builds it."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for spec in specs:
        knobs = {k: v for k, v in spec.items() if k != "name"}
        path = folder / f"{Path(model).name}-{spec['name']}-{dtype}.engine"
        t0 = time.perf_counter()
        if not path.exists():
            build_engine(model, BuildConfig(**knobs, dtype=dtype), path, progress=False)
        out.append({"path": str(path), **knobs, "dtype": dtype,
                    "sha256": _sha256(path), "build_s": round(time.perf_counter() - t0, 1)})
    return out


def agreement(rows: list[dict]) -> list[dict]:
    """Per engine, device and path: the fraction of task examples whose prediction (acc and acc_norm)
    equals the CPU reference's on the same engine (the issue's >= 99% target): for a GPU row the CPU run of
    the same path where there is one (--cpu-paths), else (and for CPU rows) the CPU `parallel` run."""
    ref = {(r["sha256"], r["path"]): r for r in rows if r.get("sha256") and r["device"] == "cpu"}
    out = []
    for r in rows:
        same_path = ref.get((r.get("sha256"), r.get("path"))) if r["device"] != "cpu" else None
        base = same_path or ref.get((r.get("sha256"), "parallel"))
        if base is None or base is r:
            continue
        for task, t in r.get("tasks", {}).items():
            b = base["tasks"].get(task)
            if not b:
                continue
            for key in ("preds", "preds_norm"):
                if key in t and key in b:
                    same = sum(x == y for x, y in zip(t[key], b[key]))
                    out.append({"engine": Path(r["model"]).name, "device": r["device"], "path": r["path"],
                                "reference": f"cpu {base['path']}",
                                "task": task, "metric": "acc" if key == "preds" else "acc_norm",
                                "n": len(b[key]), "equal": same, "fraction": same / max(len(b[key]), 1)})
    return out


def table(rows: list[dict]) -> str:
    tasks = sorted({t for r in rows for t in r.get("tasks", {})})
    lines = ["| run | device | path | ppl | vs dense | " + " | ".join(tasks) + " |",
             "|---|---|---|---:|---:|" + "---:|" * len(tasks)]
    dense = {r["device"]: r["perplexity"] for r in rows if r["kind"] == "dense"}
    for r in rows:
        d = dense.get(r["device"])
        rel = f"{100 * (r['perplexity'] / d - 1):+.2f}%" if d and r["kind"] != "dense" else ""
        accs = [f"{100 * r['tasks'][t]['accuracy']:.0f}" if t in r.get("tasks", {}) else "" for t in tasks]
        lines.append(f"| {Path(r['model']).name} | {r['device']} | {r.get('path') or 'dense'} | "
                     f"{r['perplexity']:.3f} | {rel} | " + " | ".join(accs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-mini")
    ap.add_argument("--engines", default="d0.7,d0.5,d0.35,0.3/1.0",
                    help="comma-separated: dN = `--density N` (byte budget), M/A = MLP/head densities")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--cpu-paths", default="parallel", help="paths run on the CPU (the decode loop is slow there)")
    ap.add_argument("--ppl-tokens", type=int, default=32768)
    ap.add_argument("--tasks", default="all")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--work", default="build/quality", help="folder for the engines")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    specs = [parse_engine(e) for e in a.engines.split(",") if e]
    devices = [d for d in a.devices.split(",") if d]
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("quality_kernels: --devices cuda but no CUDA GPU")
    tasks = _expand_tasks(a.tasks.split(","))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv[1:],
            "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "note": "quality on a trained model (opt-mini); engines built on the CPU with dejavu-compile's defaults"}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    engines = build(a.model, specs, a.dtype, Path(a.work))
    rows: list[dict] = []
    errors: list[dict] = []

    def save() -> None:  # after every run: what finished survives a later failure or a time limit
        if a.out:
            write_json(a.out, {"meta": meta, "engines": engines, "results": rows,
                               "agreement": agreement(rows), "errors": errors}, indent=1)

    def run(spec: str, dev: str, path: str | None, extra: dict) -> None:  # path None: the dense model
        t0 = time.perf_counter()
        settings = EvalSettings(ppl_tokens=a.ppl_tokens, limit=a.limit, device=dev, path=path or "parallel")
        try:
            r = evaluate(sm := load_scoring_model(spec, dev, settings.path), settings, tasks, progress=False)
        except Exception as e:  # noqa: BLE001 - record it, go on with the other runs
            errors.append({"run": Path(spec).name, "device": dev, "path": path, "error": f"{type(e).__name__}: {e}"})
            print(f"{Path(spec).name} {dev} {path}: FAILED {errors[-1]['error']}", flush=True)
        else:
            if "engine" in sm.info:
                extra = {**extra, "kernels": dict(sm.info["engine"].ops.kernels)}
            rows.append({**r, "device": dev, "path": path, "wall_s": round(time.perf_counter() - t0, 1), **extra})
            print(f"{Path(spec).name} {dev} {path or 'dense'}: ppl {r['perplexity']:.3f} ({rows[-1]['wall_s']} s)",
                  flush=True)
        save()

    for dev in devices:
        run(a.model, dev, None, {})
        for e in engines:
            for path in (a.paths if dev != "cpu" else a.cpu_paths).split(","):
                run(e["path"], dev, path, {"sha256": e["sha256"]})
    print(table(rows))
    low = [x for x in agreement(rows) if x["fraction"] < 0.99]
    print(f"task predictions equal to the CPU reference: {len(agreement(rows)) - len(low)} of "
          f"{len(agreement(rows))} (engine, device, path, task, metric) below 99%: {low}")
    for e in errors:
        print(f"failed: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""A reading launch's time over its bytes at the copy bandwidth, by MB read, from launch_chain.py's raw files
(one line per run and form: PDL with the reads after the wait, as the decode kernels read, or before it), with
the Llama GEMVs' kept bytes at 50% skipped marked.

    python benchmarks/plot_launch_chain.py benchmarks/results/launch-chain-*.json -o docs/img/launch_chain.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FORMS = {(True, False): ("PDL, reads after the wait", "o-", "C0"),
         (True, True): ("PDL, reads before the wait", "s--", "C1"),
         (False, False): ("no PDL", "^:", "C2")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("raw", nargs="+")
    p.add_argument("-o", "--out", required=True)
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from launch_chain import gemv_bytes, llama_shapes

    from dejavu.fileio import atomic_path

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    runs = [json.loads(Path(path).read_text(encoding="utf-8")) for path in a.raw]
    gpus = sorted({res.get("gpu", "?") for res in runs})
    labelled = set()
    for res in runs:  # each GPU's runs a line width of its own (the first GPU's thinnest), labelled once
        gpu = res.get("gpu", "?")
        n_gpu = sum(r.get("gpu", "?") == gpu for r in runs)
        for (pdl, early), (label, style, color) in FORMS.items():
            pts = sorted((r["bytes_per_launch"] / 2**20, r["over_floor"]) for r in res["reads"]
                         if r["pdl"] == pdl and r["early"] == early)
            if pts:
                key = (gpu, pdl, early)
                runs_of = f"{n_gpu} run{'s' * (n_gpu > 1)}"
                ax.plot(*zip(*pts), style, color=color, alpha=0.7, ms=4, lw=1 + 1.5 * gpus.index(gpu),
                        label=None if key in labelled else f"{label}, {gpu.removeprefix('NVIDIA ')} ({runs_of})")
                labelled.add(key)
    for name, shape in llama_shapes().items():
        for mb in gemv_bytes(shape):
            ax.axvline(mb / 2**20, color="gray", lw=0.6, ls=":" if "70b" in name else "-")
    ax.axhline(1.3, color="black", lw=0.8, ls="--", label="1.3x (the floor target)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MB a launch reads (gray: the GEMVs at 50%; 8B solid, 70B rank dotted)")
    ax.set_ylabel("time / its bytes at the copy bandwidth")
    ax.set_title("a chain of dependent reading launches in one CUDA graph", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(Path(a.out)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

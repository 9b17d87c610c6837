"""Registers, spills and shared memory of the Triton kernels one decode step compiles (H200).

    python3 benchmarks/kernel_regs.py [--model opt-30b] [--layers 2] [--density 0.3] [--batch 1]
                                      [--ablations a,b] [--out FILE]

Builds an engine of the model's shape with random weights and predictors (e2e.py's), runs a few
decode steps (no CUDA graph), then lists every compiled kernel of `dejavu.plugins` with its
registers per thread, spilled bytes, warps and shared memory, and the programs per SM those allow
(a register-bound kernel with 4 warps and 255 registers fits 2 per SM). `--ablations` applies e2e.py's
ablations first (e.g. `nounfolded`), each in a fresh process-wide kernel cache entry. JSON to --out
(default $OUT/kernel-regs.json).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402


def compiled_kernels() -> list[dict]:
    """Every kernel compiled so far through the plugins' launchers (dejavu.plugins.jitted), with its resources."""
    from dejavu.plugins import jitted

    props = torch.cuda.get_device_properties(0)
    regs_sm = props.regs_per_multiprocessor
    rows = []
    for fn, jf in jitted().items():
        for caches in getattr(jf, "device_caches", {}).values():
            for key, k in caches[0].items():
                k._init_handles()
                warps = k.metadata.num_warps
                by_regs = regs_sm // max(1, k.n_regs * 32 * warps)
                rows.append({"kernel": fn.__name__, "regs": k.n_regs, "spill_bytes": k.n_spills, "warps": warps,
                             "shared": k.metadata.shared, "programs_per_sm_by_regs": by_regs,
                             "key": str(key)[:300]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-30b", choices=sorted(e2e.SHAPES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--density", type=float, default=0.3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ablations", default="", help="e2e.py ablations to apply (comma list)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_regs: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dejavu.fileio import write_json
    from dejavu.runtime import Engine

    c = {**e2e.SHAPES[a.model], "num_hidden_layers": a.layers}
    ranks, _ = e2e.default_ranks(c)
    t = e2e.random_tensors(c, torch.float16, "cuda", ranks)
    prompts = [[5 + i for i in range(16)] for _ in range(a.batch)]
    out = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                    "note": "resources of the compiled Triton kernels of a decode step (random weights)"},
           "configs": {}}
    for ablation in [""] + [x for x in a.ablations.split(",") if x]:
        from dejavu.plugins import jitted
        jitted().clear()  # this configuration's kernels only
        eng = Engine.from_tensors(e2e.header_for(c, a.density, "float16", ranks), t, "cuda", use_graphs=False)
        undo = e2e.ABLATIONS[ablation](eng) if ablation else None
        try:
            eng.generate(prompts, 4, stop_at_eos=False)
            torch.cuda.synchronize()
            rows = compiled_kernels()
        finally:
            if undo:
                undo()
        out["configs"][ablation or "default"] = rows
        print(f"## {ablation or 'default'}")
        for r in sorted(rows, key=lambda r: r["kernel"]):
            print(f"  {r['kernel']:34s} regs {r['regs']:3d}  spill {r['spill_bytes']:4d} B  warps {r['warps']}  "
                  f"smem {r['shared']:6d}  per SM (regs) {r['programs_per_sm_by_regs']}")
    path = Path(a.out or Path(os.environ.get("OUT", ".")) / "kernel-regs.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, out, indent=1)
    print("JSON:", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

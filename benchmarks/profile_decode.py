"""Where one decode step's time goes: per-kernel GPU time of a dejavu engine (H200).

    source benchmarks/device_env.sh && python3 benchmarks/profile_decode.py [--densities 0.3] [--out F]

Model: an OPT shape (default OPT-30B) in fp16 with RANDOM weights and predictors of the
real shapes (benchmarks/e2e.py builds them), batch 1, a 128-token prompt. For each
configuration, `--steps` decode steps run under `torch.profiler` (CUPTI kernel records,
also for kernels inside a CUDA-graph replay) and the kernels are grouped by name:
GPU microseconds per step and launches per step, next to the wall time of a step. The sum
of kernel times above the wall time means streams overlapped; below it, the gap is launch
latency and idle time between kernels.

Configurations: dense (graph), dejavu at each density with overlap off (eager, one
stream: every kernel in order) and on (graph, the shipped path), kv_policy deferred.
JSON to --out (default $OUT/profile.json) and a table per configuration on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (random engines of OPT shapes)


def _short(name: str) -> str:
    """A kernel name people can read: Triton kernels keep their function name; cuBLAS and
    PyTorch kernels lose templates and namespaces."""
    n = name.split("(")[0].split("<")[0]
    n = n.replace("void ", "").split("::")[-1]
    return n[:60]


def profile_steps(step, tokens, pos, steps: int) -> dict:
    """Time `steps` decode steps, then profile as many more; each step one position further
    (so the deferred K/V policy sees its steady state: newly selected heads catch up)."""
    from torch.profiler import ProfilerActivity, profile

    def run(n):
        nonlocal pos
        for _ in range(n):
            step(tokens, pos)
            pos = pos + 1

    run(3)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(steps)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run(steps)
        torch.cuda.synchronize()
    agg: dict[str, list] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        if not us or "Memcpy" in e.name and us == 0:
            continue
        a = agg[_short(e.name)]
        a[0] += us
        a[1] += 1
        total += us
    rows = sorted(([k, v[0] / steps, v[1] / steps] for k, v in agg.items()), key=lambda r: -r[1])
    return {"wall_ms_per_step": 1e3 * wall, "kernel_ms_per_step": total / steps / 1e3,
            "launches_per_step": sum(r[2] for r in rows),
            "kernels": [{"name": k, "us_per_step": round(us, 2), "launches_per_step": n} for k, us, n in rows]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-30b", choices=sorted(e2e.SHAPES))
    p.add_argument("--layers", type=int, default=None, help="keep only this many layers (default all)")
    p.add_argument("--densities", default="0.3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kv-policy", default="deferred", choices=["deferred", "full"])
    p.add_argument("--out", default=None)
    p.add_argument("--tuned", default=None, help="kernels.py JSON whose sweep_attn configs to use")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dejavu.runtime import Engine
    from dejavu.runtime.generate import right_pad

    tuned = e2e.apply_tuned(a.tuned)
    c = dict(e2e.SHAPES[a.model])
    if a.layers:
        c["num_hidden_layers"] = a.layers
    ranks, _ = e2e.default_ranks(c)
    t = e2e.random_tensors(c, torch.float16, "cuda", ranks)
    out = Path(a.out or Path(os.environ.get("OUT", ".")) / "profile.json")
    data = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                     "shape": c, "ranks": list(ranks), "tuned": tuned,
                     "note": "random weights and predictors of the real shapes; per decode step"}, "configs": []}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, c["vocab_size"], (a.batch, a.prompt_len), generator=g).tolist()
    configs = [("dense_graph", None, True, True)]
    for d in (float(x) for x in a.densities.split(",")):
        configs += [(f"d{d}_off_eager", d, False, False), (f"d{d}_on_graph", d, True, True)]
    for name, d, overlap, graphs in configs:
        eng = Engine.from_tensors(e2e.header_for(c, d, "float16", ranks), t, "cuda", overlap=overlap,
                                  use_graphs=graphs, kv_policy=a.kv_policy)
        with torch.inference_mode():
            ids, lens = right_pad(prompts, 1, c["vocab_size"])
            step = eng.activate(a.batch, a.prompt_len + 2 * a.steps + 8)
            pos = lens.cuda()
            eng.decoder.prefill(ids.cuda(), pos)
            tokens = torch.full((a.batch,), 5, dtype=torch.long, device="cuda")
            r = profile_steps(step, tokens, pos, a.steps)
        r["config"] = name
        data["configs"].append(r)
        tmp = out.with_suffix(".tmp")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, out)
        print(f"\n## {name}: wall {r['wall_ms_per_step']:.3f} ms/step, kernels {r['kernel_ms_per_step']:.3f} ms, "
              f"{r['launches_per_step']:.0f} launches/step")
        for k in r["kernels"][:25]:
            print(f"  {k['us_per_step']:9.1f} us  {k['launches_per_step']:6.1f}x  {k['name']}")
        eng = None
        torch.cuda.empty_cache()
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one dependent launch costs in a CUDA graph, and what that leaves of the floor target.

    python3 benchmarks/launch_chain.py --out $OUT/launch-chain.json      # GPU, under a minute
    TRITON_INTERPRET=1 python benchmarks/launch_chain.py --smoke         # CPU: the chain's arithmetic only

A chain of --launches tiny Triton kernels, each adding 1 to the float32 vector the one before it wrote
(--width values a program, P programs: every launch depends on the last), is captured in one CUDA graph
and replayed; the time a launch is the replay's over the chain's length. With programmatic dependent
launch (PDL, sm_90: each kernel waits for its predecessor by griddepcontrol.wait and lets the next one
launch early, as the decode kernels do) and without; P of one program, one a streaming multiprocessor
and four (the GEMV's grid is about that).

A Llama decode layer is ten such dependent launches (docs/llama.md: select, q/k/v GEMV, sum + RoPE,
attention, select, o, select, gate/up, select, down). Ten launches a layer at the measured cost, added to
the bandwidth floor of the H200 run (2aeff05: Llama-3-8B at 50% skipped 1.924 ms, the 70B TP-8 rank
2.099 ms), bound from below the ratio to the floor any kernels of that structure reach: reading no byte
more than the floor and doing nothing else, they still wait that long for each other.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PHASES_PER_LAYER = 10
FLOORS_MS = {"llama-3-8b": (32, 1.924), "llama-3-70b-tp8": (80, 2.099)}  # layers, floor (H200, 2aeff05)

_kernel = None


def kernel():
    """The chain's kernel (Triton imported on first use, so --smoke can set the interpreter first)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, W: tl.constexpr, PDL: tl.constexpr):
            offs = tl.program_id(0) * W + tl.arange(0, W)
            if PDL:
                tl.extra.cuda.gdc_wait()  # the previous launch complete, its writes visible
            x = tl.load(x_ptr + offs)
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
            tl.store(x_ptr + offs, x + 1.0)

        _kernel = add_one
    return _kernel


def launch(x: torch.Tensor, programs: int, width: int, pdl: bool) -> None:
    kernel()[(programs,)](x, W=width, PDL=int(pdl), **({"launch_pdl": True} if pdl else {}))


def time_chain(programs: int, width: int, launches: int, pdl: bool, replays: int, repeats: int) -> dict:
    """µs a launch (median of `repeats` timings of `replays` graph replays), after checking the chain's sum."""
    x = torch.zeros(programs * width, device="cuda")
    launch(x, programs, width, pdl)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch(x, programs, width, pdl)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    if not torch.all(x == launches):  # every launch ran, in order (a lost dependency would lose adds)
        raise RuntimeError(f"the chain summed {x.min().item()}..{x.max().item()}, expected {launches}")
    us = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us.append(1000 * start.elapsed_time(end) / (replays * launches))
    return {"programs": programs, "width": width, "launches": launches, "pdl": pdl,
            "us_per_launch": statistics.median(us), "us_all": [round(u, 4) for u in us]}


def floor_bound(us_per_launch: float) -> dict:
    """Per Llama shape: the floor plus ten dependent launches a layer, over the floor."""
    return {m: round((f + PHASES_PER_LAYER * layers * us_per_launch / 1000) / f, 3)
            for m, (layers, f) in FLOORS_MS.items()}


def smoke(launches: int = 5) -> None:
    """The chain eagerly on the interpreter's CPU tensors: every launch adds its 1."""
    x = torch.zeros(3 * 16)
    for _ in range(launches):
        launch(x, 3, 16, pdl=False)
    if not torch.all(x == launches):
        raise SystemExit(f"launch_chain --smoke: got {x.tolist()}, expected {launches} everywhere")
    print(f"launch_chain --smoke: {launches} launches summed as expected")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launches", type=int, default=PHASES_PER_LAYER * 32,
                   help="the chain's length (default: an 8B step's)")
    p.add_argument("--programs", type=int, nargs="+", help="grid sizes (default: 1, the SM count, 4 × it)")
    p.add_argument("--width", type=int, default=256, help="float32 values a program adds to (a power of two)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: check the chain's arithmetic")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.smoke:
        smoke()
        return 0
    if not torch.cuda.is_available():
        print("launch_chain: needs a GPU (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from dejavu.provenance import tree_commit

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    res = {"gpu": torch.cuda.get_device_name(), "commit": tree_commit(Path(__file__)), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a),
           "floors_ms": FLOORS_MS, "phases_per_layer": PHASES_PER_LAYER, "runs": []}
    for programs in a.programs or [1, sms, 4 * sms]:
        for pdl in (False, True) if sm90 else (False,):
            r = time_chain(programs, a.width, a.launches, pdl, a.replays, a.repeats)
            r["floor_bound"] = floor_bound(r["us_per_launch"])
            res["runs"].append(r)
            b = r["floor_bound"]
            print(f"{programs:5d} programs, PDL {'on ' if pdl else 'off'}: {r['us_per_launch']:.3f} µs a launch; "
                  f"floor bound 8B {b['llama-3-8b']:.3f}x, 70B rank {b['llama-3-70b-tp8']:.3f}x", flush=True)
    if a.out:
        from dejavu.fileio import atomic_path

        with atomic_path(Path(a.out)) as tmp:  # no partial file if the run is cut short
            tmp.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one dependent launch costs in a CUDA graph, and what that leaves of the floor target.

    python3 benchmarks/launch_chain.py --out $OUT/launch-chain.json      # GPU, about a minute
    TRITON_INTERPRET=1 python benchmarks/launch_chain.py --smoke         # CPU: the chains' arithmetic only

A chain of --launches tiny Triton kernels, each adding 1 to the float32 vector the one before it wrote
(--width values a program, P programs: every launch depends on the last), is captured in one CUDA graph
and replayed; the time a launch is the replay's over the chain's length. With programmatic dependent
launch (PDL, sm_90: each kernel waits for its predecessor by griddepcontrol.wait and lets the next one
launch early, as the decode kernels do) and without; P of one program, one a streaming multiprocessor
and four (the GEMV's grid is about that).

The second chain (--mb) makes each launch also read its own MB of fp16 weights (4 programs a streaming
multiprocessor, each summing a contiguous slice; the launches cycle through a pool past the L2), as a GEMV
does: the time a launch over its bytes at the copy bandwidth is how near a launch of that size can come to
its floor. `early` issues the reads before waiting for the previous launch (the weights never depend on it;
only the rows a sparse GEMV keeps do), `late` after, as the decode kernels do now.

From both chains, the structure's bound (`structure_bound`): a Llama decode layer is ten dependent launches
(docs/llama.md: select, q/k/v GEMV, sum + RoPE, attention, select, o, select, gate/up, select, down). With each
GEMV a reading launch of its kept bytes (50% skipped; the reading chain's time, interpolated in bytes), the six
others at the cost of a launch of one program a streaming multiprocessor, and the LM head at the copy
bandwidth, the step takes at least that long against the floor (every byte at the copy bandwidth). It is a
bound from below on what kernels of this structure reach: they read no byte more and do nothing else.
`--from RAW` recomputes it from a run's file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PHASES_PER_LAYER = 10  # four of them GEMVs

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

        @triton.jit
        def read_add(x_ptr, w_ptr, sink_ptr, chunk, W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     EARLY: tl.constexpr):
            pid = tl.program_id(0)
            base = w_ptr + pid.to(tl.int64) * chunk
            if PDL and not EARLY:
                tl.extra.cuda.gdc_wait()
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(0, chunk, BLOCK):
                acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
            if PDL and EARLY:
                tl.extra.cuda.gdc_wait()
            offs = pid * W + tl.arange(0, W)
            x = tl.load(x_ptr + offs)
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
            tl.store(x_ptr + offs, x + 1.0)
            tl.store(sink_ptr + pid, tl.sum(acc))  # keeps the reads

        _kernel = (add_one, read_add)
    return _kernel


READ_BLOCK = 1024  # fp16 values a program reads a step


def launch(x: torch.Tensor, programs: int, width: int, pdl: bool, w=None, sink=None, early=False) -> None:
    """One launch of the chain: add 1 to x, after reading w's slices (one a program) when w is given."""
    pdl_kw = {"launch_pdl": True} if pdl else {}
    if w is None:
        kernel()[0][(programs,)](x, W=width, PDL=int(pdl), **pdl_kw)
    else:
        kernel()[1][(programs,)](x, w, sink, w.numel() // programs, W=width, BLOCK=READ_BLOCK, PDL=int(pdl),
                                 EARLY=int(early), **pdl_kw)


def weight_slices(programs: int, mb: float, launches: int, pool_bytes: int, device) -> list:
    """fp16 slices of about `mb` MB (a whole READ_BLOCK per program), cycled over a pool of `pool_bytes`."""
    per_launch = programs * READ_BLOCK * max(1, round(mb * 2**20 / (2 * programs * READ_BLOCK)))
    n = max(1, min(launches, pool_bytes // (2 * per_launch)))
    pool = torch.ones(n * per_launch, dtype=torch.float16, device=device)
    return [pool[(i % n) * per_launch:(i % n + 1) * per_launch] for i in range(launches)]


def time_chain(programs: int, width: int, launches: int, pdl: bool, replays: int, repeats: int,
               mb: float = 0.0, early: bool = False, pool_bytes: int = 512 << 20) -> dict:
    """µs a launch (median of `repeats` timings of `replays` graph replays), after checking the chain's sum.
    With `mb`, every launch also reads its own slice of weights (`early`: before its wait)."""
    x = torch.zeros(programs * width, device="cuda")
    ws = weight_slices(programs, mb, launches, pool_bytes, x.device) if mb else [None] * launches
    sink = torch.zeros(programs, device="cuda")
    launch(x, programs, width, pdl, ws[0], sink, early)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            launch(x, programs, width, pdl, w, sink, early)
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
    if mb and not torch.all(sink == ws[-1].numel() // programs):  # the pool is ones: each program's sum
        raise RuntimeError("the reads summed otherwise than their slices' lengths")
    return {"programs": programs, "width": width, "launches": launches, "pdl": pdl,
            "bytes_per_launch": 2 * ws[0].numel() if mb else 0, "early": early,
            "us_per_launch": statistics.median(us), "us_all": [round(u, 4) for u in us]}


def read_efficiency(r: dict, copy: float) -> dict:
    """A reading launch against its bytes at the copy bandwidth: the ratio, and the µs beyond."""
    at_copy_us = r["bytes_per_launch"] / copy / 1e3
    return {"at_copy_us": round(at_copy_us, 3), "over_floor": round(r["us_per_launch"] / at_copy_us, 3),
            "extra_us": round(r["us_per_launch"] - at_copy_us, 3)}


def gemv_bytes(shape: dict, skip: float = 0.5, esize: int = 2) -> tuple[float, ...]:
    """Bytes of a decode layer's four input-sparse GEMVs (q/k/v, o, gate/up, down) at `skip`."""
    d, hd, i = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    h, hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    rows_cols = ((d, (h + 2 * hkv) * hd), (h * hd, d), (d, 2 * i), (i, d))
    return tuple((1 - skip) * n * m * esize for n, m in rows_cols)


def structure_bound(res: dict, shapes: dict, pdl: bool = True, early: bool = False) -> dict:
    """Per Llama shape: the ten-launch layer's least step time (ms) and its ratio to the floor, from a run's
    chains (res: this script's JSON)."""
    reads = sorted((r["bytes_per_launch"], r["us_per_launch"]) for r in res["reads"]
                   if r["pdl"] == pdl and r["early"] == early)
    sms = res.get("sms") or res["reads"][0]["programs"] // 4  # the reading chain runs 4 programs an SM
    small = [r["us_per_launch"] for r in res["runs"] if r["pdl"] == pdl and r["programs"] == sms]
    if len(reads) < 2 or not small:
        raise ValueError("structure_bound: the run has no reading chain or no one-program-an-SM chain of that kind")
    xs, ys = zip(*reads)
    copy = res["copy_GBps"] * 1e3  # bytes a µs

    def read_us(n: float) -> float:  # linear in bytes between the measured sizes, and past them
        j = min(max(1, sum(x <= n for x in xs)), len(xs) - 1)
        return ys[j - 1] + (ys[j] - ys[j - 1]) * (n - xs[j - 1]) / (xs[j] - xs[j - 1])

    out = {}
    for name, c in shapes.items():
        per, head = gemv_bytes(c), 2 * c["vocab_size"] * c["hidden_size"]
        layer_us = sum(read_us(n) for n in per) + (PHASES_PER_LAYER - len(per)) * small[0]
        step_ms = (c["num_hidden_layers"] * layer_us + head / copy) / 1e3
        floor_ms = (c["num_hidden_layers"] * sum(per) + head) / copy / 1e3
        out[name] = {"layer_us": round(layer_us, 2), "step_ms": round(step_ms, 3), "floor_ms": round(floor_ms, 3),
                     "over_floor": round(step_ms / floor_ms, 3)}
    return out


def e2e_llama():
    """benchmarks/e2e_llama.py (the script's folder imported as the other benchmarks do): its shapes, its copy
    bandwidth."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import e2e_llama

    return e2e_llama


def llama_shapes() -> dict:
    """e2e_llama.py's Llama-3 shapes (the speed target's)."""
    return {k: v for k, v in e2e_llama().SHAPES.items() if k.startswith("llama-3")}


def print_bounds(res: dict) -> None:
    for pdl, early in sorted({(r["pdl"], r["early"]) for r in res["reads"]} - {(False, False)}) or [(False, False)]:
        for name, b in structure_bound(res, llama_shapes(), pdl, early).items():
            print(f"{name}: ten launches a layer, reads {'early' if early else 'after the wait'}: a layer "
                  f"{b['layer_us']:.1f} µs, a step {b['step_ms']:.3f} ms against its floor {b['floor_ms']:.3f} "
                  f"({b['over_floor']:.3f}x)", flush=True)


def smoke(launches: int = 5) -> None:
    """Both chains eagerly on the interpreter's CPU tensors: every launch adds its 1, every read its slice."""
    x = torch.zeros(3 * 16)
    for _ in range(launches):
        launch(x, 3, 16, pdl=False)
    if not torch.all(x == launches):
        raise SystemExit(f"launch_chain --smoke: got {x.tolist()}, expected {launches} everywhere")
    x.zero_()
    ws = weight_slices(3, 0.01, launches, 1 << 20, "cpu")
    for i, w in enumerate(ws):
        w.copy_(torch.arange(w.numel()) % 7)  # slices that differ: a program reading the wrong one would show
        sink = torch.zeros(3)
        launch(x, 3, 16, pdl=False, w=w, sink=sink)
        want = w.float().view(3, -1).sum(1)
        if not torch.equal(sink, want):
            raise SystemExit(f"launch_chain --smoke: read sums {sink.tolist()}, expected {want.tolist()}")
    if not torch.all(x == launches):
        raise SystemExit(f"launch_chain --smoke: the reading chain got {x.tolist()}, expected {launches}")
    print(f"launch_chain --smoke: {launches} launches summed as expected, with and without reads")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launches", type=int, default=PHASES_PER_LAYER * 32,
                   help="the chain's length (default: an 8B step's)")
    p.add_argument("--programs", type=int, nargs="+", help="grid sizes (default: 1, the SM count, 4 × it)")
    p.add_argument("--width", type=int, default=256, help="float32 values a program adds to (a power of two)")
    p.add_argument("--mb", type=float, nargs="*", default=[4, 8, 16, 32, 64, 128],
                   help="MB each launch of the reading chain reads (at 50%% skipped, an 8B layer reads 25 (q/k/v) to 117 (gate/up); the 70B rank 8 to 59)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: check the chain's arithmetic")
    p.add_argument("--out")
    p.add_argument("--from", dest="src", metavar="RAW", help="no run: the structure's bound from a run's JSON")
    a = p.parse_args(argv)
    if a.src:
        print_bounds(json.loads(Path(a.src).read_text(encoding="utf-8")))
        return 0
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
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a), "sms": sms, "sm90": sm90,
           "phases_per_layer": PHASES_PER_LAYER, "runs": []}
    for programs in a.programs or [1, sms, 4 * sms]:
        for pdl in (False, True) if sm90 else (False,):
            r = time_chain(programs, a.width, a.launches, pdl, a.replays, a.repeats)
            res["runs"].append(r)
            print(f"{programs:5d} programs, PDL {'on ' if pdl else 'off'}: {r['us_per_launch']:.3f} µs a launch",
                  flush=True)
    res["copy_GBps"] = copy = e2e_llama().copy_bandwidth(torch.device("cuda"))["copy_GBps"]
    res["reads"] = []
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    for mb in a.mb:
        for pdl, early in ((False, False), (True, False), (True, True)) if sm90 else ((False, False),):
            r = time_chain(4 * sms, a.width, a.launches, pdl, a.replays, a.repeats, mb=mb, early=early)
            r.update(read_efficiency(r, copy))
            res["reads"].append(r)
            print(f"{r['bytes_per_launch'] / 2**20:6.2f} MB a launch, PDL {'on ' if pdl else 'off'}"
                  f"{', reads early' if early else ''}: {r['us_per_launch']:.2f} µs, {r['over_floor']:.3f}x its bytes "
                  f"at the copy bandwidth (+{r['extra_us']:.2f} µs)", flush=True)
    if a.out:
        from dejavu.fileio import write_json

        write_json(a.out, res)
    print_bounds(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

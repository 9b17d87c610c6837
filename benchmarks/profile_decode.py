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
stream: every kernel in order) and on (graph, the shipped path), kv_policy deferred;
`--ablations a,b` adds graph rows with e2e.py's ablations applied (e.g. nopdl, nopred).
JSON to --out (default $OUT/profile.json) and a table per configuration on stdout.

Timeline (`timeline` in each configuration's JSON, from the profiler's Chrome trace): kernels
are told apart by name and launch shape, not by stream (a graph replay runs its kernels on
streams of its own; with PDL on, dozens): the predictors' kernels (top-k, and the scoring
GEMVs: 8-warp blocks or the grid of the N / BLOCK_R score rows) are side work, the rest is
the main stream. Each main-stream kernel is charged the
time from its start to the next main-stream kernel's start (the last one: to its end), so
the charges of a step add up to the main stream's span: with programmatic dependent launch
a kernel's own duration includes its wait for the previous one, the charge does not. Also
the main stream's idle time (no kernel of it running) and how long side-stream kernels ran
while a main-stream kernel did. `--trace-dir D` keeps the raw traces (gzip).

Layer timeline (`layer`, printed as "one layer"): per main-stream kernel of a decoder layer, its median
start / end from the layer's Q/K/V partial kernel, what it adds and how busy the side stream is beside
it; `side`: the side stream's kernels that start in each layer's window, placed the same way.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
_ADDED = _HERE not in sys.path  # imported from elsewhere (the tests), not run as a script
if _ADDED:
    sys.path.insert(0, _HERE)
try:
    import e2e  # noqa: E402  (random engines of OPT shapes)
finally:
    if _ADDED:  # leave sys.path as found: benchmarks/kernels.py would shadow HF's `kernels` package
        sys.path.remove(_HERE)


def _short(name: str) -> str:
    """A kernel name people can read: Triton kernels keep their function name; cuBLAS and
    PyTorch kernels lose templates and namespaces."""
    n = name.split("(")[0].split("<")[0]
    n = n.replace("void ", "").split("::")[-1]
    return n[:60]


def side_kernel(score_rows: set[int]):
    """The predicate of side-stream (predictor) kernels for `timeline`: top-k, the deferred K/V
    catch-up or refresh pick after the head top-k, and the scoring gather_gemv launches (8-warp blocks: `x @ a.T`;
    grid (1, N / BLOCK_R) for N in score_rows: `h @ b.T`). fc1's gather_gemv has 4-warp blocks
    and grid (B, K / 2)."""
    def side(e: dict) -> bool:
        n, g, b = e["name"], e.get("args", {}).get("grid") or [0, 0], e.get("args", {}).get("block") or [0]
        if "_topk_kernel" in n or "_refresh_kernel" in n:
            return True
        return "_gather_gemv_kernel" in n and (b[0] == 256 or g[1] in score_rows)
    return side


# Main-stream kernels by what bounds them (`sections`): weight streaming (Q/K/V, fc1, the output
# projection and fc2, the LM head's cuBLAS GEMV), the attention section (Q/K/V finish, attention,
# chunk combine, commit), LayerNorms and split-K reductions; the rest is "other".
SECTIONS = (("weights", ("_qkv_partial", "_gather_gemv_kernel", "_gather_dot_t_kernel", "_gather_dot_kernel",
                         "_gather_gemv_t_kernel", "nvjet", "gemv", "gemm")),
            ("attention", ("_qkv_finish", "_attn_decode", "_attn_combine", "_commit_kernel")),
            ("norms", ("_layer_norm", "_split_reduce")))


def sections(charges: list[dict]) -> dict:
    """us per step of the main-stream charges (timeline's) summed by SECTIONS (first match)."""
    out = {name: 0.0 for name, _ in SECTIONS}
    out["other"] = 0.0
    for c in charges:
        sec = next((name for name, keys in SECTIONS if any(k in c["name"] for k in keys)), "other")
        out[sec] += c["us_per_step"]
    return {k: round(v, 2) for k, v in out.items()}


def _union(intervals) -> tuple[list[list[float]], list[float]]:
    """Intervals (t0, t1) merged into disjoint sorted ones, with their starts (for `_covered`)."""
    merged: list[list[float]] = []
    for t0, t1 in sorted(intervals):
        if merged and t0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t1)
        else:
            merged.append([t0, t1])
    return merged, [m[0] for m in merged]


def _covered(union, a: float, b: float) -> float:
    """How much of [a, b] the merged intervals of `_union` cover."""
    merged, starts = union
    i, tot = max(0, bisect.bisect_right(starts, a) - 1), 0.0
    while i < len(merged) and merged[i][0] < b:
        tot += max(0.0, min(merged[i][1], b) - max(merged[i][0], a))
        i += 1
    return tot


def timeline(events: list[dict], steps: int, side_fn) -> dict:
    """Critical-path charges of the main stream from Chrome-trace kernel events (ts/dur in us);
    side_fn(event) True: a side-stream (predictor) kernel."""
    by_stream: dict = {"main": [], "side": []}
    for e in events:
        by_stream["side" if side_fn(e) else "main"].append((e["ts"], e["ts"] + e["dur"], _short(e["name"])))
    ks = sorted(by_stream["main"])
    if not ks:
        return {}
    charge: dict[str, list] = defaultdict(lambda: [0.0, 0])
    idle, end = 0.0, ks[0][0]
    for i, (t0, t1, name) in enumerate(ks):
        nxt = ks[i + 1][0] if i + 1 < len(ks) else t1
        charge[name][0] += nxt - t0
        charge[name][1] += 1
        idle += max(0.0, t0 - end)
        end = max(end, t1)
    span = ks[-1][1] - ks[0][0]
    side = by_stream["side"]
    side_us = sum(t1 - t0 for t0, t1, _ in side)
    # side-stream time that ran while some main-stream kernel was running (merged main intervals)
    merged = _union((t0, t1) for t0, t1, _ in ks)
    over = sum(_covered(merged, t0, t1) for t0, t1, _ in side)
    rows = sorted(([k, v[0] / steps, v[1] / steps] for k, v in charge.items()), key=lambda r: -r[1])
    charges = [{"name": k, "us_per_step": round(us, 2), "launches_per_step": n} for k, us, n in rows]
    return {"span_ms_per_step": span / steps / 1e3,
            "main_idle_ms_per_step": idle / steps / 1e3, "side_kernel_ms_per_step": side_us / steps / 1e3,
            "side_overlapping_main_ms_per_step": over / steps / 1e3,
            "charges": charges, "sections": sections(charges)}


def layer_timeline(events: list[dict], side_fn, anchor: str = "_qkv_partial") -> dict:
    """One decoder layer's main-stream kernels, from Chrome-trace kernel events (ts/dur in us): the
    layers start at each kernel whose name contains `anchor` (the batch-1 deferred step's Q/K/V partial
    kernel); a kernel is labelled by its short name, with #2, #3 for its later launches in the layer.
    Per label (in order of start): the median start and end from the layer's anchor start, the median
    time from the previous label's end to its end (what it adds to the layer; the anchor: its duration),
    and the fraction of that window in which a side-stream kernel ran; kernels of at most half the layers are left out.
    `period_us`: the median anchor-to-anchor time. `side`: the side stream's kernels that start in a layer's
    window (from its anchor to the next), labelled and placed the same way (start, end, duration). {} without
    anchors."""
    main = sorted((e["ts"], e["ts"] + e["dur"], _short(e["name"])) for e in events if not side_fn(e))
    side_k = sorted((e["ts"], e["ts"] + e["dur"], _short(e["name"])) for e in events if side_fn(e))
    side = [(t0, t1) for t0, t1, _ in side_k]
    layers: list[dict] = []
    for t0, t1, name in main:
        if anchor in name:
            layers.append({"_t0": t0})
        if not layers:
            continue
        _place(layers[-1], name, t0, t1)
    if not layers:
        return {}
    starts = [lay["_t0"] for lay in layers]
    side_layers = [{"_t0": t} for t in starts]
    for t0, t1, name in side_k:
        i = bisect.bisect_right(starts, t0) - 1
        if i >= 0:
            _place(side_layers[i], name, t0, t1)
    gaps = [b["_t0"] - a["_t0"] for a, b in zip(layers, layers[1:])]
    period = statistics.median(gaps) if gaps else None
    # kernels of most layers (not the LM head and sampling after the last one, nor the first LayerNorm)
    labels = _labels(layers)

    side_busy = _union(side)

    def busy(a: float, b: float) -> float:
        return _covered(side_busy, a, b) / (b - a) if b > a else 0.0

    rows, prev = [], None
    for k in labels:
        have = [lay for lay in layers if k in lay]
        ends = [lay[k][1] for lay in have]
        row = {"kernel": k, "layers": len(have), "start_us": round(statistics.median(lay[k][0] for lay in have), 2),
               "end_us": round(statistics.median(ends), 2)}
        if prev is None:  # the anchor: from its start
            row["adds_us"] = round(statistics.median(lay[k][1] - lay[k][0] for lay in have), 2)
            row["side_busy"] = round(statistics.median(
                busy(lay["_t0"] + lay[k][0], lay["_t0"] + lay[k][1]) for lay in have), 3)
        else:
            both = [lay for lay in have if prev in lay]
            if both:
                row["adds_us"] = round(statistics.median(lay[k][1] - lay[prev][1] for lay in both), 2)
                row["side_busy"] = round(statistics.median(
                    busy(lay["_t0"] + lay[prev][1], lay["_t0"] + lay[k][1]) for lay in both), 3)
        rows.append(row)
        prev = k
    side_rows = []
    for k in _labels(side_layers):
        spans = [lay[k] for lay in side_layers if k in lay]
        side_rows.append({"kernel": k, "layers": len(spans),
                          "start_us": round(statistics.median(t0 for t0, _ in spans), 2),
                          "end_us": round(statistics.median(t1 for _, t1 in spans), 2),
                          "dur_us": round(statistics.median(t1 - t0 for t0, t1 in spans), 2)})
    return {"anchor": anchor, "layers": len(layers), "period_us": period and round(period, 2), "kernels": rows,
            "side": side_rows}


def _place(lay: dict, name: str, t0: float, t1: float) -> None:
    """Put a kernel into one layer's dict under its short name, #2, #3 ... for later launches, as (start, end)
    from the layer's anchor start `_t0`."""
    label, k = name, 1
    while label in lay:
        k += 1
        label = f"{name}#{k}"
    lay[label] = (t0 - lay["_t0"], t1 - lay["_t0"])


def _labels(layers: list[dict]) -> list[str]:
    """The labels of more than half the layers, by median start."""
    seen: dict[str, int] = defaultdict(int)
    for lay in layers:
        for k in lay:
            seen[k] += 1
    return sorted((k for k, n in seen.items() if k != "_t0" and 2 * n > len(layers)),
                  key=lambda k: statistics.median(lay[k][0] for lay in layers if k in lay))


def profile_steps(step, tokens, pos, steps: int, side_fn, trace: Path | None = None, anchor="_qkv_partial") -> dict:
    """Time `steps` decode steps, then profile as many more; each step one position further
    (so the deferred K/V policy sees its steady state: newly selected heads catch up). anchor: the
    layer timeline's anchor kernel, or a function of the [(name, us, launches) per step] rows that
    picks it (benchmarks/e2e_llama.py)."""
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
    anchor = anchor(rows) if callable(anchor) else anchor
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"dejavu-trace-{os.getpid()}.json"
    prof.export_chrome_trace(str(tmp))
    raw = tmp.read_bytes()
    tmp.unlink()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_bytes(gzip.compress(raw))
    kern = [e for e in json.loads(raw).get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    return {"wall_ms_per_step": 1e3 * wall, "kernel_ms_per_step": total / steps / 1e3,
            "launches_per_step": sum(r[2] for r in rows),
            "kernels": [{"name": k, "us_per_step": round(us, 2), "launches_per_step": n} for k, us, n in rows],
            "timeline": timeline(kern, steps, side_fn), "layer": layer_timeline(kern, side_fn, anchor)}


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
    p.add_argument("--ablations", default="", help="graph rows with these e2e.py ablations (comma list)")
    p.add_argument("--no-eager", action="store_true", help="skip the overlap-off eager rows")
    p.add_argument("--no-dense", action="store_true", help="skip the dense graph row")
    p.add_argument("--trace-dir", default=None, help="keep each configuration's Chrome trace here (gzip)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dejavu.fileio import write_json
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
    abl = [x for x in a.ablations.split(",") if x]
    if any(x not in e2e.ABLATIONS for x in abl):
        p.error("--ablations: a comma list of " + ", ".join(e2e.ABLATIONS))
    configs = [] if a.no_dense else [("dense_graph", None, True, True, None)]
    for d in (float(x) for x in a.densities.split(",")):
        configs += [] if a.no_eager else [(f"d{d}_off_eager", d, False, False, None)]
        configs += [(f"d{d}_on_graph", d, True, True, None)]
        configs += [(f"d{d}_on_graph_{x}", d, True, True, x) for x in abl]
    trace_dir = Path(a.trace_dir) if a.trace_dir else None
    from dejavu.plugins import DEFAULT
    br = DEFAULT.scoring.b.BLOCK_R
    side = side_kernel({-(-c["ffn_dim"] // br), -(-c["num_attention_heads"] // br)})
    for name, d, overlap, graphs, ablation in configs:
        eng = Engine.from_tensors(e2e.header_for(c, d, "float16", ranks), t, "cuda", overlap=overlap,
                                  use_graphs=graphs, kv_policy=a.kv_policy)
        undo = e2e.ABLATIONS[ablation](eng) if ablation else None
        try:
            with torch.inference_mode():
                ids, lens = right_pad(prompts, 1, c["vocab_size"])
                step = eng.activate(a.batch, a.prompt_len + 2 * a.steps + 8)
                pos = lens.cuda()
                eng.decoder.prefill(ids.cuda(), pos)
                tokens = torch.full((a.batch,), 5, dtype=torch.long, device="cuda")
                r = profile_steps(step, tokens, pos, a.steps, side,
                                  trace_dir / f"trace-{name}.json.gz" if trace_dir else None)
        finally:
            if undo:
                undo()
        r["config"] = name
        data["configs"].append(r)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, data, indent=1)
        print(f"\n## {name}: wall {r['wall_ms_per_step']:.3f} ms/step, kernels {r['kernel_ms_per_step']:.3f} ms, "
              f"{r['launches_per_step']:.0f} launches/step")
        for k in r["kernels"][:25]:
            print(f"  {k['us_per_step']:9.1f} us  {k['launches_per_step']:6.1f}x  {k['name']}")
        tl = r["timeline"]
        if tl:
            print(f"  main stream: span {tl['span_ms_per_step']:.3f} ms/step, idle {tl['main_idle_ms_per_step']:.3f} ms, "
                  f"side kernels {tl['side_kernel_ms_per_step']:.3f} ms ({tl['side_overlapping_main_ms_per_step']:.3f} "
                  f"beside main); charges (start to next start):")
            for k in tl["charges"][:20]:
                print(f"  {k['us_per_step']:9.1f} us  {k['launches_per_step']:6.1f}x  {k['name']}")
            print("  by section (us/step): " + ", ".join(f"{k} {v:.1f}" for k, v in tl["sections"].items()))
        lay = r.get("layer")
        if lay:
            print(f"  one layer (median of {lay['layers']}, period {lay['period_us']} us; from its "
                  f"{lay['anchor']} start): kernel, start, end, adds, side stream busy")
            for k in lay["kernels"]:
                print(f"  {k['kernel']:34s} {k['start_us']:7.1f} {k['end_us']:7.1f} "
                      f"{k.get('adds_us', k['end_us']):6.1f} {k.get('side_busy', 0):5.2f}")
            print("  side stream, kernels starting in the layer's window: kernel, start, end, duration")
            for k in lay.get("side", []):
                print(f"  {k['kernel']:34s} {k['start_us']:7.1f} {k['end_us']:7.1f} {k['dur_us']:6.1f}")
        eng = None
        torch.cuda.empty_cache()
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The input-sparse GEMV's settings per projection shape, measured: select + GEMV + sum as LlamaOps launches them.

    python3 benchmarks/input_sparse_sweep.py --out r.json [--models llama-3-8b,llama-3-70b-tp8] [--budget-s 170]
    python3 benchmarks/input_sparse_sweep.py --smoke --out r.json    # CPU, Triton's interpreter, tiny shapes

Each projection kind of a Llama block (plugins.PROJECTIONS) of each model shape (e2e_llama.SHAPES), batch 1,
random fp16 weights (N(0, 1 / N)) and inputs, the threshold between the two |h| at the median (half the
inputs kept), launched through runtime/llama_decoder.LlamaOps with the settings under test:
  qkv      x [B, D]: select fused with RMSNorm, GEMV [D, (H + 2 Hkv) hd], sum with RoPE + cache write (qkv_rope)
  o        o [B, H hd]: select, GEMV [H hd, D], split-K sum + residual (linear), or with fp32_residual (the
           default) the splits adding into the fp32 residual stream (o and down alike)
  gate_up  x [B, D]: select fused with RMSNorm, GEMV [D, 2 I], fp32 partials left for down (gate_up)
  down     gate/up's partials (as many as gate_up's default split): select summing them fused with SwiGLU,
           GEMV [I, D], split-K sum + residual (down)
A measurement is one CUDA graph of C launch groups, each on its own copy of the weights (C copies hold at
least --footprint-mb, 512 MB by default, ten times a 50 MB L2: no group finds its rows in L2, as no layer
of a decode step does), replayed for about --measure-s (0.15); time per group = the median of 3 timed runs / C.
Before a configuration is timed, its output on copy 0 is checked against PyTorch (the same fp16 h, the
masked product in fp32; max |diff| <= 2e-2 max |ref|, LlamaOps.verify's bound): a mismatch or a launch
error is recorded in "errors", never timed.

The settings (InputSparseSettings fields) are searched per shape by coordinate descent from the defaults (the
table with the shape's kind's input_sparse.projections over it: what the decode step launches there), stage by
stage for every shape before the next stage (STAGES: block_m x block_k, num_warps, min_split_inputs,
target_programs), each stage's candidates around the shape's best so far; a candidate that launches what was
already measured (the same blocks, warps and split) reuses that time; an accumulator over 64 fp32 registers a
thread (block_k / 2 x block_m / (32 num_warps)) is skipped. No stage starts a measurement after --budget-s;
what is left is listed under "skipped". --start-from r.json --stages warps,... continues a run's descent from
each shape's best there.

JSON to --out (rewritten after every measurement): meta (device, torch / triton, commit), bandwidth (a
device copy: read + written bytes / time), shapes (N, M, producer, copies, kept rows, bytes a group reads:
kept rows x M x 2), results (per measurement: the settings that differ from the shape's defaults, split, us
per group, GB/s of weight rows read, fraction of the copy bandwidth, wall seconds including compiles), best
(per shape: the default's and the best time and settings), errors, skipped. A table of the best per shape on
stdout, with the decode step's projections at the best against the defaults (x layers). Benchmarks assert
nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from e2e_llama import SHAPES, copy_bandwidth, sync  # benchmarks/, the script's folder (run as a script)

# (stage, the InputSparseSettings fields it varies, their values); --smoke: SMOKE_STAGES on tiny shapes
STAGES = [("blocks", ("block_m", "block_k"), ([32, 64, 128], [64, 128, 256])),
          ("warps", ("num_warps",), ([2, 4, 8],)),
          ("split_len", ("min_split_inputs",), ([256, 512, 1024],)),
          ("programs", ("target_programs",), ([264, 528, 1056],))]
SMOKE_STAGES = [("blocks", ("block_m", "block_k"), ([16, 32], [8, 16])),
                ("warps", ("num_warps",), ([2, 4],)),
                ("split_len", ("min_split_inputs",), ([16, 256],))]
MAX_ACC_REGS = 64  # fp32 accumulator elements a thread holds: block_k / 2 x block_m / (32 num_warps)
TOL = 2e-2  # max |diff| / max |ref| (LlamaOps.verify)


def projections(c: dict) -> list[dict]:
    """The four projection kinds of shape c: name, N inputs, M outputs, the select's producer."""
    D, H, Hkv, hd, inter = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                            c["intermediate_size"])
    return [dict(proj="qkv", N=D, M=(H + 2 * Hkv) * hd, producer="norm"),
            dict(proj="o", N=H * hd, M=D, producer="none"),
            dict(proj="gate_up", N=D, M=2 * inter, producer="norm"),
            dict(proj="down", N=inter, M=D, producer="swiglu")]


def kind_table(base, proj: str):
    """The InputSparseSettings proj's launches take under the KernelSettings base (its input_sparse.projections
    applied), as one table (no projections: every kind the sweep launches takes it)."""
    from dejavu.plugins import resolve_projection_settings

    return dataclasses.replace(base.with_overrides(resolve_projection_settings(base)[proj]).input_sparse,
                               projections=())


def _median_t(h: torch.Tensor) -> float:
    """A threshold between the two |h| values around the median: half the inputs kept, none on the edge."""
    a = h.float().abs().flatten().sort().values
    i = a.numel() // 2
    return float((a[i - 1] + a[i]) / 2)


class Shape:
    """One projection of one model: its weight copies, inputs, threshold and PyTorch reference."""

    def __init__(self, model: str, c: dict, p: dict, batch: int, footprint: int, dev, dtype, seed: int):
        from dejavu.plugins import DEFAULT
        from dejavu.plugins.input_sparse import produce_ref, split_k_for, sum_parts_ref

        self.model, self.c, self.dev, self.dtype = model, c, dev, dtype
        self.proj, self.N, self.M, self.producer = p["proj"], p["N"], p["M"], p["producer"]
        g = torch.Generator(device=dev).manual_seed(seed)
        N, M, B = self.N, self.M, batch
        w_bytes = N * M * torch.finfo(dtype).bits // 8
        self.copies = max(2, min(64, -(-footprint // w_bytes)))
        self.w = [(torch.randn(N, M, generator=g, device=dev) * N ** -0.5).to(dtype) for _ in range(self.copies)]
        self.norm = None
        if self.producer == "norm":
            self.norm = ((1 + 0.1 * torch.randn(N, generator=g, device=dev)).to(dtype), 1e-5)
        if self.proj == "down":  # gate/up's partials as gate_up's default launch leaves them
            s0 = split_k_for(B, c["hidden_size"], 2 * N, kind_table(DEFAULT, "gate_up"))
            self.x = torch.randn(s0, B, 2 * N, generator=g, device=dev) * s0 ** -0.5
            h = produce_ref(sum_parts_ref(self.x, dtype), swiglu=True)
        else:
            self.x = torch.randn(B, N, generator=g, device=dev).to(dtype)
            h = produce_ref(self.x, *(self.norm or (None, 0.0)))
        self.t = _median_t(h)
        kept = h.float().abs() > self.t
        self.kept_rows = int(kept.sum())
        self.read_bytes = self.kept_rows * M * torch.finfo(dtype).bits // 8  # weight rows a group reads
        self.res = torch.randn(B, M, generator=g, device=dev).to(dtype) if self.proj in ("o", "down") else None
        # the fp32 residual stream (input_sparse.fp32_residual): o and down add into it in place
        self.res32 = self.res.float() if self.res is not None else None
        y = (h * kept).float() @ self.w[0].float()  # [B, M] fp32, the same fp16 h
        if self.proj == "qkv":
            self.rope_args(B)
            self.ref = self._qkv_ref(y.to(dtype))
        elif self.proj == "gate_up":
            self.ref = y
        else:
            self.ref = y + self.res.float()

    def rope_args(self, B: int):
        c, dev = self.c, self.dev
        hd, Hkv, T = c["head_dim"], c["num_key_value_heads"], 64
        ang = torch.full((B, hd), 0.3, device=dev) * torch.arange(1, hd + 1, device=dev) / hd
        self.cos, sin = ang.cos().to(self.dtype), ang.sin().to(self.dtype)
        self.sin = torch.cat((-sin[..., :hd // 2], sin[..., hd // 2:]), -1)
        self.pos = torch.full((B,), 7, dtype=torch.int64, device=dev)
        self.kc = torch.zeros(B, Hkv, T, hd, dtype=self.dtype, device=dev)
        self.vc = torch.zeros_like(self.kc)
        self.rows = torch.arange(B, device=dev)

    def _qkv_ref(self, qkv):
        from dejavu.plugins.input_sparse import sliced_qkv_rope_ref

        kc, vc = torch.zeros_like(self.kc), torch.zeros_like(self.kc)
        q = sliced_qkv_rope_ref(qkv, self.cos, self.sin, self.pos, kc, vc, self.rows)
        return torch.cat([q.flatten(), kc[:, :, 7].flatten(), vc[:, :, 7].flatten()]).float()

    def launch(self, ops, i: int):
        """One launch group on weight copy i, as the decode step launches it."""
        w = self.w[i]
        res = self.res32 if ops.fp32_residual else self.res
        if self.proj == "qkv":
            return ops.qkv_rope(self.x, w, self.t, self.norm, self.cos, self.sin, self.pos, self.kc, self.vc,
                                self.rows)
        if self.proj == "o":
            return ops.linear(self.x, w, self.t, residual=res, kind="o")
        if self.proj == "gate_up":
            return ops.gate_up(self.x, w, self.t, self.norm)
        return ops.down(self.x, w, self.t, res)

    def error(self, ops) -> float:
        """max |launch(copy 0) - ref| / max |ref|."""
        from dejavu.plugins.input_sparse import sum_parts_ref

        if self.proj == "qkv":
            self.kc.zero_(), self.vc.zero_()
        if self.res32 is not None:
            self.res32.copy_(self.res)  # the timed launches added into it
        out = self.launch(ops, 0)
        if self.proj == "qkv":
            out = torch.cat([out.flatten(), self.kc[:, :, 7].flatten(), self.vc[:, :, 7].flatten()])
        elif self.proj == "gate_up" and out.dim() == 3:
            out = sum_parts_ref(out, torch.float32)
        return float((out.float() - self.ref).abs().max() / self.ref.abs().max().clamp_min(1e-30))


def launch_key(s: Shape, cfg) -> tuple:
    """What a configuration launches on s: configurations with equal keys launch the same kernels."""
    from dejavu.plugins.input_sparse import split_k_for

    return cfg.block_m, cfg.block_k, cfg.num_warps, split_k_for(s.x.shape[-2], s.N, s.M, cfg)


def time_groups(s: Shape, ops, measure_s: float) -> float:
    """Seconds per launch group: a CUDA graph of one group per weight copy, replayed (eager on the CPU)."""
    dev = s.dev
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for i in range(s.copies):
            s.launch(ops, i)
        return (time.perf_counter() - t0) / s.copies
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm: every launch compiled and its allocations made outside the capture
        for i in range(s.copies):
            s.launch(ops, i)
    torch.cuda.current_stream(dev).wait_stream(side)
    sync(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [s.launch(ops, i) for i in range(s.copies)]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    e0.record()
    g.replay()
    e1.record()
    sync(dev)
    reps = max(1, min(1000, round(measure_s / 3 / max(e0.elapsed_time(e1) / 1e3, 1e-6))))
    samples = []
    for _ in range(3):
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        sync(dev)
        samples.append(e0.elapsed_time(e1) / 1e3 / reps)
    del g, outs
    return statistics.median(samples) / s.copies


class Sweep:
    """Measurements, the best per shape, the JSON (rewritten after every record)."""

    def __init__(self, out: Path, meta: dict, base):
        self.out, self.base = out, base  # base: the KernelSettings a configuration's input_sparse replaces
        self.data = {"meta": meta, "bandwidth": None, "shapes": [], "results": [], "best": {}, "errors": [],
                     "skipped": []}
        self.seen: dict = {}  # (shape, launch key) -> result

    def save(self):
        from dejavu.fileio import write_json

        self.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.out, self.data, indent=1, default=str)

    def measure(self, s: Shape, cfg, stage: str, measure_s: float) -> dict | None:
        """The time of cfg on s (None: an error, recorded); a launch measured before is not timed again."""
        from dejavu.runtime.llama_decoder import LlamaOps

        name = f"{s.model}/{s.proj}"
        key = (name, launch_key(s, cfg))
        diff = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(s.start, k)}
        if key in self.seen:
            return self.seen[key]
        t0 = time.perf_counter()
        try:
            ops = LlamaOps("triton", dataclasses.replace(self.base, input_sparse=cfg))
            err = s.error(ops)
            if not err <= TOL:
                raise RuntimeError(f"max |diff| / max |ref| {err:.3g} > {TOL}")
            sec = time_groups(s, ops, measure_s)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is a result too
            self.data["errors"].append({"shape": name, "stage": stage, "settings": diff, "error": repr(e)[:500],
                                        "trace": traceback.format_exc()[-1500:]})
            self.seen[key] = None
            self.save()
            print(f"  {name:<24} {stage:<10} {json.dumps(diff):<60} ERROR {repr(e)[:120]}", flush=True)
            return None
        bw = (self.data["bandwidth"] or {}).get("copy_GBps")
        r = {"shape": name, "stage": stage, "settings": diff, "split": key[1][-1], "us": sec * 1e6,
             "GBps": s.read_bytes / sec / 1e9, "frac_copy": s.read_bytes / sec / 1e9 / bw if bw else None,
             "max_rel_diff": err, "wall_s": time.perf_counter() - t0, "config": dataclasses.asdict(cfg)}
        self.data["results"].append(r)
        self.seen[key] = r
        self.save()
        print(f"  {name:<24} {stage:<10} {json.dumps(diff):<60} {r['us']:8.2f} us  {r['GBps']:7.0f} GB/s  "
              f"split {r['split']:<3} ({r['wall_s']:.1f} s)", flush=True)
        return r


def candidates(best, fields, values):
    """best with the stage's fields set to every combination of their values (best's own first)."""
    import itertools

    out = [best]
    for combo in itertools.product(*values):
        c = dataclasses.replace(best, **dict(zip(fields, combo)))
        if c not in out:
            out.append(c)
    return out


def acc_regs(cfg) -> float:
    return max(1, cfg.block_k // 2) * cfg.block_m / (32 * cfg.num_warps)


def run(a, dev) -> Sweep:
    from dejavu.runtime.ops import settings_for

    sweep = Sweep(Path(a.out), meta(dev, a), settings_for(None, dev))  # the defaults as resolved for this GPU
    sweep.data["bandwidth"] = copy_bandwidth(dev)
    sweep.save()
    print(f"device copy {sweep.data['bandwidth']['copy_GBps']:.0f} GB/s", flush=True)
    models = a.models.split(",")
    shapes = []
    for mi, m in enumerate(models):
        for pi, p in enumerate(projections(SHAPES[m])):
            s = Shape(m, SHAPES[m], p, a.batch, a.footprint_mb << 20, dev, torch.float16, seed=10 * mi + pi)
            shapes.append(s)
            sweep.data["shapes"].append({"shape": f"{m}/{s.proj}", "N": s.N, "M": s.M, "producer": s.producer,
                                         "batch": a.batch, "copies": s.copies, "threshold": s.t,
                                         "kept_rows": s.kept_rows, "read_bytes": s.read_bytes,
                                         "layers": SHAPES[m]["num_hidden_layers"]})
    sweep.save()
    start = time.perf_counter()
    for s in shapes:
        s.start = kind_table(sweep.base, s.proj)  # the defaults of the shape's kind, where its descent starts
    best = {f"{s.model}/{s.proj}": (s.start, None) for s in shapes}
    start_from = json.loads(Path(a.start_from).read_text())["best"] if a.start_from else {}
    stages = SMOKE_STAGES if a.smoke else STAGES
    if a.stages:
        stages = [st for st in stages if st[0] in a.stages.split(",")]
    for stage, fields, values in stages:
        print(f"stage {stage} ({time.perf_counter() - start:.0f} s)", flush=True)
        for s in shapes:
            name = f"{s.model}/{s.proj}"
            cfg0, r0 = best[name]
            if name not in sweep.data["best"]:  # the defaults first
                r0 = sweep.measure(s, cfg0, "default", a.measure_s)
                best[name] = (cfg0, r0)
                sweep.data["best"][name] = {"default_us": r0 and r0["us"], "us": r0 and r0["us"], "settings": {}}
                if name in start_from:  # a previous run's best, where this run's descent starts
                    cfg = dataclasses.replace(cfg0, **start_from[name]["settings"])
                    r = sweep.measure(s, cfg, "start", a.measure_s)
                    if r is not None and (r0 is None or r["us"] < r0["us"]):
                        best[name] = (cfg, r)
                        sweep.data["best"][name].update(us=r["us"], settings=r["settings"], GBps=r["GBps"],
                                                        split=r["split"])
                cfg0 = best[name][0]
            for cfg in candidates(cfg0, fields, values):
                if acc_regs(cfg) > MAX_ACC_REGS:
                    continue
                if time.perf_counter() - start > a.budget_s:
                    sweep.data["skipped"].append({"shape": name, "stage": stage,
                                                  "settings": {f: getattr(cfg, f) for f in fields}})
                    continue
                r = sweep.measure(s, cfg, stage, a.measure_s)
                if r is not None and (best[name][1] is None or r["us"] < best[name][1]["us"]):
                    best[name] = (cfg, r)
                    sweep.data["best"][name].update(us=r["us"], settings=r["settings"], GBps=r["GBps"],
                                                    split=r["split"])
        sweep.save()
    return sweep


def meta(dev, a) -> dict:
    import triton

    from dejavu.provenance import tree_commit

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": tree_commit(Path(__file__)),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "args": vars(a)}


def table(sweep: Sweep) -> str:
    """Best per shape, and per model the step's four projections x layers at the defaults and at the best."""
    shapes = {d["shape"]: d for d in sweep.data["shapes"]}
    lines = [f"{'shape':<24} {'default us':>10} {'best us':>9} {'x':>5} {'GB/s':>6} {'split':>5}  best settings"]
    step: dict = {}
    for name, b in sweep.data["best"].items():
        if b["us"] is None:
            lines.append(f"{name:<24} {'error':>10}")
            continue
        if b["default_us"] is None:  # the defaults failed: no ratio, no step estimate
            lines.append(f"{name:<24} {'error':>10} {b['us']:>9.2f}  {json.dumps(b['settings'])}")
            continue
        lines.append(f"{name:<24} {b['default_us']:>10.2f} {b['us']:>9.2f} {b['default_us'] / b['us']:>5.2f} "
                     f"{b.get('GBps', shapes[name]['read_bytes'] / b['us'] / 1e3):>6.0f} "
                     f"{str(b.get('split', '')):>5}  {json.dumps(b['settings'])}")
        m, L = name.split("/")[0], shapes[name]["layers"]
        d, t = step.get(m, (0.0, 0.0))
        step[m] = (d + L * b["default_us"] / 1e3, t + L * b["us"] / 1e3)
    for m, (d, t) in step.items():
        lines.append(f"{m}: the step's projections {d:.3f} ms at the defaults, {t:.3f} ms at each shape's best")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--models", default=None, help="default llama-3-8b,llama-3-70b-tp8 (--smoke: tiny)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=170.0, help="no measurement starts after this many seconds")
    p.add_argument("--measure-s", type=float, default=0.15, help="seconds of replays a measurement times")
    p.add_argument("--footprint-mb", type=int, default=512, help="weight copies of a shape hold at least this")
    p.add_argument("--stages", default=None, help="comma list of stages to run (default: all)")
    p.add_argument("--start-from", default=None,
                   help="a previous run's JSON: each shape's descent starts from its best there (with --stages)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes, a small grid")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (the launchers import it lazily)
        dev = torch.device("cpu")
        a.models, a.footprint_mb = a.models or "tiny", 0  # two weight copies
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device (--smoke runs the CPU check)")
        dev = torch.device("cuda")
        a.models = a.models or "llama-3-8b,llama-3-70b-tp8"
    unknown = [m for m in a.models.split(",") if m not in SHAPES]
    if unknown:
        p.error(f"--models: unknown shape(s) {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    sweep = run(a, dev)
    print(table(sweep))
    print(f"{len(sweep.data['results'])} measured, {len(sweep.data['errors'])} errors, "
          f"{len(sweep.data['skipped'])} skipped -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

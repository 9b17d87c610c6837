"""Does warming L2 with the next kernel's weight rows pay? (H200; plugins/prefetch.py)

    source benchmarks/device_env.sh && python3 benchmarks/l2_prefetch.py [--out F]

OPT-30B shapes, fp16, batch 1, RANDOM weights, density 0.3: the output projection's rows
of 17 of 56 heads (2176 rows x 7168, 31 MB, through sparse_fc2's kernel: the same gathered
tl.dot path) and fc1's 8602 neuron rows (123 MB, of which the first `--fc1-mb` are
prefetched). Every timing is a CUDA graph over 4 weight copies (cold L2 between calls).

- `op`: the kernel alone; `pf`: the prefetch alone; `pf+op`: prefetch then kernel on one
  stream (op time saved = op - (pf+op - pf): what L2 hits are worth).
- `window`: the decode-step situation: the main stream runs a latency-bound stretch
  (`torch.cuda._sleep`, `--window-us`, as the Q/K/V finish + attention kernels) and then the
  kernel, while a side stream prefetches during the stretch; against the same without
  the prefetch. `window+gemv` adds a 36 MB GEMV on a third stream during the stretch (the
  side-stream predictors of the next layer, which compete for L2 and bandwidth).
Eviction policy "evict_last" (the default) and "" (normal) are both timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as K  # noqa: E402  (bench_graph, the plugins import, bandwidth)

PF = __import__("importlib").import_module("dejavu.plugins.prefetch")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "l2_prefetch.json"))
    ap.add_argument("--window-us", type=float, default=20.0)
    ap.add_argument("--fc1-mb", default="16,32")
    a = ap.parse_args(argv)
    dev, dt = "cuda", torch.float16
    D, F, H = K.SHAPES["opt-30b"]
    hd, kh, kf = D // H, round(0.3 * H), round(0.3 * F)
    copies = 4
    g = torch.Generator(device=dev).manual_seed(0)
    wo = [torch.randn(H * hd, D, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(copies)]
    w1 = [torch.randn(F, D, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(copies)]
    b1, bo = torch.zeros(F, device=dev, dtype=dt), torch.zeros(D, device=dev, dtype=dt)
    heads = [torch.randperm(H, device=dev)[:kh].to(torch.int32) for _ in range(copies)]
    rows_o = [(h[:, None].long() * hd + torch.arange(hd, device=dev)).reshape(-1).to(torch.int32) for h in heads]
    neu = [torch.randperm(F, device=dev)[:kf].to(torch.int32) for _ in range(copies)]
    o = torch.randn(1, kh * hd, device=dev, dtype=dt)
    x = torch.randn(1, D, device=dev, dtype=dt)
    gx = torch.randn(1, 512, device=dev, dtype=dt)
    gw = [torch.randn(F, 512, device=dev, dtype=dt, generator=g) for _ in range(copies)]  # 29 MB each
    buf = torch.empty(1 << 16, dtype=torch.float32, device=dev)
    cycles = int(a.window_us * 1e-6 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    side, third = torch.cuda.Stream(), torch.cuda.Stream()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%F %T"),
           "window_us": a.window_us, "sleep_cycles": cycles, "bandwidth": K.measure_bandwidth(), "rows": []}

    out_op = lambda i: K.P.sparse_fc2(o, wo[i], bo, rows_o[i], validate=False)  # noqa: E731
    fc1_op = lambda i: K.P.sparse_fc1(x, w1[i], b1, neu[i], validate=False)  # noqa: E731
    cases = [("out_proj", out_op, lambda i: (wo[i], heads[i], hd), [None])]
    cases += [("fc1", fc1_op, lambda i: (w1[i], neu[i], 1), [int(m) << 20 for m in a.fc1_mb.split(",")])]

    for name, op, args, caps in cases:
        t_op = K.bench_graph([lambda i=i: op(i) for i in range(copies)])
        t_sleep = K.bench_graph([lambda: torch.cuda._sleep(cycles)] * copies)
        for cap in caps:
            for evict in ("evict_last", ""):
                cfg = {"EVICT": evict}
                pf = lambda i, cap=cap, cfg=cfg: PF.prefetch_rows(*args(i)[:2], args(i)[2], max_bytes=cap,  # noqa: E731
                                                                  out=buf, validate=False, config=cfg)
                gemv = lambda i: torch.nn.functional.linear(gx, gw[i])  # noqa: E731
                t_pf = K.bench_graph([lambda i=i: pf(i) for i in range(copies)])
                t_seq = K.bench_graph([lambda i=i: (pf(i), op(i)) for i in range(copies)])

                def window(with_pf, with_gemv):
                    def call(i):
                        main = torch.cuda.current_stream()
                        ev = torch.cuda.Event()
                        ev.record()
                        joins = []
                        for s, work in ((side, pf if with_pf else None), (third, gemv if with_gemv else None)):
                            if work is None:
                                continue
                            s.wait_event(ev)
                            with torch.cuda.stream(s):
                                work(i)
                                done = torch.cuda.Event()
                                done.record()
                            joins.append(done)
                        torch.cuda._sleep(cycles)
                        op(i)
                        for j in joins:
                            main.wait_event(j)
                    return K.bench_graph([lambda i=i: call(i) for i in range(copies)])

                nbytes = PF.prefetch_plan(args(0)[1].numel(), args(0)[2], D, 2, cap)[0] * D * 2
                row = {"kernel": name, "prefetch_MB": nbytes / 2**20, "evict": evict or "normal",
                       "op_us": 1e3 * t_op, "sleep_us": 1e3 * t_sleep, "pf_us": 1e3 * t_pf, "pf_then_op_us": 1e3 * t_seq,
                       "op_saved_us": 1e3 * (t_op - (t_seq - t_pf)),
                       "window_us": 1e3 * window(False, False), "window_pf_us": 1e3 * window(True, False),
                       "window_gemv_us": 1e3 * window(False, True), "window_gemv_pf_us": 1e3 * window(True, True)}
                row["window_saved_us"] = row["window_us"] - row["window_pf_us"]
                row["window_gemv_saved_us"] = row["window_gemv_us"] - row["window_gemv_pf_us"]
                res["rows"].append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

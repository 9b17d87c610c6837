"""Time the q/k/v sum kernel alone (`input_sparse._sum_rope`) over S split-K partial planes, in a CUDA graph of
200 launches: the Llama-3-70B TP-8 rank's q/k/v (8 + 2 heads of 128, M 1280) and Llama-3-8B's (48 heads, M 6144),
S 1 (a product), 6, 14, 27; with PDL as the decode step launches it and without.
    python3 benchmarks/probe_sum_rope.py --out F"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from dejavu.plugins import input_sparse as IS
from dejavu.plugins.settings import DEFAULT, PDLSettings


def time_graph(fn, reps=200, rounds=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(out)[len(out) // 2]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.float16
    rows = []
    for name, H, Hkv in (("llama-3-70b-tp8", 8, 1), ("llama-3-8b", 32, 8)):
        hd, T = 128, 256
        M = (H + 2 * Hkv) * hd
        kc, vc = (torch.zeros(1, Hkv, T, hd, device=dev, dtype=dt) for _ in range(2))
        cos, sin = torch.rand(1, hd, device=dev, dtype=dt), torch.rand(1, hd, device=dev, dtype=dt)
        pos = torch.tensor([130], device=dev)
        for S in (0, 6, 14, 27):
            part = torch.randn(S, 1, M, device=dev) if S else torch.randn(1, M, device=dev, dtype=dt)
            for pdl in (True, False):
                for block_m in (64, 256):
                    ks = DEFAULT.with_overrides({"input_sparse": {"block_m": block_m}})
                    if not pdl:
                        ks = dataclasses.replace(ks, pdl=PDLSettings(ENABLED=False))
                    us = time_graph(lambda: IS._sum_rope(part, dt, cos, sin, pos, kc, vc, ks, None, None))
                    rows.append({"shape": name, "M": M, "S": S, "pdl": pdl, "block_m": block_m, "us_per_launch": us})
                    print(name, M, S, pdl, block_m, f"{us:.3f}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "argv": sys.argv}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

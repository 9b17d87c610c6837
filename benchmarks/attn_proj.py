"""Kernel-level cost of the attention and its output projection in one launch
(`sparse_attention.attend_project`, ATTN_CONFIG["PROJ_*"]) against the chunked attention, its
combine and the projection as separate launches, on the GPU: OPT-30B layer shapes, batch 1,
fp16, random weights (speed only), S_max 256 (prompt 128 + 128 new tokens), position 200.

For each head density and configuration:
- `op`: the whole deferred-K/V attention op (Q/K/V kernels, attention, projection, the split-K
  reduction with the MLP's LayerNorm, as the decode step calls it);
- `attn+proj`: attention and projection alone, from a fixed Q.
Each: 24 calls captured in one CUDA graph cycling over L layers' weights and caches (so the
projection rows come from HBM, not from an L2 warm from the previous call), replay timed by
triton.testing.do_bench (median, per call); outputs compared with the chunked path's
(relative error of y, of the LayerNorm'd y, equal valid_len).

    python3 benchmarks/attn_proj.py --out results.json
    python3 benchmarks/attn_proj.py --tiny --out /tmp/x.json   # CPU dry run (TRITON_INTERPRET=1)
"""
from __future__ import annotations

import argparse
import json
import os

import torch

# name -> ATTN_CONFIG entries (PROJ_MAX_S 0: the chunked path, the reference of the comparison)
CONFIGS = {
    "chunked": {"PROJ_MAX_S": 0},
    "fused": {},  # PROJ_MAX_S 4096 added to every "fused" row
    "fused d128 w8": {"PROJ_BLOCK_D": 128, "PROJ_WARPS": 8},
    "fused w8": {"PROJ_WARPS": 8},
    "fused no prefetch": {"PROJ_PF": False},
    "fused T132": {"PROJ_TARGET": 132},
    "fused T528": {"PROJ_TARGET": 528},
    "fused S64": {"PROJ_BLOCK_S": 64},
    "fused S16": {"PROJ_BLOCK_S": 16},
    "fused sum": {"PROJ_DOT": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--densities", default="0.3,0.1")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--layers", type=int, default=6, help="layers of weights cycled through")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (TRITON_INTERPRET=1): a dry run")
    a = ap.parse_args()
    if a.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.testing as tt

    from dejavu.plugins import sparse_attention as SA
    from dejavu.plugins.deferred_kv import sparse_attn_decode_deferred
    from dejavu.plugins.sparse_attention import _positions, attend_project

    dev, dt = torch.device("cpu" if a.tiny else "cuda"), torch.float16
    D, H, S, pos, L = (64, 8, 16, 11, 2) if a.tiny else (7168, 56, 256, 200, a.layers)
    hd = D // H
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    layers = [dict(wq=rnd(D, D, scale=D ** -0.5), bq=rnd(D, scale=0.1), wkv=rnd(2 * D, D, scale=D ** -0.5),
                   bkv=rnd(2 * D, scale=0.1), wo_t=rnd(D, D, scale=D ** -0.5), bo=rnd(D, scale=0.1),
                   kc=rnd(1, H, S, hd), vc=rnd(1, H, S, hd), xh=rnd(1, S, D),
                   ln=(1 + rnd(D, scale=0.1), rnd(D, scale=0.1))) for _ in range(L)]
    x, res = rnd(1, D), rnd(1, D)
    pos_t = torch.tensor([pos], dtype=torch.int32, device=dev)

    def time_us(fn, n=24):
        if a.tiny:
            fn(0)
            return float("nan")
        for i in range(L):
            fn(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                fn(i % L)
        return 1e3 * tt.do_bench(graph.replay, warmup=5, rep=100) / n

    rows = []
    for dens in [float(s) for s in a.densities.split(",")]:
        kh = max(1, round(dens * H))
        heads = torch.randperm(H, generator=g, device=dev)[:kh].sort().values.to(torch.int32)
        vl0 = torch.full((1, H), pos, dtype=torch.int32, device=dev)  # steady state: no slots to catch up
        q = torch.randn(1, kh * hd, generator=g, device=dev) * 0.1
        ref = None
        for name in a.configs.split(","):
            cfg = CONFIGS[name] if name == "chunked" else {"PROJ_MAX_S": 4096, **CONFIGS[name]}
            vls = [vl0.clone() for _ in range(L)]
            outs = [torch.empty(1, D, dtype=dt, device=dev) for _ in range(L)]
            lns = [torch.empty(1, D, dtype=dt, device=dev) for _ in range(L)]

            def op(i):
                w = layers[i]
                vls[i].copy_(vl0)
                return sparse_attn_decode_deferred(x, w["wq"], w["bq"], w["wkv"], w["bkv"], w["wo_t"], w["bo"], heads,
                                                   w["kc"], w["vc"], w["xh"], vls[i], pos_t, res, out=outs[i],
                                                   ln=w["ln"], ln_out=lns[i], config={"attn": cfg})

            def ap_only(i):
                w = layers[i]
                return attend_project(q, heads, w["kc"], w["vc"], pos_t, 0, w["wo_t"], w["bo"], res, outs[i], cfg)

            row = {"density": dens, "heads": kh, "config": name, "attn_config": {**SA.ATTN_CONFIG, **cfg},
                   "op_us": time_us(op), "attn_proj_us": time_us(ap_only)}
            op(0)
            got = (outs[0].float().clone(), lns[0].float().clone(), vls[0].clone())
            if ref is None:
                ref = got
            row["y_rel_err"] = float((got[0] - ref[0]).norm() / ref[0].norm())
            row["ln_rel_err"] = float((got[1] - ref[1]).norm() / ref[1].norm())
            row["valid_len_equal"] = bool(torch.equal(got[2], ref[2]))
            row["finite"] = bool(torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all())
            rows.append(row)
            print(f"d{dens} {kh:3d} heads  {name:20s} op {row['op_us']:7.2f} us  attn+proj {row['attn_proj_us']:7.2f} us"
                  f"  y rel {row['y_rel_err']:.1e}  ln rel {row['ln_rel_err']:.1e}  vl {row['valid_len_equal']}",
                  flush=True)
    meta = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "shape": {"D": D, "H": H, "S_max": S, "pos": pos, "layers": L}, "dtype": str(dt)}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()

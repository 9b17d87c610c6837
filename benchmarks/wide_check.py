"""GPU check of the deferred Q/K/V kernels' wide tile (QKV_CONFIG_B1 SHARED_P_WIDE, opt-in) at a real shape.

    source benchmarks/device_env.sh && python3 benchmarks/wide_check.py [--out F]

OPT-30B attention shape (56 heads of 128, D 7168), batch 1, random weights: decode steps whose
selected heads are 0 to 60 slots behind (the small tile up to 15, the wide tile to 31, then the
finishing kernel's slow path; a fifth step with every head 3 behind), through
`sparse_attn_decode_deferred` with SHARED_P_WIDE 32 (on SHARED_P 16), with neither it nor
SHARED_P_UNFOLDED (every head past 15 in the slow path), with the default (SHARED_P_UNFOLDED 32: every
program's dot over 31 slots), with SHARED_P_WIDE_ALL (all32: every K/V program wide in a launch with a
head past 15, none otherwise; 2026-12-04), and through the float64 reference (on the GPU). 2026-12-04
ran it on trees before SHARED_P_UNFOLDED existed (the first two forms).
Reports the relative errors of the output and of the caches written; fails (exit 1) past 2e-3
(fp16) / 1e-5 (fp32) relative to float64.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None) -> int:
    from dejavu.plugins.deferred_kv import sparse_attn_decode_deferred, sparse_attn_decode_deferred_ref

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "wide_check.json"))
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--hd", type=int, default=128)
    a = ap.parse_args(argv)
    dev = "cuda"
    H, hd = a.heads, a.hd
    D, S = H * hd, 192
    g = torch.Generator(device=dev).manual_seed(0)
    rows, ok = [], True
    for dtype, tol in ((torch.float16, 2e-3), (torch.float32, 1e-5)):
        def r(*shape, s=1.0):
            return (torch.randn(*shape, device=dev, generator=g) * s).to(dtype)
        w = [r(D, D, s=D ** -0.5), r(D, s=0.25), r(2 * D, D, s=D ** -0.5), r(2 * D, s=0.25), r(D, D, s=D ** -0.5),
             r(D, s=0.25)]
        w64 = [t.double() for t in w]
        hist0, kc0, vc0 = r(1, S, D), r(1, H, S, hd), r(1, H, S, hd)
        pos0 = 100
        lag = torch.arange(H, device=dev) % 61  # 0..60 slots behind
        vl0 = (pos0 - lag).to(torch.int32).reshape(1, H)
        for wide, cfg in ((32, {"qkv": {"SHARED_P_WIDE": 32, "SHARED_P_UNFOLDED": None}}),
                          (0, {"qkv": {"SHARED_P_WIDE": 0, "SHARED_P_UNFOLDED": None}}), ("default", None),
                          ("all32", {"qkv": {"SHARED_P_WIDE": 32, "SHARED_P_WIDE_ALL": True, "SHARED_P_UNFOLDED": None,
                                             "maxnreg": 128}})):
            kc, vc, vl, hist = kc0.clone(), vc0.clone(), vl0.clone(), hist0.clone()
            k64, v64, vl64, h64 = kc0.double(), vc0.double(), vl0.clone(), hist0.double()
            for step in range(5):
                pos = pos0 + 3 * step
                if step < 4:
                    heads = torch.randperm(H, device=dev, generator=g)[: max(1, H * 3 // 10)].to(torch.int32)
                    heads = heads.reshape(1, -1)
                # step 4 takes step 3's heads again (3 slots behind): no head past 15 (all32's small-tile launch)
                x, res = r(1, D), r(1, D)
                lags = (pos - torch.minimum(vl64[0, heads[0].long()], torch.tensor(pos, device=dev))).tolist()
                y = sparse_attn_decode_deferred(x, *w, heads, kc, vc, hist, vl, torch.tensor([pos], device=dev), res,
                                                config=cfg)
                ref = sparse_attn_decode_deferred_ref(x.double(), *w64, heads, k64, v64, h64, vl64,
                                                      torch.tensor([pos], device=dev), res.double())
                torch.cuda.synchronize()
                e_y = float((y.double() - ref).norm() / ref.norm())
                e_k = float((kc.double() - k64).norm() / k64.norm())
                e_v = float((vc.double() - v64).norm() / v64.norm())
                same_vl = bool(torch.equal(vl, vl64))
                good = max(e_y, e_k, e_v) <= tol and same_vl
                ok &= good
                rows.append({"dtype": str(dtype)[6:], "shared_p_wide": wide,
                             "step": step, "max_lag": max(lags), "lags_over_15": sum(x > 15 for x in lags),
                             "rel_err_y": e_y, "rel_err_k": e_k, "rel_err_v": e_v, "valid_len_equal": same_vl,
                             "ok": good})
                print(rows[-1], flush=True)
    json.dump({"ok": ok, "rows": rows, "gpu": torch.cuda.get_device_name()}, open(a.out, "w"), indent=1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The SwiGLU MLP of a TEAL decode step alone, fused (input_sparse.fused_mlp_add: one launch after gate/up's select)
against the defaults' launches (gate/up's partials, down's SwiGLU select, down adding into the fp32 stream), on the
Llama-3-8B and Llama-3-70B TP-8 rank MLP shapes (random fp16 weights of std 0.02, norms 1, batch 1, 50% of gate/up's
and down's inputs skipped): each form's error against a float64 reference of the same roundings' inputs (and, where
it is off, alpha: the error's share of down's output, 1.0 = down added twice), and its time in a CUDA graph of 20
MLPs (one layer's weights, several times the L2), median of 5 replays; with PDL and without, at several blocks.
    python3 benchmarks/probe_fused_mlp.py --out F"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from dejavu.plugins import input_sparse as IS
from dejavu.plugins.settings import DEFAULT, PDLSettings
from dejavu.runtime.llama_decoder import LlamaOps, linear_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_sum_rope import time_graph  # noqa: E402

SHAPES = {"llama-3-8b": (4096, 14336), "llama-3-70b-tp8": (8192, 3584)}
FORMS = [("unfused", {}), ("fused", {"fuse_mlp": True}), ("fused_i16", {"fuse_mlp": True, "mlp_block_i": 16}),
         ("fused_i64", {"fuse_mlp": True, "mlp_block_i": 64}), ("fused_d64", {"fuse_mlp": True, "mlp_block_d": 64}),
         ("fused_w1", {"fuse_mlp": True, "num_warps": 1})]


def diagnose(dev, dt, D: int = 8192, I: int = 3584) -> dict:
    """The fused kernel with down = the identity on its first I outputs (D 8192 > I 3584): the output less x is h
    where kept, so a wrong neuron shows by its index; with no neuron kept (t_down huge) x must come back unchanged,
    and with every one kept (t_down -1) the whole product."""
    g = torch.Generator(device=dev).manual_seed(1)
    wgu = torch.randn(D, 2 * I, device=dev, dtype=dt, generator=g) * 0.02
    wd = torch.zeros(I, D, device=dev, dtype=dt)
    wd[:, :I] = torch.eye(I, device=dev, dtype=dt)
    nw = torch.ones(D, device=dev, dtype=dt)
    x = torch.randn(2, D, device=dev, generator=g)
    gu = linear_ref(x, wgu.float(), 0.5, (nw.float(), 1e-5)).to(dt)
    h = IS.produce_ref(gu, swiglu=True).float()
    out = {}
    for fields in ({"fuse_mlp": True}, {"fuse_mlp": True, "num_warps": 1}, {"fuse_mlp": True, "sync": 1},
                   {"fuse_mlp": True, "pdl": 0}):
        ks = DEFAULT.with_overrides({"input_sparse": {k: v for k, v in fields.items() if k not in ("sync", "pdl")}})
        if "pdl" in fields:
            ks = dataclasses.replace(ks, pdl=PDLSettings(ENABLED=False))
        ops = LlamaOps("triton", ks)
        for t_down in (0.05, -1.0, 1e9):
            if "sync" in fields:  # a barrier after each step of down's loop (the launcher's launch, SYNC 1)
                y = x.clone()
                sel = ops._select(y, wgu, 0.5, "gate_up", (nw, 1e-5), dtype=dt)
                cfg = ops.kinds["gate_up"].input_sparse
                IS.jit(IS._fused_mlp_kernel, dev)[(2, -(-I // cfg.mlp_block_i))](
                    *sel, wgu, wd, wgu, y, D, I, D, -(-D // sel[2].shape[1]), sel[2].shape[1], float(t_down),
                    BLOCK_I=cfg.mlp_block_i, SUB=cfg.block_k // 2, BLOCK_D=cfg.mlp_block_d, HAS_BIAS=False, SYNC=1,
                    num_warps=cfg.num_warps, **IS.pdl_args(dev, "is_gemv", ks.pdl))
            else:
                y = ops.mlp(x.clone(), wgu, wd, 0.5, t_down, (nw, 1e-5))
            torch.cuda.synchronize()
            want = h * (h.abs() > t_down)
            got = (y - x)[:, :I]
            bad = ((got - want).abs() > 1e-2 * (want.abs() + 1e-3)).nonzero().tolist()
            out[f"{json.dumps(fields)} t_down {t_down:g}"] = {
                "max_err": float((got - want).abs().max()), "rest_max": float((y - x)[:, I:].abs().max()),
                "n_bad": len(bad), "bad_first": bad[:12], "ratio_first": [
                    round(float(got[b, j] / want[b, j]), 4) if float(want[b, j]) else None for b, j in bad[:12]]}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.float16
    rows = []
    for name, (D, I) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        wgu = torch.randn(D, 2 * I, device=dev, dtype=dt, generator=g) * 0.02
        wd = torch.randn(I, D, device=dev, dtype=dt, generator=g) * 0.02
        nw = torch.ones(D, device=dev, dtype=dt)
        x = torch.randn(1, D, device=dev, generator=g)
        h_in = linear_ref(x, torch.eye(D, device=dev), 0.0, (nw.float(), 1e-5))  # nw * rms_norm(x)
        t_in = float(h_in.abs().quantile(0.5))
        gu = linear_ref(x, wgu.float(), t_in, (nw.float(), 1e-5)).to(dt)
        t_down = float(IS.produce_ref(gu, swiglu=True).float().abs().quantile(0.5))
        ref = linear_ref(gu.float(), wd.float(), t_down, swiglu=True, residual=x).double()
        down = ref - x.double()
        for form, fields in FORMS:
            for pdl in (True, False):
                ks = DEFAULT.with_overrides({"input_sparse": fields})
                if not pdl:
                    ks = dataclasses.replace(ks, pdl=PDLSettings(ENABLED=False))
                ops = LlamaOps("triton", ks)
                y = x.clone()
                with torch.inference_mode():
                    y = ops.mlp(y, wgu, wd, t_in, t_down, (nw, 1e-5))
                torch.cuda.synchronize()
                err = y.double() - ref
                alpha = float((err * down).sum() / (down * down).sum())
                stream = x.clone()
                us = time_graph(lambda: ops.mlp(stream, wgu, wd, t_in, t_down, (nw, 1e-5)), reps=20)
                r = {"shape": name, "form": form, "pdl": pdl, "max_err": float(err.abs().max()),
                     "max_down": float(down.abs().max()), "alpha": round(alpha, 4), "us": round(us, 2)}
                print(json.dumps(r), flush=True)
                rows.append(r)
    diag = diagnose(dev, dt)
    print(json.dumps(diag), flush=True)
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows, "diagnosis": diag},
                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two forms of the TEAL select + GEMV against the shipped pair, measured per projection shape (GPU).

    python3 benchmarks/gemv_forms.py --out r.json [--models llama-3-8b,llama-3-70b-tp8]
    TRITON_INTERPRET=1 python3 benchmarks/gemv_forms.py --smoke --out r.json   # CPU, tiny shapes, checks only

An RMSNorm input h = norm_w * rms_norm(x) thresholded at t (the q/k/v and gate/up launches of a Llama block),
y = W[:, idx] @ h[idx] left as fp32 split-K partials [S, B, M] (what gate_up leaves for down's select), at
every weight shape of a Llama block (q/k/v, o, gate/up, down: N inputs, M outputs), batch 1:
  shipped  LlamaOps.gate_up: select_slices (NORM) writes each split's (index, value) pairs, sliced_parts reads
           them and gathers the kept rows of w_t [N, M] (input_sparse.py; PDL between the two)
  panel    the same select, the GEMV reading w_t stored as column panels [M / BLOCK_M, N, BLOCK_M]: a program's
           kept rows lie in one contiguous panel, ascending (the same bytes read)
  fused    no select launch: every GEMV program computes the row's rstd itself (the row from L2), then walks
           its split's inputs SUB at a time, h and |h| > t in registers, the weight rows loaded under that
           mask (a skipped row is never fetched), into the same partials
  fused_panel  both
Shapes, weights (copies past the L2), threshold (half the inputs kept) and timing (one CUDA graph of a group
per weight copy, the median of 3) are input_sparse_sweep.py's; each form's partials summed are checked
against the same PyTorch reference first (max |diff| <= 2e-2 max |ref|). JSON: meta, bandwidth, and per shape
and form us, GB/s of kept weight rows, the fraction of the copy bandwidth. Benchmarks assert nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from e2e_llama import SHAPES, copy_bandwidth  # benchmarks/, the script's folder (run as a script)
from input_sparse_sweep import TOL, Shape, meta, projections, time_groups


@triton.jit
def _gdc(GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _panel_gemv_kernel(idx_ptr, val_ptr, count_ptr, w_ptr, part_ptr, B, N, M, PER, BLOCK_M: tl.constexpr,
                       SUB: tl.constexpr, GDC: tl.constexpr):
    # input_sparse._sliced_gemv_kernel with w [P, N, BLOCK_M]: kept row i of panel pm at (pm * N + i) * BLOCK_M
    b, pm, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_c = tl.arange(0, BLOCK_M)
    _gdc(GDC)
    n = tl.load(count_ptr + b * tl.num_programs(2) + ps)
    idx_ptr += b * N + ps * PER
    val_ptr += b * N + ps * PER
    w_ptr += pm.to(tl.int64) * N * BLOCK_M
    ar = tl.arange(0, SUB)
    acc = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, n, 2 * SUB):
        k_a, k_b = k0 + ar, k0 + SUB + ar
        i_a = tl.load(idx_ptr + k_a, mask=k_a < n, other=0)
        i_b = tl.load(idx_ptr + k_b, mask=k_b < n, other=0)
        v_a = tl.load(val_ptr + k_a, mask=k_a < n, other=0.0).to(tl.float32)
        v_b = tl.load(val_ptr + k_b, mask=k_b < n, other=0.0).to(tl.float32)
        w_a = tl.load(w_ptr + i_a[:, None] * BLOCK_M + offs_c[None, :], mask=(k_a < n)[:, None], other=0.0)
        w_b = tl.load(w_ptr + i_b[:, None] * BLOCK_M + offs_c[None, :], mask=(k_b < n)[:, None], other=0.0)
        acc += w_a.to(tl.float32) * v_a[:, None] + w_b.to(tl.float32) * v_b[:, None]
    offs_m = pm * BLOCK_M + offs_c
    tl.store(part_ptr + (ps * B + b) * M + offs_m, tl.sum(acc, 0), mask=offs_m < M)


@triton.jit
def _fused_norm_gemv_kernel(x_ptr, nw_ptr, w_ptr, part_ptr, B, N, M, PER, t, eps, BLOCK_M: tl.constexpr,
                            SUB: tl.constexpr, ROW: tl.constexpr, PANEL: tl.constexpr, GDC: tl.constexpr):
    # h = nw * rms_norm(x) rounded as select_slices rounds it; rows with |h| > t of this split, loaded under
    # that mask; w [N, M] (PANEL 0) or [P, N, BLOCK_M] (PANEL 1)
    b, pm, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_c = tl.arange(0, BLOCK_M)
    offs_m = pm * BLOCK_M + offs_c
    m_ok = offs_m < M
    dt = nw_ptr.dtype.element_ty
    _gdc(GDC)
    ss = tl.zeros([ROW], dtype=tl.float32)
    for n0 in range(0, N, ROW):
        offs = n0 + tl.arange(0, ROW)
        xv = tl.load(x_ptr + b * N + offs, mask=offs < N, other=0.0).to(tl.float32)
        ss += xv * xv
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / N + eps)
    lo = ps * PER
    hi = tl.minimum(lo + PER, N)
    if PANEL:
        w_ptr += pm.to(tl.int64) * N * BLOCK_M
    ar = tl.arange(0, SUB)
    acc = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)
    for k0 in range(lo, hi, SUB):
        ks = k0 + ar
        inside = ks < hi
        xv = tl.load(x_ptr + b * N + ks, mask=inside, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + ks, mask=inside, other=0.0).to(tl.float32)
        h = (nw * (xv * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        keep = (tl.abs(h) > t) & inside
        if PANEL:
            w = tl.load(w_ptr + ks[:, None] * BLOCK_M + offs_c[None, :], mask=keep[:, None], other=0.0)
        else:
            w = tl.load(w_ptr + ks[:, None].to(tl.int64) * M + offs_m[None, :], mask=keep[:, None] & m_ok[None, :],
                        other=0.0)
        acc += w.to(tl.float32) * h[:, None]
    tl.store(part_ptr + (ps * B + b) * M + offs_m, tl.sum(acc, 0), mask=m_ok)


def panels(w_t: torch.Tensor, bm: int) -> torch.Tensor:
    """w_t [N, M] as column panels [ceil(M / bm), N, bm] (the last padded with zeros)."""
    N, M = w_t.shape
    P = -(-M // bm)
    out = torch.zeros(P * bm, N, dtype=w_t.dtype, device=w_t.device)
    out[:M] = w_t.t()
    return out.view(P, bm, N).transpose(1, 2).contiguous()


class Forms:
    """An `ops` for Shape.launch (gate_up only): the shipped pair, or one of the forms above."""

    def __init__(self, form: str, panel_w: dict, sub: int, warps: int):
        from dejavu.plugins import DEFAULT
        from dejavu.runtime.llama_decoder import LlamaOps

        self.form, self.panel_w, self.sub, self.warps = form, panel_w, sub, warps
        self.ops = LlamaOps("triton", DEFAULT)
        self.cfg = DEFAULT.input_sparse
        self.fp32_residual = False
        self.gdc = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    def gate_up(self, x, w, t, norm):
        from dejavu.plugins.input_sparse import split_k_for

        if self.form == "shipped":
            return self.ops.gate_up(x, w, t, norm)
        B, N = x.shape
        M = w.shape[1]
        bm = self.cfg.block_m
        split = split_k_for(B, N, M, self.cfg)
        per = -(-N // split)
        part = torch.empty(split, B, M, dtype=torch.float32, device=x.device)
        grid = (B, -(-M // bm), split)
        pdl = {"launch_pdl": True} if self.gdc else {}
        wp = self.panel_w[id(w)] if "panel" in self.form else w
        if self.form == "panel":
            idx, val, count = self.ops._select(x, w, t, "gate_up", norm, dtype=w.dtype)
            _panel_gemv_kernel[grid](idx, val, count, wp, part, B, N, M, per, BLOCK_M=bm,
                                     SUB=max(1, self.cfg.block_k // 2), GDC=int(self.gdc), num_warps=4, **pdl)
            return part
        _fused_norm_gemv_kernel[grid](x, norm[0], wp, part, B, N, M, per, float(t), float(norm[1]), BLOCK_M=bm,
                                      SUB=self.sub, ROW=min(4096, triton.next_power_of_2(N)),
                                      PANEL=int(self.form == "fused_panel"), GDC=int(self.gdc),
                                      num_warps=self.warps, **pdl)
        return part


FORMS = ("shipped", "panel", "fused", "fused_panel")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama-3-8b,llama-3-70b-tp8")
    p.add_argument("--fused", default="64x4,128x8", help="the fused forms' SUB x num_warps, comma-separated")
    p.add_argument("--footprint-mb", type=int, default=512)
    p.add_argument("--measure-s", type=float, default=0.15)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, checks only (Triton's interpreter on a CPU)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from dejavu.plugins.input_sparse import sum_parts_ref

    data = {"meta": meta(dev, a), "bandwidth": copy_bandwidth(dev) if dev.type == "cuda" else None, "results": []}
    bw = (data["bandwidth"] or {}).get("copy_GBps")
    if a.smoke:
        shapes = [("tiny", dict(proj="gate_up", N=600, M=80, producer="norm"))]  # 2 splits, a padded panel
        footprint = 1
    else:
        shapes = [(m, dict(q, proj="gate_up", kind=q["proj"], producer="norm"))
                  for m in a.models.split(",") for q in projections(SHAPES[m])]
        footprint = a.footprint_mb << 20
    variants = [("shipped", 0, 0), ("panel", 0, 0)] + [
        (f, int(s), int(w)) for f in ("fused", "fused_panel") for s, w in (v.split("x") for v in a.fused.split(","))]
    for model, q in shapes:
        s = Shape(model, SHAPES.get(model, {}), q, 1, footprint, dev, torch.float16, seed=0)
        pw = {id(w): panels(w, 64) for w in s.w}
        for form, sub, warps in variants:
            name = form + (f"[{sub}x{warps}]" if sub else "")
            ops = Forms(form, pw, sub, warps)
            row = {"model": model, "kind": q.get("kind", q["proj"]), "N": s.N, "M": s.M, "form": name}
            try:
                out = sum_parts_ref(s.launch(ops, 0), torch.float32)
                err = float((out - s.ref).abs().max() / s.ref.abs().max().clamp_min(1e-30))
                row["max_rel_diff"] = err
                if not err <= TOL:
                    raise RuntimeError(f"max |diff| / max |ref| {err:.3g} > {TOL}")
                if not a.smoke:
                    sec = time_groups(s, ops, a.measure_s)
                    row.update(us=sec * 1e6, GBps=s.read_bytes / sec / 1e9,
                               frac_copy=s.read_bytes / sec / 1e9 / bw if bw else None)
            except Exception as e:  # noqa: BLE001 - a form that fails is a result too
                row["error"] = repr(e)[:300]
            data["results"].append(row)
            print(json.dumps(row), flush=True)
        del s, pw
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data, indent=1, default=str))
    bad = [r for r in data["results"] if "error" in r]
    return 1 if a.smoke and bad else 0


if __name__ == "__main__":
    sys.exit(main())

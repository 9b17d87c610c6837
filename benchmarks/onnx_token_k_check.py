"""An OPT engine's `--onnx-out` form (a) against the engine's own CPU decode, on WikiText-2 test text.

    python benchmarks/onnx_token_k_check.py m.engine ONNX_DIR --tokens 512 --out check.json

ONNX Runtime runs `prefill.sparse.onnx` over one window (BOS + the first tokens-1 tokens of
WikiText-2 test, the engine's tokenizer) with each sparse MLP layer's `pred_mlp.idx` / `.keep`
as extra outputs; the runtime decodes the same tokens one step each (`Engine.decode_logits`, CPU)
and its predictor op's (idx, keep) are recorded. Reports max |logits diff| and, per layer, whether
the selected rows and the kept rows agree for every token, the kept-row counts, and for the
(token, row) pairs kept by one side only their margin: how far, in ONNX Runtime's float32 scores,
the row is from the rule's edge (|s_j − thr| for a row both select, thr = min(log θ + logsumexp(s),
max s); |s_j − the k-th score| for a row one side's top-k has and the other's has not). The two
sides compute the scores along different paths (one prefill vs one decode step a token), so
rows within a rounding of the edge may go either way; a margin far above float32 rounding would
be a disagreement. An engine without a per-token K has no keep flags: every selected row counts
as kept. Writes raw JSON; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch


def ort_rows(path, ids: torch.Tensor, layers: list[int], keep: bool):
    """Form (a) at `path` on ids [1, S]: (logits [1,S,V], {l: (idx [1,S,k], keep [1,S,k] bool, scores [1,S,F])})."""
    import onnx

    from dejavu.compiler.onnx_export import run_onnxruntime

    m = onnx.load(str(path))  # external data read: re-serialised with the weights inside
    kinds = ("scores", "idx", "keep") if keep else ("scores", "idx")
    names = [f"layers.{l}.pred_mlp.{t}" for l in layers for t in kinds]
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    out = run_onnxruntime(m, {"input_ids": ids.numpy()})
    rows = {}
    for l in layers:
        idx = out[f"layers.{l}.pred_mlp.idx"]
        rows[l] = (idx, out[f"layers.{l}.pred_mlp.keep"] if keep else np.ones(idx.shape, bool),
                   out[f"layers.{l}.pred_mlp.scores"])
    return out["logits"], rows


def runtime_rows(engine, ids: torch.Tensor, layers: list[int]):
    """The runtime's decode logits [1,S,V] and {l: (idx [1,S,k], keep [1,S,k])} from its MLP predictor op
    (one call per step and sparse layer, in layer order; with a per-token K it returns the kept count)."""
    rec, op = [], engine.decoder.pred.topk

    def topk(x, *args, min_share=None, **kw):
        out = op(x, *args, min_share=min_share, **kw)
        if min_share is not None:  # (idx, n): the n kept rows come first
            idx, n = out
            rec.append((idx.clone(), torch.arange(idx.shape[-1], device=idx.device) < n.reshape(-1, 1)))
        elif args[1].shape[0] == engine.spec.ffn_dim:  # b [F, r]: an MLP predictor (fixed K)
            rec.append((out.clone(), torch.ones(out.shape, dtype=torch.bool)))
        return out

    engine.decoder.pred.topk = topk
    try:
        logits = engine.decode_logits(ids)
    finally:
        del engine.decoder.pred.topk
    S, n = ids.shape[1], len(layers)
    if len(rec) != S * n:
        raise RuntimeError(f"expected {S * n} MLP predictor calls, recorded {len(rec)}")
    rows = {l: tuple(torch.stack([rec[t * n + i][j].reshape(-1) for t in range(S)])[None].numpy() for j in (0, 1))
            for i, l in enumerate(layers)}
    return logits, rows


def kept_mask(F: int, idx: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """[..., F] bool: the rows kept, from idx / keep [..., k] (any order)."""
    m = np.zeros((*idx.shape[:-1], F), bool)
    np.put_along_axis(m, idx.astype(np.int64), keep, -1)
    return m


def edge_margins(scores: np.ndarray, k: int, min_share: float | None, rows: np.ndarray, both: np.ndarray):
    """|distance to the rule's edge| (float64, from scores [S, F]) of the (token, row) pairs `rows`
    [n, 2]; both[n]: whether both sides selected the row (then the share edge, else the top-k edge)."""
    s = scores.astype(np.float64)
    kth = -np.sort(-s, -1)[:, k - 1]  # [S]
    m = s.max(-1)
    lse = m + np.log(np.exp(s - m[:, None]).sum(-1))
    thr = m if min_share is None else np.minimum(np.log(max(min_share, 1e-300)) + lse, m)
    t, j = rows[:, 0], rows[:, 1]
    return np.where(both, np.abs(s[t, j] - thr[t]), np.abs(s[t, j] - kth[t]))


def compare(engine_path, onnx_dir, tokens: int) -> dict:
    """The report (module docstring) over BOS + the first tokens - 1 tokens of WikiText-2 test."""
    from dejavu.datafiles import WIKITEXT2_TEST
    from dejavu.runtime.engine import Engine

    eng = Engine.load(engine_path, "cpu")
    spec, tk = eng.spec, eng.spec.token_k
    ids = torch.tensor([eng.tokenizer.encode(WIKITEXT2_TEST.read_text()[:max(4000, 40 * tokens)])[:tokens]])
    layers = [l for l in range(spec.num_layers) if spec.sparse_mlp(l)]
    ort_logits, ort = ort_rows(Path(onnx_dir) / "prefill.sparse.onnx", ids, layers, tk is not None)
    rt_logits, rt = runtime_rows(eng, ids, layers)
    per_layer = []
    for l in layers:
        (oi, ok, sc), (ri, rk) = ort[l], rt[l]
        F, share = spec.ffn_dim, None if tk is None else tk[l][0]
        sel_o, sel_r = kept_mask(F, oi, np.ones_like(ok))[0], kept_mask(F, ri, np.ones_like(rk))[0]  # [S, F]
        kept_o, kept_r = kept_mask(F, oi, ok)[0], kept_mask(F, ri, rk)[0]
        odd = np.argwhere(kept_o != kept_r)  # [n, 2] (token, row)
        margins = edge_margins(sc[0], int(oi.shape[-1]), share, odd, (sel_o & sel_r)[odd[:, 0], odd[:, 1]])
        per_layer.append({
            "layer": l, "k": int(oi.shape[-1]), "min_share": share,
            "same_selection": bool(np.array_equal(sel_o, sel_r)), "same_kept_rows": bool(np.array_equal(kept_o, kept_r)),
            "rows_kept_by_one_side": int(len(odd)), "tokens_affected": int(len(np.unique(odd[:, 0]))),
            "max_edge_margin_of_those": float(margins.max()) if len(odd) else None,
            "kept_rows": {"mean": round(float(ok.sum(-1).mean()), 2), "min": int(ok.sum(-1).min()),
                          "max": int(ok.sum(-1).max())}})
    return {"tokens": int(ids.shape[1]), "per_token_k": tk is not None,
            "max_abs_logits_diff": float(np.abs(ort_logits - rt_logits.numpy()).max()),
            "max_abs_logit": float(np.abs(ort_logits).max()), "per_layer": per_layer}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine")
    p.add_argument("onnx_dir", help="the engine's --onnx-out folder")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    r = {"engine": a.engine, "onnx_dir": a.onnx_dir, **compare(a.engine, a.onnx_dir, a.tokens)}
    print(json.dumps(r, indent=2))
    if a.out:
        from dejavu.fileio import write_json

        write_json(a.out, r, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

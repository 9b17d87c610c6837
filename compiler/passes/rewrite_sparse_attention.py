"""Pass 3: each layer's attention → predictor TopK over heads → Q / attention / out_proj of those heads.

K and V stay dense (all heads, so the cache is complete: docs/ARCHITECTURE.md). Replaces
`layers.{l}.q_proj/*`, `layers.{l}.attn_core/*`, `layers.{l}.out_proj/*` (output
`layers.{l}.attn_out` keeps its name) for every layer with K_attn < H. Per token
(x: [B,S,D], keys/values: [B,H,T,hd], idx: [B,S,K]):

    q   = Gather(Wq_h, idx) @ x + bq_h[idx]                 [B,S,K,hd]  (1/sqrt(hd) folded in)
    k_g = GatherND(keys, idx, batch_dims=1)                  [B,S*K,T,hd] (same for values)
    o   = softmax(q k_gᵀ + mask) v_g                         [B,S,K,hd]
    y   = flatten(o) @ flatten(Gather(Wo_h, idx)) + bo       [B,S,D]

New nodes under `layers.{l}.sparse_attn/`; initializers use the engine names
`layers.{l}.attn.wq/.bq/.wo_t/.bo` ([D,D] / [D], reshaped to heads inside the graph).
"""
from __future__ import annotations

import logging

import numpy as np
import onnx

from dejavu.compiler.onnx_export import GraphBuilder
from dejavu.compiler.passes._graph import group, has_tensor, init_array, maybe_init, replace, topk_indices
from dejavu.errors import DejavuError

log = logging.getLogger(__name__)


def _weights(g: GraphBuilder, model: onnx.ModelProto, p: str, H: int, hd: int) -> tuple[str, str, str, str]:
    D = H * hd
    wq_t = init_array(model, f"{p}.q_proj.weight_t")
    dt = wq_t.dtype  # the graph's: scaled in float32, rounded once (as the engine's layout)
    scaled = lambda a: (a.astype(np.float32) * np.float32(hd**-0.5)).astype(dt)
    bq = maybe_init(model, f"{p}.q_proj.bias")
    bo = maybe_init(model, f"{p}.out_proj.bias")
    wq = g.const(f"{p}.attn.wq", scaled(wq_t.T))  # [D, D] rows head-major
    bq = g.const(f"{p}.attn.bq", scaled(bq if bq is not None else np.zeros(D, dt)))
    wo = g.const(f"{p}.attn.wo_t", init_array(model, f"{p}.out_proj.weight_t"))  # [D, D] row j = input j
    bo = g.const(f"{p}.attn.bo", bo if bo is not None else np.zeros(D, dt))
    return wq, bq, wo, bo, dt


def _sparse_attention(g: GraphBuilder, p: str, x: str, idx: str, w, H: int, hd: int, k: int) -> None:
    s = f"{p}.sparse_attn"
    wq, bq, wo, bo, _ = w
    wq_h = g.op("Reshape", [wq, g.ints(f"{s}.w_heads", [H, hd, H * hd])], f"{s}/wq_heads")  # [H,hd,D]
    bq_h = g.op("Reshape", [bq, g.ints(f"{s}.b_heads", [H, hd])], f"{s}/bq_heads")  # [H,hd]
    wo_h = g.op("Reshape", [wo, f"{s}.w_heads"], f"{s}/wo_heads")  # [H,hd,D]
    xc = g.op("Reshape", [x, g.ints(f"{s}.x_shape", [0, 0, 1, H * hd, 1])], f"{s}/x_col")  # [B,S,1,D,1]
    q = g.op("MatMul", [g.op("Gather", [wq_h, idx], f"{s}/gather_wq", axis=0), xc], f"{s}/q")  # [B,S,K,hd,1]
    q = g.op("Squeeze", [q, g.ints(f"{s}.axes_m1", [-1])], f"{s}/q_squeeze")
    q = g.op("Add", [q, g.op("Gather", [bq_h, idx], f"{s}/gather_bq", axis=0)], f"{s}/q_bias")  # [B,S,K,hd]
    q = g.op("Reshape", [q, g.ints(f"{s}.q_rows", [0, -1, 1, hd])], f"{s}/q_rows")  # [B,S*K,1,hd]
    flat_idx = g.op("Reshape", [idx, g.ints(f"{s}.idx_shape", [0, -1, 1])], f"{s}/idx_rows")  # [B,S*K,1]
    kg = g.op("GatherND", [f"{p}.keys", flat_idx], f"{s}/gather_k", batch_dims=1)  # [B,S*K,T,hd]
    vg = g.op("GatherND", [f"{p}.values", flat_idx], f"{s}/gather_v", batch_dims=1)
    sc = g.op("MatMul", [q, g.op("Transpose", [kg], f"{s}/k_t", perm=[0, 1, 3, 2])], f"{s}/scores")  # [B,S*K,1,T]
    sc = g.op("Reshape", [sc, g.ints(f"{s}.score_heads", [0, -1, k, 0])], f"{s}/scores_heads")  # [B,S,K,T]
    mask = g.op("Unsqueeze", ["attn_mask_bias", g.ints(f"{s}.axes_1", [1])], f"{s}/mask_heads")  # [S,1,T]
    pr = g.op("Softmax", [g.op("Add", [sc, mask], f"{s}/mask")], f"{s}/softmax", axis=-1)
    pr = g.op("Reshape", [pr, g.ints(f"{s}.p_rows", [0, -1, 1, 0])], f"{s}/p_rows")  # [B,S*K,1,T]
    o = g.op("MatMul", [pr, vg], f"{s}/pv")  # [B,S*K,1,hd]
    o = g.op("Reshape", [o, g.ints(f"{s}.o_row", [0, -1, 1, k * hd])], f"{s}/o_row")  # [B,S,1,K*hd]
    wg = g.op("Gather", [wo_h, idx], f"{s}/gather_wo", axis=0)  # [B,S,K,hd,D]
    wg = g.op("Reshape", [wg, g.ints(f"{s}.wo_rows", [0, 0, k * hd, H * hd])], f"{s}/wo_rows")  # [B,S,K*hd,D]
    y = g.op("Squeeze", [g.op("MatMul", [o, wg], f"{s}/out"), g.ints(f"{s}.axes_m2", [-2])], f"{s}/out_squeeze")
    g.op("Add", [y, bo], f"{s}/out_bias", outputs=[f"{p}.attn_out"])


def rewrite_sparse_attention(model: onnx.ModelProto, settings) -> onnx.ModelProto:
    g = GraphBuilder(model.graph)
    remove, done = [], []
    for l in settings.layer_ids():
        k, p = settings.attn_k[l], f"layers.{l}"
        _, _, H, hd = (int(v) for v in init_array(model, f"{p}.heads_shape"))
        if k >= H:
            continue
        scores = f"{p}.pred_attn.scores"
        if not has_tensor(model, scores):
            raise DejavuError(f"rewrite_sparse_attention: {scores!r} is missing (run insert_predictors first)")
        old = group(model, f"{p}.q_proj/") + group(model, f"{p}.attn_core/") + group(model, f"{p}.out_proj/")
        x = next(n for n in old if n.name == f"{p}.q_proj/MatMul").input[0]
        w = _weights(g, model, p, H, hd)
        idx = topk_indices(g, scores, k, settings.topk_limit, f"{p}.pred_attn.topk", f"{p}.pred_attn.idx",
                           w[-1])
        _sparse_attention(g, p, x, idx, w, H, hd, k)
        remove += old
        done.append(f"{l}:K={k}/{H}")
    replace(model, remove, g)
    log.info("rewrite_sparse_attention: rewrote %d attention blocks (layer:K heads) %s, removed %d dense nodes",
             len(done), " ".join(done), len(remove))
    return model

"""Pass 2: each layer's MLP → predictor TopK → Gather(W1 rows) → MatMul → Relu → Gather(W2ᵀ rows) → MatMul.

Replaces `layers.{l}.fc1/*`, `layers.{l}.act/Relu`, `layers.{l}.fc2/*` (output
`layers.{l}.mlp_out` keeps its name) for every layer with K_mlp < F. Per token (x: [B,S,D]):

    idx = TopK(scores, K)                      [B,S,K]   node layers.{l}.pred_mlp.topk/...
    h   = Relu(Gather(W1, idx) @ x + b1[idx])  [B,S,K]   W1: [F,D] (rows = neurons)
    y   = h @ Gather(W2ᵀ, idx) + b2            [B,S,D]   W2ᵀ: [F,D]

With a per-token K (`settings.token_k`) K is the layer's static cap k_max, and each token keeps
the candidates whose predicted share passes the layer's threshold (the engine's rule):

    keep = share_keep(scores, idx, theta_l)    [B,S,k_max] bool   nodes layers.{l}.pred_mlp.keep/...
    h    = Relu(...) * keep                    dropped rows give h = 0 (fc2 adds nothing for them)

New nodes live under `layers.{l}.sparse_mlp/`; initializers use the engine names
`layers.{l}.mlp.w1/.b1/.w2_t/.b2`.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper

from dejavu.compiler.onnx_export import GraphBuilder
from dejavu.compiler.passes._graph import (group, has_tensor, init_array, maybe_init, replace, share_keep,
                                           topk_indices)
from dejavu.errors import DejavuError

log = logging.getLogger(__name__)


def rewrite_sparse_mlp(model: onnx.ModelProto, settings) -> onnx.ModelProto:
    g = GraphBuilder(model.graph)
    remove, done = [], []
    for l in settings.layer_ids():
        p = f"layers.{l}"
        w1_t = init_array(model, f"{p}.fc1.weight_t")  # [D, F]
        F = w1_t.shape[1]
        if settings.mlp_k[l] >= F:
            continue
        k, min_share = settings.mlp_rows(l), settings.min_share(l)
        scores = f"{p}.pred_mlp.scores"
        if not has_tensor(model, scores):
            raise DejavuError(f"rewrite_sparse_mlp: {scores!r} is missing (run insert_predictors first)")
        old = group(model, f"{p}.fc1/") + group(model, f"{p}.act/") + group(model, f"{p}.fc2/")
        x = next(n for n in old if n.name == f"{p}.fc1/MatMul").input[0]
        D = w1_t.shape[0]
        b1 = maybe_init(model, f"{p}.fc1.bias")
        b2 = maybe_init(model, f"{p}.fc2.bias")
        s = f"{p}.sparse_mlp"
        w1 = g.const(f"{p}.mlp.w1", w1_t.T)  # [F, D]
        b1 = g.const(f"{p}.mlp.b1", b1 if b1 is not None else np.zeros(F, w1_t.dtype))
        w2t = g.const(f"{p}.mlp.w2_t", init_array(model, f"{p}.fc2.weight_t"))  # [F, D]
        b2 = g.const(f"{p}.mlp.b2", b2 if b2 is not None else np.zeros(D, w1_t.dtype))
        idx = topk_indices(g, scores, k, settings.topk_limit, f"{p}.pred_mlp.topk", f"{p}.pred_mlp.idx",
                           w1_t.dtype)
        xc = g.op("Unsqueeze", [x, g.ints(f"{s}.axes_last", [-1])], f"{s}/x_col")  # [B,S,D,1]
        h = g.op("MatMul", [g.op("Gather", [w1, idx], f"{s}/gather_w1", axis=0), xc], f"{s}/fc1")  # [B,S,K,1]
        h = g.op("Squeeze", [h, g.ints(f"{s}.axes_m1", [-1])], f"{s}/fc1_squeeze")
        h = g.op("Add", [h, g.op("Gather", [b1, idx], f"{s}/gather_b1", axis=0)], f"{s}/fc1_bias")
        h = g.op("Relu", [h], f"{s}/relu")
        if min_share is not None:
            keep = share_keep(g, scores, idx, min_share, f"{p}.pred_mlp.keep", f"{p}.pred_mlp.keep", w1_t.dtype)
            keep = g.op("Cast", [keep], f"{s}/keep_cast", to=helper.np_dtype_to_tensor_dtype(w1_t.dtype))
            h = g.op("Mul", [h, keep], f"{s}/keep")
        h = g.op("Unsqueeze", [h, g.ints(f"{s}.axes_m2", [-2])], f"{s}/h_row")  # [B,S,1,K]
        y = g.op("MatMul", [h, g.op("Gather", [w2t, idx], f"{s}/gather_w2_t", axis=0)], f"{s}/fc2")  # [B,S,1,D]
        y = g.op("Squeeze", [y, f"{s}.axes_m2"], f"{s}/fc2_squeeze")
        g.op("Add", [y, b2], f"{s}/fc2_bias", outputs=[f"{p}.mlp_out"])
        remove += old
        done.append(f"{l}:K={k}/{F}" + ("" if min_share is None else f" share>={min_share:.3g}"))
    replace(model, remove, g)
    log.info("rewrite_sparse_mlp: rewrote %d MLPs (layer:K[ share>=theta: a per-token K]) %s, removed %d dense nodes",
             len(done), " ".join(done), len(remove))
    return model

"""Pass 4 (form "plugin" only): collapse the sparse subgraphs into custom-domain nodes.

    layers.{l}.pred_{kind}/* + .topk/*  → dejavu.Predictor(src, a, b, bias) -> idx [B,S,K]
      (int8 rows: Predictor(src, a_q, a_scale, b_q, b_scale, bias), weights="int8")
      (+ .keep/* with a per-token K)        → dejavu.Predictor(...; min_share) -> idx [B,S,K], keep [B,S,K] bool
    layers.{l}.sparse_mlp/*             → dejavu.SparseMLP(x, idx, w1, b1, w2_t, b2[, keep]) -> mlp_out
    layers.{l}.sparse_attn/*            → dejavu.SparseAttention(x, idx, wq, bq, keys, values,
                                              attn_mask_bias, wo_t, bo) -> attn_out

Weights are in the engine's kernel layout (a [r,D], b [N,r], w1 [F,D], w2_t [F,D], wq/bq
with 1/sqrt(hd) folded in, wo_t [D,D]). Every node carries what a TensorRT plugin needs:
`plugin_namespace="dejavu"`, `plugin_version="1"` (TensorRT maps op_type → plugin name),
plus k and the dimensions. Domain `dejavu` (version 1) is added to opset_import.

A per-token MLP K (`settings.token_k`) gives the MLP Predictor k = k_max, a float attribute
`min_share` (theta_l: the runtime's `predictor_topk(..., min_share=)`) and a second output, the
keep flags; SparseMLP takes them as a seventh input and a dropped row contributes nothing (its
fc1 / fc2 bytes need not be read: the runtime's KEEP and compact_rows).
"""
from __future__ import annotations

import logging

import onnx

from dejavu.compiler.onnx_export import GraphBuilder
from dejavu.compiler.passes._graph import group, init_array, maybe_init, replace, set_opset

log = logging.getLogger(__name__)

DOMAIN = "dejavu"
_PLUGIN = {"plugin_namespace": DOMAIN, "plugin_version": "1"}


def _src(nodes, name: str) -> str:
    return next(n for n in nodes if n.name == name).input[0]


def _collapse_predictor(model, g, p: str, kind: str, k: int, min_share: float | None) -> list:
    old = group(model, f"{p}.pred_{kind}/") + group(model, f"{p}.pred_{kind}.topk/")
    if not old:
        return []
    outputs, share = [f"{p}.pred_{kind}.idx"], {}
    if min_share is not None:
        old += group(model, f"{p}.pred_{kind}.keep/")
        outputs.append(f"{p}.pred_{kind}.keep")
        share = {"min_share": min_share}
    q = f"{p}.pred_{kind}"
    if maybe_init(model, f"{q}.a_q") is not None:  # int8 rows: a_q, a_scale, b_q, b_scale (the engine's tensors)
        aq, bq = init_array(model, f"{q}.a_q"), init_array(model, f"{q}.b_q")  # [r, D], [N, r]
        r, D, N = aq.shape[0], aq.shape[1], bq.shape[0]
        weights, form = [f"{q}.a_q", f"{q}.a_scale", f"{q}.b_q", f"{q}.b_scale"], {"weights": "int8"}
    else:
        at = init_array(model, f"{q}.a_t")  # [D, r]
        bt = init_array(model, f"{q}.b_t")  # [r, N]
        r, D, N = at.shape[1], at.shape[0], bt.shape[1]
        weights, form = [g.const(f"{q}.a", at.T), g.const(f"{q}.b", bt.T)], {}
    g.op("Predictor", [_src(old, f"{q}/MatMul_a"), *weights, f"{q}.bias"],
         q, outputs=outputs, domain=DOMAIN, k=k, kind=kind,
         rank=int(r), hidden_size=int(D), num_outputs=int(N), **form, **share, **_PLUGIN)
    return old


def to_plugin_form(model: onnx.ModelProto, settings) -> onnx.ModelProto:
    if settings.form != "plugin":
        log.info("to_plugin_form: skipped (form %r keeps standard ONNX ops)", settings.form)
        return model
    g = GraphBuilder(model.graph)
    remove, counts = [], {"Predictor": 0, "SparseMLP": 0, "SparseAttention": 0}
    for l in settings.layer_ids():
        p = f"layers.{l}"
        for kind, k, share in (("mlp", settings.mlp_rows(l), settings.min_share(l)),
                               ("attn", settings.attn_k[l], None)):
            old = _collapse_predictor(model, g, p, kind, k, share)
            remove += old
            counts["Predictor"] += bool(old)
        old = group(model, f"{p}.sparse_mlp/")
        if old:
            D, F = (int(v) for v in init_array(model, f"{p}.mlp.w2_t").shape[::-1])
            x = _src(old, f"{p}.sparse_mlp/x_col")
            keep = [] if settings.min_share(l) is None else [f"{p}.pred_mlp.keep"]
            g.op("SparseMLP", [x, f"{p}.pred_mlp.idx", f"{p}.mlp.w1", f"{p}.mlp.b1", f"{p}.mlp.w2_t",
                               f"{p}.mlp.b2", *keep], f"{p}.sparse_mlp", outputs=[f"{p}.mlp_out"], domain=DOMAIN,
                 k=settings.mlp_rows(l), hidden_size=D, ffn_dim=F, activation="relu", **_PLUGIN)
            remove += old
            counts["SparseMLP"] += 1
        old = group(model, f"{p}.sparse_attn/")
        if old:
            _, _, H, hd = (int(v) for v in init_array(model, f"{p}.heads_shape"))
            x = _src(old, f"{p}.sparse_attn/x_col")
            g.op("SparseAttention", [x, f"{p}.pred_attn.idx", f"{p}.attn.wq", f"{p}.attn.bq", f"{p}.keys",
                                     f"{p}.values", "attn_mask_bias", f"{p}.attn.wo_t", f"{p}.attn.bo"],
                 f"{p}.sparse_attn", outputs=[f"{p}.attn_out"], domain=DOMAIN, k=settings.attn_k[l],
                 num_heads=H, head_dim=hd, q_scale_folded=1, **_PLUGIN)
            remove += old
            counts["SparseAttention"] += 1
    replace(model, remove, g)
    if any(counts.values()):
        set_opset(model, DOMAIN, 1)
    log.info("to_plugin_form: %s custom nodes (domain %r), removed %d standard nodes",
             ", ".join(f"{v} {DOMAIN}.{k}" for k, v in counts.items()), DOMAIN, len(remove))
    return model

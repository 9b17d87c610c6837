"""Pass 1: add each layer's predictor subgraphs (scores only; the rewrite passes add TopK).

For layer l and kind in (mlp, attn) with K < N, reading `src[l - lookahead]`
(`layers.{j}.attn_in` / `layers.{j}.mlp_in`, layer 0's attention input when j < 0):

    layers.{l}.pred_{kind}/MatMul_a : src @ A.T      (initializer layers.{l}.pred_{kind}.a_t  [D, r])
    layers.{l}.pred_{kind}/MatMul_b : . @ B.T        (initializer layers.{l}.pred_{kind}.b_t  [r, N])
    layers.{l}.pred_{kind}/Add      : . + bias  ->  tensor layers.{l}.pred_{kind}.scores [B, S, N]

An int8 predictor (the predictor tensors hold `.a_scale` / `.b_scale`: a, b its dequantized values) keeps
its weights int8 in the graph, each read through the standard per-axis DequantizeLinear that TensorRT
parses as weight-only quantization:

    layers.{l}.pred_{kind}/DequantizeLinear_a : a_q [r, D] int8, a_scale [r] (axis 0)  (initializers .a_q, .a_scale)
    layers.{l}.pred_{kind}/Transpose_a        : [D, r]  (then Cast to the graph dtype unless float32)
    layers.{l}.pred_{kind}/MatMul_a           : src @ .
    (the same for b: .b_q [N, r], .b_scale [N]), then Add as above.

The scales are float32 in the graph (opset 17's DequantizeLinear takes float32 scales; the engine's fp16
scales are exact in float32).
"""
from __future__ import annotations

import logging

import numpy as np
import onnx

from dejavu.compiler.onnx_export import GraphBuilder
from dejavu.compiler.passes._graph import has_tensor, init_array, replace
from dejavu.errors import DejavuError

log = logging.getLogger(__name__)


def predictor_source(l: int, predictor_input: dict) -> str:
    """The tensor layer l's predictors read (docs/ARCHITECTURE.md, lookahead convention)."""
    src, la = predictor_input.get("source"), predictor_input.get("lookahead")
    if src not in ("attn_in", "mlp_in") or la not in (0, 1):
        raise DejavuError(f"predictor_input must be source attn_in|mlp_in, lookahead 0|1; got {predictor_input}")
    if src == "mlp_in" and la == 0:
        raise DejavuError("predictor input mlp_in with lookahead 0 is produced after the layer's attention; "
                          "the head predictor cannot read it")
    j = l - la
    return "layers.0.attn_in" if j < 0 else f"layers.{j}.{src}"


def _np(t, dtype) -> np.ndarray:
    """A predictor tensor (torch or numpy) in the graph dtype `dtype`."""
    a = np.asarray(t.detach().float().cpu().numpy() if hasattr(t, "detach") else t, dtype=np.float32)
    return a.astype(dtype)


def _int8_weight(g: GraphBuilder, p: str, n: str, pt: dict, dtype) -> str:
    """W.T [C, R] in the graph dtype from W's int8 rows: Transpose(DequantizeLinear(q [R, C], scale [R], axis 0));
    q = the dequantized values / scale, exact (predictors.int8_rows)."""
    scale = np.asarray(pt[f"{p}.{n}_scale"].detach().float().cpu().numpy(), dtype=np.float32)
    w = np.asarray(pt[f"{p}.{n}"].detach().float().cpu().numpy(), dtype=np.float32)
    q = np.rint(w / scale[:, None]).astype(np.int8)
    deq = g.op("DequantizeLinear", [g.const(f"{p}.{n}_q", q), g.const(f"{p}.{n}_scale", scale)],
               f"{p}/DequantizeLinear_{n}", axis=0)
    wt = g.op("Transpose", [deq], f"{p}/Transpose_{n}", perm=[1, 0])
    if np.dtype(dtype) == np.float32:
        return wt
    return g.op("Cast", [wt], f"{p}/Cast_{n}", to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def insert_predictors(model: onnx.ModelProto, settings) -> onnx.ModelProto:
    g = GraphBuilder(model.graph)
    added = []
    for l in settings.layer_ids():
        src = predictor_source(l, settings.predictor_input)
        if not has_tensor(model, src):
            raise DejavuError(f"insert_predictors: the graph has no tensor {src!r}")
        w1 = init_array(model, f"layers.{l}.fc1.weight_t")
        F = w1.shape[1]
        H = int(init_array(model, f"layers.{l}.heads_shape")[2])
        for kind, k, n in (("mlp", settings.mlp_k[l], F), ("attn", settings.attn_k[l], H)):
            if k >= n:  # K = N: the layer stays dense, no predictor needed
                continue
            p = f"layers.{l}.pred_{kind}"
            pt = settings.predictors
            try:
                a, b, bias = (_np(pt[f"{p}.{n}"], w1.dtype) for n in ("a", "b", "bias"))
            except KeyError as e:
                raise DejavuError(f"insert_predictors: predictor tensor {e.args[0]!r} is missing") from None
            int8 = f"{p}.a_scale" in pt
            h = src
            for n, w in (("a", a), ("b", b)):
                wt = _int8_weight(g, p, n, pt, w1.dtype) if int8 else g.const(f"{p}.{n}_t", w.T)
                h = g.op("MatMul", [h, wt], f"{p}/MatMul_{n}")
            g.op("Add", [h, g.const(f"{p}.bias", bias)], f"{p}/Add", outputs=[f"{p}.scores"])
            added.append(f"{p}(r={a.shape[0]}, N={b.shape[0]}, src={src}{', int8' if int8 else ''})")
    replace(model, [], g)
    log.info("insert_predictors: added %d predictor subgraphs%s", len(added),
             (": " + ", ".join(added[:4]) + (" ..." if len(added) > 4 else "")) if added else "")
    return model

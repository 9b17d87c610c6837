"""Llama-family → ONNX: dense and TEAL-sparse prefill and decode-step graphs, stable per-layer names.

Emitted op for op from `dejavu.models.llama` by compiler/onnx_export.py's `GraphBuilder` (the
reasons OPT's export gives hold here too). Standard ops only (opset 17, fp32):
- RMSNorm as Pow / ReduceMean / Add / Sqrt / Reciprocal / Mul; RoPE (half-split) from the
  positions and the model's rotary frequencies; grouped-query attention by broadcasting each KV
  head over its group of query heads ([B, Hkv, G, S, hd] against [B, Hkv, 1, T, hd], no copy);
  SwiGLU as Sigmoid · gate · up.
- The sparse graph (thresholds given): every projection input x becomes Where(|x| > t, x, 0)
  before its MatMul (attn_in → q, k, v; o_in → o; mlp_in → gate, up; down_in → down), t the
  layer's threshold from the engine: masked dense, compiler/gated_sparsity's simulation.

Graphs: prefill `input_ids [B,S]` → `logits [B,S,V]`, `present.{l}.key/.value [B,Hkv,S,hd]`;
decode `input_ids [B,1]`, `position_ids [B,1]`, `past.{l}.key/.value [B,Hkv,T,hd]` → `logits
[B,1,V]`, `present.{l}.* [B,Hkv,T+1,hd]`. Names, per layer l: tensors `layers.{l}.attn_in`,
`layers.{l}.mlp_in` (the residual into each block), nodes `layers.{l}.{q,k,v,o,gate,up,down}_proj/MatMul`
with initializers `layers.{l}.{...}_proj.weight_t` (W^T) and, where the checkpoint has them, `.bias` (added after
the MatMul by `{...}_proj/Add`: Qwen2's q/k/v, Llama's attention_bias / mlp_bias), masks `layers.{l}.{input}/mask`;
Qwen3's heads' RMSNorm `layers.{l}.{q,k}_norm/...` between the projection and RoPE.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from dejavu.compiler.onnx_export import (IR_VERSION, OPSET, GraphBuilder, _mask_and_positions, check_model,
                                         save_model)
from dejavu.errors import DejavuError

log = logging.getLogger(__name__)


def _c(g: GraphBuilder, name: str, array) -> str:
    """A constant shared by every layer (and with _mask_and_positions'): added once."""
    if any(i.name == name for i in g.inits):
        return name
    return g.const(name, np.asarray(array))


def _rms_norm(g: GraphBuilder, x: str, w, eps: float, name: str) -> str:
    # x: [B, S, D] -> x / sqrt(mean(x^2) + eps) * w
    ms = g.op("ReduceMean", [g.op("Pow", [x, _c(g, "c.ftwo", np.array(2.0, np.float32))], f"{name}/Pow")],
              f"{name}/ReduceMean", axes=[-1], keepdims=1)
    r = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(f"{name}.eps", np.array(eps, np.float32))],
                                               f"{name}/Add")], f"{name}/Sqrt")], f"{name}/Reciprocal")
    return g.op("Mul", [g.op("Mul", [x, r], f"{name}/Normalize"), g.const(f"{name}.weight", g.weight(w))], f"{name}/Scale")


def _masked(g: GraphBuilder, x: str, thresholds, key: str, l: int) -> str:
    """x, or Where(|x| > t, x, 0) with t = thresholds[key][l] (the TEAL input mask)."""
    if thresholds is None or thresholds[key][l] <= 0:
        return x
    p = f"layers.{l}.{key}/mask"
    keep = g.op("Greater", [g.op("Abs", [x], f"{p}/Abs"),
                            g.const(f"layers.{l}.{key}.threshold", np.array(thresholds[key][l], np.float32))],
                f"{p}/Greater")
    return g.op("Where", [keep, x, _c(g, "c.fzero", np.array(0.0, np.float32))], p)


def _proj(g: GraphBuilder, x: str, linear, name: str) -> str:
    y = g.op("MatMul", [x, g.const(f"{name}.weight_t", g.weight(linear.weight).T)], f"{name}/MatMul")
    if linear.bias is None:
        return y
    return g.op("Add", [y, g.const(f"{name}.bias", g.weight(linear.bias))], f"{name}/Add")


def _rope_tables(g: GraphBuilder, model, positions: str) -> tuple[str, str]:
    """cos, sin [B|1, 1, S, hd] of the positions [B|1, S] (angles in fp32; models.llama.rope_cos_sin's layout: the
    half-split rotary dimensions scaled, then cos 1 and sin 0 for a partial rotary's other dimensions)."""
    pos = g.op("Cast", [positions], "rope/pos_f", to=TensorProto.FLOAT)
    inv = g.const("rope.inv_freq", g.weight(model.inv_freq))
    if model.long_after is not None:  # LongRoPE: the long factors' frequencies where the furthest position is past it
        last = g.op("ReduceMax", [positions], "rope/last_position", keepdims=0)
        past = g.op("Greater", [last, _c(g, "rope.long_after", np.array(model.long_after - 1, np.int64))], "rope/long")
        inv = g.op("Where", [past, g.const("rope.inv_freq_long", g.weight(model.inv_freq_long)), inv], "rope/inv_freq")
    ang = g.op("Mul", [g.op("Unsqueeze", [pos, _c(g, "c.axis_last", np.array([-1], np.int64))], "rope/pos_col"),
                       inv], "rope/angles")  # [B, S, rot/2]
    ang = g.op("Concat", [ang, ang], "rope/angles2", axis=-1)
    ang = g.op("Unsqueeze", [ang, _c(g, "c.axis1", np.array([1], np.int64))], "rope/angles_heads")  # [B, 1, S, rot]
    cos, sin = g.op("Cos", [ang], "rope/cos"), g.op("Sin", [ang], "rope/sin")
    if model.rope_scale != 1.0:  # YaRN's, LongRoPE's attention factor
        scale = _c(g, "rope.attention_factor", np.array(model.rope_scale, np.float32))
        cos, sin = g.op("Mul", [cos, scale], "rope/cos_scaled"), g.op("Mul", [sin, scale], "rope/sin_scaled")
    pad = model.config.head_dim - model.config.rope_dim
    if pad:  # a partial rotary: the other dimensions pass through (cos 1, sin 0), padded to [B, 1, S, hd]
        pads = _c(g, "rope.pass_pads", np.array([0, 0, 0, 0, 0, 0, 0, pad], np.int64))
        cos = g.op("Pad", [cos, pads, _c(g, "c.fone", np.array(1.0, np.float32))], "rope/cos_pass")
        sin = g.op("Pad", [sin, pads, _c(g, "c.fzero", np.array(0.0, np.float32))], "rope/sin_pass")
    return cos, sin


def _rotate(g: GraphBuilder, x: str, cos: str, sin: str, hd: int, name: str, rot: int | None = None) -> str:
    # x cos + rotate_half(x) sin, rotate_half over the first rot dimensions (a partial rotary), the rest as they are
    rot = rot or hd
    sizes = [rot // 2, rot // 2] + ([hd - rot] if rot < hd else [])
    parts = g.op("Split", [x, _c(g, "c.rope_split", np.array(sizes, np.int64))], f"{name}/split",
                 n_out=len(sizes), axis=-1)
    rot_half = [g.op("Neg", [parts[1]], f"{name}/neg"), parts[0], *parts[2:]]
    rot_x = g.op("Concat", rot_half, f"{name}/rotate_half", axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], f"{name}/cos"), g.op("Mul", [rot_x, sin], f"{name}/sin")], name)


def _attention(g: GraphBuilder, layer, l: int, h: str, cos: str, sin: str, decode: bool, cfg, th) -> str:
    p, a = f"layers.{l}", layer.self_attn
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    G, c = H // Hkv, f"{p}.attn_core"
    h = _masked(g, h, th, "attn_in", l)

    def heads(t, n, name):  # [B, S, n hd] -> [B, n, S, hd]
        t = g.op("Reshape", [t, g.ints(f"{name}.shape", [0, 0, n, hd])], f"{name}/split")
        return g.op("Transpose", [t], f"{name}/heads", perm=[0, 2, 1, 3])

    q = heads(_proj(g, h, a.q_proj, f"{p}.q_proj"), H, f"{p}.q_proj")
    k = heads(_proj(g, h, a.k_proj, f"{p}.k_proj"), Hkv, f"{p}.k_proj")
    if cfg.qk_norm:  # each head's RMSNorm over its hd values (Qwen3)
        q = _rms_norm(g, q, a.q_norm.weight, cfg.rms_norm_eps, f"{p}.q_norm")
        k = _rms_norm(g, k, a.k_norm.weight, cfg.rms_norm_eps, f"{p}.k_norm")
    if l not in cfg.nope_layers:  # a NoPE layer (SmolLM3): q and k as projected
        rot = cfg.rope_dim
        q, k = _rotate(g, q, cos, sin, hd, f"{p}.q_rope", rot), _rotate(g, k, cos, sin, hd, f"{p}.k_rope", rot)
    v = heads(_proj(g, h, a.v_proj, f"{p}.v_proj"), Hkv, f"{p}.v_proj")
    kv = []
    for kind, t in (("key", k), ("value", v)):
        new = f"{p}.{kind}s"
        if decode:
            g.op("Concat", [f"past.{l}.{kind}", t], f"{p}.{kind}/concat_past", outputs=[new], axis=2)
        else:
            g.op("Identity", [t], f"{p}.{kind}/new", outputs=[new])
        g.op("Identity", [new], f"{p}.{kind}/present", outputs=[f"present.{l}.{kind}"])
        axis2 = _c(g, "c.axis2", np.array([2], np.int64))
        kv.append(g.op("Unsqueeze", [new, axis2], f"{c}/{kind}_group"))  # [B, Hkv, 1, T, hd]
    # q [B, H, S, hd] -> [B, Hkv, G, S, hd]: query head h reads KV head h // G
    q = g.op("Reshape", [q, g.ints(f"{c}.q_group_shape", [0, Hkv, G, -1, hd])], f"{c}/q_group")
    q = g.op("Mul", [q, _c(g, "c.q_scale", np.array(hd ** -0.5, np.float32))], f"{c}/scale")
    s = g.op("MatMul", [q, g.op("Transpose", [kv[0]], f"{c}/k_t", perm=[0, 1, 2, 4, 3])], f"{c}/scores")
    pr = g.op("Softmax", [g.op("Add", [s, "attn_mask_bias"], f"{c}/mask")], f"{c}/softmax", axis=-1)
    y = g.op("MatMul", [pr, kv[1]], f"{c}/pv")  # [B, Hkv, G, S, hd]
    y = g.op("Reshape", [y, g.ints(f"{c}.heads_shape", [0, H, -1, hd])], f"{c}/heads")
    y = g.op("Reshape", [g.op("Transpose", [y], f"{c}/merge_t", perm=[0, 2, 1, 3]),
                         g.ints(f"{c}.merge_shape", [0, 0, H * hd])], f"{c}/merge")  # [B, S, H hd]
    return _proj(g, _masked(g, y, th, "o_in", l), a.o_proj, f"{p}.o_proj")


def _layer(g: GraphBuilder, layer, l: int, x: str, cos: str, sin: str, decode: bool, cfg, th) -> str:
    p, eps = f"layers.{l}", cfg.rms_norm_eps
    x = g.op("Identity", [x], f"{p}.attn_in")
    h = _rms_norm(g, x, layer.input_layernorm.weight, eps, f"{p}.attn_norm")
    x = g.op("Add", [x, _attention(g, layer, l, h, cos, sin, decode, cfg, th)], f"{p}.attn_residual")
    x = g.op("Identity", [x], f"{p}.mlp_in")
    h = _masked(g, _rms_norm(g, x, layer.post_attention_layernorm.weight, eps, f"{p}.mlp_norm"), th, "mlp_in", l)
    gate = _proj(g, h, layer.mlp.gate_proj, f"{p}.gate_proj")
    act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.act/Sigmoid")], f"{p}.act/SiLU")
    a = g.op("Mul", [act, _proj(g, h, layer.mlp.up_proj, f"{p}.up_proj")], f"{p}.act/gated")
    y = _proj(g, _masked(g, a, th, "down_in", l), layer.mlp.down_proj, f"{p}.down_proj")
    return g.op("Add", [x, y], f"{p}.mlp_residual")


def build_llama_graph(model, mode: str = "prefill", thresholds: dict | None = None) -> onnx.ModelProto:
    """A LlamaForCausalLM as an ONNX graph: `mode` "prefill" | "decode"; thresholds {input: [L]}
    (the engine header's sparsity.thresholds) give the TEAL-sparse graph, None the dense one."""
    if mode not in ("prefill", "decode"):
        raise DejavuError(f"ONNX graph mode must be 'prefill' or 'decode', got {mode!r}")
    cfg = model.config
    decode = mode == "decode"
    L, Hkv, hd, V = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    name = f"llama_{mode}" + ("_teal" if thresholds is not None else "")
    graph = helper.make_graph([], name, [], [])
    g = GraphBuilder(graph)
    S = 1 if decode else "seq"
    graph.input.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", S]))
    if decode:
        graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", 1]))
        for l in range(L):
            for kind in ("key", "value"):
                graph.input.append(helper.make_tensor_value_info(f"past.{l}.{kind}", TensorProto.FLOAT,
                                                                 ["batch", Hkv, "past", hd]))
    positions = _mask_and_positions(g, decode)
    cos, sin = _rope_tables(g, model, positions)
    emb = g.const("embed_tokens", g.weight(model.model.embed_tokens.weight))  # [V, D]
    x = g.op("Gather", [emb, "input_ids"], "embed/tokens")  # [B, S, D]
    for l, layer in enumerate(model.layers):
        x = _layer(g, layer, l, x, cos, sin, decode, cfg, thresholds)
    x = _rms_norm(g, x, model.model.norm.weight, cfg.rms_norm_eps, "final_norm")
    if cfg.tie_word_embeddings:
        head = g.op("Transpose", [emb], "lm_head/weight_t", perm=[1, 0])
    else:
        head = g.const("lm_head.weight_t", g.weight(model.lm_head.weight).T)
    g.op("MatMul", [x, head], "lm_head/MatMul", outputs=["logits"])
    g.flush()
    graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", S, V]))
    for l in range(L):
        for kind in ("key", "value"):
            graph.output.append(helper.make_tensor_value_info(
                f"present.{l}.{kind}", TensorProto.FLOAT, ["batch", Hkv, "past_plus_1" if decode else "seq", hd]))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dejavu",
                          producer_version="1")
    m.ir_version = IR_VERSION
    return m


def export_llama_onnx(model, out_dir: str | os.PathLike, thresholds: dict | None = None) -> dict[str, Path]:
    """Write {prefill,decode}.onnx (dense) and, with thresholds, {prefill,decode}.sparse.onnx (TEAL),
    each checked by onnx.checker and strict shape inference; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for mode in ("prefill", "decode"):
        for th, suffix in ((None, ""), (thresholds, ".sparse")):
            if suffix and th is None:
                continue
            m = check_model(build_llama_graph(model, mode, th))
            paths[f"{mode}{suffix}"] = save_model(m, out / f"{mode}{suffix}.onnx")
            log.info("exported %s%s graph: %d nodes -> %s", mode, suffix, len(m.graph.node), out)
    return paths

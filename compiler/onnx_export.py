"""Dense OPT → ONNX: a prefill graph and a decode-step graph, with stable per-layer names.

The graphs are emitted op for op from `dejavu.models.opt` (same order of operations, same
weights) by a small builder instead of `torch.onnx.export`: tracing renames and folds the
projections (`val_123`, transposed anonymous initializers), and the rewrite passes need to
find each layer's fc1 / fc2 / q / k / v / out MatMuls by name. `tests/compiler/
test_onnx_export.py` checks that ONNX Runtime reproduces the PyTorch model (max abs ≤ 1e-4).

Graphs (opset 17, dims `batch`, `seq`, `past`; every float tensor in the graph's dtype, float32 by
default, the engine's dtype for `--onnx-out`: float16 / bfloat16 / float32):
- prefill: `input_ids [B,S]` → `logits [B,S,V]`, `present.{l}.key/.value [B,H,S,hd]`
- decode:  `input_ids [B,1]`, `position_ids [B,1]`, `past.{l}.key/.value [B,H,T,hd]`
           → `logits [B,1,V]`, `present.{l}.key/.value [B,H,T+1,hd]`

Names the passes rely on, per layer l (node names; each node's output has the same name
unless listed):
- tensors `layers.{l}.attn_in` (residual into the layer), `layers.{l}.attn_ln` (attention
  input after LN for pre-LN blocks; = attn_in for post-LN), `layers.{l}.mlp_in`,
  `layers.{l}.mlp_ln`, `layers.{l}.keys` / `.values` [B,H,T,hd], `layers.{l}.attn_out`
  (out_proj output), `layers.{l}.mlp_out` (fc2 output), shared `attn_mask_bias` [S,T];
- nodes `layers.{l}.fc1/MatMul`, `fc1/Add`, `act/Relu`, `fc2/MatMul`, `fc2/Add`;
  `layers.{l}.q_proj/...`, `k_proj/...`, `v_proj/...`, `out_proj/...`; the attention
  core (q path, scores, softmax, PV, head merge) under `layers.{l}.attn_core/`;
- initializers `layers.{l}.{q,k,v,out}_proj.weight_t` [D,D] (x @ W.T layout), `.bias`,
  `layers.{l}.fc1.weight_t` [D,F], `layers.{l}.fc2.weight_t` [F,D] (= W2ᵀ rows), `.bias`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from dejavu.errors import DejavuError

log = logging.getLogger(__name__)

OPSET = 17
IR_VERSION = 8
MASK_NEG = -1e9  # additive mask; exp(-1e9 - max) == 0 in fp32, and no inf for TensorRT
# graph dtype -> (torch dtype, numpy dtype); bfloat16 through ml_dtypes (an onnx dependency)
FLOAT_TYPES = {"float32": (torch.float32, np.dtype(np.float32)), "float16": (torch.float16, np.dtype(np.float16)),
               "bfloat16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16))}


def mask_neg(np_dtype) -> float:
    """MASK_NEG, or the dtype's lowest finite value where -1e9 does not fit (float16: -65504)."""
    return max(MASK_NEG, float(ml_dtypes.finfo(np_dtype).min))


class GraphBuilder:
    """Append nodes and initializers to an ONNX graph with explicit, stable names.

    `dtype` (a FLOAT_TYPES key) is the type of the weights and float constants it creates
    (`weight`, `floats`); the passes create theirs in the dtype of the weights they read."""

    def __init__(self, graph: onnx.GraphProto, dtype: str = "float32"):
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []  # new nodes, in order (caller places them)
        self.inits: list[onnx.TensorProto] = []
        self.torch_dtype, self.np_dtype = FLOAT_TYPES[dtype]
        self.elem_type = helper.np_dtype_to_tensor_dtype(self.np_dtype)

    def weight(self, t: torch.Tensor) -> np.ndarray:
        """A torch tensor as a numpy array in the graph dtype (rounded by torch, as the engine's)."""
        t = t.detach().cpu().to(self.torch_dtype).contiguous()
        return t.view(torch.int16).numpy().view(self.np_dtype) if t.dtype == torch.bfloat16 else t.numpy()

    def floats(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.float32).astype(self.np_dtype)

    def const(self, name: str, array) -> str:
        self.inits.append(numpy_helper.from_array(np.array(array, order="C", copy=True), name))
        return name

    def ints(self, name: str, values) -> str:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def op(self, op_type: str, inputs: list[str], name: str, outputs: list[str] | None = None,
           n_out: int = 1, domain: str = "", **attrs):
        """Add a node named `name`; return its output name (or list of names if n_out > 1)."""
        if outputs is None:
            outputs = [name] if n_out == 1 else [f"{name}:{i}" for i in range(n_out)]
        node = helper.make_node(op_type, inputs, outputs, name=name, domain=domain or None, **attrs)
        self.nodes.append(node)
        return outputs[0] if len(outputs) == 1 else outputs

    def flush(self) -> None:
        """Append the collected nodes/initializers to the graph."""
        self.graph.node.extend(self.nodes)
        self.graph.initializer.extend(self.inits)
        self.nodes, self.inits = [], []


def _linear(g: GraphBuilder, x: str, w: torch.Tensor, b: torch.Tensor | None, name: str,
            out: str | None = None) -> str:
    # nn.Linear: x @ W.T + b ; the weight is stored transposed so MatMul reads it directly
    wt = g.const(f"{name}.weight_t", g.weight(w).T)
    if b is None:
        return g.op("MatMul", [x, wt], f"{name}/MatMul", outputs=[out] if out else None)
    y = g.op("MatMul", [x, wt], f"{name}/MatMul")
    return g.op("Add", [y, g.const(f"{name}.bias", g.weight(b))], f"{name}/Add", outputs=[out] if out else None)


def _layer_norm(g: GraphBuilder, x: str, ln: torch.nn.LayerNorm, name: str, out: str | None = None) -> str:
    D = ln.normalized_shape[0]
    w = g.weight(ln.weight) if ln.weight is not None else g.floats(np.ones(D))
    b = g.weight(ln.bias) if ln.bias is not None else g.floats(np.zeros(D))
    return g.op("LayerNormalization", [x, g.const(f"{name}.weight", w), g.const(f"{name}.bias", b)],
                f"{name}/LayerNormalization", outputs=[out or name], axis=-1, epsilon=float(ln.eps))


def _attention(g: GraphBuilder, layer, l: int, x: str, decode: bool, H: int, hd: int) -> str:
    """Self-attention of layer l on x [B,S,D]; emits present K/V; returns the out_proj output."""
    p, a = f"layers.{l}", layer.self_attn
    split = g.ints(f"{p}.heads_shape", [0, 0, H, hd])  # [B,S,D] -> [B,S,H,hd]
    c = f"{p}.attn_core"
    q = _linear(g, x, a.q_proj.weight, a.q_proj.bias, f"{p}.q_proj")
    q = g.op("Mul", [q, g.const(f"{p}.q_scale", g.floats(hd**-0.5))], f"{c}/Scale")
    q = g.op("Transpose", [g.op("Reshape", [q, split], f"{c}/q_split")], f"{c}/q_heads", perm=[0, 2, 1, 3])
    kv = []
    for kind, proj in (("key", a.k_proj), ("value", a.v_proj)):
        short = kind[0]
        t = _linear(g, x, proj.weight, proj.bias, f"{p}.{short}_proj")
        t = g.op("Reshape", [t, split], f"{p}.{short}_proj/split")
        new = f"{p}.keys" if kind == "key" else f"{p}.values"
        if decode:
            t = g.op("Transpose", [t], f"{p}.{short}_proj/heads", perm=[0, 2, 1, 3])
            g.op("Concat", [f"past.{l}.{kind}", t], f"{p}.{short}_proj/concat_past",
                 outputs=[new], axis=2)
        else:
            g.op("Transpose", [t], f"{p}.{short}_proj/heads", outputs=[new], perm=[0, 2, 1, 3])
        g.op("Identity", [new], f"{p}.{short}_proj/present", outputs=[f"present.{l}.{kind}"])
        kv.append(new)
    kt = g.op("Transpose", [kv[0]], f"{c}/k_t", perm=[0, 1, 3, 2])  # [B,H,hd,T]
    s = g.op("MatMul", [q, kt], f"{c}/scores")  # [B,H,S,T]
    s = g.op("Add", [s, "attn_mask_bias"], f"{c}/mask")
    pr = g.op("Softmax", [s], f"{c}/softmax", axis=-1)
    y = g.op("MatMul", [pr, kv[1]], f"{c}/pv")  # [B,H,S,hd]
    y = g.op("Transpose", [y], f"{c}/merge_t", perm=[0, 2, 1, 3])
    y = g.op("Reshape", [y, g.ints(f"{p}.merge_shape", [0, 0, H * hd])], f"{c}/merge",
             outputs=[f"{p}.attn_heads"])  # heads concatenated head-major: the out_proj input
    return _linear(g, y, a.out_proj.weight, a.out_proj.bias, f"{p}.out_proj", out=f"{p}.attn_out")


def _layer(g: GraphBuilder, layer, l: int, x: str, decode: bool, H: int, hd: int) -> str:
    p = f"layers.{l}"
    x = g.op("Identity", [x], f"{p}.attn_in")
    h = _layer_norm(g, x, layer.self_attn_layer_norm, f"{p}.ln_attn", f"{p}.attn_ln") if layer.pre_ln \
        else g.op("Identity", [x], f"{p}.attn_ln")
    a = _attention(g, layer, l, h, decode, H, hd)
    x = g.op("Add", [x, a], f"{p}.attn_residual")
    if not layer.pre_ln:
        x = _layer_norm(g, x, layer.self_attn_layer_norm, f"{p}.ln_attn")
    x = g.op("Identity", [x], f"{p}.mlp_in")
    h = _layer_norm(g, x, layer.final_layer_norm, f"{p}.ln_mlp", f"{p}.mlp_ln") if layer.pre_ln \
        else g.op("Identity", [x], f"{p}.mlp_ln")
    h = _linear(g, h, layer.fc1.weight, layer.fc1.bias, f"{p}.fc1")
    h = g.op("Relu", [h], f"{p}.act/Relu")
    y = _linear(g, h, layer.fc2.weight, layer.fc2.bias, f"{p}.fc2", out=f"{p}.mlp_out")
    x = g.op("Add", [x, y], f"{p}.mlp_residual")
    if not layer.pre_ln:
        x = _layer_norm(g, x, layer.final_layer_norm, f"{p}.ln_mlp")
    return x


def _mask_and_positions(g: GraphBuilder, decode: bool) -> str:
    """Emit `attn_mask_bias` [S,T] (0 / MASK_NEG) and return the position-id tensor [B,S]."""
    one, ax0 = g.ints("c.one", 1), g.ints("c.axis0", [0])  # a scalar, Unsqueeze axes
    if decode:  # one new token attends to every past key and itself
        t = g.op("Gather", [g.op("Shape", ["past.0.key"], "mask/past_shape"), g.ints("c.two", 2)], "mask/T")
        t = g.op("Add", [t, one], "mask/T1")
        z = g.op("ConstantOfShape", [g.op("Unsqueeze", [t, ax0], "mask/T1v")], "mask/zeros",
                 value=numpy_helper.from_array(g.floats([0.0]), "v"))
        g.op("Unsqueeze", [z, ax0], "mask/bias", outputs=["attn_mask_bias"])  # [1, T+1]
        return "position_ids"
    zero, ax1 = g.ints("c.zero", 0), g.ints("c.axis1", [1])
    s = g.op("Gather", [g.op("Shape", ["input_ids"], "mask/ids_shape"), one], "mask/S")
    pos = g.op("Range", [zero, s, one], "mask/range")  # [S]
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [pos, ax0], "mask/k_pos"),
                                  g.op("Unsqueeze", [pos, ax1], "mask/q_pos")], "mask/causal")
    g.op("Where", [causal, g.const("c.fzero", g.floats(0.0)), g.const("c.neg", g.floats(mask_neg(g.np_dtype)))],
         "mask/bias", outputs=["attn_mask_bias"])
    return g.op("Unsqueeze", [pos, ax0], "mask/positions")  # [1, S]


def graph_io(graph: onnx.GraphProto, cfg, mode: str, elem_type: int) -> None:
    """The graph's inputs and outputs (module docstring), float tensors of `elem_type`."""
    decode = mode == "decode"
    L, H, hd, V = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size
    S = 1 if decode else "seq"
    graph.input.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", S]))
    if decode:
        graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", 1]))
    graph.output.append(helper.make_tensor_value_info("logits", elem_type, ["batch", S, V]))
    for l in range(L):
        for kind in ("key", "value"):
            if decode:
                graph.input.append(helper.make_tensor_value_info(f"past.{l}.{kind}", elem_type,
                                                                 ["batch", H, "past", hd]))
            graph.output.append(helper.make_tensor_value_info(
                f"present.{l}.{kind}", elem_type, ["batch", H, "past_plus_1" if decode else "seq", hd]))


def emit_embeddings(g: GraphBuilder, dec, mode: str) -> str:
    """Mask, positions and embeddings; returns the residual entering layer 0 [B,S,D]."""
    positions = _mask_and_positions(g, mode == "decode")
    emb = g.const("embed_tokens", g.weight(dec.embed_tokens.weight))  # [V, E]
    x = g.op("Gather", [emb, "input_ids"], "embed/tokens")  # [B, S, E]
    if dec.project_in is not None:
        x = _linear(g, x, dec.project_in.weight, None, "project_in")
    off = g.op("Add", [positions, g.ints("c.pos_offset", 2)], "embed/pos_offset")
    return g.op("Add", [x, g.op("Gather", [g.const("embed_positions", g.weight(dec.embed_positions.weight)), off],
                                "embed/positions")], "embed/sum")


def emit_layer(g: GraphBuilder, layer, l: int, x: str, mode: str, cfg) -> str:
    """Decoder layer l on the residual x; returns the residual it outputs."""
    return _layer(g, layer, l, x, mode == "decode", cfg.num_attention_heads, cfg.head_dim)


def emit_head(g: GraphBuilder, dec, x: str) -> None:
    """Final LayerNorm, project_out and the LM head (tied to embed_tokens) -> `logits`."""
    if dec.final_layer_norm is not None:
        x = _layer_norm(g, x, dec.final_layer_norm, "final_ln")
    if dec.project_out is not None:
        x = _linear(g, x, dec.project_out.weight, None, "project_out")
    emb = g.const("embed_tokens", g.weight(dec.embed_tokens.weight))
    g.op("MatMul", [x, g.op("Transpose", [emb], "lm_head/weight_t", perm=[1, 0])], "lm_head/MatMul",
         outputs=["logits"])


def new_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                          producer_name="dejavu", producer_version="1")
    m.ir_version = IR_VERSION
    return m


def check_mode(mode: str) -> None:
    if mode not in ("prefill", "decode"):
        raise DejavuError(f"ONNX graph mode must be 'prefill' or 'decode', got {mode!r}")


def build_dense_graph(model, mode: str = "prefill", dtype: str = "float32") -> onnx.ModelProto:
    """The dense model as an ONNX graph in memory; `mode` is "prefill" or "decode" (see module
    doc). `compiler/onnx_stream.py` writes the same graph layer by layer with external data."""
    check_mode(mode)
    dec = model.decoder
    graph = helper.make_graph([], f"opt_{mode}", [], [])
    g = GraphBuilder(graph, dtype)
    graph_io(graph, model.config, mode, g.elem_type)
    x = emit_embeddings(g, dec, mode)
    for l, layer in enumerate(dec.layers):
        x = emit_layer(g, layer, l, x, mode, model.config)
    emit_head(g, dec, x)
    _dedupe_inits(g)
    g.flush()
    return new_model(graph)


def _dedupe_inits(g: GraphBuilder) -> None:
    """embed_tokens is emitted by the embeddings and by the tied LM head: keep one."""
    seen = set()
    g.inits = [t for t in g.inits if not (t.name in seen or seen.add(t.name))]


def check_model(m: onnx.ModelProto) -> onnx.ModelProto:
    """onnx.checker + strict shape inference; returns the shape-inferred model."""
    try:
        onnx.checker.check_model(m)
        return onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise DejavuError(f"ONNX graph {m.graph.name!r} is invalid: {str(e).splitlines()[0]}") from None


def save_model(m: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Save a model; weights go to `<name>.data` beside it once the model passes ~1.8 GB."""
    path = Path(path)
    big = m.ByteSize() > 1_800_000_000
    onnx.save_model(m, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=path.name + ".data" if big else None)
    return path


def run_onnxruntime(m: onnx.ModelProto | str | os.PathLike, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a standard-op model (in memory, or a path: external data beside it) on ONNX Runtime's
    CPU provider; {output name: array}."""
    import onnxruntime as ort  # optional dependency

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    src = str(m) if isinstance(m, (str, os.PathLike)) else m.SerializeToString()
    sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def export_onnx(model, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `prefill.onnx` and `decode.onnx` (dense, checked) to out_dir; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for mode in ("prefill", "decode"):
        m = check_model(build_dense_graph(model, mode))
        paths[mode] = save_model(m, out / f"{mode}.onnx")
        log.info("exported %s graph: %d nodes -> %s", mode, len(m.graph.node), paths[mode])
    return paths

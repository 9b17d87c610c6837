"""Graph editing helpers shared by the passes (not a pass itself)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from dejavu.compiler.onnx_export import GraphBuilder
from dejavu.errors import DejavuError



def node_map(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in model.graph.node}


def has_tensor(model: onnx.ModelProto, name: str) -> bool:
    g = model.graph
    return any(name in n.output for n in g.node) or any(i.name == name for i in g.input) \
        or any(i.name == name for i in g.initializer)


def init_array(model: onnx.ModelProto, name: str) -> np.ndarray:
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise DejavuError(f"ONNX graph has no initializer {name!r}")


def maybe_init(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    return init_array(model, name) if any(t.name == name for t in model.graph.initializer) else None


def group(model: onnx.ModelProto, prefix: str) -> list[onnx.NodeProto]:
    """Nodes whose name starts with `prefix` (a node-name scope such as `layers.3.fc1/`)."""
    return [n for n in model.graph.node if n.name.startswith(prefix)]


def _toposort(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Stable topological order (keeps the given order where it is already valid)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    done, order, visiting = set(), [], set()

    def visit(i):  # iterative DFS: graphs of big models are deep
        stack = [(i, False)]
        while stack:
            j, expanded = stack.pop()
            if j in done:
                continue
            if expanded:
                done.add(j)
                visiting.discard(j)
                order.append(nodes[j])
                continue
            if j in visiting:
                raise DejavuError(f"ONNX graph has a cycle through node {nodes[j].name!r}")
            visiting.add(j)
            stack.append((j, True))
            for t in reversed(list(nodes[j].input)):
                p = producer.get(t)
                if t and t not in available and p is not None and p not in done:
                    stack.append((p, False))

    for i in range(len(nodes)):
        visit(i)
    return order


def replace(model: onnx.ModelProto, remove: list[onnx.NodeProto], g: GraphBuilder) -> None:
    """Remove `remove`, add the builder's nodes/initializers, re-sort, drop unused initializers."""
    gone = {id(n) for n in remove}
    nodes = [n for n in model.graph.node if id(n) not in gone] + g.nodes
    model.graph.initializer.extend(g.inits)
    g.nodes, g.inits = [], []
    available = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    ordered = [onnx.NodeProto.FromString(n.SerializeToString()) for n in _toposort(nodes, available)]
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    used = {t for n in model.graph.node for t in n.input} | {o.name for o in model.graph.output}
    keep = [t for t in model.graph.initializer if t.name in used]
    if len(keep) != len(model.graph.initializer):
        keep = [onnx.TensorProto.FromString(t.SerializeToString()) for t in keep]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)


def topk_indices(g: GraphBuilder, scores: str, k: int, limit: int, prefix: str, out: str,
                 dtype=np.float32) -> str:
    """Indices [..., k] (int64, best first) of the top-k of scores [..., N] (of numpy `dtype`)
    along the last axis.

    TensorRT's TopK takes k <= 3840 (`limit`); a larger k is taken in rounds of at most
    `limit`, masking each round's picks to the dtype's lowest float before the next (exact,
    same order as a single TopK up to ties)."""
    if k <= limit:
        _, idx = g.op("TopK", [scores, g.ints(f"{prefix}.k", [k])], f"{prefix}/TopK",
                      outputs=[f"{prefix}/TopK:values", out], axis=-1, largest=1, sorted=1)
        return idx
    parts, cur, taken, r = [], scores, 0, 0
    while taken < k:
        take = min(limit, k - taken)
        _, idx = g.op("TopK", [cur, g.ints(f"{prefix}.k{r}", [take])], f"{prefix}/TopK_{r}", n_out=2,
                      axis=-1, largest=1, sorted=1)
        parts.append(idx)
        taken += take
        if taken < k:
            fill = g.op("ConstantOfShape", [g.op("Shape", [idx], f"{prefix}/shape_{r}")], f"{prefix}/fill_{r}",
                        value=numpy_helper.from_array(np.array([ml_dtypes.finfo(dtype).min], dtype), "v"))
            cur = g.op("ScatterElements", [cur, idx, fill], f"{prefix}/mask_{r}", axis=-1)
        r += 1
    return g.op("Concat", parts, f"{prefix}/concat", outputs=[out], axis=-1)


def share_keep(g: GraphBuilder, scores: str, idx: str, min_share: float, prefix: str, out: str,
               dtype=np.float32) -> str:
    """keep [..., k] bool: which of the selected rows idx [..., k] (int64, best first) of scores
    [..., N] (of numpy `dtype`) a token keeps under the per-token K rule (plugins.share_keep):
    softmax share >= min_share, and always the best row. Without a softmax over N:

        keep_j = s_j >= min(log(min_share) + logsumexp(s), max(s))        (in float32)

    The max is subtracted inside the logsumexp explicitly (Exp of raw scores overflows float32
    past 88, and a backend's ReduceLogSumExp need not subtract it); min_share 0 keeps every row."""
    s = scores if np.dtype(dtype) == np.float32 else \
        g.op("Cast", [scores], f"{prefix}/cast", to=onnx.TensorProto.FLOAT)  # as the runtime: fp32
    m = g.op("ReduceMax", [s], f"{prefix}/max", axes=[-1], keepdims=1)  # [..., 1]
    e = g.op("Exp", [g.op("Sub", [s, m], f"{prefix}/shift")], f"{prefix}/exp")
    lse = g.op("ReduceSum", [e, g.ints(f"{prefix}.axes_m1", [-1])], f"{prefix}/sum", keepdims=1)
    lse = g.op("Add", [g.op("Log", [lse], f"{prefix}/log"), m], f"{prefix}/lse")  # [..., 1]
    log_share = math.log(min_share) if min_share > 0 else float(np.finfo(np.float32).min)
    thr = g.op("Add", [lse, g.const(f"{prefix}.log_min_share", np.array(log_share, np.float32))], f"{prefix}/thr")
    thr = g.op("Min", [thr, m], f"{prefix}/thr_best")  # the best row passes whatever its share
    v = g.op("GatherElements", [s, idx], f"{prefix}/selected", axis=-1)  # [..., k]
    return g.op("GreaterOrEqual", [v, thr], f"{prefix}/compare", outputs=[out])


def set_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))

"""Rewrite passes on the exported ONNX graph, run in one ordered list.

Each pass is `pass(model: onnx.ModelProto, settings: PassSettings) -> onnx.ModelProto`, lives in
its own file, and logs (logger `dejavu.compiler.passes.<name>`) what it rewrote:

1. `insert_predictors`        per layer: scores = (src @ A.T) @ B.T + bias, src per the lookahead
2. `rewrite_sparse_mlp`       fc1/Relu/fc2 → TopK → Gather(W1 rows) → MatMul → Relu → Gather(W2ᵀ rows) → MatMul;
                              with a per-token K (`token_k`): TopK(k_max), the keep flags of the share
                              rule, h · keep
3. `rewrite_sparse_attention` Q / attention / out_proj over the top-k heads (K/V stay dense)
4. `to_plugin_form`           (form "plugin" only) the subgraphs → `dejavu.Predictor` (+ keep),
                              `dejavu.SparseMLP`, `dejavu.SparseAttention` custom-domain nodes

After passes 1–3 the graph is form (a): standard ONNX ops only (ONNX Runtime runs it and it
equals the masked-dense reference). After pass 4 it is form (b). New weights take the dtype of
the weights they are made from (arithmetic in float32, one rounding), so a float16 graph stays
float16 and its tensors equal the engine's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx

from dejavu.compiler.config import DEFAULT_PREDICTOR_INPUT, TENSORRT_TOPK_LIMIT
from dejavu.errors import DejavuError

log = logging.getLogger(__name__)


@dataclass
class PassSettings:
    """What the passes need: per-layer K, the predictors (engine tensor names), the form.

    token_k: the engine's per-token MLP K (`build_config.token_k`, form "share": threshold [L],
    k_max [L]); a sparse MLP layer then takes its top k_max rows and keeps those whose predicted
    share is >= threshold[l]. None: K_l rows for every token."""

    mlp_k: list[int]
    attn_k: list[int]
    predictors: dict = field(default_factory=dict)  # layers.{l}.pred_{mlp,attn}.{a,b,bias}
    predictor_input: dict = field(default_factory=lambda: dict(DEFAULT_PREDICTOR_INPUT))
    form: str = "standard"  # "standard" (form a) or "plugin" (form b)
    topk_limit: int = TENSORRT_TOPK_LIMIT
    layers: list[int] | None = None  # the layers to rewrite; None: all (the streamed writer: one)
    token_k: dict | None = None

    def __post_init__(self):
        if self.form not in ("standard", "plugin"):
            raise DejavuError(f"ONNX form must be 'standard' or 'plugin', got {self.form!r}")
        if self.topk_limit < 1:
            raise DejavuError(f"topk_limit must be positive, got {self.topk_limit}")
        tk, L = self.token_k, len(self.mlp_k)
        if tk is not None:
            if not isinstance(tk, dict) or tk.get("form") != "share":
                raise DejavuError(f"token_k must be the header's record of form 'share', got {tk!r}")
            th, km = tk.get("threshold"), tk.get("k_max")
            if not isinstance(th, (list, tuple)) or len(th) != L or \
                    not all(isinstance(t, (int, float)) and 0.0 <= t <= 1.0 for t in th):
                raise DejavuError(f"token_k.threshold must list {L} numbers in [0, 1], got {th!r}")
            if not isinstance(km, (list, tuple)) or len(km) != L or \
                    not all(isinstance(m, int) and m >= k for m, k in zip(km, self.mlp_k)):
                raise DejavuError(f"token_k.k_max must list {L} integers >= each layer's K, got {km!r}")

    def layer_ids(self) -> list[int]:
        return list(range(len(self.mlp_k))) if self.layers is None else list(self.layers)

    def mlp_rows(self, l: int) -> int:
        """The rows layer l's sparse MLP selects: k_max with a per-token K, else K_l."""
        return self.mlp_k[l] if self.token_k is None else int(self.token_k["k_max"][l])

    def min_share(self, l: int) -> float | None:
        """Layer l's share threshold (a per-token K), or None (every selected row kept)."""
        return None if self.token_k is None else float(self.token_k["threshold"][l])


from dejavu.compiler.passes.insert_predictors import insert_predictors  # noqa: E402
from dejavu.compiler.passes.rewrite_sparse_attention import rewrite_sparse_attention  # noqa: E402
from dejavu.compiler.passes.rewrite_sparse_mlp import rewrite_sparse_mlp  # noqa: E402
from dejavu.compiler.passes.to_plugin_form import to_plugin_form  # noqa: E402

PASSES = [insert_predictors, rewrite_sparse_mlp, rewrite_sparse_attention, to_plugin_form]


def run_passes(model: onnx.ModelProto, settings: PassSettings, passes=None) -> onnx.ModelProto:
    """Apply `passes` (default: PASSES) in order to a copy of `model`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for p in PASSES if passes is None else passes:
        before = len(out.graph.node)
        out = p(out, settings)
        log.debug("%s: %d -> %d nodes", p.__name__, before, len(out.graph.node))
    return out

"""What the runtime reads from an engine header: dimensions, per-layer K, predictor input.

The runtime never imports the compiler: everything it needs is in the header and tensors
(docs/ARCHITECTURE.md, "Engine file").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dejavu.engine_file import predictor_dtypes
from dejavu.errors import DejavuError
from dejavu.models.tokenizer import end_ids

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SOURCES = ("attn_in", "mlp_in")
PREDICTOR_FORMS = ("lowrank",)  # scores = (x @ a.T) @ b.T + bias (plugins/predictor.py)
# A dense engine's header has no predictor input (nothing is predicted, the schedule is empty);
# EngineSpec still holds one. Not a default: a sparse engine without the field is rejected.
NO_PREDICTOR_INPUT = {"source": "attn_in", "lookahead": 0}


@dataclass(frozen=True)
class EngineSpec:
    """Model dimensions and sparsity settings of one engine (all from its header)."""

    vocab_size: int
    hidden_size: int  # D
    ffn_dim: int  # F
    num_heads: int  # H
    num_layers: int  # L
    max_positions: int
    embed_dim: int  # E (word_embed_proj_dim)
    pre_ln: bool
    final_ln: bool
    mlp_k: tuple[int, ...]
    attn_k: tuple[int, ...]
    has_predictors: bool
    source: str  # "attn_in" | "mlp_in"
    lookahead: int  # 0 | 1
    dtype: torch.dtype
    eos_id: int | None
    bos_id: int | None
    pad_id: int | None
    stop_ids: tuple[int, ...] = ()  # every id that ends a generation (eos_id first)
    # per-token MLP K (build_config.token_k, form "share"): per layer (min_share, k_max); None: K_l
    # rows for every token (engines without the field). The predictor selects the top k_max rows and
    # a token keeps those whose predicted share is >= min_share (at least its best: plugins.share_keep)
    token_k: tuple[tuple[float, int], ...] | None = None
    # predictor kinds ("mlp", "attn") stored as int8 rows with an fp16 scale a row (.a_scale, .b_scale;
    # build_config.predictor_dtype); engines without the field: none (float predictors)
    int8_predictors: frozenset[str] = frozenset()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def density(self) -> tuple[float, float]:
        """Mean (mlp, attn) fraction kept per token."""
        return (sum(self.mlp_k) / (self.num_layers * self.ffn_dim),
                sum(self.attn_k) / (self.num_layers * self.num_heads))

    def sparse_mlp(self, l: int) -> bool:
        return self.mlp_k[l] < self.ffn_dim

    def sparse_attn(self, l: int) -> bool:
        return self.attn_k[l] < self.num_heads


TOKEN_K_FORMS = ("share",)  # what the runtime runs; "mass" (a sort per token) is the compiler's reference only


def _token_k(bc: dict, mlp_k, F: int):
    """build_config.token_k as EngineSpec.token_k (None when absent or null: engines before the field)."""
    tk = bc.get("token_k")
    if tk is None:
        return None
    L = len(mlp_k)
    if not isinstance(tk, dict) or tk.get("form") not in TOKEN_K_FORMS:
        raise DejavuError(f"engine header: build_config.token_k must be an object with form in {TOKEN_K_FORMS}")
    th, km = tk.get("threshold"), tk.get("k_max")
    if not (isinstance(th, list) and len(th) == L and all(type(v) in (int, float) and 0.0 <= v <= 1.0 for v in th)):
        raise DejavuError(f"engine header: build_config.token_k.threshold must list {L} numbers in [0, 1]")
    if not (isinstance(km, list) and len(km) == L and all(type(k) is int and m <= k <= F for k, m in zip(km, mlp_k))):
        raise DejavuError(f"engine header: build_config.token_k.k_max must list {L} integers in [K_l, {F}]")
    return tuple((float(t), k) for t, k in zip(th, km))


def _int(d: dict, key: str, default=None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise DejavuError(f"engine header: model_config.{key} must be a positive integer, got {v!r}")
    return v


def spec_from_header(header: dict) -> EngineSpec:
    """Validate the parts of the header the runtime uses; DejavuError naming the bad field."""
    if not isinstance(header, dict):
        raise DejavuError("engine header is not a JSON object")
    mc, bc = header.get("model_config"), header.get("build_config")
    if not isinstance(mc, dict) or not isinstance(bc, dict):
        raise DejavuError("engine header lacks model_config or build_config")
    if mc.get("activation_function", "relu") != "relu":
        raise DejavuError("engine header: only ReLU OPT models are supported")
    D, F, H, L = (_int(mc, k) for k in ("hidden_size", "ffn_dim", "num_attention_heads", "num_hidden_layers"))
    if D % H:
        raise DejavuError("engine header: hidden_size is not divisible by num_attention_heads")
    ks = {}
    for key, n in (("mlp_k", F), ("attn_k", H)):
        v = bc.get(key, [n] * L)
        if not (isinstance(v, list) and len(v) == L and all(type(k) is int and 1 <= k <= n for k in v)):
            raise DejavuError(f"engine header: build_config.{key} must list {L} integers in [1, {n}]")
        ks[key] = tuple(v)
    has_pred = bool(bc.get("predictors", True))
    sparse = any(k < F for k in ks["mlp_k"]) or any(k < H for k in ks["attn_k"])
    if sparse and not has_pred:
        raise DejavuError("engine header: K < N for some layer but the engine has no predictors")
    pi = bc.get("predictor_input")  # the compiler records it for every engine with predictors
    if pi is None:
        if sparse:
            raise DejavuError("engine header: build_config.predictor_input is missing (the input the predictors "
                              "read: {source, lookahead})")
        pi = NO_PREDICTOR_INPUT
    if not isinstance(pi, dict):
        raise DejavuError(f"engine header: build_config.predictor_input {pi!r} is not an object")
    source, lookahead = pi.get("source"), pi.get("lookahead")
    if source not in SOURCES or lookahead not in (0, 1):
        raise DejavuError(f"engine header: build_config.predictor_input {pi!r} is not "
                          "{source: attn_in|mlp_in, lookahead: 0|1}")
    form = bc.get("predictor_form") or "lowrank"  # engines before the field: the same form
    if form not in PREDICTOR_FORMS:
        raise DejavuError(f"engine header: build_config.predictor_form {form!r} is not one of {PREDICTOR_FORMS}")
    if source == "mlp_in" and lookahead == 0 and any(k < H for k in ks["attn_k"]):
        # the head predictor of layer l would read layer l's attention output: not causal
        raise DejavuError("engine header: predictor_input mlp_in with lookahead 0 cannot drive "
                          "the attention-head predictor (it would read its own layer's output)")
    dtype = header.get("dtype", "float32")
    if dtype not in DTYPES:
        raise DejavuError(f"engine header: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    try:
        stops = end_ids(mc.get("eos_token_id", 2))
    except DejavuError as e:
        raise DejavuError(f"engine header: model_config: {e}") from None
    return EngineSpec(
        vocab_size=_int(mc, "vocab_size"), hidden_size=D, ffn_dim=F, num_heads=H, num_layers=L,
        max_positions=_int(mc, "max_position_embeddings"),
        embed_dim=_int(mc, "word_embed_proj_dim", D) if mc.get("word_embed_proj_dim") else D,
        pre_ln=bool(mc.get("do_layer_norm_before", True)),
        final_ln=bool(mc.get("do_layer_norm_before", True)) and not bool(mc.get("_remove_final_layer_norm", False)),
        mlp_k=ks["mlp_k"], attn_k=ks["attn_k"], has_predictors=has_pred, source=source,
        lookahead=lookahead, dtype=DTYPES[dtype], eos_id=stops[0] if stops else None, stop_ids=stops,
        bos_id=mc.get("bos_token_id", 2), pad_id=mc.get("pad_token_id", 1),
        token_k=_token_k(bc, ks["mlp_k"], F),
        int8_predictors=frozenset(k for k, v in predictor_dtypes(header).items() if v == "int8"))


def check_tensors(spec: EngineSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Shapes of the tensors the decoder reads (engines from memory skip engine_file's checks)."""
    D, F, H, E = spec.hidden_size, spec.ffn_dim, spec.num_heads, spec.embed_dim
    Dq = H * spec.head_dim  # D, or the rows of a tensor-parallel shard's heads (runtime/tp.py)
    want = {"embed_tokens": (spec.vocab_size, E), "embed_positions": (spec.max_positions + 2, D)}
    if E != D:
        want.update(project_in=(D, E), project_out=(E, D))
    if spec.final_ln:
        want.update({"final_ln.weight": (D,), "final_ln.bias": (D,)})
    for l in range(spec.num_layers):
        p = f"layers.{l}."
        want.update({p + "ln_attn.weight": (D,), p + "ln_attn.bias": (D,), p + "ln_mlp.weight": (D,),
                     p + "ln_mlp.bias": (D,), p + "attn.wq": (Dq, D), p + "attn.bq": (Dq,),
                     p + "attn.wkv": (2 * Dq, D), p + "attn.bkv": (2 * Dq,), p + "attn.wo_t": (Dq, D),
                     p + "attn.bo": (D,), p + "mlp.w1": (F, D), p + "mlp.b1": (F,),
                     p + "mlp.w2_t": (F, D), p + "mlp.b2": (D,)})
        for kind, n, sparse in (("mlp", F, spec.sparse_mlp(l)), ("attn", H, spec.sparse_attn(l))):
            if not sparse:
                continue
            q = f"{p}pred_{kind}."
            r = tuple(tensors.get(q + "a", torch.empty(0, 0)).shape)[:1]
            want.update({q + "a": r + (D,), q + "b": (n,) + r, q + "bias": (n,)})
            if kind in spec.int8_predictors:
                want.update({q + "a_scale": r, q + "b_scale": (n,)})
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            raise DejavuError(f"engine lacks tensor {name!r}")
        if tuple(t.shape) != shape:
            raise DejavuError(f"engine tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")

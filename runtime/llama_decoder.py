"""The Llama-family decoder over engine tensors (compiler/build_llama.py's kernel layout), TEAL sparse.

Same design as the OPT decoder (runtime/decoder.py):
- `prefill(ids, lengths)`: dense over a right-padded prompt batch but for each sequence's first position,
  which gets the thresholds (the attention sink, as the compiler measured it), K/V into the cache.
- `decode_step(tokens, pos)`: one token per sequence; every block projection reads only the
  input columns with |x_i| > its layer's threshold (`LlamaOps.linear` and `qkv_rope`: masked dense
  on the CPU path, `plugins/input_sparse` kernels on CUDA, with the RMSNorm / SwiGLU before and the
  residual / RoPE and cache write after fused into them; `LlamaOps.mlp`: gate/up's split-K sum folded
  into down's SwiGLU select; `LlamaOps.attend_project`: plugins/gqa_attention's kernel on CUDA, reading
  only the slots <= pos, its splits combined by the o projection's select; the CPU path one masked SDPA
  over the whole cache); static shapes and no
  host sync, so one CUDA graph captures it (runtime/graphs.py).
- `forward_tokens(ids)`: token-parallel logits, each position thresholded on its own inputs:
  the compiler's simulation (compiler/gated_sparsity.py) on the engine's weights.
Decode step: RMSNorm, fused q/k/v, RoPE on the new token, GQA over a [B, H_kv, T, hd] cache, fused gate/up,
SwiGLU, down. Biases where the checkpoint has them: q/k/v's added before RoPE in their sum kernel (Qwen2, Llama's
attention_bias), o's, gate/up's and down's (attention_bias, mlp_bias) one launch each. Qwen3's RMSNorm of each
query and key head: in the same sum kernel, after the biases and before RoPE. A layer without RoPE (SmolLM3's
NoPE layers): the same kernel with cos 1 and sin 0, which leave q and k as projected. No side stream: TEAL has
no predictor to overlap (the thresholds are the selection, computed where the input is).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from dejavu.errors import DejavuError
from dejavu.models.llama import apply_rope, rope_angles, rope_cos_sin
from dejavu.models.tokenizer import end_ids
from dejavu.runtime.spec import DTYPES

INPUTS = ("attn_in", "o_in", "mlp_in", "down_in")


@dataclass(frozen=True)
class LlamaSpec:
    """Dimensions and the TEAL setting of one Llama engine (all from its header)."""

    config: object  # dejavu.models.llama.LlamaConfig
    skip: float
    thresholds: dict  # input -> tuple of L floats
    dtype: torch.dtype
    eos_id: int | None
    bos_id: int | None
    pad_id: int | None
    stop_ids: tuple[int, ...] = ()  # every id that ends a generation (eos_id first)

    def __getattr__(self, name):  # vocab_size, hidden_size, ... read through to the model config
        if name == "config":
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_positions(self) -> int:
        c = self.config
        return min(c.max_position_embeddings, c.sliding_window or c.max_position_embeddings)


def llama_spec_from_header(header: dict) -> LlamaSpec:
    """Validate what the Llama runtime reads from a header; DejavuError naming the bad field."""
    from dejavu.models.llama import LlamaConfig

    try:
        cfg = LlamaConfig.from_hf_dict(header.get("model_config"))
    except DejavuError as e:
        raise DejavuError(f"engine header: model_config: {e}") from None
    sp = header.get("sparsity")
    if not isinstance(sp, dict) or sp.get("method") != "teal":
        raise DejavuError("engine header: sparsity must be {method: teal, skip, thresholds}")
    L, th = cfg.num_hidden_layers, sp.get("thresholds") or {}
    for key in INPUTS:
        v = th.get(key)
        if not (isinstance(v, list) and len(v) == L and all(type(t) in (int, float) and t >= 0 for t in v)):
            raise DejavuError(f"engine header: sparsity.thresholds.{key} must list {L} non-negative numbers")
    dtype = header.get("dtype", "float32")
    if dtype not in DTYPES:
        raise DejavuError(f"engine header: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    stops = end_ids(cfg.eos_token_id)
    return LlamaSpec(cfg, float(sp.get("skip", 0.0)), {k: tuple(float(t) for t in th[k]) for k in INPUTS},
                     DTYPES[dtype], stops[0] if stops else None, cfg.bos_token_id, cfg.pad_token_id, stops)


def check_llama_tensors(header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Names and shapes (engines from memory skip engine_file's checks)."""
    from dejavu.engine_file import llama_shapes

    for name, shape in llama_shapes(header).items():
        t = tensors.get(name)
        if t is None:
            raise DejavuError(f"engine lacks tensor {name!r}")
        if list(t.shape) != shape:
            raise DejavuError(f"engine tensor {name!r} has shape {list(t.shape)}, expected {shape}")


def linear_ref(x: torch.Tensor, w_t: torch.Tensor, t: float, norm=None, swiglu: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + h @ w_t with |h| <= t zeroed (t 0: dense); h = x [..., N], w * rms_norm(x) (norm: (w, eps))
    or silu(x[..., :N]) * x[..., N:] (swiglu): the decode step's projections in PyTorch (masked dense)."""
    from dejavu.plugins.input_sparse import input_sparse_gemv_ref, produce_ref

    h = produce_ref(x, *(norm or (None, 0.0)), swiglu=swiglu)
    y = input_sparse_gemv_ref(h, w_t, t) if t > 0 else h @ w_t
    return y if residual is None else residual + y


class LlamaOps:
    """The decode step's sparse projections on one backend: "ref" (PyTorch, masked dense) or "triton"
    (plugins/input_sparse: per-split selects fused with the producer, the pairs' GEMV, fused split-K sums),
    each projection kind (plugins.PROJECTIONS: qkv, o, gate_up, down) launched with its own settings."""

    def __init__(self, backend: str, settings=None):
        """settings: the engine's plugins.KernelSettings (runtime/ops.settings_for: the header's
        target.kernel_settings where they fit this GPU; their `input_sparse` blocks, per projection kind
        plugins.resolve_projection_settings' overrides of them; None: DEFAULT)."""
        from dejavu.plugins.settings import DEFAULT, resolve_projection_settings

        if backend not in ("ref", "triton"):
            raise DejavuError(f"backend must be 'ref' or 'triton', got {backend!r}")
        self.backend = backend
        self.settings = settings or DEFAULT
        self.kinds = {k: self.settings.with_overrides(o) for k, o in resolve_projection_settings(self.settings).items()}
        # the decode step's attention: plugins/gqa_attention's kernel (slots <= pos only) on the triton backend
        # where its settings turn it on; else one scaled_dot_product_attention over the whole cache, masked
        self.attn_kernel = backend == "triton" and self.settings.gqa_attn.kernel
        # the residual stream in fp32, o and down adding into it (input_sparse.fp32_residual; decode steps only)
        self.fp32_residual = backend == "triton" and self.settings.input_sparse.fp32_residual
        self.kernels = {"input_sparse_gemv": backend, "gqa_attention": "triton" if self.attn_kernel else "torch"}

    def _select(self, x, w_t: torch.Tensor, t: float, kind: str, norm=None, swiglu: bool = False, dtype=None):
        # (idx, val, count) of the inputs of w_t kept from x (or its partials), the split from kind's settings
        from dejavu.plugins import input_sparse as IS

        settings = self.kinds[kind]
        B = x.acc.shape[0] if isinstance(x, IS.GQAPartials) else x.shape[-2]
        split = IS.split_k_for(B, w_t.shape[0], w_t.shape[1], settings.input_sparse)
        return IS.select_slices(x, t, split, *(norm or (None, 0.0)), swiglu, dtype, settings=settings)

    def linear(self, x: torch.Tensor, w_t: torch.Tensor, t: float, norm=None, swiglu: bool = False,
               residual: torch.Tensor | None = None, *, kind: str) -> torch.Tensor:
        """linear_ref's y [B, M] from x [B, N] (swiglu: [B, 2N]); t 0: PyTorch's dense product; the kernels
        with projection `kind`'s settings."""
        if t <= 0 or self.backend == "ref":
            return linear_ref(x.to(w_t.dtype), w_t, t, norm, swiglu, residual)  # an fp32 residual stream's x rounded
        return self._project(self._select(x, w_t, t, kind, norm, swiglu, w_t.dtype), w_t, residual, kind)

    def _project(self, sel, w_t: torch.Tensor, residual: torch.Tensor | None, kind: str) -> torch.Tensor:
        # the pairs' GEMV of select `sel`: residual + y by the split-K sum launch, or added into the fp32 residual
        # stream in place (fp32_residual)
        from dejavu.plugins.input_sparse import sliced_gemv, sliced_gemv_add

        if self.fp32_residual and residual is not None:
            return sliced_gemv_add(*sel, w_t, residual, settings=self.kinds[kind])
        return sliced_gemv(*sel, w_t, residual, settings=self.kinds[kind])

    def gate_up(self, x: torch.Tensor, wgu_t: torch.Tensor, t: float, norm) -> torch.Tensor:
        """The fused gate/up projection of x [B, D] through the MLP's RMSNorm (norm: (w, eps)), unsummed: fp32
        partials [S, B, 2I] (triton, t > 0; down's select sums them), else gate | up [B, 2I]."""
        if t <= 0 or self.backend == "ref":
            return self.linear(x, wgu_t, t, norm=norm, kind="gate_up")
        from dejavu.plugins.input_sparse import sliced_parts

        return sliced_parts(*self._select(x, wgu_t, t, "gate_up", norm, dtype=wgu_t.dtype), wgu_t,
                            settings=self.kinds["gate_up"])

    def down(self, gu: torch.Tensor, wd_t: torch.Tensor, t: float, x: torch.Tensor | None) -> torch.Tensor:
        """x + down(SiLU(gate) * up) from gate_up's output gu (its partials [S, B, 2I] or [B, 2I]); x None: the
        product alone."""
        if gu.dim() == 3:  # partials: t > 0 on triton
            from dejavu.plugins.input_sparse import sum_parts_ref

            if t <= 0:
                return self.linear(sum_parts_ref(gu, wd_t.dtype), wd_t, t, swiglu=True, residual=x, kind="down")
            return self._project(self._select(gu, wd_t, t, "down", swiglu=True, dtype=wd_t.dtype), wd_t, x, "down")
        return self.linear(gu, wd_t, t, swiglu=True, residual=x, kind="down")

    def mlp(self, x: torch.Tensor, wgu_t: torch.Tensor, wd_t: torch.Tensor, t_in: float, t_down: float,
            norm, add: bool = True, bgu: torch.Tensor | None = None) -> torch.Tensor:
        """x + down(SiLU(gate) * up) of x [B, D] (norm: the MLP's RMSNorm (w, eps)): gate/up's partials go
        straight into down's SwiGLU select, which sums them (no split-K sum launch between). add False: down's
        output alone (tensor parallel: a rank's part, added after the all-reduce). bgu: gate/up's biases [2I]
        (mlp_bias checkpoints), added before the SwiGLU (into the first split's partials); down's bias is the
        caller's, as every output bias is."""
        gu = self.gate_up(x, wgu_t, t_in, norm)
        if bgu is not None and gu.dim() == 3:
            gu[0] += bgu  # one launch; the partials are this step's own tensor
        elif bgu is not None:
            gu = gu + bgu
        return self.down(gu, wd_t, t_down, x if add else None)

    def qkv_rope(self, x: torch.Tensor, w_t: torch.Tensor, t: float, norm, cos: torch.Tensor, sin: torch.Tensor,
                 pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                 bias: torch.Tensor | None = None, qk_norm: tuple | None = None,
                 rot: int | None = None) -> torch.Tensor:
        """q [B, H, hd] of linear(x, w_t, t, norm) (+ bias: q/k/v's biases [M], Qwen2), the fused q/k/v
        projection, each q and k head through RMSNorm (qk_norm: (q_w [hd], k_w [hd], eps), Qwen3), RoPE on q and k
        (cos, sin [B, hd], sin signed for rotate_half; rot: the rotary dimensions of a head, None: all), k and v
        written into the caches [B, Hkv, T, hd] at slot pos[b]."""
        from dejavu.plugins import input_sparse as IS

        if self.backend == "ref":
            return IS.sliced_qkv_rope_ref(_plus(self.linear(x, w_t, t, norm, kind="qkv"), bias), cos, sin, pos,
                                          k_cache, v_cache, rows, qk_norm, rot)
        if t <= 0:  # the dense product, then the same sum kernel: bias, norms, RoPE and the cache writes in one launch
            return IS.qkv_rope(self.linear(x, w_t, t, norm, kind="qkv"), cos, sin, pos, k_cache, v_cache,
                               settings=self.kinds["qkv"], bias=bias, qk_norm=qk_norm, rot=rot)
        return IS.sliced_qkv_rope(*self._select(x, w_t, t, "qkv", norm, dtype=w_t.dtype), w_t, cos, sin, pos,
                                  k_cache, v_cache, settings=self.kinds["qkv"], bias=bias, qk_norm=qk_norm, rot=rot)

    def attend_project(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                       mask: torch.Tensor | None, wo_t: torch.Tensor, t: float,
                       residual: torch.Tensor | None) -> torch.Tensor:
        """residual + linear(o, wo_t, t) (residual None: the product alone): o [B, H * hd] the attention of the
        rotated q [B, H, hd] over slots <= pos[b] of the caches [B, Hkv, T, hd] (mask: gqa_attention.decode_mask,
        None where attn_kernel)."""
        from dejavu.plugins import gqa_attention as GA

        if not self.attn_kernel:
            return self.linear(GA.gqa_decode_ref(q, k_cache, v_cache, pos, mask), wo_t, t, residual=residual, kind="o")
        # o thresholded: its select combines the splits' partials (no combine launch; one split: o itself)
        fuse = t > 0 and self.settings.gqa_attn.fuse_combine
        o = GA.gqa_decode(q, k_cache, v_cache, pos, combine=not fuse, settings=self.settings)
        if isinstance(o, torch.Tensor):
            return self.linear(o, wo_t, t, residual=residual, kind="o")
        return self._project(self._select(o, wo_t, t, "o"), wo_t, residual, "o")

    def verify(self, spec: LlamaSpec, tensors: dict, kinds=("qkv", "o", "gate_up", "down")) -> dict | None:
        """The kernel path once against the reference: the GEMV of each projection kind in `kinds` on layer 0's
        weights with that kind's settings (each kind launches with its own), its input through the RMSNorm or
        SwiGLU before it (sparse engines; "input_sparse_gemv" is gate/up's, "input_sparse_gemv.KIND" another's); the
        attention kernel on random
        q / caches of the engine's heads, over three tiles of its slots, rows at different positions (None on
        "ref")."""
        out = {}
        for kind in kinds if self.backend != "ref" and spec.skip > 0 else ():
            name, key, norm_name, inp = _VERIFIED[kind]
            w = tensors[f"layers.0.{name}"]
            n = w.shape[0] * (2 if kind == "down" else 1)
            x = torch.randn(2, n, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
            t = spec.thresholds[inp][0]
            norm = (tensors[f"layers.0.{norm_name}"], spec.rms_norm_eps) if norm_name else None
            ref = linear_ref(x.float(), w.float(), t, norm and (norm[0].float(), norm[1]), swiglu=kind == "down")
            out[key] = _checked(key, self.linear(x, w, t, norm, swiglu=kind == "down", kind=kind), ref)
        if self.attn_kernel:
            from dejavu.plugins import gqa_attention as GA

            w = tensors["layers.0.attn.wo_t"]
            tile, g = self.settings.gqa_attn.block_s, torch.Generator().manual_seed(1)
            T, hd = 2 * tile + 3, spec.head_dim
            q = torch.randn(2, spec.num_attention_heads, hd, generator=g).to(w.device, w.dtype)
            k, v = (torch.randn(2, spec.num_key_value_heads, T, hd, generator=g).to(w.device, w.dtype)
                    for _ in range(2))
            pos = torch.tensor([T - 1, tile], device=w.device)
            ref = GA.gqa_decode_ref(q.float(), k.float(), v.float(), pos)
            out["gqa_attention"] = _checked("gqa_attention", GA.gqa_decode(q, k, v, pos, settings=self.settings), ref)
        return out or None


# projection kind -> (its weight, the check's name, the norm before it or None, its thresholded input)
_VERIFIED = {"gate_up": ("mlp.wgu_t", "input_sparse_gemv", "mlp_norm", "mlp_in"),
             "qkv": ("attn.wqkv_t", "input_sparse_gemv.qkv", "attn_norm", "attn_in"),
             "o": ("attn.wo_t", "input_sparse_gemv.o", None, "o_in"),
             "down": ("mlp.wd_t", "input_sparse_gemv.down", None, "down_in")}


def _checked(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    # max |got - ref|, rounded; DejavuError past 2% of the reference's largest value
    err = float((got.float() - ref).abs().max())
    if not err <= 2e-2 * (float(ref.abs().max()) or 1.0):
        raise DejavuError(f"{name} disagrees with its reference on this engine (max |diff| {err:.3g})")
    return round(err, 6)


# a layer's optional vectors (compiler/build_llama.py's layout): attribute -> tensor name after "layers.l."
VECTORS = {"bqkv": "attn.bqkv", "bo": "attn.bo", "bgu": "mlp.bgu", "bd": "mlp.bd", "q_norm": "attn.q_norm",
           "k_norm": "attn.k_norm"}


def _plus(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class LlamaDecoder:
    """Weights, static KV cache and the TEAL thresholds of one Llama engine."""

    graph_priority = None  # runtime/graphs.DecodeGraph: capture on the highest-priority stream

    def __init__(self, spec: LlamaSpec, tensors: dict[str, torch.Tensor], device: torch.device, ops: LlamaOps):
        from dejavu.models.llama import rope_attention_factor, rope_inv_freq, rope_long_after

        self.spec, self.t, self.device, self.ops = spec, tensors, device, ops
        th = spec.thresholds
        self.layers = [SimpleNamespace(
            attn_norm=tensors[f"layers.{l}.attn_norm"], mlp_norm=tensors[f"layers.{l}.mlp_norm"],
            wqkv_t=tensors[f"layers.{l}.attn.wqkv_t"], wo_t=tensors[f"layers.{l}.attn.wo_t"],
            wgu_t=tensors[f"layers.{l}.mlp.wgu_t"], wd_t=tensors[f"layers.{l}.mlp.wd_t"],
            t={k: th[k][l] for k in INPUTS},
            # biases where the checkpoint has them (else None): q/k/v's before RoPE, gate/up's before the SwiGLU,
            # o's and down's added to the residual stream after the projection (under TP after the all-reduce);
            # the q and k heads' RMSNorm weights (Qwen3), between q/k/v's bias and RoPE
            **{k: tensors.get(f"layers.{l}.{name}") for k, name in VECTORS.items()}) for l in range(spec.num_layers)]
        for l, w in enumerate(self.layers):
            w.qk_norm = None if w.q_norm is None else (w.q_norm, w.k_norm, spec.rms_norm_eps)
            w.rope = l not in spec.nope_layers  # False: a NoPE layer (SmolLM3), its q and k as projected
        self.lm_head = tensors.get("lm_head", tensors["embed_tokens"])
        self.inv_freq = rope_inv_freq(spec.config).to(device)  # [hd / 2] fp32
        self.rope_scale = rope_attention_factor(spec.config)  # cos and sin scaled by it (YaRN, LongRoPE)
        self.long_after = rope_long_after(spec.config)  # LongRoPE: its long factors' frequencies past this context
        self.inv_freq_long = None if self.long_after is None else rope_inv_freq(spec.config, long=True).to(device)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.batch = self.max_seq = 0
        self._all = None
        # tensor parallel (runtime/tp.py): reduce(y) sums o's and down's outputs over the ranks, and the residual
        # is added after it (a plain residual stream in the engine dtype: no fp32 stream adding in place)
        self.reduce = None

    # ------------------------------------------------------------------ cache
    def setup(self, batch: int, max_seq: int) -> None:
        """Allocate the static KV cache: per layer k, v: [batch, H_kv, max_seq, hd]."""
        if (batch, max_seq) == (self.batch, self.max_seq):
            return
        self.release()
        s = self.spec
        shape = (batch, s.num_key_value_heads, max_seq, s.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
        self.rows = torch.arange(batch, device=self.device)
        self.slots = torch.arange(max_seq, device=self.device)
        self.batch, self.max_seq = batch, max_seq
        self._all = (self.k_cache, self.v_cache, self.rows, batch)

    def release(self) -> None:
        self.k_cache, self.v_cache, self._all = [], [], None
        self.batch = self.max_seq = 0

    def empty_cache(self, rows: torch.Tensor | None = None) -> None:
        """Start the next sequence at slot 0: nothing to reset (a step reads slots <= pos only,
        each written before it is read)."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """A server's prefix cache: row dst holds row src's first n slots (a prefill's)."""
        k, v, _, _ = self._all
        for t in (*k, *v):
            t[dst, :, :n] = t[src, :, :n]

    def keep_prefix(self, row: int, n: int) -> None:
        """A server's prefix cache: row `row` keeps its first n slots; nothing to mark (a step reads slots <= pos
        only, each written before it is read)."""

    def use_rows(self, n: int) -> None:
        """Decode steps run on the first n rows of the cache `setup` allocated (views, no copy)."""
        k, v, rows, full = self._all
        if not 1 <= n <= full:
            raise ValueError(f"use_rows: n must be in [1, {full}], got {n}")
        self.k_cache, self.v_cache = [c[:n] for c in k], [c[:n] for c in v]
        self.rows, self.batch = rows[:n], n

    # ------------------------------------------------------------------ pieces
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [...] -> cos, sin: [..., hd] in the engine dtype (angles in fp32)
        ang = rope_angles(positions, self.inv_freq, self.inv_freq_long, self.long_after)
        return rope_cos_sin(ang, self.rope_scale, self.spec.head_dim, self.spec.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """logits [..., V] from the last hidden state x [..., D]."""
        from dejavu.plugins.input_sparse import produce_ref  # w * rms_norm(x): rms_norm upcasts inside

        h = produce_ref(x, self.t["final_norm"], self.spec.rms_norm_eps)
        return F.linear(h.to(self.lm_head.dtype), self.lm_head)  # an fp32 residual stream's h rounded

    def _split_qkv(self, qkv: torch.Tensor):
        s = self.spec
        qo, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        return qkv[..., :qo], qkv[..., qo:qo + kv], qkv[..., qo + kv:]

    def _mlp(self, w, x: torch.Tensor, linear) -> torch.Tensor:
        # x: [..., D] residual -> x + down(SiLU(gate) * up), each projection thresholded on its input
        eps = self.spec.rms_norm_eps
        gu = _plus(linear(x, w.wgu_t, w.t["mlp_in"], norm=(w.mlp_norm, eps)), w.bgu)
        if self.reduce is not None:
            return _plus(x + self.reduce(linear(gu, w.wd_t, w.t["down_in"], swiglu=True)), w.bd)
        return _plus(linear(gu, w.wd_t, w.t["down_in"], swiglu=True, residual=x), w.bd)

    # ------------------------------------------------------------------ decode
    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """logits [B, V] for tokens [B] at cache slots / positions pos [B] (int64, device);
        writes this token's K/V at slot pos[b] and attends to slots <= pos[b]."""
        s = self.spec
        half = s.rope_dim // 2
        cos, sin = self._rope(pos)  # [B, hd]
        sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)  # rotate_half's sign, once per step
        # a NoPE layer's q and k through the same sum kernel unrotated: cos 1 and sin 0 give x * 1 + mate * 0 = x
        nope = (torch.ones_like(cos), torch.zeros_like(sin)) if s.nope_layers else None
        mask = None  # the kernel reads slots <= pos[b] only; SDPA: an additive mask [B, 1, 1, T], once per step
        if not self.ops.attn_kernel:
            from dejavu.plugins.gqa_attention import decode_mask

            mask = decode_mask(pos, self.max_seq, s.dtype, self.slots)
        x = F.embedding(tokens, self.t["embed_tokens"])  # [B, D]
        if self.ops.fp32_residual and self.reduce is None:
            x = x.float()  # o and down add into it in place (under TP they return their part: no residual given)
        for l, w in enumerate(self.layers):
            kc, vc = self.k_cache[l], self.v_cache[l]
            # q [B, H, hd] rotated; this token's k (rotated) and v written at slot pos[b]
            q = self.ops.qkv_rope(x, w.wqkv_t, w.t["attn_in"], (w.attn_norm, s.rms_norm_eps),
                                  *((cos, sin) if w.rope else nope), pos, kc, vc, self.rows, w.bqkv, w.qk_norm,
                                  s.rotary_dim)
            # query head h reads KV head h // (H / Hkv); o [B, H * hd] through the o projection
            norm = (w.mlp_norm, s.rms_norm_eps)
            if self.reduce is None:
                x = _plus(self.ops.attend_project(q, kc, vc, pos, mask, w.wo_t, w.t["o_in"], x), w.bo)
                x = _plus(self.ops.mlp(x, w.wgu_t, w.wd_t, w.t["mlp_in"], w.t["down_in"], norm, bgu=w.bgu), w.bd)
                continue
            x = _plus(x + self.reduce(self.ops.attend_project(q, kc, vc, pos, mask, w.wo_t, w.t["o_in"], None)), w.bo)
            x = _plus(x + self.reduce(self.ops.mlp(x, w.wgu_t, w.wd_t, w.t["mlp_in"], w.t["down_in"], norm, add=False,
                                                   bgu=w.bgu)), w.bd)
        return self.head(x)

    # ------------------------------------------------------------------ sequences
    def forward_tokens(self, ids: torch.Tensor, sparse: bool = True, write_cache: bool = False,
                       last: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                       start: int = 0) -> torch.Tensor:
        """logits for ids [B, S] at positions start..start+S-1: [B, S, V], or [B, V] at `last` [B].

        sparse: each position's projections thresholded on its own inputs (masked dense, the
        compiler's simulation); False: the dense model (prefill). write_cache: K/V at slots
        start..start+S-1 of rows `rows` (default 0..B-1); start > 0 attends to the cached slots too."""
        from dejavu.plugins.input_sparse import produce_ref  # the q and k heads' RMSNorm (Qwen3)

        s = self.spec
        B, S = ids.shape
        H, Hkv, hd = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        if start and not write_cache:
            raise ValueError("forward_tokens: start > 0 needs write_cache (earlier slots come from the cache)")
        lin = linear_ref if sparse else (lambda x, w_t, t, **kw: linear_ref(x, w_t, 0.0, **kw))
        pos = torch.arange(start, start + S, device=ids.device)
        cos, sin = (c[None, None] for c in self._rope(pos))  # [1, 1, S, hd]
        x = F.embedding(ids, self.t["embed_tokens"])  # [B, S, D]
        at = slice(None) if rows is None else rows
        for l, w in enumerate(self.layers):
            qkv = lin(x, w.wqkv_t, w.t["attn_in"], norm=(w.attn_norm, s.rms_norm_eps))
            q, k, v = self._split_qkv(_plus(qkv, w.bqkv))
            q, k = q.view(B, S, H, hd), k.view(B, S, Hkv, hd)
            if w.qk_norm is not None:
                q, k = produce_ref(q, w.q_norm, s.rms_norm_eps), produce_ref(k, w.k_norm, s.rms_norm_eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, hd], [B, Hkv, S, hd]
            if w.rope:
                q, k = apply_rope(q, cos, sin, s.rope_dim), apply_rope(k, cos, sin, s.rope_dim)
            v = v.view(B, S, Hkv, hd).transpose(1, 2)
            if write_cache:
                self.k_cache[l][at, :, start:start + S] = k
                self.v_cache[l][at, :, start:start + S] = v
            if start:
                k, v = self.k_cache[l][at, :, :start + S], self.v_cache[l][at, :, :start + S]
                mask = torch.arange(start + S, device=ids.device)[None, :] <= pos[:, None]  # [S, start + S]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
            o = o.transpose(1, 2).reshape(B, S, H * hd)
            if self.reduce is None:
                x = _plus(lin(o, w.wo_t, w.t["o_in"], residual=x), w.bo)
            else:
                x = _plus(x + self.reduce(lin(o, w.wo_t, w.t["o_in"])), w.bo)
            x = self._mlp(w, x, lin)
        if last is not None:
            x = x[torch.arange(B, device=x.device), last]  # [B, D]
        return self.head(x)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | None = None,
                start: int = 0, every: bool = False) -> torch.Tensor:
        """Prefill of right-padded ids [B, S] (real lengths [B]): last-token logits [B, V] (every: each position's,
        [B, S, V]). Dense, except a
        sequence's first position (start 0), which gets the decode steps' thresholds as every position has
        them token-parallel: it holds the attention sink, 74% of whose inputs sit under SmolLM2-135M's 25%
        thresholds, and the sparse tokens decoded after it do better reading it thresholded. The 25% engine on
        WikiText-2 test (docs/llama.md, "The prompt's first position"): a one-token prompt then 511 decoded
        tokens -0.88% against the dense model where a dense prefill measured +2.44%; a 256-token prompt then
        256 decoded +0.47%, against +0.74% for a prompt thresholded whole and +2.25% dense."""
        if start > 0:  # a later chunk of the prompt
            return self.forward_tokens(ids, sparse=False, write_cache=True, last=None if every else lengths - 1,
                                       rows=rows, start=start)
        first = self.forward_tokens(ids[:, :1], sparse=True, write_cache=True,
                                    last=None if every else torch.zeros_like(lengths), rows=rows)
        if ids.shape[1] == 1:
            return first
        rest = self.forward_tokens(ids[:, 1:], sparse=False, write_cache=True,
                                   last=None if every else (lengths - 2).clamp(min=0), rows=rows, start=1)
        return torch.cat([first, rest], 1) if every else torch.where((lengths == 1)[:, None], first, rest)

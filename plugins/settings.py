"""The kernels' settings as data: frozen dataclasses, resolved for a target GPU at build time.

    settings = resolve_kernel_settings("sm_90", sm_count=132)   # the compiler, per target
    header["target"]["kernel_settings"] = settings.to_dict()     # written into the engine
    layers = resolve_layer_settings(settings, D, hd, mlp_k, attn_k)  # per layer, from its K
    header["target"]["layer_kernel_settings"] = layers           # [{part: {field: value}}] per layer
    KernelSettings.from_dict(d).with_overrides(layers[l])        # read back by the runtime, per layer
    sparse_fc1(..., settings=settings)                           # every launcher takes one (None: DEFAULT)
    kinds = resolve_projection_settings(settings)                # Llama: per projection kind (qkv, o, ...)
    settings.with_overrides(kinds["gate_up"])                    # its launches' settings (LlamaOps)

Each default is a field default here (picked on an H200 or an H100, 132 SMs; the measurements behind them:
docs/kernels.md and BENCHMARKS.md). A launcher's `config=` dict overrides fields of its own table
for one call (sweeps, tests); unknown keys are a DejavuError. Nothing patches module globals.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dejavu.errors import DejavuError


@dataclass(frozen=True)
class GemvBlocks:
    """fc1's GEMV (`_gather_gemv_kernel`, per-sequence sets and batch 1; the predictors' products)."""
    BLOCK_R: int = 2
    BLOCK_D: int = 1024
    num_warps: int = 4
    num_stages: int = 2
    W_EV: str = "evict_first"  # the streamed rows leave L1 first; the re-read input vector stays


@dataclass(frozen=True)
class DotBlocks:
    """fc1 of a shared set from dot_min_batch (`_gather_dot_kernel`)."""
    BLOCK_R: int = 64
    BLOCK_D: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class SplitKBlocks:
    """fc2 / the output projection (`_gather_dot_t_kernel`, `_gather_gemv_t_kernel`): K split over
    SPLIT programs per D block (None: ~TARGET_PROGRAMS programs)."""
    BLOCK_K: int = 64
    BLOCK_D: int = 128
    num_warps: int = 4
    num_stages: int = 3
    SPLIT: int | None = None
    TARGET_PROGRAMS: int = 528  # ~4 programs per SM (132 SMs)


@dataclass(frozen=True)
class CompactSettings:
    """compact_rows (`_compact_rows_kernel`, fc2's nonzero rows first; runtime.ops.skips_zero): BLOCK rows
    per program, the counts before a block in loads of up to PREFIX_MAX values. Not tuned on a GPU yet."""
    BLOCK: int = 1024
    PREFIX_MAX: int = 16384
    num_warps: int = 8


@dataclass(frozen=True)
class QKVSettings:
    """The deferred Q/K/V kernels (qkv_partial.py, qkv_finish.py). BLOCK_P: missing slots per tl.dot block;
    BLOCK_R: rows per program; SPLIT: slices of D (None: ~TARGET_PROGRAMS programs); FINISH_R: rows per
    finishing program, FINISH_S: slices summed per load; SHARED_MIN_BATCH: from this batch a shared set
    (or batch 1) takes the shared-set kernel, SHARED_P - 1 missing slots per sequence in its tl.dot;
    SLOW_Z: finishing programs per row block sharing the slow path (None: ~SLOW_TARGET programs, 1-8);
    FOLD_FINISH (batch 1): the finish folded into attention (True; "wide": only past FOLD_MAX_SPLIT
    slices of D; both at most FOLD_MAX_SPLIT slices), the slow path in FOLD_SLOW_Z x (BLOCK_R /
    FOLD_SLOW_R) extra z-slices of the partial kernel, after the D slices;
    SHARED_P_UNFOLDED / UNFOLDED_MAXNREG: P and register cap of the unfolded batch-1 route without
    refresh heads. Measurements: docs/kernels.md, "The decode step's kernels"."""
    BLOCK_P: int = 16
    BLOCK_R: int = 32
    BLOCK_D: int = 128
    SPLIT: int | None = None
    TARGET_PROGRAMS: int = 1056
    FINISH_R: int = 32
    num_warps: int = 4
    num_stages: int = 2
    SHARED_MIN_BATCH: int | None = 2
    SHARED_P: int = 4
    FINISH_S: int = 8
    SLOW_Z: int | None = 1
    SLOW_TARGET: int = 640
    FOLD_FINISH: bool | str = False
    FOLD_SLOW_R: int = 16
    FOLD_SLOW_Z: int = 1
    FOLD_MAX_SPLIT: int = 8
    SHARED_P_UNFOLDED: int | None = None
    UNFOLDED_MAXNREG: int | None = None


# Batch 1: the shared-set kernel, 64-row blocks, P 16 (32 unfolded, 128-register cap), the finishing
# kernel's blocks of `kernels.py --qkv-sweep finish`, the fold where D takes many slices.
QKV_B1 = QKVSettings(BLOCK_R=64, TARGET_PROGRAMS=512, num_stages=3, SHARED_P_UNFOLDED=32, UNFOLDED_MAXNREG=128,
                     SHARED_MIN_BATCH=1, SHARED_P=16, FINISH_R=16, FINISH_S=1, SLOW_Z=None,
                     FOLD_FINISH="wide", FOLD_SLOW_Z=4)


@dataclass(frozen=True)
class AttnSettings:
    """Decode attention (`_attn_decode_kernel`): CHUNK positions per program, BLOCK_S per tile."""
    BLOCK_S: int = 32
    CHUNK: int = 32
    num_warps: int = 4


@dataclass(frozen=True)
class TopkSettings:
    """predictor_topk's top-k: method "triton" (topk_triton) or "torch". topk_triton: `block` scores per
    program of a split row (raised so a row has <= 8 * warps programs), one launch per radix round."""
    method: str = "triton"
    block: int = 1024
    warps: int = 4


@dataclass(frozen=True)
class ScoreSettings:
    """predictor_topk's scores: method "triton" (gather_gemv at batch 1) or "torch" (cuBLAS); the blocks
    of h = x @ a.T ("a") and scores = h @ b.T + bias ("b")."""
    method: str = "triton"
    a: GemvBlocks = GemvBlocks(BLOCK_R=1, BLOCK_D=1024, num_warps=8, num_stages=2)
    b: GemvBlocks = GemvBlocks(BLOCK_R=8, BLOCK_D=256, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class LNSettings:
    """layer_norm: rows up to MAX_BLOCK, in registers; WARPS: (largest D, num_warps), first match;
    num_warps: a fixed choice (None: by that rule)."""
    MAX_BLOCK: int = 16384
    WARPS: tuple = ((2048, 4), (8192, 8), (None, 16))
    num_warps: int | None = None


@dataclass(frozen=True)
class PDLSettings:
    """Programmatic dependent launch (_common.pdl_args): EARLY kinds trigger the next launch right after
    their wait, PLAIN kinds launch without PDL."""
    ENABLED: bool = True
    EARLY: tuple = ("reduce", "qkv_finish", "commit", "attn", "attn_combine", "layer_norm", "compact", "is_select",
                    "is_sum", "gqa_combine")
    PLAIN: tuple = ("pred",)


@dataclass(frozen=True)
class InputSparseSettings:
    """The TEAL input-sparse kernels (input_sparse.py: Llama engines): a select per GEMV split fused with the
    input's producer (RMSNorm, SwiGLU) writes (index, value) pairs, the pairs' GEMV, the split-K sum with the
    residual (q/k/v: RoPE and the cache write). split_k None: enough splits for `target_programs` programs
    (the GEMV is bandwidth-bound: it wants every SM busy), each at least `min_split_inputs` inputs long."""
    block_select: int = 4096  # a Llama-3-8B row of 4096 inputs in one step (a NORM select reads the row)
    select_warps: int = 8
    block_m: int = 64  # 128 / 64: 7.10 -> 5.92 ms/step with block_k 128 (Llama-3-8B, 50% skipped; docs/llama.md)
    block_k: int = 128
    split_k: int | None = None
    target_programs: int = 528  # 4 per SM on an H100 / H200 (132 SMs)
    min_split_inputs: int = 256  # 2 * block_k: a split's loop at least one step at 50% kept
    num_warps: int = 4
    # the Llama decode step's residual stream in fp32, o's and down's GEMV splits adding into it with atomics
    # (input_sparse.sliced_gemv_add): no split-K sum launch for them, 2 launches a layer fewer. Llama-3-8B at 50%
    # skipped 3.688 vs 3.749 ms a step, the 70B TP-8 rank 5.553 vs 5.687 (H100, 2026-12-06, d808819: `bash
    # benchmarks/gpu/llama_fp32_residual.sh`). The order of the splits' adds is not fixed, so the last bits vary
    # run to run; False is the bit-reproducible form (an fp16 stream, the sums by their launches)
    fp32_residual: bool = True
    # per projection kind of a Llama block (PROJECTIONS), the fields that differ from this table there:
    # (kind, field, value) triples (resolve_projection_settings). gate/up with block_k 64: 45.8 vs 54.6 us a
    # launch on Llama-3-8B, 3.909 vs 4.180 ms a step with the attention kernel (1.75x the dense graph's 6.850);
    # the 70B TP-8 rank 28.7 vs 27.7 us, 6.486 vs 6.416 ms (H100, 2026-12-05, 94b1fda: `bash
    # benchmarks/gpu/input_sparse_sweep.sh` and e2e_llama.py's confirmation run; docs/llama.md)
    projections: tuple = (("gate_up", "block_k", 64),)


@dataclass(frozen=True)
class GQAAttnSettings:
    """The Llama decode step's attention on the triton backend: `kernel` True runs gqa_attention.py's
    flash-decoding kernel (slots <= pos only); False PyTorch's scaled_dot_product_attention over the whole cache
    with a mask (every slot read). A row's slots <= pos in tiles of block_s (tl.dot: >= 16), the tiles in NS
    splits of whole tiles, one program each, NS = min(max_splits, ceil(target_programs / (B * Hkv)), the
    cache's tiles); fuse_combine: where o is thresholded (the o projection's input sparse), the splits'
    partials are combined by its select (input_sparse PRODUCER ATTN) instead of a combine launch."""
    # the kernel on: measured in its form before the splits (fixed chunks of 32 slots, T / 32 programs a KV head
    # and row): Llama-3-8B at 50% skipped 4.161 vs 4.274 ms a step (`bash benchmarks/gpu/llama_speed.sh ab`) and
    # 4.180 vs 4.293 (e2e_llama.py's confirmation run); slower on the 70B TP-8 rank (G = 8 query heads of one KV
    # head, 8 chunk programs at 256 slots): 6.416 vs 6.226 (H100, 2026-12-05, 94b1fda; docs/llama.md)
    kernel: bool = True
    block_s: int = 32
    target_programs: int = 132  # one per SM on an H100 / H200
    max_splits: int = 32
    num_warps: int = 4
    fuse_combine: bool = True


@dataclass(frozen=True)
class KernelSettings:
    """Every kernel's settings for one engine (the engine header's target.kernel_settings)."""
    fc1_gemv: GemvBlocks = GemvBlocks()
    fc1_dot: DotBlocks = DotBlocks()
    fc1_dot_min_batch: int = 2  # shared sets from this batch take the tl.dot kernel
    fc2_gemv: SplitKBlocks = SplitKBlocks(BLOCK_K=16, BLOCK_D=256, num_stages=2, SPLIT=32)
    fc2_dot: SplitKBlocks = SplitKBlocks()
    fc2_dot1: SplitKBlocks = SplitKBlocks(TARGET_PROGRAMS=396)  # batch 1: three programs per SM
    proj1: SplitKBlocks = SplitKBlocks(num_stages=4)  # batch 1, rows gathered per head
    fc2_dot_min_batch: int = 1
    compact: CompactSettings = CompactSettings()
    qkv: QKVSettings = QKVSettings()
    qkv_b1: QKVSettings = QKV_B1
    attn: AttnSettings = AttnSettings()
    topk: TopkSettings = TopkSettings()
    scoring: ScoreSettings = ScoreSettings()
    layer_norm: LNSettings = LNSettings()
    pdl: PDLSettings = PDLSettings()
    input_sparse: InputSparseSettings = InputSparseSettings()
    gqa_attn: GQAAttnSettings = GQAAttnSettings()
    arch: str | None = None  # the GPU these were resolved for (sm_XY), None: not resolved for one

    def to_dict(self) -> dict:
        """JSON-ready (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KernelSettings":
        """The settings of an engine header; missing fields take the defaults, unknown ones are a DejavuError."""
        return _from_dict(cls, d, "kernel_settings")

    def with_overrides(self, overrides: dict) -> "KernelSettings":
        """These settings with fields of their parts replaced ({part: {field: value}}: a layer's entry of
        resolve_layer_settings); unknown names are a DejavuError."""
        d = self.to_dict()
        for part, fields in overrides.items():
            if not isinstance(d.get(part), dict) or not isinstance(fields, dict):
                raise DejavuError(f"layer kernel settings: {part!r} is not a part of KernelSettings")
            d[part] = {**d[part], **fields}
        return _from_dict(KernelSettings, d, "layer kernel settings")


# InputSparseSettings fields of older headers, at the value of the one form left: the mask mode's removal (select),
# the GEMV's rows a step ahead and its pipelined loop (prefetch_w, loop_stages; measured slower, f72ba62 holds them),
# the SwiGLU MLP in one launch (fuse_mlp and its blocks; measured slower, ea722ab holds it)
REMOVED_INPUT_SPARSE = (("select", "list"), ("prefetch_w", False), ("loop_stages", None), ("fuse_mlp", False),
                        ("mlp_block_i", 32), ("mlp_block_d", 256))


def _from_dict(cls, d, where: str):
    if not isinstance(d, dict):
        raise DejavuError(f"{where}: expected an object, got {type(d).__name__}")
    if cls is InputSparseSettings:  # another value of a removed field: an unknown key
        d = {k: v for k, v in d.items() if (k, v) not in REMOVED_INPUT_SPARSE}
    if cls is GQAAttnSettings and "chunk" in d:  # headers before the split kernel (fixed chunks of the cache)
        d = {k: v for k, v in d.items() if k not in ("chunk", "block_s")}
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise DejavuError(f"{where}: unknown key(s) {', '.join(unknown)}")
    kw = {}
    for name, v in d.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            v = _from_dict(type(default), v, f"{where}.{name}")
        elif isinstance(default, tuple) and isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        kw[name] = v
    return cls(**kw)


DEFAULT = KernelSettings()
H200_SMS = 132  # the GPU the defaults were picked on
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a Llama block's input-sparse GEMVs (runtime/llama_decoder.LlamaOps)


def resolve_kernel_settings(arch: str | None, sm_count: int | None = None) -> KernelSettings:
    """The settings for a target GPU: the defaults with the grid targets scaled to its SM count
    and PDL off below sm_90 (no griddepcontrol there). arch None (CPU): the defaults."""
    if arch is None:
        return DEFAULT
    scale = (sm_count or H200_SMS) / H200_SMS
    r = dataclasses.replace

    def programs(t):
        return r(t, TARGET_PROGRAMS=max(1, round(t.TARGET_PROGRAMS * scale)))

    major = int(arch.removeprefix("sm_")[:-1] or 0)
    s, i = DEFAULT, DEFAULT.input_sparse
    kinds = tuple((k, f, max(1, round(v * scale)) if f == "target_programs" else v) for k, f, v in i.projections)
    return r(s, fc2_gemv=programs(s.fc2_gemv), fc2_dot=programs(s.fc2_dot), fc2_dot1=programs(s.fc2_dot1),
             proj1=programs(s.proj1), qkv=programs(s.qkv), qkv_b1=programs(s.qkv_b1),
             input_sparse=r(i, target_programs=max(1, round(i.target_programs * scale)), projections=kinds),
             pdl=s.pdl if major >= 9 else r(s.pdl, ENABLED=False), arch=arch)


def resolve_projection_settings(s: KernelSettings) -> dict[str, dict]:
    """Per projection kind of a Llama block (PROJECTIONS), its input-sparse kernels' settings as overrides of s
    (with_overrides): {kind: {"input_sparse": {field: value}}} from s.input_sparse.projections ({} where a kind
    takes the table as it is); a kind or field that is not one is a DejavuError."""
    fields = {f.name for f in dataclasses.fields(InputSparseSettings)} - {"projections"}
    out = {k: {} for k in PROJECTIONS}
    for entry in s.input_sparse.projections:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 3):
            raise DejavuError(f"input_sparse.projections: expected (kind, field, value) triples, got {entry!r}")
        kind, field, value = entry
        if kind not in out or field not in fields:
            raise DejavuError(f"input_sparse.projections: ({kind!r}, {field!r}) is not a projection kind "
                              f"({', '.join(PROJECTIONS)}) and an input_sparse field")
        out[kind].setdefault("input_sparse", {})[field] = value
    return out


def resolve_layer_settings(s: KernelSettings, d_model: int, head_dim: int, mlp_k, attn_k) -> list[dict]:
    """Per layer, the batch-1 launch choices that depend on its K (mlp_k[l] neurons, attn_k[l] heads) under
    s, as overrides of s (with_overrides): fc2's and the output projection's split of K (fc2_dot1 / proj1
    SPLIT), the Q/K/V partial kernel's slices of D before a fold's cap (qkv_b1.SPLIT), whether its finish
    folds into attention (qkv_b1.FOLD_FINISH), the finishing kernel's programs per row block (qkv_b1.SLOW_Z).
    The launches equal those the launchers resolve from K at each call (tests/plugins/test_kernel_settings.py)."""
    from dejavu.plugins.fc2 import split_plan
    from dejavu.plugins.qkv_finish import slow_z
    from dejavu.plugins.qkv_partial import qkv_split

    q, out = vars(s.qkv_b1), []
    for k, kh in zip(mlp_k, attn_k):
        rows = max(1, kh * 3 * -(-head_dim // q["BLOCK_R"]))  # the partial kernel's row blocks per slice of D
        out.append({"fc2_dot1": {"SPLIT": split_plan(k, d_model, vars(s.fc2_dot1))[1]},
                    "proj1": {"SPLIT": split_plan(kh * head_dim, d_model, vars(s.proj1))[1]},
                    "qkv_b1": {"SPLIT": qkv_split({**q, "FOLD_FINISH": False}, d_model, rows, False)[0],
                               "FOLD_FINISH": bool(q["FOLD_FINISH"]) and qkv_split(q, d_model, rows, True)[2],
                               "SLOW_Z": slow_z(q, kh * 3 * -(-head_dim // q["FINISH_R"]))}})
    return out


def table(t, config=None) -> dict:
    """A kernel's settings `t` as a dict, with `config` (a dict of field overrides) applied."""
    d = dict(vars(t))
    if config:
        unknown = sorted(set(config) - set(d))
        if unknown:
            raise DejavuError(f"config: unknown key(s) {', '.join(unknown)} (known: {', '.join(d)})")
        d.update(config)
    return d

"""Build settings: `BuildConfig` and the calibration and predictor settings it takes its
defaults from, with their checks. Each default is defined here once; `dejavu-compile` reads
them from here.

Imports no torch (nor numpy): `dejavu-compile --help` and its argument errors answer before
torch is imported.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from types import MappingProxyType

from dejavu.cli_common import DTYPE_ALIASES, canonical_device, canonical_dtype  # the one vocabulary
from dejavu.errors import DejavuError


def check_density(value, name: str = "density") -> float:
    """A density in (0, 1], else DejavuError naming the option."""
    try:
        d = float(value)
    except (TypeError, ValueError):
        raise DejavuError(f"--{name.replace('_', '-')} must be a number in (0, 1], got {value!r}") from None
    if not (0.0 < d <= 1.0) or math.isnan(d):
        raise DejavuError(f"--{name.replace('_', '-')} must be in (0, 1], got {value!r}")
    return d


# The lookahead decision (docs/predictors.md): layer l's predictors read layer l-1's
# attention input, which exists before layer l-1 starts, so they can run on a side stream
# one layer ahead. Same-layer inputs are more accurate but serialise prediction.
DEFAULT_PREDICTOR_INPUT = MappingProxyType({"source": "attn_in", "lookahead": 1})
PREDICTOR_SOURCES = ("attn_in", "mlp_in")
SENSITIVITY_DTYPES = ("bfloat16", "float32")  # matmuls of the sensitivity pass (BuildConfig.sensitivity_dtype)
ALLOCATIONS = ("sensitivity", "uniform")  # per-layer K: measured (knapsack) | the same fraction everywhere
# MLP rows per token: off = each layer's K for every token; share = a per-token K, the rows whose
# predicted share is >= theta_l, at most 2 K_l, mean K_l on the held-out windows (compiler/token_k.py;
# opt-mini, heads dense, 8,192 WikiText-2 test tokens: docs/predictors.md, "Per-token K in engines")
TOKEN_K_FORMS = ("off", "share")
# the measure a per-token K's thresholds are fitted to (compiler/token_k.py), the default first: read = mean
# rows read 2 K_l, fc1's kept rows + fc2's kept rows with h != 0 (fc2 runs over h's nonzero rows only,
# compacted first where runtime.ops.skips_zero, so the count is the bytes fc2 reads); selected = mean kept rows K_l.
# opt-mini, heads dense, int8 predictors, 32,704 WikiText-2 test tokens (2-core CPU, 2026-12-05): MLP 0.1 / 0.2
# +3.66 / +0.35% (selected) vs +1.52 / +0.03% (read); the whole OPT-30B step at batch 1, d0.1 (H100 80GB HBM3,
# 2026-12-05, commit 424623d, benchmarks/gpu/compact_ab.sh): 4.197 ms vs fixed K 4.006, the per-token K's
# overhead at equal claimed bytes
# (docs/predictors.md, "Default engines: int8 predictors, rows read, fc2 over nonzero rows (2026-12-05)")
TOKEN_K_ROWS = ("read", "selected")
# How the MLP predictors' A [r, D] and B [F, r] are stored: int8 = symmetric int8 with one fp16 scale a row
# (the bias in the engine dtype), at the rank the byte budget pays for in those bytes (about twice the
# float rank); float = the engine dtype. opt-mini, heads dense, 32,704 WikiText-2 test tokens: MLP 0.1
# +6.83% -> +3.66%, 0.2 +1.16% -> +0.35% over dense (docs/predictors.md, "int8 predictors at twice the rank").
# Head predictors stay float: their rank is capped at H (a linear map to H scores), so bytes buy no rank.
PREDICTOR_DTYPES = ("int8", "float")
# TensorRT's TopK takes k <= 3840: a larger K is emitted in the ONNX graphs as TopK in rounds
# (compiler/passes/_graph.py).
TENSORRT_TOPK_LIMIT = 3840


def check_predictor_input(source, lookahead) -> None:
    """attn_in with lookahead 0 or 1, or mlp_in with lookahead 1 (a layer's own mlp_in does not
    exist before its attention runs, so it cannot choose that attention's heads)."""
    if source not in PREDICTOR_SOURCES or lookahead not in (0, 1) or (source, lookahead) == ("mlp_in", 0):
        raise DejavuError("predictor input must be attn_in with lookahead 0|1, or mlp_in with lookahead 1; "
                          f"got {source!r}, {lookahead!r}")


def check_predictor_dtype(value) -> None:
    if value not in PREDICTOR_DTYPES:
        raise DejavuError(f"--predictor-dtype must be one of {', '.join(PREDICTOR_DTYPES)}, got {value!r}")


@dataclass
class CalibSettings:
    """What a calibration run reads; the defaults suit small models on CPU."""

    calib_tokens: int = 65536
    window: int = 512  # tokens per window (capped at the model's max positions)
    batch_size: int = 4  # windows per forward (does not change the result's key)
    corpus: str | None = None  # None: the shipped WikiText-2 train head
    cache_dir: str | None = None  # None: $DEJAVU_CACHE/calib or ~/.cache/dejavu/calib

    def key_fields(self) -> dict:
        return {"calib_tokens": self.calib_tokens, "window": self.window}


@dataclass
class PredictorSettings:
    """Predictor training settings; the one place for their defaults."""

    mlp_rank: int | None = None  # None: the budget spent per layer (predictors.mlp_ranks); an int: that rank everywhere
    attn_rank: int | None = None  # None: min(H, budget) (rank > H adds nothing to a linear map)
    cost_budget: float = 0.10  # predictor bytes / bytes of the dense layers they govern (counted as stored)
    dtype: str = PREDICTOR_DTYPES[0]  # the MLP predictors' storage (PREDICTOR_DTYPES); heads stay float
    # The budget rank grows with the model (1144 at OPT-30B: 82 MB a layer, as many bytes as
    # the sparse MLP reads at density 0.1); DejaVu's predictors stay near rank 1000 even at
    # 175B. Above this cap, extra rank costs decode bandwidth for little recall. Counted in float
    # bytes: int8 predictors are capped at twice this rank (the same bytes).
    max_auto_rank: int = 512
    source: str = DEFAULT_PREDICTOR_INPUT["source"]
    lookahead: int = DEFAULT_PREDICTOR_INPUT["lookahead"]
    attn_label_density: float = 0.5  # head labels: top ceil(this * H) heads by norm
    lr: float = 3e-3
    batch_tokens: int = 2048
    # BCE epochs after the least-squares start (0: least squares only), early-stopped on held-out
    # recall (patience). opt-mini, MLP 0.3 / heads 1.0, WikiText-2 perplexity vs dense: 1 epoch
    # +2.17%, 2 +1.29%, 4 +0.83%, 8 +0.60% (BENCHMARKS.md, 2026-12-04)
    max_epochs: int = 8
    patience: int = 1
    holdout: float = 0.1  # fraction of the stream (tail windows) held out
    max_pos_weight: float = 50.0
    ridge: float = 1e-3  # ridge of the least-squares initialisation (times the token count)
    report_density: float = 0.3  # K for the recall/precision report when none is given
    # MLP early stopping: held-out contribution in the top K of this density (the small K
    # where predictors differ; near K = N every epoch captures everything)
    stop_density: float = 0.1
    curve_tokens: int = 1024  # held-out tokens used for the recall-vs-K curves
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        check_predictor_input(self.source, self.lookahead)
        check_predictor_dtype(self.dtype)
        for name in ("mlp_rank", "attn_rank"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise DejavuError(f"{name} must be a positive integer, got {v}")

    @property
    def predictor_input(self) -> dict:
        return {"source": self.source, "lookahead": self.lookahead}


@dataclass
class BuildConfig:
    """Every setting of a build; defaults defined here (and in the calibration/predictor settings)."""

    # fraction of the dense decode step's weight bytes read per token (allocate.ByteCosts); no
    # default: give it, or max_ppl_increase, or both mlp_density and attn_density (validate)
    density: float | None = None
    mlp_density: float | None = None  # fixes the MLP: this fraction of neurons (the budget goes to heads)
    attn_density: float | None = None  # fixes attention: this fraction of heads
    max_ppl_increase: float | None = None  # percent: search the least density within it (held-out windows)
    # held-out text for sensitivity, the allocation check and the recorded accuracy: a corpus like
    # --calib (past the calibration stream where it is the same); None: the shipped WikiText-2
    # validation head (allocate.DEFAULT_HELDOUT), never trained on, never the test text
    heldout: str | None = None
    heldout_tokens: int = 2048  # tokens of each held-out set (sensitivity; combined engines on a second set)
    # matmuls of the sensitivity pass (allocate.measure_sensitivity; the combined engines' held-out
    # figures stay float32): on opt-mini's 133 branches bfloat16 autocast moved each single-layer loss
    # increase by 0.084 of its paired standard error over the 2,048 tokens (median; at most 0.0015
    # nats) and took 47.8 s of CPU time against 80.4 s on one thread (2026-12-05,
    # benchmarks/sensitivity_dtype.py, docs/compiler.md "Allocation").
    # (--sensitivity-dtype float32 suits a CPU without bfloat16 instructions, AVX512-BF16 / AMX, not measured here)
    sensitivity_dtype: str = "bfloat16"
    # GiB the sensitivity pass's branch states may hold (allocate.measure_sensitivity_passes: more
    # passes over the layers where they do not fit; the result is the same); None: half the free
    # memory of the device (allocate.SENSITIVITY_FREE_SHARE)
    sensitivity_memory_gib: float | None = None
    dtype: str = "float16"  # engine weight dtype: float16 | bfloat16 | float32
    # calibration forward (layers and carried residuals): float32, or float16 | bfloat16 to halve
    # the device memory of a layer and of the residuals (docs/compiler.md: recall vs float32)
    compute_dtype: str = "float32"
    device: str = PredictorSettings.device  # where calibration and predictor training run; the engine's target
    calib: str | None = CalibSettings.corpus  # corpus: text file, .jsonl, folder, hf:NAME; None = shipped
    calib_tokens: int = CalibSettings.calib_tokens
    calib_window: int = CalibSettings.window
    mlp_rank: int | None = PredictorSettings.mlp_rank  # None: largest within the cost budget
    attn_rank: int | None = PredictorSettings.attn_rank
    predictor_source: str = DEFAULT_PREDICTOR_INPUT["source"]  # attn_in | mlp_in
    predictor_lookahead: int = DEFAULT_PREDICTOR_INPUT["lookahead"]  # 0 | 1
    predictor_epochs: int = PredictorSettings.max_epochs
    predictor_dtype: str = PredictorSettings.dtype  # MLP predictors: int8 (a scale a row) | float (engine dtype)
    allocation: str = ALLOCATIONS[0]  # sensitivity
    # Llama: held-out evaluations of the joint refinement of the per-kind skips (allocate_llama.refine_skips;
    # the start's included); 0 or 1: off
    refine_evals: int = 24
    # Llama: rotate the residual stream before the TEAL thresholds (compiler/rotate_llama.py), the
    # given number of channels of largest mean square kept as they are, fitted on the calib_tokens
    # calibration tokens after the thresholds' (build_llama.calibration_windows); None: no rotation. Off by
    # default: on SmolLM2-135M it wins at 40% and 50% skipped but loses at 25% (docs/llama.md)
    rotate_keep: int | None = None
    # Llama: Adam steps of sparsity-aware distillation after the allocation (compiler/distill_llama.py:
    # every block weight and norm trained to the dense model's own outputs under the TEAL masks,
    # distill_batch windows of calibration text a step; the thresholds calibrated again after); 0: off.
    # Off by default: it costs a training run (SmolLM2-135M at 40% skipped, 1,000 steps: +8.4% -> +2.2%
    # perplexity, 3 min on an H100 or 40 min on two CPU cores; docs/llama.md)
    distill_steps: int = 0
    # Llama: windows of calibration text a distillation step (8 x 1,000 steps: an engine at SmolLM2-135M's
    # 40% +1.33% where 1 x 1,000 measured +2.28%, the same minutes on an H100; the corpus needs steps x batch
    # windows past the calibration and held-out tokens; docs/llama.md)
    distill_batch: int = 1
    no_predictors: bool = False  # dense engine (only with density 1.0)
    topk_limit: int = TENSORRT_TOPK_LIMIT  # largest K of one ONNX TopK node (larger K: chunked)
    seed: int = PredictorSettings.seed  # of predictor training
    tp: int = 1  # tensor-parallel ranks: one engine file per rank (docs/tensor_parallel.md)
    # None: "share" where the engine can carry it (an OPT engine of one rank; its --onnx-out graphs
    # too), "off" elsewhere (resolve_token_k_form); the header's settings record the form resolved
    token_k: str | None = None
    # what a per-token K's held-out mean spends the layer's budget on (TOKEN_K_ROWS, read); the header's
    # bytes_per_token counts the same rows (headers before the field record "selected")
    token_k_rows: str = TOKEN_K_ROWS[0]

    def __post_init__(self):
        self.validate()

    def validate(self) -> "BuildConfig":
        if self.density is not None:
            self.density = check_density(self.density)
        if self.mlp_density is not None:
            self.mlp_density = check_density(self.mlp_density, "mlp_density")
        if self.attn_density is not None:
            self.attn_density = check_density(self.attn_density, "attn_density")
        self.dtype = canonical_dtype(self.dtype)
        cdt = DTYPE_ALIASES.get(str(self.compute_dtype).lower())
        if cdt is None:
            raise DejavuError(f"--compute-dtype must be one of float32, float16, bfloat16; got {self.compute_dtype!r}")
        self.compute_dtype = cdt
        self.device = canonical_device(self.device)
        for name in ("calib_tokens", "calib_window", "predictor_epochs", "topk_limit", "tp", "heldout_tokens",
                     "distill_batch"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise DejavuError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("mlp_rank", "attn_rank"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise DejavuError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.sensitivity_dtype not in SENSITIVITY_DTYPES:
            raise DejavuError(f"--sensitivity-dtype must be one of {', '.join(SENSITIVITY_DTYPES)}, "
                              f"got {self.sensitivity_dtype!r}")
        m = self.sensitivity_memory_gib
        if m is not None and (type(m) not in (int, float) or not m > 0 or math.isinf(m)):
            raise DejavuError(f"--sensitivity-memory-gib must be a positive number, got {m!r}")
        if self.allocation not in ALLOCATIONS:
            raise DejavuError(f"--allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")
        if type(self.refine_evals) is not int or self.refine_evals < 0:
            raise DejavuError(f"--refine-evals must be a non-negative integer, got {self.refine_evals!r}")
        if type(self.distill_steps) is not int or self.distill_steps < 0:
            raise DejavuError(f"--distill-steps must be a non-negative integer, got {self.distill_steps!r}")
        k = self.rotate_keep
        if k is not None and (type(k) is not int or k < 0):
            raise DejavuError(f"--rotate-keep must be a non-negative integer, got {k!r}")
        if self.token_k is not None and self.token_k not in TOKEN_K_FORMS:
            raise DejavuError(f"--token-k must be one of {', '.join(TOKEN_K_FORMS)}, got {self.token_k!r}")
        if self.token_k == "share" and self.tp > 1:
            raise DejavuError("--token-k share is not supported with --tp > 1")
        if self.token_k_rows not in TOKEN_K_ROWS:
            raise DejavuError(f"--token-k-rows must be one of {', '.join(TOKEN_K_ROWS)}, got {self.token_k_rows!r}")
        if self.max_ppl_increase is not None:
            p = self.max_ppl_increase
            try:
                p = float(p)
            except (TypeError, ValueError):
                p = math.nan
            if not 0.0 <= p <= 1000.0:
                raise DejavuError(f"--max-ppl-increase must be a percentage in [0, 1000], got {self.max_ppl_increase!r}")
            self.max_ppl_increase = p
            if self.no_predictors:
                raise DejavuError("--max-ppl-increase needs predictors (--no-predictors builds a dense engine)")
        check_predictor_input(self.predictor_source, self.predictor_lookahead)
        check_predictor_dtype(self.predictor_dtype)
        dense = self.density in (None, 1.0) and self.mlp_density in (None, 1.0) and self.attn_density in (None, 1.0)
        if self.no_predictors and not dense:
            raise DejavuError("--no-predictors needs --density 1.0 (a sparse engine needs predictors)")
        if self.density is None and self.max_ppl_increase is None and \
                (self.mlp_density is None or self.attn_density is None):
            raise DejavuError("one of --density or --max-ppl-increase is required (or both --mlp-density and "
                              "--attn-density)")
        return self

    @property
    def predictor_input(self) -> dict:
        return {"source": self.predictor_source, "lookahead": self.predictor_lookahead}

    def resolve_token_k_form(self, opt: bool) -> str:
        """token_k as given, or for None: "share" for an OPT engine of one rank (its ONNX graphs carry
        the same rule), "off" elsewhere. Given "share" where it cannot be carried, or token_k_rows other
        than the default without a per-token K: DejavuError."""
        can = opt and self.tp == 1
        if self.token_k == "share" and not can:
            raise DejavuError("--token-k share needs an OPT model (Llama-family engines have no predictors)")
        form = self.token_k or ("share" if can else "off")
        if form == "off" and self.token_k_rows != TOKEN_K_ROWS[0]:
            raise DejavuError(f"--token-k-rows {self.token_k_rows} needs a per-token K (--token-k share: an OPT "
                              "engine of one rank)")
        return form

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "BuildConfig":
        if not isinstance(d, dict):
            raise DejavuError("build config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DejavuError(f"unknown build config key(s): {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "BuildConfig":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise DejavuError(f"build config is not valid JSON: {e}") from None
        return cls.from_dict(d)

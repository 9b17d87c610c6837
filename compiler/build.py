"""Engine build: model → calibrate → train predictors → per-layer K → (ONNX + passes) → `.engine`.

`BuildConfig` holds every build setting once (the CLI reads its defaults from it) and
round-trips JSON, rejecting unknown keys. `build_engine` runs the stages, times them, and
writes the engine with `dejavu.engine_file.write_engine` (atomic, deterministic bytes: seeded
training, CPU-deterministic ops, no timestamps or absolute paths in the header).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dejavu.compiler.calibrate import CalibSettings
from dejavu.compiler.density import check_density
from dejavu.compiler.predictors import DEFAULT_PREDICTOR_INPUT, PredictorSettings
from dejavu.engine_file import DTYPE_NAMES, FORMAT_NAME, FORMAT_VERSION, write_engine
from dejavu.errors import DejavuError

_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
                  "float": "float32", **{k: k for k in DTYPE_NAMES}}


@dataclass
class BuildConfig:
    """Every setting of a build; defaults defined here (and in the calibration/predictor settings)."""

    density: float = 0.5  # fraction of the dense decode step's weight bytes read per token (allocate.ByteCosts)
    mlp_density: float | None = None  # fixes the MLP: this fraction of neurons (the budget goes to heads)
    attn_density: float | None = None  # fixes attention: this fraction of heads
    max_ppl_increase: float | None = None  # percent: search the least density within it (held-out windows)
    heldout_tokens: int = 2048  # corpus tokens after the calibration stream: sensitivity and accuracy
    dtype: str = "float16"  # engine weight dtype: float16 | bfloat16 | float32
    device: str = "cpu"  # where calibration and predictor training run; the engine's target
    calib: str | None = CalibSettings.corpus  # corpus: text file, .jsonl, folder, hf:NAME; None = shipped
    calib_tokens: int = CalibSettings.calib_tokens
    calib_window: int = CalibSettings.window
    mlp_rank: int | None = PredictorSettings.mlp_rank  # None: largest within the cost budget
    attn_rank: int | None = PredictorSettings.attn_rank
    predictor_source: str = DEFAULT_PREDICTOR_INPUT["source"]  # attn_in | mlp_in
    predictor_lookahead: int = DEFAULT_PREDICTOR_INPUT["lookahead"]  # 0 | 1
    predictor_epochs: int = PredictorSettings.max_epochs
    allocation: str = "sensitivity"  # per-layer K: "sensitivity" (measured, knapsack) | "uniform" (even)
    no_predictors: bool = False  # dense engine (only with density 1.0)
    topk_limit: int = 3840  # TensorRT TopK limit: larger K is emitted as chunked TopK in ONNX
    seed: int = 0
    tp: int = 1  # tensor-parallel ranks: one engine file per rank (docs/tensor_parallel.md)

    def __post_init__(self):
        self.validate()

    def validate(self) -> "BuildConfig":
        self.density = check_density(self.density)
        if self.mlp_density is not None:
            self.mlp_density = check_density(self.mlp_density, "mlp_density")
        if self.attn_density is not None:
            self.attn_density = check_density(self.attn_density, "attn_density")
        dt = _DTYPE_ALIASES.get(str(self.dtype).lower())
        if dt is None:
            raise DejavuError(f"--dtype must be one of float16, bfloat16, float32; got {self.dtype!r}")
        self.dtype = dt
        if not (self.device == "cpu" or str(self.device).startswith("cuda")):
            raise DejavuError(f"--device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("calib_tokens", "calib_window", "predictor_epochs", "topk_limit", "tp", "heldout_tokens"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise DejavuError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("mlp_rank", "attn_rank"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise DejavuError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.allocation not in ("sensitivity", "uniform"):
            raise DejavuError(f"--allocation must be 'sensitivity' or 'uniform', got {self.allocation!r}")
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
        if self.predictor_source not in ("attn_in", "mlp_in") or self.predictor_lookahead not in (0, 1) \
                or (self.predictor_source, self.predictor_lookahead) == ("mlp_in", 0):
            raise DejavuError("predictor input must be attn_in with lookahead 0|1, or mlp_in with lookahead 1; "
                              f"got {self.predictor_source!r}, {self.predictor_lookahead!r}")
        dense = self.density == 1.0 and self.mlp_density in (None, 1.0) and self.attn_density in (None, 1.0)
        if self.no_predictors and not dense:
            raise DejavuError("--no-predictors needs --density 1.0 (a sparse engine needs predictors)")
        return self

    @property
    def predictor_input(self) -> dict:
        return {"source": self.predictor_source, "lookahead": self.predictor_lookahead}

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


# ------------------------------------------------------------------------------- layout

def kernel_layout(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense weights in the engine's kernel layout (docs/ARCHITECTURE.md), cast to dtype.

    Transforms run in fp32 before the cast (so the folded 1/sqrt(hd) rounds once)."""
    cfg, dec = model.config, model.decoder
    D, hd = cfg.hidden_size, cfg.head_dim
    f = lambda t: t.detach().to(device="cpu", dtype=torch.float32)
    bias = lambda lin, n: f(lin.bias) if lin.bias is not None else torch.zeros(n)
    ln = lambda m: (f(m.weight) if m.weight is not None else torch.ones(D),
                    f(m.bias) if m.bias is not None else torch.zeros(D))
    out = {"embed_tokens": f(dec.embed_tokens.weight), "embed_positions": f(dec.embed_positions.weight)}
    if dec.project_in is not None:
        out["project_in"] = f(dec.project_in.weight)  # [D, E]
        out["project_out"] = f(dec.project_out.weight)  # [E, D]
    if dec.final_layer_norm is not None:
        out["final_ln.weight"], out["final_ln.bias"] = ln(dec.final_layer_norm)
    scale = hd**-0.5
    for l, layer in enumerate(dec.layers):
        p, a = f"layers.{l}.", layer.self_attn
        out[p + "ln_attn.weight"], out[p + "ln_attn.bias"] = ln(layer.self_attn_layer_norm)
        out[p + "ln_mlp.weight"], out[p + "ln_mlp.bias"] = ln(layer.final_layer_norm)
        out[p + "attn.wq"] = f(a.q_proj.weight) * scale
        out[p + "attn.bq"] = bias(a.q_proj, D) * scale
        out[p + "attn.wkv"] = torch.cat([f(a.k_proj.weight), f(a.v_proj.weight)])  # [2D, D]
        out[p + "attn.bkv"] = torch.cat([bias(a.k_proj, D), bias(a.v_proj, D)])
        out[p + "attn.wo_t"] = f(a.out_proj.weight).T
        out[p + "attn.bo"] = bias(a.out_proj, D)
        out[p + "mlp.w1"] = f(layer.fc1.weight)  # [F, D]
        out[p + "mlp.b1"] = bias(layer.fc1, cfg.ffn_dim)
        out[p + "mlp.w2_t"] = f(layer.fc2.weight).T  # [F, D]
        out[p + "mlp.b2"] = bias(layer.fc2, D)
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def target_info(device: str) -> dict:
    """The target device, its architecture (sm_XY on CUDA) and the kernels' settings."""
    if not str(device).startswith("cuda"):
        return {"device": "cpu", "arch": None, "kernel_settings": {}}
    if not torch.cuda.is_available():
        raise DejavuError(f"--device {device} requested but no CUDA device is available")
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    settings = {}
    try:
        from dejavu.plugins import kernel_settings
        settings = kernel_settings()
    except ImportError:
        pass
    return {"device": "cuda", "arch": f"sm_{major}{minor}", "name": torch.cuda.get_device_name(device),
            "kernel_settings": settings}


# ------------------------------------------------------------------------------- stages

class _Stages:
    """Times each stage and prints one line per stage to stderr when progress is on."""

    def __init__(self, progress: bool):
        self.progress, self.times, self._t = progress, {}, None

    def __call__(self, name: str):
        self._name = name
        return self

    def __enter__(self):
        if self.progress:
            print(f"[dejavu-compile] {self._name} ...", file=sys.stderr, flush=True)
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        self.times[self._name] = round(time.perf_counter() - self._t, 3)


def _tokenizer_json(folder: Path, tokenizer) -> str:
    tj = folder / "tokenizer.json"
    return tj.read_text(encoding="utf-8") if tj.is_file() else tokenizer.to_str()


def _recall_at(curves, ks) -> list[float | None]:
    if not curves:
        return [None] * len(ks)
    return [round(float(c[k - 1]), 6) for c, k in zip(curves, ks)]


def _check_inputs(model_name_or_path, config: BuildConfig) -> None:
    """Cheap checks before any progress output: the model resolves, the corpus exists."""
    from dejavu.models.presets import resolve

    resolve(model_name_or_path)
    c = config.calib
    if c is not None and not str(c).startswith("hf:") and not Path(str(c)).expanduser().exists():
        raise DejavuError(f"corpus {c!r} not found (a text file, .jsonl, folder of .txt, or hf:NAME[:CONFIG[:SPLIT]])")


def _check_output(out_path) -> Path:
    out = Path(out_path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise DejavuError(f"output path {out} is a folder, expected a file name")
    if not folder.is_dir():
        raise DejavuError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise DejavuError(f"output folder is not writable: {folder}")
    return out


def _corpus_name(corpus) -> str | None:
    """The shipped corpus by its package-relative name (no install path in the header)."""
    from dejavu.compiler.text import DATA_DIR

    if corpus is None:
        return None
    try:
        return "dejavu/data/" + Path(corpus).resolve().relative_to(DATA_DIR.resolve()).as_posix()
    except ValueError:
        return str(corpus)


def train_stage(model, tokenizer, model_id: str, config: BuildConfig, progress: bool, stages: _Stages):
    """Calibrate (cached) and train predictors; returns the `Predictors`."""
    from dejavu.compiler.calibrate import calibrate
    from dejavu.compiler.predictors import train_predictors

    with stages("calibrate"):
        cal = calibrate(model, tokenizer, CalibSettings(calib_tokens=config.calib_tokens,
                                                        window=config.calib_window, corpus=config.calib),
                        model_id=model_id, progress=progress)
    with stages("train predictors"):
        ps = PredictorSettings(mlp_rank=config.mlp_rank, attn_rank=config.attn_rank,
                               source=config.predictor_source, lookahead=config.predictor_lookahead,
                               max_epochs=config.predictor_epochs, seed=config.seed, device=config.device,
                               report_density=config.density)
        torch.manual_seed(config.seed)
        predictors = train_predictors(cal, ps, progress=progress)
    predictors.metrics["calibration"] = {"corpus": _corpus_name(cal.manifest.get("corpus")), "n_tokens": cal.n_tokens,
                                         "window": cal.window,
                                         "tokens_fingerprint": cal.manifest.get("tokens_fingerprint")}
    return predictors


def build_engine(model_name_or_path, config: BuildConfig, out_path, onnx_out=None, progress: bool = True,
                 predictors=None) -> dict:
    """Build `out_path` (.engine) from a model folder / preset / hub id; return a summary dict.

    `predictors` (a `dejavu.compiler.predictors.Predictors`) skips calibration and training
    (tests pass random ones). `onnx_out`: folder for the dense, form-(a) and plugin-form graphs.
    """
    config = BuildConfig.from_dict(config.to_dict())  # validated copy
    out = _check_output(out_path)
    if onnx_out is not None and Path(onnx_out).exists() and not Path(onnx_out).is_dir():
        raise DejavuError(f"--onnx-out {onnx_out} exists and is not a folder")
    target = target_info(config.device)  # fails early when CUDA is asked for and absent
    _check_inputs(model_name_or_path, config)
    stages = _Stages(progress)
    t_start = time.perf_counter()
    if target["device"] == "cpu":  # CPU kernels are deterministic already (and the switch imports dynamo: 8 s)
        return _build(model_name_or_path, config, out, onnx_out, progress, predictors, target, stages, t_start)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _build(model_name_or_path, config, out, onnx_out, progress, predictors, target, stages, t_start)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _build(model_name_or_path, config, out, onnx_out, progress, predictors, target, stages, t_start) -> dict:
    from dejavu.models.loader import load_model, load_tokenizer
    from dejavu.models.presets import resolve

    with stages("load model"):
        folder = resolve(model_name_or_path)
        model, cfg = load_model(folder, dtype=torch.float32, device=config.device)
        tokenizer = load_tokenizer(folder)
    if config.tp > 1:  # before the long stages
        from dejavu.compiler.tensor_parallel import check_tp
        check_tp(cfg.num_attention_heads, cfg.ffn_dim, config.tp)
    if predictors is None and not config.no_predictors:
        from dejavu.compiler.allocate import check_budget
        from dejavu.compiler.predictors import default_ranks
        check_budget(cfg, config, default_ranks(cfg, PredictorSettings(mlp_rank=config.mlp_rank,
                                                                         attn_rank=config.attn_rank)))
        predictors = train_stage(model, tokenizer, str(model_name_or_path), config, progress, stages)
    with stages("resolve K"):  # byte budget -> per-layer K, held-out accuracy (compiler/allocate.py)
        from dejavu.compiler.allocate import model_parts, resolve_k
        from dejavu.compiler.calibrate import model_fingerprint

        mlp_k, attn_k, allocation = resolve_k(lambda: model_parts(model), cfg, config, predictors, tokenizer,
                                              model_fingerprint(model, str(model_name_or_path)), progress)
        config.density = allocation["density"]  # the searched one with --max-ppl-increase
    if onnx_out is not None:
        with stages("export ONNX + passes"):
            onnx_report = export_graphs(model, predictors, mlp_k, attn_k, config, Path(onnx_out))
    with stages("kernel layout"):
        dtype = DTYPE_NAMES[config.dtype]
        tensors = kernel_layout(model, dtype)
        if predictors is not None:
            tensors.update({k: v.detach().cpu().to(dtype).contiguous()
                            for k, v in predictors.state_dict().items()})
    header = make_header(model_name_or_path, cfg, config, target, predictors, mlp_k, attn_k,
                         _tokenizer_json(folder, tokenizer), allocation)
    with stages("write engine"):
        if config.tp > 1:  # one file per rank, named by dejavu.shards.shard_path
            from dejavu.compiler.tensor_parallel import write_shards
            size, files = write_shards(out, header, tensors, config.tp)
            out = f"{files[0]} .. {files[-1]} (tp={config.tp}, sizes summed)"
        else:
            size = write_engine(out, header, tensors)
    n_pred = sum(v.numel() for k, v in tensors.items() if ".pred_" in k)
    elem = torch.tensor([], dtype=DTYPE_NAMES[config.dtype]).element_size()
    summary = {"engine": str(out), "engine_bytes": size, "predictor_bytes": n_pred * elem,
               "weight_bytes": sum(v.numel() for v in tensors.values()) * elem - n_pred * elem,
               "mlp_k": mlp_k, "attn_k": attn_k, "ffn_dim": cfg.ffn_dim, "num_heads": cfg.num_attention_heads,
               "predictor_recall": header["build_config"]["predictor_recall"],
               "predictor_input": header["build_config"]["predictor_input"],
               "density": config.density, "bytes_per_token": allocation["bytes_per_token"],
               "heldout": allocation["heldout"], "allocation": config.allocation,
               "stage_seconds": stages.times, "total_seconds": round(time.perf_counter() - t_start, 3),
               "dtype": config.dtype, "target": target}
    if onnx_out is not None:
        summary["onnx"] = onnx_report
    return summary


def make_header(model_name_or_path, cfg, config: BuildConfig, target: dict, predictors, mlp_k, attn_k,
                tokenizer_json: str, allocation: dict | None = None) -> dict:
    """The engine header (docs/compiler.md lists the fields); JSON-only, no timestamps or paths."""
    rc = predictors.recall_curves if predictors is not None else {}
    pred_sd = predictors.state_dict() if predictors is not None else {}
    rank = lambda kind: int(pred_sd[f"layers.0.pred_{kind}.a"].shape[0]) if pred_sd else None
    name = str(model_name_or_path)
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "model": Path(name).name if Path(name).is_dir() else name,
        "model_config": cfg.to_hf_dict(), "dtype": config.dtype, "target": target,
        "build_config": {
            # density: the byte fraction; mlp_/attn_density: the fraction of neurons / heads kept (mean of K/N)
            "density": config.density, "mlp_density": round(sum(mlp_k) / (cfg.ffn_dim * len(mlp_k)), 4),
            "attn_density": round(sum(attn_k) / (cfg.num_attention_heads * len(attn_k)), 4),
            "mlp_k": mlp_k, "attn_k": attn_k,
            "predictors": predictors is not None,
            "predictor_rank_mlp": rank("mlp"), "predictor_rank_attn": rank("attn"),
            "predictor_input": dict(predictors.predictor_input) if predictors is not None else None,
            "predictor_recall": {"mlp": _recall_at(rc.get("mlp"), mlp_k), "attn": _recall_at(rc.get("attn"), attn_k)},
            "calibration": predictors.metrics.get("calibration") if predictors is not None else None,
            "allocation": config.allocation,
            # bytes read per decode token and the held-out perplexity measured at build (allocate.py)
            "bytes_per_token": (allocation or {}).get("bytes_per_token"),
            "heldout": (allocation or {}).get("heldout"),
            "settings": config.to_dict(),
        },
        "tokenizer_json": tokenizer_json,
    }


def export_graphs(model, predictors, mlp_k, attn_k, config: BuildConfig, out_dir: Path) -> dict:
    """Write dense, form-(a) and plugin-form prefill/decode graphs; check form (a) in ORT.

    Files: {prefill,decode}.onnx (dense), {prefill,decode}.sparse.onnx (standard ops),
    {prefill,decode}.plugin.onnx (dejavu custom-domain nodes)."""
    from dejavu.compiler.onnx_export import build_dense_graph, check_model, save_model
    from dejavu.compiler.passes import PassSettings, run_passes

    out_dir.mkdir(parents=True, exist_ok=True)
    sd = predictors.state_dict() if predictors is not None else {}
    pi = predictors.predictor_input if predictors is not None else config.predictor_input
    files = {}
    for mode in ("prefill", "decode"):
        dense = check_model(build_dense_graph(model, mode))
        files[f"{mode}.onnx"] = dense
        for form in ("standard", "plugin"):
            st = PassSettings(mlp_k=mlp_k, attn_k=attn_k, predictors=sd, predictor_input=pi, form=form,
                              topk_limit=config.topk_limit)
            g = run_passes(dense, st)
            g = check_model(g) if form == "standard" else g
            files[f"{mode}.{'sparse' if form == 'standard' else 'plugin'}.onnx"] = g
    for name, g in files.items():
        save_model(g, out_dir / name)
    report = {"dir": str(out_dir), "files": sorted(files)}
    try:
        report["form_a_max_abs_diff"] = check_form_a(model, files["prefill.sparse.onnx"], predictors,
                                                     mlp_k, attn_k)
    except ImportError:
        report["form_a_max_abs_diff"] = None  # onnxruntime not installed
    return report


def check_form_a(model, graph, predictors, mlp_k, attn_k, seq: int = 16) -> float:
    """max |ORT(form a) - masked-dense PyTorch| of the logits on a fixed token sequence."""
    import numpy as np

    from dejavu.compiler.masking import masked_sparsity
    from dejavu.compiler.onnx_export import run_onnxruntime

    cfg = model.config
    ids = torch.arange(seq, dtype=torch.int64)[None] * 7919 % cfg.vocab_size  # fixed, spread tokens
    ids = ids[:, :min(seq, cfg.max_position_embeddings)]
    ort_logits = run_onnxruntime(graph, {"input_ids": ids.numpy()})["logits"]
    m32 = model.float().cpu()
    with torch.no_grad():
        if predictors is None:
            ref = m32(ids)
        else:
            with masked_sparsity(m32, mlp_k, attn_k, "predicted", predictors.to("cpu", torch.float32)):
                ref = m32(ids)
    d = float(np.abs(ort_logits - ref.numpy()).max())
    return d if math.isfinite(d) else float("inf")

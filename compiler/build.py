"""Engine build: model → calibrate → train predictors → per-layer K → (ONNX + passes) → `.engine`.

`BuildConfig` holds every build setting once (the CLI reads its defaults from it) and
round-trips JSON, rejecting unknown keys. `build_engine` runs the stages, times them, and
writes the engine with `dejavu.engine_file.write_engine` (atomic, deterministic bytes: seeded
training, CPU-deterministic ops, no timestamps or absolute paths in the header).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dejavu.cli_common import DTYPE_ALIASES as _DTYPE_ALIASES  # the one alias table (fp16, bf16, ...)
from dejavu.compiler.calibrate import CalibSettings
from dejavu.compiler.density import check_density
from dejavu.compiler.predictors import (DEFAULT_PREDICTOR_INPUT, PREDICTOR_FORM, PREDICTOR_TARGETS,
                                        PredictorSettings)
from dejavu.engine_file import DTYPE_NAMES, FORMAT_NAME, FORMAT_VERSION
from dejavu.errors import DejavuError


@dataclass
class BuildConfig:
    """Every setting of a build; defaults defined here (and in the calibration/predictor settings)."""

    density: float = 0.5  # fraction of the dense decode step's weight bytes read per token (allocate.ByteCosts)
    mlp_density: float | None = None  # fixes the MLP: this fraction of neurons (the budget goes to heads)
    attn_density: float | None = None  # fixes attention: this fraction of heads
    max_ppl_increase: float | None = None  # percent: search the least density within it (held-out windows)
    heldout_tokens: int = 2048  # corpus tokens after the calibration stream: sensitivity and accuracy
    dtype: str = "float16"  # engine weight dtype: float16 | bfloat16 | float32
    # calibration forward (layers and carried residuals): float32, or float16 | bfloat16 to halve
    # the device memory of a layer and of the residuals (docs/compiler.md: recall vs float32)
    compute_dtype: str = "float32"
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
        cdt = _DTYPE_ALIASES.get(str(self.compute_dtype).lower())
        if cdt is None:
            raise DejavuError(f"--compute-dtype must be one of float32, float16, bfloat16; got {self.compute_dtype!r}")
        self.compute_dtype = cdt
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


# ------------------------------------------------------------------------------- target

def target_info(device: str) -> dict:
    """The target device, its architecture (sm_XY on CUDA) and the kernels' settings resolved for it
    (plugins.resolve_kernel_settings; the runtime reads them back, plugins.KernelSettings.from_dict)."""
    if not str(device).startswith("cuda"):
        return {"device": "cpu", "arch": None, "kernel_settings": {}}
    if not torch.cuda.is_available():
        raise DejavuError(f"--device {device} requested but no CUDA device is available")
    from dejavu.plugins import resolve_kernel_settings

    dev = torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    arch, sms = f"sm_{major}{minor}", torch.cuda.get_device_properties(dev).multi_processor_count
    return {"device": "cuda", "arch": arch, "name": torch.cuda.get_device_name(device),
            "kernel_settings": resolve_kernel_settings(arch, sms).to_dict()}


# ------------------------------------------------------------------------------- stages

class _Stages:
    """Sums the seconds of each stage (a stage recurs once per layer) and prints a line on a
    stage's first entry to stderr when progress is on."""

    def __init__(self, progress: bool):
        self.progress, self.times, self._t = progress, {}, None

    def __call__(self, name: str):
        self._name = name
        return self

    def __enter__(self):
        if self.progress and self._name not in self.times:
            print(f"[dejavu-compile] {self._name} ...", file=sys.stderr, flush=True)
        self.times.setdefault(self._name, 0.0)
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        self.times[self._name] = round(self.times[self._name] + time.perf_counter() - self._t, 3)


def _tokenizer_json(folder: Path, tokenizer) -> str:
    tj = folder / "tokenizer.json"
    return tj.read_text(encoding="utf-8") if tj.is_file() else tokenizer.to_str()


def _chat_template(folder: Path) -> str | None:
    """tokenizer_config.json's `chat_template` (a Jinja string; dejavu-serve's chat endpoint), if any."""
    tc = folder / "tokenizer_config.json"
    if not tc.is_file():
        return None
    try:
        t = json.loads(tc.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, AttributeError):
        return None
    return t if isinstance(t, str) and t else None


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


def _calibration(tokenizer, cfg, config: BuildConfig) -> dict:
    """The calibration token stream and how it is cut into windows and forward batches."""
    from dejavu.compiler.stream import calib_batches
    from dejavu.compiler.text import corpus_tokens, fingerprint_tokens

    window = min(config.calib_window, cfg.max_position_embeddings)
    if window < 2:
        raise DejavuError(f"calibration window must be at least 2 tokens, got {window}")
    ids, corpus = corpus_tokens(tokenizer, config.calib, config.calib_tokens, bos_id=cfg.bos_token_id)
    return {"ids": ids, "window": window, "n_windows": -(-len(ids) // window),
            "batches": calib_batches(len(ids), window, CalibSettings.batch_size),
            "header": {"corpus": _corpus_name(corpus), "n_tokens": int(len(ids)), "window": window,
                       "tokens_fingerprint": fingerprint_tokens(ids)}}


def _predictor_settings(config: BuildConfig) -> PredictorSettings:
    return PredictorSettings(mlp_rank=config.mlp_rank, attn_rank=config.attn_rank, source=config.predictor_source,
                             lookahead=config.predictor_lookahead, max_epochs=config.predictor_epochs,
                             seed=config.seed, device=config.device)  # predictors do not depend on the budget


def _state_key(ckpt, config: BuildConfig, calib, predictors) -> dict:
    """Every input that changes a layer's bytes (density enters through the report K that
    early stopping reads); not the per-layer K, which lives in the header."""
    from dejavu.compiler.stream import file_fingerprint

    given = None
    if predictors is not None:
        h = hashlib.sha256()
        for name, t in sorted(predictors.state_dict().items()):
            h.update(name.encode() + t.detach().float().cpu().numpy().tobytes())
        given = h.hexdigest()
    return {"config": ckpt.cfg.to_hf_dict(), "files": file_fingerprint(ckpt.files), "dtype": config.dtype,
            "device": config.device, "compute_dtype": config.compute_dtype, "given_predictors": given,
            "calibration": None if calib is None else {**calib["header"], "batch": CalibSettings.batch_size},
            "training": None if calib is None else dataclasses.asdict(_predictor_settings(config))}


def stream_layers(ckpt, config: BuildConfig, state, calib, predictors, progress: bool, stages) -> None:
    """Spill the shell and every layer (kernel layout + predictors) to `state`, one layer in
    memory at a time; resumes after the last finished layer (docs/compiler.md, "Streaming")."""
    from dejavu.compiler.layout import layer_layout, shell_layout
    from dejavu.compiler.predictors import default_ranks, holdout_split, mlp_contributions, train_layer
    from dejavu.compiler.stream import (embed_tokens, predictor_input_of, predictor_tensors, records_needed,
                                        run_layer)
    from dejavu.models.loader import iter_decoder_layers, load_decoder_shell

    cfg, dtype, dev = ckpt.cfg, DTYPE_NAMES[config.dtype], torch.device(config.device)
    cdt = DTYPE_NAMES[config.compute_dtype]
    L, done = cfg.num_hidden_layers, state.layers_done
    x = prev = None
    if calib is not None:
        ps = _predictor_settings(config)
        src, la = ps.source, ps.lookahead
        ranks = default_ranks(cfg, ps)
        report_k = (max(1, round(ps.report_density * cfg.ffn_dim)), max(1, round(ps.report_density *
                                                                                 cfg.num_attention_heads)))
        split = holdout_split(len(calib["ids"]), calib["n_windows"], calib["window"], ps)
        gen = torch.Generator().manual_seed(ps.seed)
    if done == 0:
        with stages("embeddings"):
            dec = load_decoder_shell(ckpt, torch.float32, dev)
            state.save_part("shell", shell_layout(dec, cfg, dtype), {})
            if calib is not None:
                x = embed_tokens(dec, calib["ids"], calib["batches"], torch.float32, dev).to(cdt)
            del dec
    elif calib is not None:
        carry = state.load_carry(done, dev)
        x, prev = carry["hidden"], carry.get("prev")
        gen.set_state(carry["gen"].cpu())
    # fp32 compute reads the layers in fp32; a half compute dtype reads them as stored, takes the
    # layout from those (exact) weights, then casts the layer in place for the forward.
    it = iter_decoder_layers(ckpt, torch.float32 if cdt == torch.float32 else None, dev, start=done)
    while True:
        t0 = time.perf_counter()
        with stages("load layers"):
            l, layer = next(it, (None, None))
        if layer is None:
            break
        pm = pa = None
        info = {}
        with stages("kernel layout"):
            tensors = layer_layout(layer, l, cfg, dtype)
        if calib is not None:
            with stages("calibrate"):
                rec = run_layer(layer.to(cdt), x, calib["batches"], cfg, records_needed(l, src, la))
            with stages("train predictors"):
                xin = predictor_input_of(l, rec, prev, src, la).to(ps.device).float()
                contrib = mlp_contributions(layer, rec["mlp_in"]).to(ps.device)  # [T, F] fp32
                pm, pa, row, curves = train_layer(xin, rec["mlp_active"].to(ps.device), contrib,
                                                  rec["head_norm"].to(ps.device), split, ranks, report_k, ps, gen)
                info = {"metrics": row, "curves": {k: v.tolist() for k, v in curves.items()}}
                prev = rec.get(src) if la else None
                del rec, xin, contrib
        elif predictors is not None:
            pm, pa = predictors.mlp[l], predictors.attn[l]
        del layer
        with stages("kernel layout"):
            state.save_part(f"layer_{l:05d}", {**tensors, **predictor_tensors(l, dtype, pm, pa)}, info)
            del tensors
            carry = {} if calib is None else {"hidden": x, "gen": gen.get_state(),
                                              **({"prev": prev} if prev is not None else {})}
            state.save_carry(l + 1, carry)
        if progress:
            print(f"[dejavu-compile] layer {l + 1}/{L} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
                  flush=True)


def _streamed_parts(ckpt, device: str):
    """parts() -> (layers, embed, head) for compiler.allocate, the layers read one at a time from
    the checkpoint in fp32 (each pass re-reads them: the whole model is never in memory)."""
    import types

    from dejavu.compiler.allocate import model_parts
    from dejavu.models.loader import iter_decoder_layers, load_decoder_shell

    def parts():
        dec = load_decoder_shell(ckpt, torch.float32, device)
        shell = types.SimpleNamespace(decoder=dec, lm_head=lambda x: x @ dec.embed_tokens.weight.T)  # tied
        _, embed, head = model_parts(shell)
        layers = (layer for _, layer in iter_decoder_layers(ckpt, torch.float32, device))
        return layers, (lambda ids: embed(ids.to(device))), (lambda x: head(x).cpu())

    return parts


def _spilled_predictors(state, cfg, info: dict, device: str):
    """The trained predictors (fp32, from the finished layers' files) as one `Predictors`."""
    from dejavu.compiler.predictors import Predictors

    sd = {}
    for l in range(cfg.num_hidden_layers):
        sd.update({n[len("fp32."):]: t for n, t in state.tensors(f"layer_{l:05d}", prefix="fp32.").items()})
    p = Predictors.from_state_dict(sd, info["input"]).to(device)
    p.recall_curves = info["curves"]
    return p


def _predictor_info(state, cfg, config: BuildConfig, calib, predictors) -> dict | None:
    """What the header records about the predictors, from the finished layers' files."""
    if predictors is not None:
        return {"ranks": (int(predictors.mlp[0]["a"].shape[0]), int(predictors.attn[0]["a"].shape[0])),
                "input": dict(predictors.predictor_input), "curves": predictors.recall_curves or {},
                "calibration": predictors.metrics.get("calibration")}
    if calib is None:
        return None
    from dejavu.compiler.predictors import default_ranks

    curves, rows = {"mlp": [], "attn": []}, []
    for l in range(cfg.num_hidden_layers):
        info = state.part_info(f"layer_{l:05d}")["info"]
        for kind in curves:
            curves[kind].append(info["curves"][kind])
        rows.append({"layer": l, **info["metrics"]})
    return {"ranks": default_ranks(cfg, _predictor_settings(config)), "input": config.predictor_input,
            "curves": curves, "calibration": calib["header"], "per_layer": rows}


def _build(model_name_or_path, config, out, onnx_out, progress, predictors, target, stages, t_start) -> dict:
    from dejavu.compiler.stream import BuildState, calib_bytes, gpu_peak_bytes, in_memory, rss_peak_bytes
    from dejavu.engine_file import write_engine_parts
    from dejavu.models.loader import Checkpoint, load_tokenizer
    from dejavu.models.presets import resolve

    with stages("open checkpoint"):
        folder = resolve(model_name_or_path)
        ckpt = Checkpoint(folder)  # every key and shape checked before the long stages
        cfg = ckpt.cfg
        tokenizer = load_tokenizer(folder)
    if config.tp > 1:  # before the long stages
        from dejavu.compiler.tensor_parallel import check_tp
        check_tp(cfg.num_attention_heads, cfg.ffn_dim, config.tp)
    calib = _calibration(tokenizer, cfg, config) if predictors is None and not config.no_predictors else None
    if calib is not None:  # a budget below the least engine fails before the long stages
        from dejavu.compiler.allocate import check_budget
        from dejavu.compiler.predictors import default_ranks
        check_budget(cfg, config, default_ranks(cfg, _predictor_settings(config)))
    state = BuildState(out, _state_key(ckpt, config, calib, predictors))
    resumed = state.layers_done
    stream_layers(ckpt, config, state, calib, predictors, progress, stages)
    info = _predictor_info(state, cfg, config, calib, predictors)
    with stages("resolve K"):  # byte budget -> per-layer K, held-out accuracy (compiler/allocate.py)
        from dejavu.compiler.allocate import resolve_k
        from dejavu.compiler.stream import file_fingerprint

        preds = predictors if predictors is not None or info is None else \
            _spilled_predictors(state, cfg, info, config.device)
        if preds is not None:
            preds = preds.to(config.device)
        key = json.dumps({"model": str(model_name_or_path), "files": file_fingerprint(ckpt.files)}, sort_keys=True)
        mlp_k, attn_k, allocation = resolve_k(_streamed_parts(ckpt, config.device), cfg, config, preds, tokenizer,
                                              key, progress)
        config.density = allocation["density"]  # the searched one with --max-ppl-increase
        del preds
    header = make_header(model_name_or_path, cfg, config, target, info, mlp_k, attn_k,
                         _tokenizer_json(folder, tokenizer), allocation)
    if onnx_out is not None:
        with stages("export ONNX + passes"):
            onnx_report = _export_onnx(folder, state, cfg, info, mlp_k, attn_k, config, Path(onnx_out))
    chat = _chat_template(folder)
    if chat is not None:  # only then: headers of models without one are unchanged
        header["chat_template"] = chat
    state_bytes = state.nbytes()
    parts = state.parts("shell", consume=True)
    for l in range(cfg.num_hidden_layers):
        parts.update(state.parts(f"layer_{l:05d}", prefix="layers.", consume=True))
    with stages("write engine"):
        if config.tp > 1:  # one file per rank, named by dejavu.shards.shard_path (whole engine in memory)
            from dejavu.compiler.tensor_parallel import write_shards
            size, files = write_shards(out, header, in_memory(parts), config.tp)
            out = f"{files[0]} .. {files[-1]} (tp={config.tp}, sizes summed)"
        else:
            size = write_engine_parts(out, header, parts)
    state.remove()
    n_pred = sum(p.nbytes for n, p in parts.items() if ".pred_" in n)
    summary = {"engine": str(out), "engine_bytes": size, "predictor_bytes": n_pred,
               "weight_bytes": sum(p.nbytes for p in parts.values()) - n_pred,
               "mlp_k": mlp_k, "attn_k": attn_k, "ffn_dim": cfg.ffn_dim, "num_heads": cfg.num_attention_heads,
               "predictor_recall": header["build_config"]["predictor_recall"],
               "predictor_input": header["build_config"]["predictor_input"],
               "density": config.density, "bytes_per_token": allocation["bytes_per_token"],
               "heldout": allocation["heldout"], "allocation": config.allocation,
               "stage_seconds": stages.times, "total_seconds": round(time.perf_counter() - t_start, 3),
               "dtype": config.dtype, "target": target, "resumed_at_layer": resumed,
               "peak_host_bytes": rss_peak_bytes(), "peak_gpu_bytes": gpu_peak_bytes(config.device),
               "build_state_bytes": state_bytes,
               "calib_device_bytes": calib_bytes(len(calib["ids"]), cfg) if calib is not None else 0}
    if onnx_out is not None:
        summary["onnx"] = onnx_report
    return summary


def _export_onnx(folder, state, cfg, info, mlp_k, attn_k, config, out_dir: Path) -> dict:
    """--onnx-out: the whole fp32 model in memory (not streamed), predictors in fp32."""
    from dejavu.compiler.predictors import Predictors
    from dejavu.models.loader import load_model

    model, _ = load_model(folder, dtype=torch.float32, device="cpu")
    predictors = None
    if info is not None:
        sd = {}
        for l in range(cfg.num_hidden_layers):
            sd.update({n[len("fp32."):]: t for n, t in state.tensors(f"layer_{l:05d}", prefix="fp32.").items()})
        predictors = Predictors.from_state_dict(sd, info["input"])
    return export_graphs(model, predictors, mlp_k, attn_k, config, out_dir)


def make_header(model_name_or_path, cfg, config: BuildConfig, target: dict, info: dict | None, mlp_k, attn_k,
                tokenizer_json: str, allocation: dict | None = None) -> dict:
    """The engine header (docs/compiler.md lists the fields); JSON-only, no timestamps or paths.

    `info`: None (no predictors) or {"ranks": (mlp, attn), "input": {source, lookahead},
    "curves": {"mlp"|"attn": [L curves]}, "calibration": {...} | None}."""
    rc = info["curves"] if info is not None else {}
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
            "predictors": info is not None,
            "predictor_rank_mlp": info["ranks"][0] if info else None,
            "predictor_rank_attn": info["ranks"][1] if info else None,
            "predictor_input": dict(info["input"]) if info is not None else None,
            # scores = (x @ a.T) @ b.T + bias (engines without the field carry the same form)
            "predictor_form": PREDICTOR_FORM if info is not None else None,
            "predictor_targets": dict(PREDICTOR_TARGETS) if info is not None else None,
            "predictor_recall": {"mlp": _recall_at(rc.get("mlp"), mlp_k), "attn": _recall_at(rc.get("attn"), attn_k)},
            "calibration": info.get("calibration") if info is not None else None,
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

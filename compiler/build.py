"""Engine build: model → calibrate → train predictors → per-layer K → (ONNX + passes) → `.engine`.

`BuildConfig` (compiler/config.py) holds every build setting once. `build_engine` runs the
stages, times them, and writes the engine with `dejavu.engine_file.write_engine` (atomic,
deterministic bytes: seeded training, CPU-deterministic ops, no timestamps or absolute paths
in the header).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from dejavu.compiler.config import BuildConfig, CalibSettings, PredictorSettings
from dejavu.compiler.predictors import PREDICTOR_FORM, PREDICTOR_TARGETS
from dejavu.engine_file import DTYPE_NAMES, FORMAT_NAME, FORMAT_VERSION
from dejavu.errors import DejavuError


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


def layer_target(target: dict, hidden: int, heads: int, mlp_k, attn_k) -> dict:
    """target with each layer's kernel settings (plugins.resolve_layer_settings from the layer's K; the
    runtime reads them per layer) where it records settings for a GPU; a CPU target as it is."""
    if not target.get("kernel_settings"):
        return target
    from dejavu.plugins import KernelSettings, resolve_layer_settings

    base = KernelSettings.from_dict(target["kernel_settings"])
    return {**target, "layer_kernel_settings": resolve_layer_settings(base, hidden, hidden // heads, mlp_k, attn_k)}


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


def _recall_at(curves, ks) -> list[float | None]:
    if not curves:
        return [None] * len(ks)
    return [round(float(c[k - 1]), 6) for c, k in zip(curves, ks)]


def _check_inputs(model_name_or_path, config: BuildConfig) -> None:
    """Cheap checks before any progress output: the model resolves, the corpus exists."""
    from dejavu.models.presets import resolve

    resolve(model_name_or_path)
    for c in (config.calib, config.heldout):
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
    from dejavu.datafiles import DATA_DIR

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
    from dejavu.models.auto import model_type

    opt = model_type(model_name_or_path) == "opt"
    config.token_k = config.resolve_token_k_form(opt)
    if not opt:  # Llama family: TEAL thresholds (compiler/build_llama.py)
        if predictors is not None:
            raise DejavuError("Llama-family engines have no predictors (TEAL thresholds)")
        from dejavu.compiler.build_llama import build_llama_engine
        return build_llama_engine(model_name_or_path, config, out_path, progress, onnx_out)
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
                             seed=config.seed, device=config.device,
                             dtype=config.predictor_dtype)  # predictors do not depend on the budget


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
            "predictor_dtype": config.predictor_dtype,
            "calibration": None if calib is None else {**calib["header"], "batch": CalibSettings.batch_size},
            "training": None if calib is None else dataclasses.asdict(_predictor_settings(config))}


def stream_layers(ckpt, config: BuildConfig, state, calib, predictors, progress: bool, stages) -> None:
    """Spill the shell and every layer (kernel layout + predictors) to `state`, one layer in
    memory at a time; resumes after the last finished layer (docs/compiler.md, "Streaming")."""
    from dejavu.compiler.layout import layer_layout, shell_layout
    from dejavu.compiler.predictors import default_ranks, holdout_split, int8_rows, mlp_ranks, train_layer
    from dejavu.compiler.stream import (embed_tokens, mlp_targets, predictor_input_of, predictor_tensors,
                                        records_needed, run_layer)
    from dejavu.models.loader import iter_decoder_layers, load_decoder_shell

    cfg, dtype, dev = ckpt.cfg, DTYPE_NAMES[config.dtype], torch.device(config.device)
    cdt = DTYPE_NAMES[config.compute_dtype]
    L, done = cfg.num_hidden_layers, state.layers_done
    x = prev = None
    if calib is not None:
        ps = _predictor_settings(config)
        src, la = ps.source, ps.lookahead
        ranks = (mlp_ranks(cfg, ps), default_ranks(cfg, ps)[1])  # ([L] MLP ranks, head rank)
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
                contrib = mlp_targets(layer, rec["mlp_in"], ps.device)  # [T, F] bfloat16
                pm, pa, row, curves = train_layer(xin, rec["mlp_active"].to(ps.device), contrib,
                                                  rec["head_norm"].to(ps.device), split, (ranks[0][l], ranks[1]),
                                                  report_k, ps, gen)
                info = {"metrics": row, "curves": {k: v.tolist() for k, v in curves.items()}}
                prev = rec.get(src) if la else None
                del rec, xin, contrib
        elif predictors is not None:
            pm, pa = predictors.mlp[l], predictors.attn[l]
        if pm is not None and config.predictor_dtype == "int8":
            pm = int8_rows(pm)  # the engine's values from here on (allocation, per-token K, ONNX)
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
    from dejavu.compiler.predictors import default_ranks, mlp_ranks

    if predictors is not None:
        return {"ranks": ([int(p["a"].shape[0]) for p in predictors.mlp], int(predictors.attn[0]["a"].shape[0])),
                "input": dict(predictors.predictor_input), "curves": predictors.recall_curves or {},
                "calibration": predictors.metrics.get("calibration")}
    if calib is None:
        return None

    curves, rows = {"mlp": [], "attn": []}, []
    for l in range(cfg.num_hidden_layers):
        info = state.part_info(f"layer_{l:05d}")["info"]
        for kind in curves:
            curves[kind].append(info["curves"][kind])
        rows.append({"layer": l, **info["metrics"]})
    ps = _predictor_settings(config)
    return {"ranks": (mlp_ranks(cfg, ps), default_ranks(cfg, ps)[1]), "input": config.predictor_input,
            "curves": curves, "calibration": calib["header"], "per_layer": rows}


def _build(model_name_or_path, config, out, onnx_out, progress, predictors, target, stages, t_start) -> dict:
    from dejavu.compiler.stream import BuildState, gpu_peak_bytes, memory_bound, rss_peak_bytes
    from dejavu.engine_file import write_engine_parts
    from dejavu.models.auto import load_sampling_defaults
    from dejavu.models.loader import Checkpoint, load_tokenizer
    from dejavu.models.presets import resolve

    with stages("open checkpoint"):
        folder = resolve(model_name_or_path)
        ckpt = Checkpoint(folder)  # every key and shape checked before the long stages
        cfg = ckpt.cfg
        tokenizer = load_tokenizer(folder)
        sampling = load_sampling_defaults(folder)
    if config.tp > 1:  # before the long stages
        from dejavu.compiler.tensor_parallel import check_tp
        check_tp(config.tp, num_attention_heads=cfg.num_attention_heads, ffn_dim=cfg.ffn_dim)
    calib = _calibration(tokenizer, cfg, config) if predictors is None and not config.no_predictors else None
    if calib is not None:  # a budget below the least engine fails before the long stages
        from dejavu.compiler.allocate import check_budget
        from dejavu.compiler.predictors import default_ranks, mlp_ranks
        ps = _predictor_settings(config)
        mr = mlp_ranks(cfg, ps)
        check_budget(cfg, config, (math.ceil(sum(mr) / len(mr)), default_ranks(cfg, ps)[1]))  # mean MLP rank
    state = BuildState(out, _state_key(ckpt, config, calib, predictors))
    resumed = state.layers_done
    stream_layers(ckpt, config, state, calib, predictors, progress, stages)
    info = _predictor_info(state, cfg, config, calib, predictors)
    with stages("resolve K"):  # byte budget -> per-layer K, held-out accuracy (compiler/allocate.py)
        from dejavu.compiler.allocate import resolve_k
        from dejavu.compiler.stream import file_fingerprint

        # the values the engine carries (given predictors too: int8 rows where the engine stores them)
        preds = None if info is None else _spilled_predictors(state, cfg, info, config.device)
        if preds is not None:
            preds = preds.to(config.device)
        key = json.dumps({"model": str(model_name_or_path), "files": file_fingerprint(ckpt.files)}, sort_keys=True)
        mlp_k, attn_k, allocation = resolve_k(_streamed_parts(ckpt, config.device), cfg, config, preds, tokenizer,
                                              key, progress)
        config.density = allocation["density"]  # the searched one with --max-ppl-increase
    token_k = None
    if config.token_k != "off" and preds is not None and any(k < cfg.ffn_dim for k in mlp_k):
        with stages("fit per-token K"):  # thresholds on held-out windows (compiler/token_k.py)
            from dejavu.compiler.token_k import resolve_token_k

            _, token_k = resolve_token_k(_streamed_parts(ckpt, config.device), cfg, config, preds, tokenizer,
                                         mlp_k, attn_k, allocation)
    del preds
    target = layer_target(target, cfg.hidden_size, cfg.num_attention_heads, mlp_k, attn_k)
    header = make_header(model_name_or_path, cfg, config, target, info, mlp_k, attn_k,
                         _tokenizer_json(folder, tokenizer), allocation, token_k)
    if onnx_out is not None:
        with stages("export ONNX + passes"):
            onnx_report = _export_onnx(ckpt, state, cfg, info, mlp_k, attn_k, config, Path(onnx_out), token_k)
    from dejavu.models.auto import folder_chat_template

    chat = folder_chat_template(folder)
    if chat is not None:  # only then: headers of models without one are unchanged
        header["chat_template"] = chat
    if sampling:  # dejavu-serve's defaults where a request leaves them out
        header["sampling_defaults"] = sampling
    state_bytes = state.nbytes()
    parts = state.parts("shell", consume=True)  # each spilled tensor read once (--tp: for every rank at once)
    for l in range(cfg.num_hidden_layers):
        parts.update(state.parts(f"layer_{l:05d}", prefix="layers.", consume=True))
    with stages("write engine"):
        if config.tp > 1:  # one file per rank, named by dejavu.shards.shard_path, written side by side
            from dejavu.compiler.tensor_parallel import write_shards
            size, files = write_shards(out, header, parts, config.tp)
            out = f"{files[0]} .. {files[-1]} (tp={config.tp}, sizes summed)"
        else:
            size = write_engine_parts(out, header, parts)
    state.remove()
    n_pred = sum(p.nbytes for n, p in parts.items() if ".pred_" in n)
    bound = memory_bound(cfg, len(calib["ids"]) if calib is not None else 0,  # docs/compiler.md, "Streaming"
                         host=config.device == "cpu")
    summary = {"engine": str(out), "engine_bytes": size, "predictor_bytes": n_pred,
               "weight_bytes": sum(p.nbytes for p in parts.values()) - n_pred,
               "mlp_k": mlp_k, "attn_k": attn_k, "ffn_dim": cfg.ffn_dim, "num_heads": cfg.num_attention_heads,
               "predictor_recall": header["build_config"]["predictor_recall"],
               "predictor_input": header["build_config"]["predictor_input"],
               "density": config.density, "bytes_per_token": header["build_config"]["bytes_per_token"],
               "heldout": header["build_config"]["heldout"], "allocation": config.allocation,
               "token_k": token_k,
               "stage_seconds": stages.times, "total_seconds": round(time.perf_counter() - t_start, 3),
               "dtype": config.dtype, "target": target, "resumed_at_layer": resumed,
               "peak_host_bytes": rss_peak_bytes(), "peak_gpu_bytes": gpu_peak_bytes(config.device),
               "build_state_bytes": state_bytes,
               "calib_device_bytes": bound["calib_bytes"], "bound_bytes": bound["bound_bytes"],
               "kept_heap_bytes": bound["kept_heap_bytes"],
               "largest_layer_fp32_bytes": bound["largest_layer_fp32_bytes"]}
    if onnx_out is not None:
        summary["onnx"] = onnx_report
    return summary


def _export_onnx(ckpt, state, cfg, info, mlp_k, attn_k, config, out_dir: Path, token_k: dict | None) -> dict:
    """--onnx-out: the graphs written layer by layer in the engine dtype (compiler/onnx_stream.py),
    each layer's fp32 predictors read back from the build state; the engine's per-token MLP K
    (`token_k`, its header record) in the graphs too."""
    from dejavu.compiler.onnx_stream import write_onnx

    def predictors_of(l):
        return {n[len("fp32."):]: t for n, t in state.tensors(f"layer_{l:05d}", prefix="fp32.").items()}

    pi = info["input"] if info is not None else config.predictor_input
    return write_onnx(ckpt, config.dtype, mlp_k, attn_k, predictors_of if info is not None else None, pi,
                      config.topk_limit, out_dir, token_k)


def make_header(model_name_or_path, cfg, config: BuildConfig, target: dict, info: dict | None, mlp_k, attn_k,
                tokenizer_json: str, allocation: dict | None = None, token_k: dict | None = None) -> dict:
    """The engine header (docs/compiler.md lists the fields); JSON-only, no timestamps or paths.

    `token_k`: the per-token MLP K's record (token_k.resolve_token_k) or None (K_l rows for every
    token; then the header has no `token_k` field, as before it existed). With it the recorded
    bytes per token count the held-out mean kept rows, and the held-out figure is that engine's.

    `info`: None (no predictors) or {"ranks": ([L] mlp, attn), "input": {source, lookahead},
    "curves": {"mlp"|"attn": [L curves]}, "calibration": {...} | None}."""
    rc = info["curves"] if info is not None else {}
    name = str(model_name_or_path)
    header = {
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
            # how A and B are stored per kind: int8 (one fp16 scale a row: .a_scale, .b_scale) or float (the
            # engine dtype); engines without the field carry float predictors
            "predictor_dtype": {"mlp": config.predictor_dtype, "attn": "float"} if info is not None else None,
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
    if token_k is not None:
        bc = header["build_config"]
        bc["token_k"] = token_k
        bc["bytes_per_token"] = token_k["bytes_per_token"]
        held = token_k["heldout"]
        if bc["heldout"] is not None:  # the fixed-K engine's figure stays beside it
            bc["heldout"] = {**bc["heldout"], "fixed_k_engine_ppl": bc["heldout"].get("engine_ppl"),
                             "fixed_k_increase_pct": bc["heldout"].get("increase_pct"),
                             "engine_ppl": held["engine_ppl"], "increase_pct": held.get("increase_pct")}
    return header

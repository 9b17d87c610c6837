"""`dejavu-compile MODEL --density D ...` and `dejavu-inspect FILE.engine [--json]`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from dejavu.cli_common import Parser, add_device, add_dtype, add_quiet
from dejavu.compiler.config import (ALLOCATIONS, PREDICTOR_DTYPES, PREDICTOR_SOURCES, SENSITIVITY_DTYPES, TOKEN_K_FORMS,
                                    TOKEN_K_ROWS, BuildConfig)
from dejavu.compiler.summary import accuracy_lines, format_summary, token_k_line
from dejavu.errors import DejavuError, cli_entry

# glibc malloc hands a freed block of more than 128 KiB-32 MiB (its dynamic threshold) back to the kernel,
# and the next block of that size faults in fresh zeroed pages. The build allocates and frees tensors of
# 12-50 MB thousands of times (the predictors' training steps, the sensitivity branches): the default
# build of opt-mini took 8.6 M page faults. Blocks up to 1 GiB stay in the heap for reuse instead
# (`reuse_freed_memory`), as GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...
# would; the arithmetic, and so the engine, is unchanged (docs/predictors.md, "Build time"). The memory
# bound counts the kept heap (stream.memory_bound): the OPT-1.3B shape's build peaked at 2.09 GiB with it,
# past the 1.85 GiB of the bound without it. A 128 MiB trim threshold kept the bound but lost most of the
# time (opt-mini 116.1 s, 3.6 M page faults, against 108 s and 0.44 M).
MALLOC_KEEP_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def reuse_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to MALLOC_KEEP_BYTES for this process (`dejavu-compile`
    only: a library call never changes its caller's allocator). False where the C library has no
    mallopt or refuses (not glibc), and nothing changes."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MALLOC_KEEP_BYTES) and mallopt(_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES)):
        return False
    from dejavu.compiler.stream import set_kept_heap

    set_kept_heap(MALLOC_KEEP_BYTES)  # the memory bound counts what the heap now keeps (docs/compiler.md)
    return True


class _CompileParser(Parser):
    """Options that set a `BuildConfig` field default to SUPPRESS, so `args` holds only what
    was given (a --config file fills the rest, then BuildConfig's defaults). --help shows those
    defaults, read from BuildConfig's fields (compiler/config.py: no torch)."""

    def format_help(self):
        defaults = {f.name: f.default for f in dataclasses.fields(BuildConfig)}
        for a in self._actions:
            if a.default is argparse.SUPPRESS and a.dest in defaults and not a.required:
                a.default = defaults[a.dest]
        return super().format_help()


def compile_parser() -> argparse.ArgumentParser:
    p = _CompileParser("dejavu-compile", "Build a DejaVu sparse .engine file from an OPT or Llama-family model.")
    S = argparse.SUPPRESS  # a BuildConfig field: its default lives there (shown by --help)
    p.add_argument("model", help="preset name (opt-mini, opt-125m, smollm2-135m, ...), model folder, .gguf file "
                                 "or Hugging Face id")
    p.add_argument("--density", default=S,
                   help="fraction of the dense decode step's weight bytes read per token, in (0, 1] "
                        "(spent across layers, heads and neurons by --allocation; unused when both "
                        "--mlp-density and --attn-density fix K)")
    p.add_argument("--max-ppl-increase", default=S, metavar="P",
                   help="instead of --density: the least byte budget whose engine stays within P percent "
                        "of dense perplexity on held-out calibration windows")
    p.add_argument("-o", "--output", default=None, help="engine path (default: MODEL-NAME.engine here)")
    p.add_argument("--mlp-density", default=S,
                   help="fix the fraction of MLP neurons kept (the byte budget goes to heads)")
    p.add_argument("--attn-density", default=S,
                   help="fix the fraction of heads kept, spread across layers by measured held-out loss "
                        "(evenly with the uniform allocation); the byte budget goes to neurons")
    p.add_argument("--heldout", default=S, metavar="CORPUS",
                   help="held-out text for sensitivity and the recorded accuracy, a corpus like --calib "
                        "(default: the shipped WikiText-2 validation head)")
    p.add_argument("--heldout-tokens", type=int, default=S, metavar="N",
                   help="held-out tokens (after the calibration stream where --heldout is the --calib corpus)")
    p.add_argument("--refine-evals", type=int, default=S, metavar="N",
                   help="Llama: held-out evaluations of the joint refinement of the per-kind skips (0: off)")
    p.add_argument("--rotate-keep", type=int, default=S, metavar="K",
                   help="Llama: rotate the residual stream into its principal components before the TEAL "
                        "thresholds, keeping the K channels of largest mean square (default: no rotation)")
    p.add_argument("--distill-steps", type=int, default=S, metavar="N",
                   help="Llama: train the block weights and norms for N steps to the dense model's own outputs "
                        "under the TEAL masks (sparsity-aware distillation; the thresholds calibrated again "
                        "after; default 0: off; SmolLM2-135M at 40%% skipped: 1000 steps, docs/llama.md)")
    p.add_argument("--distill-batch", type=int, default=S, metavar="B",
                   help="Llama: windows of calibration text a distillation step (the corpus needs "
                        "steps x B windows of 256 tokens past the calibration tokens)")
    p.add_argument("--calib", default=S, metavar="CORPUS",
                   help="calibration corpus: text file, .jsonl, folder of .txt or hf:NAME "
                        "(default: the shipped WikiText-2 head)")
    p.add_argument("--calib-tokens", type=int, default=S, metavar="N", help="calibration tokens")
    p.add_argument("--calib-window", type=int, default=S, metavar="N",
                   help="tokens per calibration window (capped at the model's positions)")
    add_dtype(p, S, "engine weight dtype")
    add_device(p, S, "where calibration and predictor training run; the engine's target: cpu | cuda | cuda:N")
    p.add_argument("--compute-dtype", default=S, choices=["float32", "float16", "bfloat16"],
                   help="calibration forward dtype (half: less device memory)")
    p.add_argument("--mlp-rank", type=int, default=S, metavar="R",
                   help="MLP predictor rank (default: the largest within the predictor cost budget)")
    p.add_argument("--attn-rank", type=int, default=S, metavar="R",
                   help="head predictor rank (default: min(heads, the cost budget))")
    p.add_argument("--predictor-source", default=S, choices=PREDICTOR_SOURCES,
                   help="the activation the predictors read")
    p.add_argument("--predictor-lookahead", type=int, default=S, choices=[0, 1],
                   help="1: predict a layer's sets from the previous layer (overlaps on a side stream)")
    p.add_argument("--predictor-epochs", type=int, default=S, metavar="N",
                   help="training epochs after the least-squares start (0: least squares only)")
    p.add_argument("--predictor-dtype", default=S, choices=PREDICTOR_DTYPES,
                   help="MLP predictor storage: int8 = int8 with an fp16 scale a row, at the rank the byte budget "
                        "pays for in those bytes (about twice float's); float = the engine dtype (head predictors "
                        "are float either way)")
    p.add_argument("--allocation", default=S, choices=ALLOCATIONS,
                   help="sensitivity: by measured held-out loss per byte (OPT: K per layer and kind; Llama: one "
                        "TEAL skip per projection input); uniform: the same fraction everywhere")
    p.add_argument("--sensitivity-dtype", default=S, choices=SENSITIVITY_DTYPES,
                   help="matmuls of the sensitivity pass (the recorded held-out figures are float32; float32 "
                        "on CPUs without bfloat16 instructions)")
    p.add_argument("--sensitivity-memory-gib", type=float, default=S, metavar="GIB",
                   help="cap on the sensitivity pass's branch states (more passes over the layers, the same "
                        "result; default: half the device's free memory)")
    p.add_argument("--token-k", default=S, choices=TOKEN_K_FORMS,
                   help="share: a per-token MLP K (the rows whose predicted share passes a per-layer threshold, "
                        "at most 2 K per layer, mean K on the held-out windows; the --onnx-out graphs carry it "
                        "too); off: K rows for every token, a fixed-K graph (default: share for an OPT engine "
                        "of one rank, off elsewhere)")
    p.add_argument("--token-k-rows", default=S, choices=TOKEN_K_ROWS,
                   help="what the per-token K's held-out mean spends each layer's budget on: selected = K kept "
                        "rows; read = 2 K rows read, fc1's kept rows + fc2's nonzero ones (fc2 runs over h's "
                        "nonzero rows); the header's bytes per token count the same rows")
    p.add_argument("--no-predictors", action="store_true", default=S,
                   help="dense engine without predictors (needs --density 1.0)")
    p.add_argument("--topk-limit", type=int, default=S, metavar="K",
                   help="largest K of one TopK node in the ONNX graphs (TensorRT's limit; larger K is chunked)")
    p.add_argument("--seed", type=int, default=S, help="seed of predictor training")
    p.add_argument("--tp", type=int, default=S, metavar="N",
                   help="tensor-parallel ranks: writes OUT.rank{r}-of-{N}.engine per rank, or -o with {rank}")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="BuildConfig JSON file; command-line options override it")
    p.add_argument("--onnx-out", default=None, metavar="DIR",
                   help="folder for the ONNX graphs (dense, form a, plugin form)")
    p.add_argument("--summary-json", default=None, metavar="FILE", help="also write the summary as JSON to this file")
    p.add_argument("--tune", action="store_true",
                   help="Llama engines built on a GPU: then time their launch shapes there and record the fastest "
                        "in the engine (what dejavu-tune does to an engine file; with --tp, rank 0's shard timed alone "
                        "and its settings given to every rank)")
    add_quiet(p, "no progress bars or log lines (the summary still prints)")
    return p


def _config(args):
    """BuildConfig from the options given, over the --config file, over BuildConfig's defaults."""
    fields = {f.name for f in dataclasses.fields(BuildConfig)}
    base = {}
    if args.config:
        try:
            base = BuildConfig.from_json(Path(args.config).read_text()).to_dict()
        except OSError as e:
            raise DejavuError(f"--config {args.config}: {e.strerror or e}") from None
    given = {k: v for k, v in vars(args).items() if k in fields}
    if "density" in given and "max_ppl_increase" in given:
        raise DejavuError("give --density or --max-ppl-increase, not both")
    if "density" in given:  # the command line's choice wins over the file's
        base.pop("max_ppl_increase", None)
    return BuildConfig.from_dict({**base, **given})


def _output_path(args) -> Path:
    if args.output:
        return Path(args.output)
    return Path(Path(str(args.model).rstrip("/")).name + ".engine")


@cli_entry
def main(argv=None) -> int:
    args = compile_parser().parse_args(argv)
    out = _output_path(args)
    if args.summary_json and Path(args.summary_json).resolve() == out.resolve():
        raise DejavuError("--summary-json must differ from the engine path")
    config = _config(args)
    if args.tune:
        from dejavu.models.auto import model_type

        if not str(config.device).startswith("cuda"):
            raise DejavuError("--tune times launches on the GPU the engine is built on: it needs --device cuda")
        if model_type(args.model) == "opt":
            raise DejavuError("--tune: only Llama-family engines have launch shapes to tune")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    from dejavu.compiler.build import build_engine

    reuse_freed_memory()
    summary = build_engine(args.model, config, out, onnx_out=args.onnx_out, progress=not args.quiet)
    if summary.get("model_family") == "llama":
        from dejavu.compiler.build_llama import format_llama_summary
        print(format_llama_summary(summary))
    else:
        print(format_summary(summary))
    if args.tune:
        from dejavu.runtime.tune import tune_file

        from dejavu.shards import shard_path

        files = [shard_path(out, r, config.tp) for r in range(config.tp)] if config.tp > 1 else [out]
        # every rank's shard has the same shapes: rank 0's tuned alone (no all-reduce), its settings given to all
        tuned = tune_file(files[0], device=config.device, say=None if args.quiet else print, same_for=files[1:])
        summary["tuned"] = {"gpu": tuned["gpu"], "step_ms": tuned["step_ms"]}
        print(f"tuned       {tuned['step_ms'][0]:.3f} -> {tuned['step_ms'][1]:.3f} ms a decode step on {tuned['gpu']}")
    if args.summary_json:
        from dejavu.fileio import write_json
        write_json(args.summary_json, summary, indent=2, sort_keys=True)
    return 0


def inspect_parser() -> argparse.ArgumentParser:
    p = Parser("dejavu-inspect", "Print a dejavu .engine file's header; without --header-only the whole file is "
                                 "read and its checksum verified, and the tensors are listed.")
    p.add_argument("engine", help="FILE.engine")
    p.add_argument("--json", action="store_true",
                   help="the header as JSON, the tokenizer summarised (chars, sha256); with the file's tensor "
                        "count and size unless --header-only")
    p.add_argument("--full", action="store_true",
                   help="with --json: the whole tokenizer.json string and every tensor's dtype and shape")
    p.add_argument("--header-only", action="store_true",
                   help="read only the header (fast; no checksum, no tensor list)")
    return p


def _tokenizer_summary(h: dict) -> dict:
    import hashlib

    tj = h.get("tokenizer_json") or ""
    return {"chars": len(tj), "sha256": hashlib.sha256(tj.encode("utf-8")).hexdigest()}


def _tensor_lines(tensors: dict) -> list[str]:
    """The tensors outside the layers, and layer 0's (every layer holds the same names)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()})
    lines = [f"tensors     {len(tensors)} ({nbytes / 2**20:.2f} MiB, {', '.join(dtypes)}); checksum verified"]
    shown = [n for n in tensors if not n.startswith("layers.") or n.startswith("layers.0.")]
    for n in sorted(shown):
        t = tensors[n]
        lines.append(f"  {n:<36} {str(t.dtype).replace('torch.', ''):<9} {list(t.shape)}")
    if len(shown) < len(tensors):
        lines.append("  (layers.1 ... hold the same names as layers.0)")
    return lines


def _tuned_text(target: dict) -> str:
    """', tuned on GPU (date): before -> after ms a decode step, the changes kept' where dejavu-tune ran."""
    tu = target.get("tuned")
    if not isinstance(tu, dict):
        return ""
    kept = [f"{x['where']}.{x['field']}={x['value']}" for x in tu.get("trials", []) if x.get("outcome") == "kept"]
    before, after = (tu.get("step_ms") or [0.0, 0.0])[:2]
    return (f", tuned on {tu.get('gpu')} ({str(tu.get('date_utc', ''))[:10]}): {before:.3f} -> {after:.3f} ms a "
            f"decode step; kept {', '.join(kept) or 'nothing'}")


def format_llama_header(h: dict, path: str, size: int) -> str:
    """dejavu-inspect's lines for a Llama-family engine (TEAL thresholds per layer and input)."""
    mc, bc, sp, t = h["model_config"], h.get("build_config", {}), h["sparsity"], h.get("target", {})
    b = bc.get("bytes_per_token") or {}
    lines = [f"{path}: {h['format']} v{h['format_version']}, {size / 2**20:.2f} MiB",
             f"model       {h.get('model')} (family llama, {mc.get('model_type')}): {mc['num_hidden_layers']} layers, "
             f"hidden {mc['hidden_size']}, intermediate {mc['intermediate_size']}, heads {mc['num_attention_heads']} "
             f"/ kv {mc['num_key_value_heads']}, vocab {mc['vocab_size']}",
             f"dtype       {h.get('dtype')}",
             f"target      {t.get('device')} arch={t.get('arch')}" + _tuned_text(t),
             f"density     {bc.get('density')} of the bytes ({b.get('fraction')} read: {b.get('engine')} of "
             f"{b.get('dense')} bytes per token; allocation {bc.get('allocation')})"]
    h_out = bc.get("heldout")
    if h_out:
        lines += accuracy_lines(bc.get("density"), bc.get("allocation"), None, h_out)
    skips = sp.get("skips") or {k: sp["skip"] for k in sp["thresholds"]}  # engines before per-input skips
    lines.append(f"sparsity    {sp['method']}: {sp['skip']} of the block bytes skipped ("
                 + ", ".join(f"{k} {v}" for k, v in skips.items()) + "), thresholds per layer:")
    keys = list(sp["thresholds"])
    lines.append(f"{'layer':>5} " + " ".join(f"{k:>9}" for k in keys))
    for l in range(mc["num_hidden_layers"]):
        lines.append(f"{l:>5} " + " ".join(f"{sp['thresholds'][k][l]:>9.4f}" for k in keys))
    if bc.get("calibration"):
        lines.append(f"calibration {json.dumps(bc['calibration'], sort_keys=True)}")
    tok = _tokenizer_summary(h)
    lines.append(f"tokenizer   {tok['chars']} chars of tokenizer.json, sha256 {tok['sha256'][:16]}")
    return "\n".join(lines)


def format_header(h: dict, path: str, size: int) -> str:
    if h.get("model_family") == "llama":
        return format_llama_header(h, path, size)
    mc, bc, t = h["model_config"], h.get("build_config", {}), h.get("target", {})
    lines = [f"{path}: {h['format']} v{h['format_version']}, {size / 2**20:.2f} MiB",
             f"model       {h.get('model')}: {mc['num_hidden_layers']} layers, hidden {mc['hidden_size']}, "
             f"ffn {mc['ffn_dim']}, heads {mc['num_attention_heads']}, vocab {mc['vocab_size']}",
             f"dtype       {h.get('dtype')}",
             f"target      {t.get('device')} arch={t.get('arch')} kernel_settings={json.dumps(t.get('kernel_settings'))}",
             f"density     {bc.get('density')} of the bytes (neurons kept {bc.get('mlp_density')}, "
             f"heads kept {bc.get('attn_density')})",
             f"mlp_k       {bc.get('mlp_k')}",
             f"attn_k      {bc.get('attn_k')}",
             f"predictors  {bc.get('predictors')} input={bc.get('predictor_input')} "
             f"rank mlp={bc.get('predictor_rank_mlp')} attn={bc.get('predictor_rank_attn')}"]
    lines += accuracy_lines(bc.get("density"), bc.get("allocation"), bc.get("bytes_per_token"), bc.get("heldout"))
    lines += token_k_line(bc.get("token_k"), bc.get("heldout"))
    rec = bc.get("predictor_recall") or {}
    for kind in ("mlp", "attn"):
        if rec.get(kind):
            lines.append(f"recall {kind:<4} " + " ".join("-" if r is None else f"{r:.3f}" for r in rec[kind]))
    if bc.get("calibration"):
        lines.append(f"calibration {json.dumps(bc['calibration'], sort_keys=True)}")
    if bc.get("tp"):
        tp = bc["tp"]
        lines.append(f"tp          shard {tp['rank']} of {tp['size']}: heads {tp['num_heads']}, ffn {tp['ffn_dim']}, "
                     f"k_per_rank mlp {tp['k_per_rank']['mlp']} attn {tp['k_per_rank']['attn']}")
    tok = _tokenizer_summary(h)
    lines.append(f"tokenizer   {tok['chars']} chars of tokenizer.json, sha256 {tok['sha256'][:16]}")
    return "\n".join(lines)


@cli_entry
def inspect_main(argv=None) -> int:
    args = inspect_parser().parse_args(argv)
    if args.full and not args.json:
        raise DejavuError("--full goes with --json (the plain output already lists the tensors)")
    from dejavu.engine_file import read_engine, read_header

    if args.header_only:
        header, tensors = read_header(args.engine), None
    else:
        header, tensors = read_engine(args.engine)
    size = Path(args.engine).stat().st_size
    if args.json:
        obj = dict(header)
        if not args.full:
            obj.pop("tokenizer_json", None)
            obj["tokenizer"] = _tokenizer_summary(header)
        if tensors is not None:
            obj["file"] = {"bytes": size, "checksum": "verified", "tensors": len(tensors)}
            if args.full:
                obj["file"]["tensor_shapes"] = {n: [str(t.dtype).replace("torch.", ""), list(t.shape)]
                                                for n, t in sorted(tensors.items())}
        print(json.dumps(obj, indent=2, sort_keys=True))
    else:
        text = format_header(header, args.engine, size)
        rest = _tensor_lines(tensors) if tensors is not None else ["tensors     not read (--header-only: checksum "
                                                                   "not verified)"]
        print(text + "\n" + "\n".join(rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())

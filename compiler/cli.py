"""`dejavu-compile MODEL --density D ...` and `dejavu-inspect FILE.engine [--json]`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from dejavu.compiler.build import BuildConfig
from dejavu.errors import DejavuError, cli_entry

_D = BuildConfig.__dataclass_fields__  # defaults are defined once, in BuildConfig


def _default(name):
    return _D[name].default


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line DejavuErrors (exit 2 through cli_entry)."""

    def error(self, message):
        raise DejavuError(f"{self.prog}: {message}")


def compile_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dejavu-compile", description="Build a DejaVu sparse .engine file from an OPT model.")
    p.add_argument("model", help="preset name (opt-mini, opt-125m, ...), model folder or Hugging Face id")
    p.add_argument("--density", default=_default("density"),
                   help="fraction of the dense decode step's weight bytes read per token, in (0, 1] "
                        "(spent across layers, heads and neurons by --allocation)")
    p.add_argument("--max-ppl-increase", default=_default("max_ppl_increase"), metavar="P",
                   help="instead of --density: the least byte budget whose engine stays within P percent "
                        "of dense perplexity on held-out calibration windows")
    p.add_argument("-o", "--output", default=None, help="engine path (default: MODEL-NAME.engine here)")
    p.add_argument("--mlp-density", default=_default("mlp_density"),
                   help="fix the fraction of MLP neurons kept (the byte budget goes to heads)")
    p.add_argument("--attn-density", default=_default("attn_density"),
                   help="fix the fraction of heads kept (the byte budget goes to neurons)")
    p.add_argument("--heldout-tokens", type=int, default=_default("heldout_tokens"),
                   help="corpus tokens after the calibration stream, for sensitivity and the recorded accuracy")
    p.add_argument("--calib", default=_default("calib"),
                   help="calibration corpus: text file, .jsonl, folder of .txt or hf:NAME (default: shipped WikiText-2 head)")
    p.add_argument("--calib-tokens", type=int, default=_default("calib_tokens"))
    p.add_argument("--calib-window", type=int, default=_default("calib_window"))
    p.add_argument("--dtype", default=_default("dtype"), help="engine dtype: float16 | bfloat16 | float32")
    p.add_argument("--device", default=_default("device"), help="cpu | cuda[:N] (calibration, training, target)")
    p.add_argument("--mlp-rank", type=int, default=_default("mlp_rank"))
    p.add_argument("--attn-rank", type=int, default=_default("attn_rank"))
    p.add_argument("--predictor-source", default=_default("predictor_source"), choices=["attn_in", "mlp_in"])
    p.add_argument("--predictor-lookahead", type=int, default=_default("predictor_lookahead"), choices=[0, 1])
    p.add_argument("--predictor-epochs", type=int, default=_default("predictor_epochs"))
    p.add_argument("--allocation", default=_default("allocation"), choices=["sensitivity", "uniform"],
                   help="sensitivity: K by measured loss per byte (knapsack); uniform: the same fraction everywhere")
    p.add_argument("--no-predictors", action="store_true", default=_default("no_predictors"),
                   help="dense engine without predictors (needs --density 1.0)")
    p.add_argument("--topk-limit", type=int, default=_default("topk_limit"))
    p.add_argument("--seed", type=int, default=_default("seed"))
    p.add_argument("--tp", type=int, default=_default("tp"),
                   help="tensor-parallel ranks: writes OUT.rank{r}-of-{N}.engine per rank, or -o with {rank}")
    p.add_argument("--config", default=None, help="BuildConfig JSON file; command-line options override it")
    p.add_argument("--onnx-out", default=None, help="folder for the ONNX graphs (dense, form a, plugin form)")
    p.add_argument("--summary-json", default=None, help="also write the summary as JSON to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def _config(args, argv) -> BuildConfig:
    fields = {f.name for f in dataclasses.fields(BuildConfig)}
    base = {}
    if args.config:
        try:
            base = BuildConfig.from_json(Path(args.config).read_text()).to_dict()
        except OSError as e:
            raise DejavuError(f"--config {args.config}: {e.strerror or e}") from None
    given = {a.split("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    if "density" in given and "max_ppl_increase" in given:
        raise DejavuError("give --density or --max-ppl-increase, not both")
    if not ({"density", "max_ppl_increase"} & given) and not args.config:
        raise DejavuError("dejavu-compile: one of --density or --max-ppl-increase is required")
    d = {**{k: v for k, v in vars(args).items() if k in fields}}
    d = {**d, **{k: v for k, v in base.items() if k not in given}} if base else d
    return BuildConfig.from_dict(d)


def _output_path(args) -> Path:
    if args.output:
        return Path(args.output)
    return Path(Path(str(args.model).rstrip("/")).name + ".engine")


def _accuracy_lines(density, allocation, b: dict | None, h: dict | None) -> list[str]:
    """Bytes read per token and the held-out perplexity measured at build (build summary, inspect)."""
    out = []
    if b:
        out.append(f"bytes/token {b['engine'] / 2**20:.3f} MiB of {b['dense'] / 2**20:.3f} MiB dense = "
                   f"{b['fraction']:.4f} (density {density}, allocation {allocation})")
    if h:
        out.append(f"held-out    ppl {h['engine_ppl']:.3f} vs dense {h['dense_ppl']:.3f} ({h['increase_pct']:+.2f}%) "
                   f"on {h['tokens']} tokens: {h['source']}")
    return out


def format_summary(s: dict) -> str:
    mb = lambda n: f"{n / 2**20:.2f} MiB"
    lines = [f"engine      {s['engine']}  ({mb(s['engine_bytes'])}: weights {mb(s['weight_bytes'])}, "
             f"predictors {mb(s['predictor_bytes'])}, {s['dtype']}, target {s['target']['device']}"
             f"{' ' + s['target']['arch'] if s['target'].get('arch') else ''})",
             f"predictors  input {s['predictor_input']}"]
    lines += _accuracy_lines(s.get("density"), s.get("allocation"), s.get("bytes_per_token"), s.get("heldout"))
    rec = s["predictor_recall"]
    lines.append(f"{'layer':>5} {'K_mlp':>7} {'recall':>7} {'K_attn':>7} {'recall':>7}")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    for l, (km, ka) in enumerate(zip(s["mlp_k"], s["attn_k"])):
        lines.append(f"{l:>5} {km:>5}/{s['ffn_dim']:<1} {fmt(rec['mlp'][l]):>7} {ka:>5}/{s['num_heads']:<1} "
                     f"{fmt(rec['attn'][l]):>7}")
    if "onnx" in s:
        o = s["onnx"]
        lines.append(f"onnx        {o['dir']}: {', '.join(o['files'])}; form (a) vs masked dense "
                     f"max |diff| = {o['form_a_max_abs_diff']}")
    lines.append("time        " + ", ".join(f"{k} {v:.1f}s" for k, v in s["stage_seconds"].items())
                 + f"; total {s['total_seconds']:.1f}s")
    return "\n".join(lines)


@cli_entry
def main(argv=None) -> int:
    from dejavu.compiler.build import build_engine

    argv = list(sys.argv[1:] if argv is None else argv)
    args = compile_parser().parse_args(argv)
    config = _config(args, argv)
    out = _output_path(args)
    if args.summary_json and Path(args.summary_json).resolve() == out.resolve():
        raise DejavuError("--summary-json must differ from the engine path")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    summary = build_engine(args.model, config, out, onnx_out=args.onnx_out, progress=not args.quiet)
    print(format_summary(summary))
    if args.summary_json:
        from dejavu.fileio import atomic_path
        with atomic_path(args.summary_json) as tmp:
            Path(tmp).write_text(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def inspect_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dejavu-inspect", description="Print the header of a dejavu .engine file.")
    p.add_argument("engine", help="FILE.engine")
    p.add_argument("--json", action="store_true", help="raw header JSON (tokenizer included)")
    p.add_argument("--header-only", action="store_true",
                   help="read only the header (fast; skips the tensor checksum, names and shapes)")
    return p


def format_header(h: dict, path: str, size: int) -> str:
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
    lines += _accuracy_lines(bc.get("density"), bc.get("allocation"), bc.get("bytes_per_token"), bc.get("heldout"))
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
    lines.append(f"tokenizer   {len(h.get('tokenizer_json') or '')} chars of tokenizer.json")
    return "\n".join(lines)


@cli_entry
def inspect_main(argv=None) -> int:
    from dejavu.engine_file import read_engine, read_header

    args = inspect_parser().parse_args(argv)
    header = read_header(args.engine) if args.header_only else read_engine(args.engine)[0]
    if args.json:
        print(json.dumps(header, indent=2, sort_keys=True))
    else:
        print(format_header(header, args.engine, Path(args.engine).stat().st_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())

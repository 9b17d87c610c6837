"""`dejavu-run FILE.engine --prompt TEXT [--chat]`: generate with a sparse engine, streaming tokens (--chat: the
prompt as a user message in the engine's chat template).
`dejavu-tune FILE.engine`: its launch shapes timed on this GPU and recorded in it (runtime/tune.py).

The parser and every check that needs no model (prompts, sampling values) run before torch
is imported; the prompt length is checked against the engine header before the weights load.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from dejavu.cli_common import (Parser, add_chat, add_device, add_dtype, add_output_format, add_sampling, chat_encoder,
                                check_chat_args)
from dejavu.errors import DejavuError, cli_entry
from dejavu.generation import (GENERATION, check_max_new_tokens, check_openai_penalty, check_repetition_penalty,
                               resolve_temperature)

OUTPUT_FORMATS = ("text", "jsonl", "json")


@dataclass
class RunSettings:
    """Defaults of `dejavu-run` beyond generation's (`dejavu.generation.GenerationSettings`)."""

    device: str = "cpu"
    batch_policy: str | None = None  # shared on CUDA, per_sequence on CPU (runtime/engine.py)


class _TextStream:
    """Prints one sequence's text as tokens arrive (whole characters only)."""

    def __init__(self, tokenizer, out):
        self.tok, self.out, self.ids, self.shown = tokenizer, out, [], ""

    def __call__(self, tokens):
        t = tokens[0]
        if t is None:
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        self.out.write(text[len(self.shown):])
        self.out.flush()
        self.shown = text


def build_parser() -> Parser:
    g, d = GENERATION, RunSettings()
    p = Parser("dejavu-run", "Generate text with a dejavu .engine file.")
    p.add_argument("engine", help="the .engine file (from dejavu-compile)")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--batch-file", metavar="FILE",
                   help="UTF-8 text file, one prompt per line, generated as one batch; a blank line is an "
                        "empty prompt, so output index i is line i (0-based) of the file")
    add_chat(p, "engine's")
    add_sampling(p, g, " per prompt")
    add_device(p, d.device)
    add_dtype(p, None, "run in this dtype instead of the engine's (e.g. float32 on CPU)")
    p.add_argument("--no-overlap", action="store_true", help="run the predictors inline (no side stream)")
    p.add_argument("--batch-policy", default=d.batch_policy, choices=["per_sequence", "shared"],
                   help="one selection per sequence, or one shared by the batch (unset: shared on CUDA, "
                        "per_sequence on CPU)")
    add_output_format(p, OUTPUT_FORMATS,
                      "text: the prompt and its streamed completion (with --batch-file one line per prompt, "
                      "'[i] prompt+completion', newlines shown as \\n); jsonl: one JSON object per prompt "
                      "{index, prompt, completion, tokens}; json: one object {outputs: [...], stats}")
    p.add_argument("--stats", action="store_true",
                   help="print timings at the end (stderr; inside the object with --output-format json)")
    return p


def read_prompts(args) -> list[str]:
    if (args.prompt is None) == (args.batch_file is None):
        raise DejavuError("give exactly one of --prompt TEXT or --batch-file FILE")
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.batch_file)
    if not path.is_file():
        raise DejavuError(f"batch file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DejavuError(f"batch file {path}: not UTF-8 text (byte {e.start})") from None
    if not any(ln.strip() for ln in lines):
        raise DejavuError(f"batch file {path} holds no prompts")
    return lines


def _encode_checked(engine_path: str, prompts: list[str], max_new_tokens: int, chat: bool = False,
                    system: str | None = None) -> list[list[int]]:
    """Token ids of the prompts (chat: each a user message in the engine's chat template), with the prompt length
    checked against the engine header before any weight is read."""
    from dejavu.engine_file import read_header
    from dejavu.models.tokenizer import TextTokenizer, prompt_bos

    header = read_header(engine_path)
    mc = header.get("model_config", {})
    tj = header.get("tokenizer_json")
    if not tj:
        raise DejavuError(f"{engine_path}: this engine carries no tokenizer; dejavu-run needs text prompts tokenised")
    tok = TextTokenizer(tj, mc.get("bos_token_id"), mc.get("eos_token_id"), mc.get("pad_token_id"),
                        add_bos=prompt_bos(header))
    encode = chat_encoder(header.get("chat_template"), tok, system, f"{engine_path}: this engine") if chat \
        else tok.encode
    ids = [encode(p) for p in prompts]
    limit = int(mc.get("max_position_embeddings", 0)) or None
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if limit is not None and len(ids[longest]) + max_new_tokens > limit:
        which = "the prompt" if len(ids) == 1 else f"prompt {longest}"
        raise DejavuError(f"{which} ({len(ids[longest])} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                          f"the model's {limit} positions")
    return ids


def stats_dict(eng) -> dict:
    s = eng.stats
    return {"batch": s.batch, "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
            "decode_steps": s.decode_steps, "setup_ms": round(1e3 * s.setup_s, 3),
            "prefill_ms": round(1e3 * s.prefill_s, 3), "decode_ms": round(1e3 * s.decode_s, 3),
            "ms_per_step": round(s.ms_per_token, 3), "decode_tokens_per_s": round(s.tokens_per_s, 2),
            "engine": {**eng.describe(), **(s.extra or {})}}


def format_stats(d: dict) -> str:
    e = d["engine"]
    return "\n".join([
        f"dejavu-run: batch {d['batch']}, {d['prompt_tokens']} prompt tokens, {d['new_tokens']} new tokens per "
        f"sequence (1 from the prefill, {d['decode_steps']} decode steps)",
        f"dejavu-run: prefill {d['prefill_ms']:.1f} ms; decode {d['ms_per_step']:.2f} ms/step, "
        f"{d['decode_tokens_per_s']:.1f} tokens/s",
        f"dejavu-run: engine {e['layers']} layers, {e['dtype']} on {e['device']}, density mlp {e['mlp_density']} "
        f"attn {e['attn_density']}, kernels {next(iter(e['kernels'].values()), None)}, overlap {e['overlap']}, "
        f"cuda graph {e['cuda_graph']}, batch policy {e['batch_policy']}"])


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    prompts = read_prompts(args)
    check_chat_args(args)
    n = check_max_new_tokens(args.max_new_tokens, 1, "--max-new-tokens")
    temperature = resolve_temperature(args.temperature, args.top_k, args.top_p, args.min_p)
    if args.repetition_penalty is not None:
        check_repetition_penalty(args.repetition_penalty)
    presence = check_openai_penalty(args.presence_penalty, "--presence-penalty")
    frequency = check_openai_penalty(args.frequency_penalty, "--frequency-penalty")
    if not Path(args.engine).is_file():
        raise DejavuError(f"engine file not found: {args.engine}")
    ids = _encode_checked(args.engine, prompts, n, args.chat, args.system)

    from dejavu.runtime.engine import Engine

    eng = Engine.load(args.engine, device=args.device, overlap=not args.no_overlap,
                      batch_policy=args.batch_policy, dtype=args.dtype)
    tok = eng.tokenizer
    kw = dict(temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, min_p=args.min_p,
              repetition_penalty=args.repetition_penalty,  # None: the checkpoint's
              presence_penalty=presence, frequency_penalty=frequency)
    out, fmt = sys.stdout, args.output_format
    if fmt == "text" and args.prompt is not None:
        if not args.chat:  # a completion continues the prompt; a chat reply stands alone
            out.write(prompts[0])
            out.flush()
        eng.generate(ids, n, stream=_TextStream(tok, out), **kw)
        out.write("\n")
        new = None
    else:
        new = eng.generate(ids, n, **kw)
    stats = stats_dict(eng) if args.stats and eng.stats is not None else None
    if new is not None:
        rows = [{"index": i, "prompt": p, "completion": tok.decode(t), "tokens": t}
                for i, (p, t) in enumerate(zip(prompts, new))]
        if fmt == "text":
            for r in rows:
                text = r["completion"] if args.chat else r["prompt"] + r["completion"]
                out.write(f"[{r['index']}] {_one_line(text)}\n")
        elif fmt == "jsonl":
            for r in rows:
                out.write(json.dumps(r, ensure_ascii=False) + "\n")
        else:
            obj = {"outputs": rows, **({"stats": stats} if stats else {})}
            out.write(json.dumps(obj, ensure_ascii=False, indent=1) + "\n")
    out.flush()
    if stats and fmt != "json":
        print(format_stats(stats) if fmt == "text" else json.dumps({"stats": stats}), file=sys.stderr)
    return 0


def build_tune_parser() -> Parser:
    from dejavu.cli_common import add_quiet

    p = Parser("dejavu-tune", "Time a Llama engine's launch shapes on this GPU (the whole decode step per candidate) "
                              "and record the fastest in the engine's header.")
    p.add_argument("engine", help="the .engine file (from dejavu-compile)")
    p.add_argument("-o", "--output", default=None, help="write the tuned engine here (default: in place)")
    add_device(p, "cuda", "the GPU to tune for: cuda | cuda:N")
    p.add_argument("--budget-s", type=float, default=300.0, metavar="S", help="start no trial after S seconds")
    p.add_argument("--prompt-len", type=int, default=128, metavar="N",
                   help="tokens of the random prompt before the timed step (its context)")
    p.add_argument("--min-gain", type=float, default=0.005, metavar="F",
                   help="keep a change only where the step is faster by more than this fraction")
    add_quiet(p, "no line per trial")
    return p


@cli_entry
def tune_main(argv=None) -> int:
    args = build_tune_parser().parse_args(argv)
    if not Path(args.engine).is_file():
        raise DejavuError(f"engine file not found: {args.engine}")
    if args.budget_s <= 0 or not 0 <= args.min_gain < 1 or args.prompt_len < 1:
        raise DejavuError("--budget-s must be > 0, --min-gain in [0, 1), --prompt-len >= 1")
    if not args.device.startswith("cuda"):
        raise DejavuError("dejavu-tune times launches on a GPU: --device must be cuda or cuda:N")

    from dejavu.runtime.tune import TuneSettings, tune_file

    config = TuneSettings(prompt_len=args.prompt_len, min_gain=args.min_gain, budget_s=args.budget_s)
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    tuned = tune_file(args.engine, args.output, args.device, config, say=say)
    before, after = tuned["step_ms"]
    print(f"dejavu-tune: {args.output or args.engine}: {before:.3f} -> {after:.3f} ms a decode step on {tuned['gpu']} "
          f"({sum(t['outcome'] == 'kept' for t in tuned['trials'])} changes kept)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

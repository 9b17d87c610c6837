"""`dejavu-run FILE.engine --prompt TEXT`: generate with a sparse engine, streaming tokens."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from dejavu.errors import DejavuError, cli_entry


@dataclass
class RunSettings:
    """Defaults of `dejavu-run` (defined once; argparse reads them from here)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
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


def _parser() -> argparse.ArgumentParser:
    d = RunSettings()
    p = argparse.ArgumentParser(prog="dejavu-run", description="Generate text with a dejavu .engine file.")
    p.add_argument("engine", help="the .engine file (from dejavu-compile)")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--batch-file", help="a text file with one prompt per line (generated as one batch)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="override the engine dtype (e.g. float32 on CPU)")
    p.add_argument("--no-overlap", action="store_true", help="run the predictors inline (no side stream)")
    p.add_argument("--batch-policy", default=d.batch_policy, choices=["per_sequence", "shared"])
    p.add_argument("--stats", action="store_true", help="print timings to stderr at the end")
    return p


def _prompts(args) -> list[str]:
    if (args.prompt is None) == (args.batch_file is None):
        raise DejavuError("give exactly one of --prompt TEXT or --batch-file FILE")
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.batch_file)
    if not path.is_file():
        raise DejavuError(f"batch file not found: {path}")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise DejavuError(f"batch file {path} holds no prompts")
    return lines


@cli_entry
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    prompts = _prompts(args)
    if args.max_new_tokens < 1:
        raise DejavuError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from dejavu.runtime.engine import Engine

    eng = Engine.load(args.engine, device=args.device, overlap=not args.no_overlap,
                      batch_policy=args.batch_policy, dtype=args.dtype)
    tok = eng.tokenizer
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    out = sys.stdout
    if len(prompts) == 1:
        out.write(prompts[0])
        out.flush()
        eng.generate(prompts, args.max_new_tokens, stream=_TextStream(tok, out), **kw)
        out.write("\n")
    else:
        for i, ids in enumerate(eng.generate(prompts, args.max_new_tokens, **kw)):
            out.write(f"[{i}] {prompts[i]}{tok.decode(ids)}\n")
    out.flush()
    if args.stats and eng.stats is not None:
        s = eng.stats
        print(f"dejavu-run: batch {s.batch}, prefill {s.prefill_s * 1e3:.1f} ms, {s.new_tokens} decode steps, "
              f"{s.ms_per_token:.2f} ms/step, {s.tokens_per_s:.1f} tokens/s "
              f"({dataclasses.asdict(s)['extra'] or eng.describe()})", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

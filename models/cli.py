"""`dejavu-generate MODEL --prompt TEXT`: text from a dense OPT or Llama-family model, streamed to stdout."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from dejavu.errors import DejavuError, cli_entry

DTYPES = ("fp32", "fp16", "bf16")


@dataclass
class GenerateSettings:
    """Defaults of dejavu-generate (the argparse defaults are read from here)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    dtype: str = "fp32"
    device: str = "cpu"


def torch_dtype(name: str):
    import torch

    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name not in table:
        raise DejavuError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return table[name]


def build_parser() -> argparse.ArgumentParser:
    d = GenerateSettings()
    p = argparse.ArgumentParser(prog="dejavu-generate",
                                description="Generate text with a dense OPT or Llama-family model (greedy or sampled).")
    p.add_argument("model", help="model folder, .gguf file, preset name (opt-mini, opt-125m, smollm2-135m, ...) or Hugging Face id")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    return p


class _Streamer:
    """Prints the decoded continuation as it grows (waits out incomplete UTF-8 sequences)."""

    def __init__(self, tok, out=None):
        self.tok, self.out, self.ids, self.shown = tok, out or sys.stdout, [], 0

    def __call__(self, step_tokens) -> None:
        t = step_tokens[0]
        if t is None:
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def finish(self) -> None:
        text = self.tok.decode(self.ids)
        self.out.write(text[self.shown:] + "\n")
        self.out.flush()


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dejavu.models.auto import load_any, load_text_tokenizer
    from dejavu.models.generate import generate

    model, cfg = load_any(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    tok = load_text_tokenizer(args.model)
    ids = tok.encode(args.prompt)
    streamer = _Streamer(tok)
    sys.stdout.write(args.prompt)
    t0 = time.perf_counter()
    new = generate(model, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, eos_id=tok.eos_id, stream=streamer)[0]
    dt = time.perf_counter() - t0
    streamer.finish()
    print(f"[{len(new)} tokens in {dt:.2f} s, {len(new) / max(dt, 1e-9):.1f} tok/s, "
          f"prompt {len(ids)} tokens, {args.dtype} on {args.device}]", file=sys.stderr)
    return 0



if __name__ == "__main__":
    sys.exit(main())

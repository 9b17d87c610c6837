"""`dejavu-generate MODEL --prompt TEXT [--chat]`: text from a dense OPT or Llama-family model, streamed to stdout
(--chat: the prompt as a user message in the model's chat template)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from dejavu.cli_common import Parser, add_chat, add_device, add_dtype, add_sampling, chat_encoder, check_chat_args
from dejavu.errors import DejavuError, cli_entry
from dejavu.generation import (GENERATION, check_max_new_tokens, check_openai_penalty, check_repetition_penalty,
                               resolve_temperature)


@dataclass
class GenerateSettings:
    """Defaults of dejavu-generate beyond generation's (`dejavu.generation.GenerationSettings`)."""

    dtype: str = "float32"
    device: str = "cpu"


def torch_dtype(name: str):
    import torch

    from dejavu.cli_common import canonical_dtype

    return getattr(torch, canonical_dtype(name))


def build_parser() -> Parser:
    g, d = GENERATION, GenerateSettings()
    p = Parser("dejavu-generate", "Generate text with a dense OPT or Llama-family model (greedy or sampled).")
    p.add_argument("model", help="model folder, .gguf file, preset name (opt-mini, opt-125m, smollm2-135m, ...) "
                                 "or Hugging Face id")
    p.add_argument("--prompt", required=True, help="text to continue")
    add_chat(p, "model's")
    add_sampling(p, g)
    add_dtype(p, d.dtype, "weights and compute dtype")
    add_device(p, d.device)
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


def _check_length(prompt: int, n: int, positions: int) -> None:
    if prompt + n > positions:
        raise DejavuError(f"the prompt ({prompt} tokens) + --max-new-tokens {n} exceeds the model's "
                          f"{positions} positions")


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_chat_args(args)
    n = check_max_new_tokens(args.max_new_tokens, 1, "--max-new-tokens")
    temperature = resolve_temperature(args.temperature, args.top_k, args.top_p, args.min_p)
    penalty = args.repetition_penalty
    if penalty is not None:
        check_repetition_penalty(penalty)
    presence = check_openai_penalty(args.presence_penalty, "--presence-penalty")
    frequency = check_openai_penalty(args.frequency_penalty, "--frequency-penalty")
    from dejavu.models.auto import load_any, load_chat_template, load_sampling_defaults, load_text_tokenizer, model_type
    from dejavu.models.generate import generate

    def encode(tok) -> list[int]:
        if not args.chat:
            return tok.encode(args.prompt)
        return chat_encoder(load_chat_template(args.model), tok, args.system, f"{args.model}")(args.prompt)

    if model_type(args.model) == "opt":  # OPT's config alone: the length checked before the weights load
        from dejavu.models.loader import load_config

        tok = load_text_tokenizer(args.model)
        ids = encode(tok)
        _check_length(len(ids), n, load_config(args.model).max_position_embeddings)
        model, cfg = load_any(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    else:  # the config is checked by the load (one line for a bad one), then the tokenizer
        model, cfg = load_any(args.model, dtype=torch_dtype(args.dtype), device=args.device)
        tok = load_text_tokenizer(args.model)
        ids = encode(tok)
    _check_length(len(ids), n, cfg.max_position_embeddings)  # before the prompt is echoed
    if penalty is None:  # the checkpoint's, as transformers' generate applies its generation_config
        penalty = load_sampling_defaults(args.model).get("repetition_penalty", 1.0)
    streamer = _Streamer(tok)
    if not args.chat:  # a completion continues the prompt; a chat reply stands alone
        sys.stdout.write(args.prompt)
    t0 = time.perf_counter()
    new = generate(model, [ids], n, temperature=temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, eos_id=tok.stop_ids, stream=streamer, min_p=args.min_p,
                   repetition_penalty=penalty, presence_penalty=presence, frequency_penalty=frequency)[0]
    dt = time.perf_counter() - t0
    streamer.finish()
    print(f"[{len(new)} tokens in {dt:.2f} s, {len(new) / max(dt, 1e-9):.1f} tok/s, "
          f"prompt {len(ids)} tokens, {args.dtype} on {args.device}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

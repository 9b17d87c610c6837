"""The argument vocabulary every dejavu console script shares. Imports no torch.

Every CLI builds its parser here (`Parser`): usage errors are one line (`DejavuError`, exit
2 through `cli_entry`), `--help` shows each default (read from the dataclass that owns it),
`--version` prints the package version, and `--dtype`, `--device`, `-q/--quiet` and
`--output-format` mean the same in every tool. Parsers live in modules that import no torch,
so `--help` and argument errors answer in well under a second; torch is imported inside
`main`, after the arguments were checked.
"""
from __future__ import annotations

import argparse
import re

from dejavu import __version__
from dejavu.errors import DejavuError

DTYPES = ("float16", "bfloat16", "float32")
DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
                 "float": "float32", **{d: d for d in DTYPES}}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def canonical_dtype(name) -> str:
    """float16 | bfloat16 | float32 for a name or alias (fp16, half, bf16, fp32, float)."""
    dt = DTYPE_ALIASES.get(str(name).lower())
    if dt is None:
        raise DejavuError(f"--dtype must be one of {', '.join(DTYPES)} (or fp16, bf16, fp32); got {name!r}")
    return dt


def canonical_device(name) -> str:
    """cpu | cuda | cuda:N (checked for form only; whether a GPU is there is checked at load)."""
    d = str(name).lower()
    if not _DEVICE.match(d):
        raise DejavuError(f"--device must be cpu, cuda or cuda:N; got {name!r}")
    return d


def _dtype_arg(value) -> str:
    try:
        return canonical_dtype(value)
    except DejavuError:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(DTYPES)} (or fp16, bf16, fp32)") from None


def _device_arg(value) -> str:
    try:
        return canonical_device(value)
    except DejavuError:
        raise argparse.ArgumentTypeError(f"{value!r} is not cpu, cuda or cuda:N") from None


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help unless the default is None/False or already said."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "(default" in text or not action.option_strings:
            return text
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (a DejavuError: exit 2 through `cli_entry`) and --version."""

    def __init__(self, prog: str, description: str, **kw):
        super().__init__(prog=prog, description=description, formatter_class=HelpFormatter, **kw)
        self.add_argument("--version", action="version", version=f"%(prog)s (dejavu) {__version__}",
                          help="print the version and exit")

    def error(self, message):
        raise DejavuError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_dtype(p: argparse.ArgumentParser, default, help: str) -> None:
    p.add_argument("--dtype", type=_dtype_arg, default=default,
                   metavar="{float16,bfloat16,float32}", help=f"{help}; aliases fp16, bf16, fp32")


def add_device(p: argparse.ArgumentParser, default, help: str = "where to run: cpu | cuda | cuda:N") -> None:
    p.add_argument("--device", type=_device_arg, default=default,
                   metavar="{cpu,cuda[:N]}", help=help)


def add_sampling(p: argparse.ArgumentParser, g, per: str = "") -> None:
    """--max-new-tokens, --temperature, --top-k, --top-p, --min-p, --seed and the penalties with the defaults of `g`
    (a GenerationSettings); `per`: e.g. " per prompt" in the --max-new-tokens help."""
    p.add_argument("--max-new-tokens", type=int, default=g.max_new_tokens, metavar="N",
                   help=f"tokens to generate{per} (fewer when EOS comes first)")
    p.add_argument("--temperature", type=float, default=g.temperature,
                   help="0 = greedy; unset: greedy, or 1.0 when --top-k / --top-p ask for sampling")
    p.add_argument("--top-k", type=int, default=g.top_k, help="sample from the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=g.top_p, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--min-p", type=float, default=g.min_p,
                   help="drop tokens less likely than this times the most likely one (0 = off)")
    p.add_argument("--seed", type=int, default=g.seed, help="sampling seed (unset: not reproducible)")
    p.add_argument("--repetition-penalty", type=float, default=g.repetition_penalty, metavar="P",
                   help="a seen token's logit divided by P where positive, multiplied where negative (1.0 = off; "
                        "unset: the checkpoint's generation_config.json or GGUF value, else off)")
    p.add_argument("--presence-penalty", type=float, default=g.presence_penalty, metavar="P",
                   help="OpenAI's: P subtracted from the logit of every token generated so far, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=g.frequency_penalty, metavar="P",
                   help="OpenAI's: P times its count so far subtracted from a generated token's logit, in [-2, 2] "
                        "(0 = off)")


def add_quiet(p: argparse.ArgumentParser, help: str = "no progress bars or progress lines") -> None:
    p.add_argument("-q", "--quiet", action="store_true", help=help)


def add_output_format(p: argparse.ArgumentParser, choices: tuple[str, ...], help: str) -> None:
    p.add_argument("--output-format", choices=choices, default=choices[0], help=help)


def comma_list(values) -> list[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c'] (empty items dropped)."""
    return [v.strip() for item in values or [] for v in str(item).split(",") if v.strip()]


def add_chat(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument("--chat", action="store_true",
                   help=f"the prompt is a user message, rendered by the {whose} chat template (as dejavu-serve's "
                        "/v1/chat/completions renders it); the reply alone is printed")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the prompt")


def chat_encoder(source: str | None, tok, system: str | None, owner: str):
    """prompt -> ids of the [system,] user messages rendered by the chat template `source` and tokenized as
    dejavu-serve and transformers' apply_chat_template tokenize them; `owner` ("FILE: this engine") names what
    has no template in the error line."""
    if not source:
        raise DejavuError(f"{owner} carries no chat template (its checkpoint has none); drop --chat and write the "
                          "prompt in the model's format")
    try:
        from dejavu.runtime.openai_protocol import ApiError, ChatTemplate

        template = ChatTemplate(source, tok)
    except ImportError:
        raise DejavuError("--chat renders the chat template with jinja2: pip install jinja2") from None
    except Exception as e:  # noqa: BLE001 - a template Jinja cannot parse
        raise DejavuError(f"{owner}'s chat template does not parse ({e})") from None
    head = [{"role": "system", "content": system}] if system is not None else []

    def encode(prompt: str) -> list[int]:
        try:
            return template.encode(head + [{"role": "user", "content": prompt}])
        except ApiError as e:
            raise DejavuError(e.message) from None
    return encode


def check_chat_args(args) -> None:
    if args.system is not None and not args.chat:
        raise DejavuError("--system is a chat message: give --chat too")

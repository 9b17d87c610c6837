"""The OpenAI request bodies `dejavu-serve` accepts, checked field by field, and the response
objects it returns (the legacy completions and the chat completions API).

A mistake raises `ApiError(status, message, param)`, which the server turns into OpenAI's
error object: {"error": {"message", "type", "param", "code"}}. Fields that the OpenAI API
defines but this server does not implement are accepted only at their neutral value (best_of 1,
suffix none, ...); unknown fields are rejected, as OpenAI does.
"""
from __future__ import annotations

import datetime
import functools
import json
import time
import uuid
from dataclasses import dataclass, field

from dejavu.errors import DejavuError
from dejavu.generation import GENERATION, check_openai_penalty, model_sampling


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status, "invalid_request_error")
        if self.status >= 500 and self.status != 503:
            kind = "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults of a request's fields. temperature 1 and max_tokens 16 (completions) are
    OpenAI's API defaults and stay so, although `dejavu.generation.GenerationSettings` (the
    Python API and dejavu-run) defaults to greedy and 64 tokens: a client written for OpenAI
    gets what OpenAI documents. Chat's max_tokens default is the rest of the context. top_p
    and top_k mean the same in both places and are read from GenerationSettings."""

    temperature: float = 1.0  # OpenAI's
    top_p: float = GENERATION.top_p  # 1.0 = off (OpenAI's default too)
    top_k: int = GENERATION.top_k  # an extension (vLLM's): 0 or -1 = off
    min_p: float = 0.0  # vLLM's extension: 0 = off
    completion_max_tokens: int = 16
    max_stop: int = 4  # stop strings per request (OpenAI's limit)
    max_logprobs: int = 20  # alternatives per token a request may ask for (vLLM's default max_logprobs)
    max_n: int = 128  # choices per prompt (OpenAI's limit)
    repetition_penalty: float = 1.0  # vLLM's extension; the model's (generation_config.json) where it sets one

    @classmethod
    def of_engine(cls, header: dict) -> "SamplingDefaults":
        """OpenAI's defaults, with temperature / top_p / top_k replaced by the engine header's `sampling_defaults`
        where it names them (the checkpoint's generation_config.json, copied by the compiler), as vLLM and
        TensorRT-LLM serve a model."""
        import dataclasses

        return dataclasses.replace(cls(), **model_sampling(header.get("sampling_defaults"),
                                                           "engine header: sampling_defaults"))


@dataclass
class Params:
    """A checked request: prompts (token ids) and how to complete them."""

    model: str | None
    prompts: list[list[int]]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p times the most likely one are not drawn
    min_tokens: int = 0  # vLLM's: the end-of-generation and stop_token_ids ids are not chosen before this many
    skip_special_tokens: bool = True  # vLLM's: special tokens are not text
    stop_token_ids: tuple[int, ...] = ()
    chat: bool = False
    logprobs: int | None = None  # the most likely alternatives to list with each token's logprob; None: no logprobs
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt's text (and with logprobs its tokens' logprobs) before the completion
    # OpenAI's, over the tokens generated so far (subtracted from a seen token's logit: once / per occurrence), and
    # vLLM's repetition_penalty over the prompt's and generated tokens (a seen token's logit divided by it where
    # positive, multiplied where negative); all before temperature, top-k and top-p, as vLLM applies them
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # chat: the parser that reads tool calls out of each reply (tool_choice "auto" with the server's
    # --tool-call-parser; runtime/tool_calls.py); None: the reply is content
    tool_parser: str | None = None
    logit_bias: tuple = ()  # OpenAI's: (token id, bias in [-100, 100]) pairs added to the logits before sampling
    extra: dict = field(default_factory=dict)


NEUTRAL = {"best_of": 1, "suffix": None, "response_format": {"type": "text"},
           "tools": None, "tool_choice": None, "parallel_tool_calls": None}
# OpenAI's fields that ask nothing of the model (the end user's id, the stored-completion flag and its tags, the
# service tier): accepted at any value of their type and ignored, as vLLM ignores them
IGNORED = {"user": str, "store": bool, "metadata": dict, "service_tier": str}
# top_k, ignore_eos, stop_token_ids, repetition_penalty: vLLM's extensions
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "min_tokens", "stop", "seed", "stream",
          "stream_options", "skip_special_tokens",
          "ignore_eos", "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "user"} | (
    NEUTRAL.keys() - {"tools", "tool_choice", "parallel_tool_calls", "response_format"})
# add_generation_prompt, chat_template_kwargs: vLLM's extensions (Qwen3's {"enable_thinking": false}, ...)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
                        "chat_template_kwargs", "logprobs", "top_logprobs"} | (
    NEUTRAL.keys() - {"best_of", "echo", "suffix"}) | IGNORED.keys()
# chat's tool fields, checked by chat_params (runtime/tool_calls.py) rather than held at a neutral value
_CHAT_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")
# the variables the server gives every render; a request's chat_template_kwargs may not set them
_TEMPLATE_VARS = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker (render_jinja_template)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _number(body, name, default, lo, hi, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"'{name}' must be a number, got {type(v).__name__}", name)
    if not lo <= v <= hi or (lo_open and v == lo):  # NaN (JSON's NaN literal) fails too
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"'{name}' must be in {rng}, got {v}", name)
    return float(v)


def _int(body, name, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
    return v


def _penalty(body, name) -> float:
    v = body.get(name)
    try:
        return getattr(GENERATION, name) if v is None else check_openai_penalty(v, f"'{name}'")
    except DejavuError as e:
        raise _bad(str(e), name) from None


def _common(body: dict, allowed: set, defaults: SamplingDefaults) -> dict:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in allowed and body.get(name) not in (None, neutral) and not (
                "messages" in allowed and name in _CHAT_TOOLS):
            raise _bad(f"'{name}' = {body[name]!r} is not supported by dejavu-serve (only {neutral!r})", name)
    for name, kind in IGNORED.items():
        if name in allowed and body.get(name) is not None and not isinstance(body[name], kind):
            raise _bad(f"'{name}' must be a {kind.__name__}, got {type(body[name]).__name__}", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a non-empty string or a list of them", "stop")
    if len(stop) > defaults.max_stop:
        raise _bad(f"'stop' takes at most {defaults.max_stop} strings, got {len(stop)}", "stop")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(
                opts.get("include_usage", False), bool):
            raise _bad("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(type(t) is int and t >= 0 for t in stop_ids)):
        raise _bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    top_k = _int(body, "top_k", defaults.top_k)
    if top_k < -1:
        raise _bad(f"'top_k' must be -1, 0 (off) or positive, got {top_k}", "top_k")
    penalties = {k: _penalty(body, k) for k in ("presence_penalty", "frequency_penalty")}
    penalties["repetition_penalty"] = _number(body, "repetition_penalty", defaults.repetition_penalty, 0.0,
                                              float("inf"), lo_open=True)
    bias = body.get("logit_bias") or {}
    try:
        pairs = tuple(sorted((int(k), float(v)) for k, v in bias.items() if type(v) in (int, float)))
    except (AttributeError, ValueError):
        pairs = None
    if pairs is None or len(pairs) != len(bias) or not all(t >= 0 and -100 <= v <= 100 for t, v in pairs):
        raise _bad("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise _bad("'skip_special_tokens' must be a boolean", "skip_special_tokens")
    min_tokens = _int(body, "min_tokens", 0)
    if min_tokens < 0:
        raise _bad(f"'min_tokens' must be >= 0, got {min_tokens}", "min_tokens")
    n = _int(body, "n", 1)
    if not 1 <= n <= defaults.max_n:
        raise _bad(f"'n' must be in [1, {defaults.max_n}], got {n}", "n")
    return dict(model=model, temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
                top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, lo_open=True), top_k=max(top_k, 0),
                min_p=_number(body, "min_p", defaults.min_p, 0.0, 1.0), min_tokens=min_tokens,
                skip_special_tokens=skip,
                stop=tuple(stop), seed=_int(body, "seed"), stream=bool(stream),
                include_usage=bool((opts or {}).get("include_usage", False)), ignore_eos=ignore_eos,
                stop_token_ids=tuple(stop_ids), n=n, logit_bias=pairs, **penalties)


def _prompts(prompt, tokenizer, vocab: int) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of those",
                   "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise _bad("this engine carries no tokenizer: send token ids", "prompt")
            out.append(tokenizer.encode(p))
        elif (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            if min(p) < 0 or max(p) >= vocab:
                raise _bad(f"token ids must be in [0, {vocab})", "prompt")
            out.append(list(p))
        else:
            raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of those",
                       "prompt")
    return out


def completion_params(body, tokenizer, vocab: int, defaults: SamplingDefaults) -> Params:
    c = _common(body, COMPLETION_FIELDS, defaults)
    if "prompt" not in body:
        raise _bad("'prompt' is required", "prompt")
    max_tokens = _int(body, "max_tokens", defaults.completion_max_tokens)
    n = _int(body, "logprobs")  # completions: how many alternatives (0: the sampled token's logprob alone)
    if n is not None and not 0 <= n <= defaults.max_logprobs:
        raise _bad(f"'logprobs' must be in [0, {defaults.max_logprobs}], got {n}", "logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise _bad(f"'echo' must be a boolean, got {type(echo).__name__}", "echo")
    return Params(prompts=_prompts(body["prompt"], tokenizer, vocab), max_tokens=max_tokens, logprobs=n, echo=echo,
                  **c)


def chat_params(body, tokenizer, template, defaults: SamplingDefaults, tool_parser: str | None = None,
                render_only: bool = False) -> Params:
    """template: a `chat_template.ChatTemplate` (None: the engine has none -> 400). tool_parser: the server's
    --tool-call-parser where --enable-auto-tool-choice is on (runtime/tool_calls.py), which tool_choice "auto"
    needs, as vLLM's does. render_only: the prompt alone is wanted (/tokenize): no reply is read, so "auto" needs
    no parser."""
    from dejavu.runtime import tool_calls as TC

    c = _common(body, CHAT_FIELDS, defaults)
    if template is None:
        raise _bad("this engine's tokenizer has no chat template (engine header field 'chat_template'); "
                   "use /v1/completions", "messages")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls")
        if content is None and m["role"] == "assistant" and calls:  # a turn of calls alone
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        one = {"role": m["role"], "content": content}
        try:
            if calls is not None and m["role"] == "assistant":
                one["tool_calls"] = TC.template_calls(calls, f"messages[{i}]")
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        for key in ("tool_call_id", "name"):  # a tool message's call id (and a function's name, older form)
            if isinstance(m.get(key), str):
                one[key] = m[key]
        clean.append(one)
    tools, choice_ = body.get("tools"), body.get("tool_choice")
    try:
        tools = TC.check_tools(tools) if tools is not None else None
    except ValueError as e:
        raise _bad(str(e), "tools") from None
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice_ is None:
        choice_ = "auto" if tools else "none"  # OpenAI's defaults
    if choice_ not in ("none", "auto", "required") and not (
            isinstance(choice_, dict) and choice_.get("type") == "function"
            and isinstance((choice_.get("function") or {}).get("name"), str)):
        raise _bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}", "tool_choice")
    if choice_ != "none" and not tools:
        raise _bad("'tool_choice' needs 'tools'", "tool_choice")
    if choice_ == "auto" and tool_parser is None and not render_only:  # vLLM's answer, word for word
        raise _bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                   "tool_choice")
    if choice_ not in ("none", "auto"):
        raise _bad("tool_choice \"required\" or a named function constrains decoding to the tools' JSON schema, "
                   "which dejavu-serve does not do; use \"auto\"", "tool_choice")
    gen, cont = body.get("add_generation_prompt", True), body.get("continue_final_message", False)
    for name, v in (("add_generation_prompt", gen), ("continue_final_message", cont)):
        if not isinstance(v, bool):
            raise _bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    if gen and cont:  # transformers' apply_chat_template refuses the two together, so vLLM does
        raise _bad("'continue_final_message' continues the last message; it needs 'add_generation_prompt' false",
                   "continue_final_message")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    taken = sorted(set(kwargs) & set(_TEMPLATE_VARS))
    if taken:
        raise _bad(f"'chat_template_kwargs' may not set {', '.join(taken)}: the server sets them",
                   "chat_template_kwargs")
    if tools:  # the template sees them with tool_choice "none" too, as vLLM's does
        kwargs = {**kwargs, "tools": tools}
    mt = _int(body, "max_completion_tokens")
    mt = _int(body, "max_tokens") if mt is None else mt
    want, top = body.get("logprobs"), _int(body, "top_logprobs")  # chat: a switch, then how many alternatives
    if want is not None and not isinstance(want, bool):
        raise _bad(f"'logprobs' must be a boolean, got {type(want).__name__}", "logprobs")
    if top is not None and not (want and 0 <= top <= defaults.max_logprobs):
        raise _bad(f"'top_logprobs' must be in [0, {defaults.max_logprobs}] and needs 'logprobs': true",
                   "top_logprobs")
    if choice_ == "auto" and tool_parser == "mistral":  # its calls begin with the special token [TOOL_CALLS]
        c["skip_special_tokens"] = False
    return Params(prompts=[template.encode(clean, add_generation_prompt=gen, continue_final_message=cont, **kwargs)],
                  max_tokens=mt, chat=True, logprobs=(top or 0) if want else None,
                  tool_parser=tool_parser if choice_ == "auto" else None, **c)


def check_lengths(p: Params, context: int) -> None:
    """Every prompt fits the context with its completion; max_tokens None -> the rest of it."""
    if p.max_tokens is not None and p.max_tokens < 1:
        raise _bad(f"'max_tokens' must be at least 1, got {p.max_tokens}", "max_tokens")
    for ids in p.prompts:
        want = len(ids) + (p.max_tokens or 1)
        if want > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                f"{want} tokens ({len(ids)} in the prompt, {p.max_tokens or 1} for the completion). "
                                "Please reduce the prompt or the completion length.",
                           "max_tokens" if len(ids) < context else "prompt", "context_length_exceeded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: the prompt tokens a cache row held already (prefix caching)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_object(rid: str, model: str, created: int, choices: list[dict], use: dict | None,
                      chat: bool, chunk: bool) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    out = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if use is not None or not chunk:
        out["usage"] = use
    return out


def choice(index: int, text: str | None, finish: str | None, chat: bool, chunk: bool, role: bool = False,
           logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """One choice of a response (chunk: of a stream). tool_calls: chat's calls (runtime/tool_calls.ToolCall.as_dict;
    in a chunk each with its index); with them a message's content may be None, as OpenAI's is."""
    if not chat:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if chunk:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    message = {"role": "assistant", "content": text if tool_calls else text or ""}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def logprobs_object(entries: list, tokenizer, chat: bool) -> dict:
    """OpenAI's logprobs of the tokens `entries` lists, each (token id, logprob, [(id, logprob) of the most likely
    tokens], the characters of text before it): chat's {"content": [{token, logprob, bytes, top_logprobs}]};
    completions' {tokens, token_logprobs, top_logprobs (the alternatives and the token itself), text_offset}. A
    token's text is its decoding; one that is a piece of a character is "bytes:\\xNN..." of its bytes, as OpenAI
    writes it (so two such tokens never share a key)."""
    def raw(t) -> bytes:
        return token_bytes(tokenizer, t) if tokenizer is not None else str(t).encode()

    def text(t) -> str:
        b = raw(t)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    if chat:
        def one(t, lp):
            return {"token": text(t), "logprob": lp, "bytes": list(raw(t))}
        return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]}
                            for t, lp, top, _ in entries]}
    # a prompt's first token has no logprob (nothing before it predicts it): null, as OpenAI writes it
    return {"tokens": [text(e[0]) for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [None if lp is None else {**{text(a): alp for a, alp in top}, text(t): lp}
                             for t, lp, top, _ in entries],
            "text_offset": [e[3] for e in entries]}


def token_bytes(tokenizer, t: int) -> bytes:
    """A token's own bytes: its decoding, or where that is a piece of a character (U+FFFD), the bytes its vocabulary
    entry stands for (SentencePiece's <0xNN>; a byte-level BPE's characters mapped back to bytes)."""
    s = tokenizer.decode([t], skip_special=False)
    if "\ufffd" not in s:
        return s.encode("utf-8")
    piece = tokenizer.tokenizer.id_to_token(t) or ""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    inv = _byte_level_chars()
    return bytes(inv[c] for c in piece) if piece and all(c in inv for c in piece) else s.encode("utf-8")


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    # GPT-2's byte-level alphabet (the tokenizers library's ByteLevel): printable bytes as themselves, the others
    # shifted past 255, in byte order
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(moved)}}


def now() -> int:
    return int(time.time())


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """An engine header's `chat_template` (a Jinja template, as in a Hugging Face
    tokenizer_config.json), rendered in Jinja's sandbox: messages -> prompt token ids. The environment is
    transformers' apply_chat_template's: loop controls, `raise_exception` (Mistral's templates refuse roles
    that do not alternate with it), `strftime_now` (Llama 3.2's date line), its `tojson` filter."""

    def __init__(self, source: str, tokenizer):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.template = env.from_string(source)
        self.tok = tokenizer
        ids = tokenizer.tokenizer
        self.bos = ids.id_to_token(tokenizer.bos_id) or ""
        self.eos = ids.id_to_token(tokenizer.eos_id) or ""

    def encode(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               **kwargs) -> list[int]:
        """kwargs: more template variables (a request's chat_template_kwargs, as transformers'
        apply_chat_template takes them). continue_final_message: the text ends with the last message's content,
        for the model to go on with it (what the template writes after it, the end of its turn, cut as
        transformers cuts it: at a marker appended to the content)."""
        if continue_final_message:
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        try:
            text = self.template.render(**kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos, eos_token=self.eos)
        except Exception as e:  # noqa: BLE001 - a template may raise on messages it refuses
            raise _bad(f"the chat template rejected the messages: {e}", "messages") from None
        if continue_final_message:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0:
                raise _bad("continue_final_message: the chat template does not write the last message's content",
                           "messages")
            # a template that strips the content drops the marker's space: strip what it strips
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        # tokenized as transformers' apply_chat_template and vLLM tokenize it: no special token added, the template
        # writes those its model expects (Llama's and Mistral's write BOS, ChatML's none)
        return self.tok.encode(text, add_bos=False)

"""Tool calls in chat completions, as vLLM serves them.

A request's `tools` go to the chat template (transformers' apply_chat_template variable `tools`), the messages'
earlier calls with their arguments as objects (OpenAI sends them as JSON text; templates write them with
`tojson`). With `tool_choice` "auto", the reply is read back in the checkpoint's format, named by
`dejavu-serve --enable-auto-tool-choice --tool-call-parser NAME` as vLLM names it:

- `hermes` (Hermes 2 Pro, Qwen2.5 / Qwen3, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, after any text (the reply's content);
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the reply is `{"name": ..., "parameters": {...}}` (or "arguments"),
  calls separated by "; ", after Llama's `<|python_tag|>` where the model writes it;
- `pythonic` (Llama 3.2's and Llama 4's pythonic templates): the reply is a Python list of calls with keyword
  arguments, `[get_weather(city="Paris"), get_time()]`, read with `ast` (literals only, nothing evaluated);
- `mistral`, after any text, in either of Mistral's forms: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
  (tokenizers before v11: Mistral 7B v0.3, Nemo) or `[TOOL_CALLS]name[ARGS]{...}`, once per call (v11 on: Mistral
  Small 3.2, Magistral, Devstral); `[TOOL_CALLS]` and `[ARGS]` special tokens (so the reply is detokenized with special
  tokens, as vLLM does), the calls' ids nine letters and digits (Mistral's templates refuse others when the calls
  come back).

A reply that does not parse is content, as vLLM returns it. Streamed, content goes out as it comes until a call
may have begun (`StreamGate`). Under `hermes`, `llama3_json` and both of Mistral's forms a call goes out as it is
written, as vLLM streams it: its id and name once the name is whole, then its arguments object's text as it comes
(a call whose JSON then fails to parse leaves the reply content, after its first deltas went out); under `pythonic`
the calls follow whole, one delta each, when the reply ends.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_START, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's pattern for a function's name
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str

    def as_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call_id(short: bool = False) -> str:
    if short:  # Mistral's: nine letters and digits
        n = uuid.uuid4().int
        return "".join(_ALNUM[(n >> (6 * i)) % len(_ALNUM)] for i in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name, arguments, short_id: bool = False) -> ToolCall:
    if not isinstance(name, str) or not name:
        raise ValueError("a call without a name")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), _call_id(short_id))


class _CallScan:
    """A call object `{"name": ..., "arguments": ...}` as far as it is written, read from s[a:] of a text s that only
    grows: each call scans what was added since the last. (name once that string is whole, else None; where its
    "arguments" (or "parameters") value starts in s, None: not yet)."""

    def __init__(self, a: int):
        self.i, self.name, self.start, self.done = a, None, None, False
        self.depth, self.in_str, self.esc, self.expect_key, self.key, self.at = 0, False, False, False, None, 0
        self.value_key, self.pending = None, False

    def __call__(self, s: str, stop: int) -> tuple[str | None, int | None]:
        i = self.i
        while not self.done and i < stop:
            ch = s[i]
            if self.pending and not ch.isspace():  # a value's first character at depth 1
                self.pending = False
                if self.value_key in ("arguments", "parameters"):  # llama3_json's Llama 3.1 writes "parameters"
                    self.start = i
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 1:
                        try:
                            lit = json.loads(s[self.at:i + 1])
                        except ValueError:  # a control character in the string: not JSON, nothing known from it
                            lit = None
                        if self.expect_key:
                            self.key, self.expect_key = lit, False
                        elif self.value_key == "name" and isinstance(lit, str):
                            self.name = lit
            elif ch == '"':
                self.in_str, self.at = True, i
            elif ch in "{[":
                self.depth += 1
                self.expect_key = self.depth == 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth <= 0
            elif self.depth == 1 and ch == ":":
                self.value_key, self.pending = self.key, True
            elif self.depth == 1 and ch == ",":
                self.value_key, self.expect_key = None, True
            i += 1
        self.i = i
        return self.name, self.start


class _ValueEnd:
    """Past the last character of the JSON object or array that starts at s[a], for a text s that only grows: each
    call scans what was added since the last (None while it is not closed)."""

    def __init__(self, a: int):
        self.i, self.depth, self.in_str, self.esc, self.end = a, 0, False, False, None

    def __call__(self, s: str, stop: int | None = None) -> int | None:
        i, stop = self.i, len(s) if stop is None else stop
        while self.end is None and i < stop:
            ch = s[i]
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            i += 1
        self.i = i
        return self.end


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply: content None where the reply is all calls; no calls where it holds none or
    they do not parse (then the whole reply is content)."""
    try:
        if parser == "hermes":
            if _HERMES_START not in text:
                return text, []
            calls = []
            for closed, open_ in _HERMES.findall(text):
                d = json.loads(closed or open_)
                calls.append(_call(d["name"], d.get("arguments", {})))
            content = text[:text.find(_HERMES_START)]
            return content or None, calls
        if parser == "llama3_json":
            if not (text.startswith(_PYTHON_TAG) or text.startswith("{")):
                return text, []
            dec, at, calls = json.JSONDecoder(), len(_PYTHON_TAG) if text.startswith(_PYTHON_TAG) else 0, []
            while at < len(text):
                d, end = dec.raw_decode(text[at:])
                calls.append(_call(d["name"], d["arguments"] if "arguments" in d else d.get("parameters", {})))
                at += end + len("; ")
            return None, calls
        if parser == "pythonic":
            if not (text.startswith("[") and text.rstrip().endswith("]")):
                return text, []
            tree = ast.parse(text.strip(), mode="eval").body
            if not (isinstance(tree, ast.List) and tree.elts):
                return text, []
            calls = []
            for c in tree.elts:
                if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args
                        and all(k.arg is not None for k in c.keywords)):  # f(**d) names no argument
                    return text, []
                calls.append(_call(c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords}))
            return None, calls
        if parser == "mistral":
            if _MISTRAL_START not in text:
                return text, []
            content, *raws = text.split(_MISTRAL_START)
            if raws[0].lstrip().startswith("["):  # before v11: one JSON array
                body = text.replace(_MISTRAL_START, "").strip()
                try:
                    arr = json.loads(body)
                except json.JSONDecodeError:  # text after the calls: the array alone, as vLLM finds it
                    arr = json.loads(_MISTRAL_ARRAY.findall(body)[0])
                calls = [_call(d["name"], d.get("arguments", {}), short_id=True) for d in arr]
            else:  # v11 on: name[ARGS]{...} after each [TOOL_CALLS]
                calls = []
                for raw in raws:
                    name, sep, args = raw.partition(_MISTRAL_ARGS)
                    args = json.loads(args) if sep else None
                    if not isinstance(args, dict):
                        raise ValueError("a call without [ARGS] and a JSON object")
                    if not _FUNCTION_NAME.fullmatch(name.strip()):  # another token between ([CALL_ID], ...)
                        raise ValueError(f"{name!r} is not a function's name")
                    calls.append(_call(name.strip(), args, short_id=True))
            return content or None, calls
    except (ValueError, KeyError, TypeError, AttributeError, SyntaxError, RecursionError, IndexError):
        return text, []
    raise ValueError(f"unknown tool-call parser {parser!r}")


class StreamGate:
    """A streamed reply's content, held back from where a call may begin: `add(delta)` -> content to send now;
    `tool_deltas()` -> the calls' stream deltas to send now (hermes, llama3_json, both of mistral's forms: each call
    as it is written); `finish()` ->
    (the content not yet sent, the deltas left, whether the reply holds calls). Each call's text is scanned once, as
    it comes (the scanners resume where they stopped), so a reply costs time in proportion to its length."""

    def __init__(self, parser: str):
        self.parser, self.text, self.sent = parser, "", 0
        # per call begun in the stream: [its id, the characters of its arguments sent, whether they are all sent]
        self.streamed: list[list] = []
        self._scans: dict[int, _CallScan] = {}  # a call object's scanner, by where its text starts
        self._ends: dict[int, _ValueEnd] = {}  # a call object's end (llama3_json, mistral's array), by its start
        self._args: dict[int, _ValueEnd] = {}  # each arguments object's end, by where it starts

    def _segments(self) -> list[tuple[int, int]]:
        # (start, stop) in the text of each call begun: hermes from its <tool_call> to its </tool_call> or the end;
        # mistral's v11 form from its [TOOL_CALLS] to the next; the array form before v11 each object in the array
        t, out = self.text, []
        if self.parser == "llama3_json":  # objects one after another, "; " between, after the python tag if any
            at = len(_PYTHON_TAG) if t.startswith(_PYTHON_TAG) else 0
            while at < len(t) and t[at] == "{":
                end = self._ends.setdefault(at, _ValueEnd(at))(t)
                out.append((at, len(t) if end is None else end))
                if end is None:
                    break
                at = end + len("; ")
            return out
        start = _HERMES_START if self.parser == "hermes" else _MISTRAL_START
        at = t.find(start)
        while at >= 0:
            a = at + len(start)
            at = t.find(start, a)
            stop = len(t) if at < 0 else at
            if self.parser == "hermes":
                end = t.find(_HERMES_END, a, stop)
                stop = stop if end < 0 else end
            out.append((a, stop))
        if out and self.parser == "mistral":
            first = _SPACE.match(t, out[0][0]).end()
            if first < out[0][1] and t[first] == "[":  # the array form before v11: its objects, "," between
                return self._objects(first + 1, out[0][1], ",")
        return out

    def _objects(self, at: int, stop: int, sep: str) -> list[tuple[int, int]]:
        # (start, stop) of each call object from t[at] on, one after another with sep between (spaces around it
        # skipped), the last as far as it is written
        t, out = self.text, []
        while True:
            at = _SPACE.match(t, at, stop).end()
            if at >= stop or t[at] != "{":
                return out
            end = self._ends.setdefault(at, _ValueEnd(at))(t, stop)
            out.append((at, stop if end is None else end))
            if end is None:
                return out
            at = _SPACE.match(t, end, stop).end()
            if not t.startswith(sep, at):
                return out
            at += len(sep)

    def _begun(self, a: int, stop: int) -> tuple[str | None, int | None]:
        # a call's name once it is whole (else None), and where its arguments start (None: not yet)
        t = self.text
        if self.parser in ("hermes", "llama3_json") or t.startswith("{", a):  # mistral's array form: objects too
            name, start = self._scans.setdefault(a, _CallScan(a))(t, stop)
            return name, start if start is not None and start < stop else None
        sep = t.find(_MISTRAL_ARGS, a, stop)
        if sep < 0 or not _FUNCTION_NAME.fullmatch(t[a:sep].strip()):
            return None, None
        start = _SPACE.match(t, sep + len(_MISTRAL_ARGS)).end()
        return t[a:sep].strip(), start if start < stop else None

    def _arguments(self, a: int | None, stop: int) -> tuple[str | None, bool]:
        # the text of a call's arguments object that starts at a, as far as it is written before stop (None: not an
        # object), and whether it is closed
        t = self.text
        if a is None or t[a] != "{":
            return None, False
        b = self._args.setdefault(a, _ValueEnd(a))(t, stop)
        b = b if b is not None and b <= stop else None
        return t[a:stop if b is None else b], b is not None

    def tool_deltas(self) -> list[dict]:
        if self.parser == "pythonic":
            return []
        out = []
        for j, (a, stop) in enumerate(self._segments()):
            if j < len(self.streamed) and self.streamed[j][2]:
                continue
            name, start = self._begun(a, stop)
            if j == len(self.streamed):  # a call's first delta: its id and name, once the name is whole
                if name is None:
                    break
                self.streamed.append([_call_id(short=self.parser == "mistral"), 0, False])
                out.append({"index": j, "id": self.streamed[j][0], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            raw, closed = self._arguments(start, stop)
            if raw is not None and len(raw) > self.streamed[j][1]:
                out.append({"index": j, "function": {"arguments": raw[self.streamed[j][1]:]}})
                self.streamed[j][1] = len(raw)
            self.streamed[j][2] = closed
        return out

    def _safe(self) -> int:
        # how many characters of the text are content for sure
        if self.parser in ("hermes", "mistral"):
            start = _HERMES_START if self.parser == "hermes" else _MISTRAL_START
            at = self.text.find(start, max(0, self.sent - len(start)))
            if at >= 0:
                return at
            hold = max((k for k in range(1, len(start)) if self.text.endswith(start[:k])), default=0)
            return len(self.text) - hold
        # llama3_json, pythonic: the reply is calls or content as a whole, decided by its start
        if self.parser == "pythonic":
            return 0 if self.text[:1] in ("", "[") else len(self.text)
        head = self.text[:len(_PYTHON_TAG)]
        undecided = _PYTHON_TAG.startswith(head) or head.startswith("{")
        return 0 if undecided else len(self.text)

    def add(self, delta: str) -> str:
        self.text += delta
        end = max(self.sent, self._safe())
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict], bool]:
        content, calls = parse(self.parser, self.text)
        if not calls:
            return self.text[self.sent:], [], False
        content, segs, out = content or "", self._segments() if self.streamed else [], []
        for j, c in enumerate(calls):
            if j >= len(self.streamed):  # not begun in the stream: whole
                out.append(c.as_dict(j))
                continue
            raw, closed = self._arguments(self._begun(*segs[j])[1], segs[j][1])
            raw, sent = raw if closed else None, self.streamed[j][1]
            rest = raw[sent:] if raw is not None else c.arguments if sent == 0 else ""  # not an object: whole, last
            if rest:
                out.append({"index": j, "function": {"arguments": rest}})
        return content[self.sent:] if len(content) > self.sent else "", out, True


def check_tools(tools, param: str = "tools") -> list[dict]:
    """OpenAI's tools list, checked: [{"type": "function", "function": {"name", "description"?, "parameters"?}}].
    ValueError with the reason."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"'{param}' must be a non-empty list")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(f, dict)
                and isinstance(f.get("name"), str) and f["name"]):
            raise ValueError(f"'{param}[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(f.get("parameters", {}), dict):
            raise ValueError(f"'{param}[{i}].function.parameters' must be a JSON schema object")
    return tools


def template_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as templates read them: each call's arguments an object (OpenAI sends
    JSON text), as vLLM hands them to a template. ValueError with the reason."""
    if not isinstance(calls, list):
        raise ValueError(f"'{where}.tool_calls' must be a list")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
            raise ValueError(f"'{where}.tool_calls[{j}]' must hold a function with a name")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ValueError(f"'{where}.tool_calls[{j}].function.arguments' is not JSON ({e})") from None
        out.append({**c, "function": {**f, "arguments": args}})
    return out

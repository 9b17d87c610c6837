"""`dejavu-serve ENGINE`: an OpenAI-compatible HTTP server for a `.engine` file.

    dejavu-serve opt-mini.engine --port 8000 --max-batch 8
    curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The king said", "max_tokens": 32, "stream": true}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (engines whose header carries a
`chat_template`), GET /v1/models, POST /tokenize and /detokenize (vLLM's), GET /health, GET /metrics
(Prometheus text). Streaming is
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

The stack is Starlette on uvicorn: the ASGI toolkit FastAPI itself is built on, without
FastAPI's pydantic layer, because the request checks here are OpenAI's (its error object, its
messages, 400 rather than FastAPI's 422) and are clearer written out (openai_protocol.py).
One scheduler thread owns the engine (runtime/scheduler.py: continuous batching); the event
loop only parses, queues, and relays tokens. docs/serving.md has the design and figures.

No torch at module level: the parser and the settings checks answer before torch is imported
(the scheduler and the engine are imported where they are used).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from dejavu.cli_common import Parser, add_device, add_dtype, add_quiet
from dejavu.errors import DejavuError, cli_entry
from dejavu.runtime.openai_protocol import (ApiError, ChatTemplate, SamplingDefaults, chat_params, check_lengths,
                                            choice, completion_object, completion_params, logprobs_object, new_id,
                                            now, usage)
from dejavu.runtime import tool_calls
from dejavu.runtime.serve_metrics import ServeMetrics

log = logging.getLogger("dejavu.serve")
SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval while serving (Python's default: 0.005)


@dataclass
class ServeSettings:
    """Defaults of `dejavu-serve` (defined once; argparse reads them from here)."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    max_batch: int = 8  # rows of the decode batch (KV-cache slots)
    max_queue: int = 64  # requests waiting for a row; beyond: 429 with Retry-After
    max_context: int | None = None  # tokens per row (prompt + completion); None: the model's positions
    prefill_chunk: int = 256  # prompt tokens per prefill pass, between decode steps (runtime/scheduler.py)
    api_key: str | None = None  # when set, /v1/* need `Authorization: Bearer KEY`
    model_name: str | None = None  # the served model id; None: the engine file's stem
    device: str = "cpu"
    dtype: str | None = None  # None: the engine's
    batch_policy: str | None = None  # shared on CUDA, per_sequence on CPU (runtime/engine.py)
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish, then are cancelled
    retry_after_s: int = 1
    max_body_bytes: int = 1 << 22
    log_level: str = "warning"
    quiet: bool = False  # no start line on stderr (warnings and errors still show)
    # a request's temperature / top_p / top_k where it leaves them out: "model", the engine's sampling_defaults
    # (its checkpoint's generation_config.json) over OpenAI's; "openai", OpenAI's alone
    sampling_defaults: str = "model"
    # tool_choice "auto": the format tool calls are read in (runtime/tool_calls.PARSERS), as vLLM's
    # --enable-auto-tool-choice --tool-call-parser NAME; None: "auto" is a 400
    tool_call_parser: str | None = None
    # a prompt's first whole blocks of prefix_block tokens that a cache row holds already are copied, not prefilled
    # again (runtime/scheduler.Scheduler._admit); vLLM's --enable-prefix-caching, on by default as there, and its
    # 16-token blocks. Blocks of prefill_chunk tokens give the first logits bit for bit those of no cache
    prefix_caching: bool = True
    prefix_block: int = 16
    # a Jinja chat template (vLLM's --chat-template: a file's text) served instead of the engine's; None: the engine's
    chat_template: str | None = None


def _error(e: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Relay:
    """Hands the scheduler thread's events to the event loop: queued under a lock, and one
    wake-up of the loop per batch of them (not one per token), so a decode step that emits a
    token for each of 64 rows costs the loop one callback."""

    def __init__(self):
        import threading

        self.loop = None
        self.lock = threading.Lock()
        self.items: list = []

    def sink(self, queue: asyncio.Queue, i: int):
        def put(ev):
            with self.lock:
                self.items.append((queue, (i, ev)))
                if len(self.items) > 1:
                    return  # a drain is already scheduled
            with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown)
                self.loop.call_soon_threadsafe(self._drain)
        return put

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for q, item in items:
            q.put_nowait(item)


async def _disconnected(request) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The ASGI app around one engine and its scheduler (`Server(...).app`)."""

    def __init__(self, engine, settings: ServeSettings, model_name: str,
                 defaults: SamplingDefaults | None = None):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        from dejavu.runtime.scheduler import Scheduler  # imports torch

        if defaults is None:
            model = settings.sampling_defaults == "model"
            defaults = SamplingDefaults.of_engine(engine.header) if model else SamplingDefaults()
        self.engine, self.settings, self.name, self.defaults = engine, settings, model_name, defaults
        self.metrics = ServeMetrics(settings.max_batch)
        self.scheduler = Scheduler(engine, settings.max_batch, settings.max_queue, settings.max_context, self.metrics,
                                   settings.prefill_chunk, settings.prefix_caching, settings.prefix_block)
        self.metrics.queue_depth = lambda: self.scheduler.queue_depth
        self.metrics.running = lambda: self.scheduler.running
        self.context = self.scheduler.context
        self.tokenizer = self.scheduler.tokenizer
        src = settings.chat_template or engine.header.get("chat_template")
        self.template = ChatTemplate(src, self.tokenizer) if src and self.tokenizer is not None else None
        self.created = now()
        self._relay = _Relay()

        async def http_error(request, exc: HTTPException):
            return _error(ApiError(exc.status_code, str(exc.detail)))

        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], exception_handlers={HTTPException: http_error}, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self._relay.loop = asyncio.get_running_loop()
        self.scheduler.start()
        try:
            yield
        finally:
            self.scheduler.stop()

    # ------------------------------------------------------------------ small endpoints
    def _auth(self, request) -> None:
        key = self.settings.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            raise ApiError(401, "Incorrect API key provided (send `Authorization: Bearer KEY`)",
                           code="invalid_api_key")

    async def models(self, request):
        from starlette.responses import JSONResponse

        try:
            self._auth(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                         "owned_by": "dejavu", "max_model_len": self.context}]})

    async def tokenize(self, request):
        """vLLM's /tokenize: {"prompt"} (add_special_tokens: the tokenizer's BOS rule, default true) or a chat
        request's {"messages", ...} rendered as /v1/chat/completions renders them -> {"count", "max_model_len",
        "tokens"} (and "token_strs", the vocabulary's pieces, with return_token_strs)."""
        from starlette.responses import JSONResponse

        try:
            self._auth(request)
            body = await self._body(request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            if self.tokenizer is None:
                raise ApiError(400, "this engine carries no tokenizer")
            body = dict(body)
            strs, special = body.pop("return_token_strs", False), body.pop("add_special_tokens", None)
            for name, v in (("return_token_strs", strs), ("add_special_tokens", special)):
                if v is not None and not isinstance(v, bool):
                    raise ApiError(400, f"'{name}' must be a boolean", name)
            if "messages" in body:  # what the chat endpoint would prefill, tools rendered
                if special:
                    raise ApiError(400, "a chat template writes its own special tokens: 'add_special_tokens' must "
                                   "be false with 'messages'", "add_special_tokens")
                ids = chat_params(body, self.tokenizer, self.template, self.defaults, render_only=True).prompts[0]
            else:
                prompt = body.pop("prompt", None)
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt")
                unknown = sorted(set(body) - {"model"})
                if unknown:
                    raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
                ids = self.tokenizer.encode(prompt, add_bos=None if special in (None, True) else False)
        except ApiError as e:
            self.metrics.request("/tokenize", e.status)
            return _error(e)
        self.metrics.request("/tokenize", 200)
        out = {"count": len(ids), "max_model_len": self.context, "tokens": ids}
        if strs:
            out["token_strs"] = [self.tokenizer.tokenizer.id_to_token(t) for t in ids]
        return JSONResponse(out)

    async def detokenize(self, request):
        """vLLM's /detokenize: {"tokens"} -> {"prompt"}: their text, special tokens written."""
        from starlette.responses import JSONResponse

        try:
            self._auth(request)
            body = await self._body(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            vocab = self.engine.spec.vocab_size
            if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < vocab for t in tokens)):
                raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
            if self.tokenizer is None:
                raise ApiError(400, "this engine carries no tokenizer")
        except ApiError as e:
            self.metrics.request("/detokenize", e.status)
            return _error(e)
        self.metrics.request("/detokenize", 200)
        return JSONResponse({"prompt": self.tokenizer.decode(tokens, skip_special=False)})

    async def health(self, request):
        from starlette.responses import JSONResponse

        ok = self.scheduler.alive
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def prometheus(self, request):
        from starlette.responses import PlainTextResponse

        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ completions
    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def _body(self, request):
        raw = await request.body()
        if len(raw) > self.settings.max_body_bytes:
            raise ApiError(413, f"the request body exceeds {self.settings.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None

    def _params(self, body, chat: bool):
        vocab = self.engine.spec.vocab_size
        if chat:
            p = chat_params(body, self.tokenizer, self.template, self.defaults, self.settings.tool_call_parser)
        else:
            p = completion_params(body, self.tokenizer, vocab, self.defaults)
        if any(t >= vocab for t in p.stop_token_ids):
            raise ApiError(400, f"'stop_token_ids' must be token ids below the vocabulary's {vocab}", "stop_token_ids")
        if any(t >= vocab for t, _ in p.logit_bias):
            raise ApiError(400, f"'logit_bias' names a token id beyond the vocabulary's {vocab}", "logit_bias")
        if p.model is not None and p.model != self.name:
            raise ApiError(404, f"The model `{p.model}` does not exist (this server serves `{self.name}`).",
                           "model", "model_not_found")
        check_lengths(p, self.context)
        return p

    async def _generate(self, request, chat: bool):
        from dejavu.runtime.scheduler import QueueFull, Request

        endpoint = request.url.path
        events: asyncio.Queue = asyncio.Queue()
        try:
            self._auth(request)
            p = self._params(await self._body(request), chat)

            # n choices a prompt, indexed prompt by prompt as OpenAI orders them; choice j of a seeded request
            # samples with seed + j (each as a request with that seed would)
            reqs = [Request(prompt=ids, max_tokens=p.max_tokens or self.context - len(ids),
                            sink=self._relay.sink(events, i * p.n + j),
                            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                            min_tokens=p.min_tokens, skip_special=p.skip_special_tokens, stop=p.stop,
                            seed=None if p.seed is None else p.seed + j, stop_at_eos=not p.ignore_eos,
                            stop_ids=p.stop_token_ids, logprobs=p.logprobs, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                            logit_bias=p.logit_bias, prompt_logprobs=p.logprobs if p.echo else None)
                    for i, ids in enumerate(p.prompts) for j in range(p.n)]
            try:
                self.scheduler.submit(reqs)
            except QueueFull as e:
                raise ApiError(429, f"the server is busy: {e}; retry later", code="queue_full",
                               headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except ApiError as e:
            self.metrics.request(endpoint, e.status)
            return _error(e)
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        prompt_tokens = sum(len(ids) for ids in p.prompts)  # a prompt counts once, whatever its n
        if p.stream:
            from starlette.responses import StreamingResponse

            self.metrics.request(endpoint, 200)
            return StreamingResponse(self._stream(reqs, events, p, rid, created, prompt_tokens),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(request, endpoint, reqs, events, p, rid, created, prompt_tokens)

    async def _collect(self, request, endpoint, reqs, events, p, rid, created, prompt_tokens):
        from starlette.responses import JSONResponse

        k = len(reqs)
        texts, ntok, reasons, lps = [""] * k, [0] * k, [None] * k, [[] for _ in range(k)]
        echo = [self._echo(p, r) for r in reqs]  # (the prompt's text, its logprobs) or None
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            for _ in range(k):
                while True:
                    get = asyncio.ensure_future(events.get())
                    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():  # the client left: free its rows
                        get.cancel()
                        self.metrics.request(endpoint, 499)
                        return JSONResponse({}, status_code=499)
                    i, ev = get.result()
                    if ev[0] == "token":
                        texts[i] += ev[1]
                        lps[i] += ev[3]
                        continue
                    if ev[0] == "prompt":
                        echo[i] = (echo[i][0], ev[1])
                        continue
                    if ev[0] == "error":
                        e = ApiError(503, ev[1])
                        self.metrics.request(endpoint, e.status)
                        return _error(e)
                    reasons[i], ntok[i] = ev[1], ev[2]
                    break
        finally:
            gone.cancel()
            for r in reqs:
                r.cancel()  # no-op for finished ones
        self.metrics.request(endpoint, 200)
        if p.echo:  # the prompt's text first, its tokens' logprobs first, the completion's offsets after it
            texts = [e[0] + t for e, t in zip(echo, texts)]
            lps = [e[1] + _shifted(lp, len(e[0])) for e, lp in zip(echo, lps)]
        choices = []
        for i in range(k):
            content, calls = tool_calls.parse(p.tool_parser, texts[i]) if p.tool_parser else (texts[i], [])
            choices.append(choice(i, content, "tool_calls" if calls else reasons[i], p.chat, False,
                                  logprobs=self._logprobs(p, lps[i]), tool_calls=[c.as_dict() for c in calls]))
        use = usage(prompt_tokens, sum(ntok), _cached(reqs, p.n))
        return JSONResponse(completion_object(rid, self.name, created, choices, use, p.chat, False))

    def _echo(self, p, r) -> tuple[str, list] | None:
        if not p.echo:
            return None
        return (self.tokenizer.decode(r.prompt) if self.tokenizer is not None else ""), []

    def _logprobs(self, p, entries: list) -> dict | None:
        return None if p.logprobs is None else logprobs_object(entries, self.tokenizer, p.chat)

    async def _stream(self, reqs, events, p, rid, created, prompt_tokens):
        k, left, total = len(reqs), len(reqs), 0

        def chunk(choices, use=None):
            return _sse(completion_object(rid, self.name, created, choices, use, p.chat, True))

        shift = [0] * k  # echo: the completion's text offsets start after the prompt's text
        gates = [tool_calls.StreamGate(p.tool_parser) for _ in range(k)] if p.tool_parser else None
        try:
            if p.chat:  # OpenAI's first chunk: the role
                for i in range(k):
                    yield chunk([choice(i, "", None, True, True, role=True)])
            if p.echo:  # the prompt's text first; with logprobs its tokens' logprobs follow when the prefill ends
                for i, r in enumerate(reqs):
                    text = self._echo(p, r)[0]
                    shift[i] = len(text)
                    yield chunk([choice(i, text, None, False, True)])
            while left:
                out = []  # every event already here goes out in one write
                items = [await events.get()]
                while not events.empty():
                    items.append(events.get_nowait())
                for i, ev in items:
                    if ev[0] == "prompt":
                        out.append(chunk([choice(i, "", None, False, True, logprobs=self._logprobs(p, ev[1]))]))
                        continue
                    if ev[0] == "token":
                        lp = self._logprobs(p, _shifted(ev[3], shift[i]))
                        text = ev[1] if gates is None else gates[i].add(ev[1])
                        if text or lp is not None or gates is None:
                            out.append(chunk([choice(i, text, None, p.chat, True, logprobs=lp)]))
                        for d in gates[i].tool_deltas() if gates is not None else ():  # hermes: calls as written
                            out.append(chunk([choice(i, None, None, True, True, tool_calls=[d])]))
                        continue
                    left -= 1
                    if ev[0] == "error":
                        out.append(_sse(ApiError(503, ev[1]).body()))
                        continue
                    total += ev[2]
                    reason = ev[1]
                    if gates is not None:  # what was held back: content, or the calls' deltas not yet sent
                        rest, deltas, has_calls = gates[i].finish()
                        if rest:
                            out.append(chunk([choice(i, rest, None, True, True)]))
                        for d in deltas:
                            out.append(chunk([choice(i, None, None, True, True, tool_calls=[d])]))
                        reason = "tool_calls" if has_calls else reason
                    last = left == 0 and not p.include_usage
                    out.append(chunk([choice(i, None if p.chat else "", reason, p.chat, True)],
                                     usage(prompt_tokens, total, _cached(reqs, p.n)) if last else None))
                if left == 0:
                    if p.include_usage:
                        out.append(chunk([], usage(prompt_tokens, total, _cached(reqs, p.n))))
                    out.append("data: [DONE]\n\n")
                yield "".join(out)
        finally:  # also when the client disconnects (the task is cancelled): free the rows
            for r in reqs:
                r.cancel()


def _cached(reqs, n: int) -> int:
    """The prompt tokens a cache row held already, a prompt counted once (as its usage counts it)."""
    return sum(r.cached_tokens for r in reqs[::n])


def _shifted(entries: list, by: int) -> list:
    """Logprob entries with their text offsets moved by `by` characters."""
    return [(t, lp, top, off + by) for t, lp, top, off in entries] if by else entries


# ---------------------------------------------------------------------- CLI
def build_parser() -> Parser:
    d = ServeSettings()
    p = Parser("dejavu-serve", "Serve a dejavu .engine file over the OpenAI HTTP API (completions, chat "
               "completions, streaming) with continuous batching.")
    p.add_argument("engine", help="the .engine file (from dejavu-compile)")
    p.add_argument("--host", default=d.host, help="address to bind; the default, loopback, is reachable from this machine only")
    p.add_argument("--port", type=int, default=d.port, help="TCP port; 0: any free port (printed at start)")
    p.add_argument("--max-batch", type=int, default=d.max_batch, metavar="N",
                   help="sequences decoded together (KV-cache rows)")
    p.add_argument("--max-queue", type=int, default=d.max_queue, metavar="N",
                   help="requests waiting for a row; beyond that: 429 with Retry-After")
    p.add_argument("--max-context", type=int, default=d.max_context, metavar="N",
                   help="tokens per sequence, prompt + completion (unset: the model's positions)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, metavar="N",
                   help="prompt tokens per prefill pass between decode steps")
    p.add_argument("--api-key", default=d.api_key, metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--model-name", default=d.model_name, metavar="NAME",
                   help="the model id clients send (unset: the engine file's stem)")
    add_device(p, d.device)
    add_dtype(p, d.dtype, "serve in this dtype instead of the engine's (e.g. float32 on CPU)")
    p.add_argument("--batch-policy", default=d.batch_policy, choices=["per_sequence", "shared"],
                   help="one selection per sequence, or one shared by the batch (unset: shared on CUDA, "
                        "per_sequence on CPU)")
    p.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s, metavar="SECONDS",
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level")
    p.add_argument("--sampling-defaults", default=d.sampling_defaults, choices=["model", "openai"],
                   help="a request's temperature / top_p / top_k where it leaves them out: the model's (its "
                        "generation_config.json, kept in the engine; OpenAI's where it names none) or OpenAI's")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template file served instead of the engine's (vLLM's flag: a checkpoint without "
                        "one, or a tool-calling template)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.prefix_caching,
                   help="a prompt's first whole --prefix-block blocks that a cache row holds already (an earlier "
                        "prompt's) are copied, not prefilled again")
    p.add_argument("--prefix-block", type=int, default=d.prefix_block, metavar="N",
                   help="prefix caching's granularity in tokens (vLLM's block size); --prefill-chunk's value: the "
                        "first logits bit for bit those of a server without the cache")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer tool_choice \"auto\" (the default where a chat request has tools): the model's "
                        "tool calls read back by --tool-call-parser, as vLLM's flag")
    p.add_argument("--tool-call-parser", choices=tool_calls.PARSERS, default=None,
                   help="the checkpoint's tool-call format: hermes (Qwen2.5 / Qwen3, Hermes, SmolLM3), "
                        "llama3_json (Llama 3.1-3.3), pythonic (Llama 3.2 / 4 pythonic templates), mistral "
                        "(Mistral 7B v0.3, Nemo, Small)")
    add_quiet(p, "no start line on stderr (warnings and errors still show)")
    return p


def _settings(args) -> ServeSettings:
    s = ServeSettings(host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
                      max_context=args.max_context, prefill_chunk=args.prefill_chunk, api_key=args.api_key,
                      model_name=args.model_name,
                      device=args.device, dtype=args.dtype, batch_policy=args.batch_policy,
                      shutdown_grace_s=args.shutdown_grace, log_level=args.log_level, quiet=args.quiet,
                      sampling_defaults=args.sampling_defaults,
                      tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                      prefix_caching=args.enable_prefix_caching, prefix_block=args.prefix_block,
                      chat_template=_template_file(args.chat_template))
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise DejavuError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, pythonic or "
                          "mistral)")
    if not 0 <= s.port <= 65535:
        raise DejavuError(f"--port must be in [0, 65535], got {s.port}")
    if s.max_batch < 1:
        raise DejavuError(f"--max-batch must be >= 1, got {s.max_batch}")
    if s.max_queue < 0:
        raise DejavuError(f"--max-queue must be >= 0, got {s.max_queue}")
    if s.max_context is not None and s.max_context < 2:
        raise DejavuError(f"--max-context must be >= 2, got {s.max_context}")
    if s.prefill_chunk < 1:
        raise DejavuError(f"--prefill-chunk must be >= 1, got {s.prefill_chunk}")
    if s.prefix_block < 1:
        raise DejavuError(f"--prefix-block must be >= 1, got {s.prefix_block}")
    if s.api_key is not None and not s.api_key:
        raise DejavuError("--api-key must not be empty")
    return s


def _template_file(path: str | None) -> str | None:
    """--chat-template's text, checked to parse as Jinja (one DejavuError line otherwise)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DejavuError(f"--chat-template {path}: cannot read it ({e})") from None
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except ImportError:
        raise DejavuError("--chat-template renders with jinja2: pip install jinja2") from None
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError
        raise DejavuError(f"--chat-template {path}: not a Jinja template ({e})") from None
    return text


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        raise DejavuError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def run(server: Server, sock: socket.socket, settings: ServeSettings) -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's graceful shutdown, then the scheduler stops)."""
    import uvicorn

    # The scheduler thread takes the GIL back after every torch call; with the default 5 ms
    # switch interval a busy event loop delays each of those by up to 5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    cfg = uvicorn.Config(server.app, log_level=settings.log_level, access_log=False,
                         timeout_graceful_shutdown=settings.shutdown_grace_s)
    uvicorn.Server(cfg).run(sockets=[sock])


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = _settings(args)
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise DejavuError("dejavu-serve needs Starlette and uvicorn: pip install 'dejavu[serve]'") from None
    from dejavu.runtime.engine import Engine

    path = Path(args.engine)
    engine = Engine.load(path, device=settings.device, batch_policy=settings.batch_policy, dtype=settings.dtype)
    if settings.max_context is not None and settings.max_context > engine.spec.max_positions:
        raise DejavuError(f"--max-context {settings.max_context} exceeds the model's {engine.spec.max_positions} "
                          "positions")
    server = Server(engine, settings, settings.model_name or path.stem)
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    if not settings.quiet:
        print(f"dejavu-serve: {server.name} on http://{host}:{port} (device {engine.device}, batch policy "
              f"{engine.batch_policy}, max batch {settings.max_batch}, context {server.context}, chat "
              f"{'on' if server.template else 'off'})", file=sys.stderr, flush=True)
        if settings.sampling_defaults == "model" and engine.header.get("sampling_defaults"):
            d = server.defaults
            print(f"dejavu-serve: sampling defaults from the model: temperature {d.temperature:g}, top_p "
                  f"{d.top_p:g}, top_k {d.top_k}, min_p {d.min_p:g}, repetition_penalty {d.repetition_penalty:g} "
                  "(--sampling-defaults "
                  "openai for OpenAI's)", file=sys.stderr, flush=True)
    if host not in ("127.0.0.1", "::1", "localhost") and settings.api_key is None:
        print("dejavu-serve: warning: listening beyond loopback without --api-key", file=sys.stderr, flush=True)
    run(server, sock, settings)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Continuous batching for `dejavu-serve`: one thread owns the engine; requests join and leave
the running decode batch between steps.

Slots: the decoder's static cache is allocated once, for `max_batch` rows of the model's whole
context (`SparseDecoder.setup`); a request holds one row from its prefill to its last token, the
lowest row free when it is admitted.
Prefix caching (`_admit`, on unless `prefix_caching=False`): a row keeps the K/V of the prompt
tokens it prefilled after its request ends. A newcomer takes the lowest free row, and the first
whole blocks of `prefix_block` tokens of its prompt that some row holds (its own, or another's,
free or running, copied: `copy_prefix`, a device copy far cheaper than the prefill) are not
prefilled again, never the prompt's last token (its logits give the first new token). The rest is
prefilled up to the next multiple of `prefill_chunk`, then cut where a prefill from slot 0 cuts it.
With blocks of a whole chunk (`prefix_block` None) the rest is computed as a prefill from slot 0
computes it (a test: the same first logits, bit for bit); finer blocks (the server's 16 tokens, as
vLLM's) reuse more of a prompt, and its first prefill pass is shorter, so equal within rounding. A
prompt whose logprobs are asked for (echo) is prefilled whole. Nothing else is cleared when a row
is freed: the next prefill overwrites the row's K/V after the prefix it keeps (`keep_prefix`), and
a decode step reads a row's slots only up to its own position.

One loop iteration (`Scheduler._iteration`):
1. rows of finished or cancelled requests are freed;
2. prefill, up to `prefill_chunk` prompt tokens in all: the next chunk of the prompt being
   prefilled, then of the next waiting request, which takes a free row, and so on while the
   iteration's tokens stay under the budget (`SparseDecoder.prefill(rows=, start=)`: dense,
   one prompt per call, into its row, attending to its earlier chunks in the cache). A prompt
   is cut at multiples of `prefill_chunk` from its start, whoever else is waiting, so its
   prefill is the same computation alone or not. After its last chunk its first token is
   sampled from the prefill's logits. So between two of their steps the running sequences wait
   for about one chunk's worth of prompt tokens, however long the prompts, and many short
   prompts can join in one iteration;
3. one decode step over rows 0..n-1, n the smallest bucket (powers of two, and max_batch)
   holding the highest decoding row (`SparseDecoder.use_rows`): decoding rows feed their last
   token at their position; a row being prefilled feeds a pad token at the slot its next chunk
   overwrites; a free row a pad token at the slot after the prefix it keeps.
   Every row's cache is its own, so none of this reaches another row's K/V.
   On CUDA each bucket's step is one CUDA-graph replay, every bucket's graph
   captured at start, before any request holds a row.
Each live row then samples its next token with its own settings and generator.

With the per-sequence batch policy (the CPU default) a row's selection and arithmetic are its
own: a greedy request gives the tokens it gives alone (a test). With the shared policy (CUDA)
the batch's rows, idle ones included, pick one index set together, so a request's tokens may
depend on its neighbours (benchmarks/serve.py --agreement measures how often).
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from dejavu.generation import GENERATION
from dejavu.models.sampling import Penalties, sample_next

log = logging.getLogger("dejavu.serve")


class QueueFull(Exception):
    """The waiting queue holds max_queue requests (the server answers 429)."""


@dataclass
class Request:
    """One prompt to complete. `sink(event)` is called from the scheduler thread with
    ("token", text delta, token id, logprobs) as text becomes ready (a token ending mid-character waits for
    the next; logprobs: (id, logprob, [(id, logprob) of the `logprobs` most likely], the characters of text before
    it) of each token since the last event, where `logprobs` is set), then once ("done", finish_reason, number of
    tokens, the token ids) or ("error", message). With `prompt_logprobs`, ("prompt", logprobs of the prompt's
    tokens, the first one's logprob None) comes before the first token."""

    prompt: list[int]
    max_tokens: int
    sink: Callable[[tuple], None]
    temperature: float = 0.0  # already resolved (0 = greedy); the server passes the request's
    top_p: float = GENERATION.top_p
    top_k: int = GENERATION.top_k
    min_p: float = 0.0  # vLLM's; models/sampling.sample_next
    min_tokens: int = 0  # vLLM's: no end-of-generation or stop_ids token before this many tokens
    stop: tuple[str, ...] = ()
    seed: int | None = GENERATION.seed
    stop_at_eos: bool = True
    stop_ids: tuple[int, ...] = ()  # more ids that end it (vLLM's stop_token_ids: their text is kept, as vLLM keeps it)
    # each token's logprob under the model (before temperature, top-k and top-p, as vLLM's default reports it) and
    # this many most likely alternatives; None: none computed
    logprobs: int | None = None
    presence_penalty: float = 0.0  # openai_protocol.Params says how each applies
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()  # (token id, bias) pairs added to the logits, after the penalties
    # the prompt's tokens' logprobs under the prefill's logits with this many alternatives (OpenAI's echo)
    prompt_logprobs: int | None = None
    skip_special: bool = True  # special tokens are not text (vLLM's skip_special_tokens)
    cached_tokens: int = 0  # set at admission: the prompt's tokens a row held already (not prefilled again)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the server (client gone); the row is freed at the next step

    def cancel(self) -> None:
        self.cancelled = True


class TextTracker:
    """Incremental detokenization with stop strings: `add(token)` -> (text to send, stopped).
    Text waits while it ends in an incomplete UTF-8 character or in a prefix of a stop string;
    a stop string ends the text before it. skip_special: special tokens are not text (vLLM's
    skip_special_tokens)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], skip_special: bool = True):
        self.tok, self.stop, self.skip_special = tokenizer, stop, skip_special
        self.pending: list[int] = []  # tokens not yet in text (an incomplete character)
        self.text, self.sent = "", 0

    def add(self, token: int) -> tuple[str, bool]:
        self.pending.append(token)
        piece = self.tok.decode(self.pending, skip_special=self.skip_special)
        if piece.endswith("\ufffd"):
            return "", False
        self.pending = []
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self.flush(), True
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(self.sent, len(self.text) - hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta, False

    def length(self) -> int:
        """The characters the tokens added so far decode to (a held piece of a character as U+FFFD)."""
        return len(self.text) + (len(self.tok.decode(self.pending, skip_special=self.skip_special))
                                 if self.pending else 0)

    def flush(self) -> str:
        """All text not yet sent (at the end: an incomplete character too, as decode gives it)."""
        if self.pending:
            self.text += self.tok.decode(self.pending, skip_special=self.skip_special)
            self.pending = []
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta


class _Seq:
    """A request holding a cache row."""

    def __init__(self, req: Request, row: int, tokenizer, device):
        self.req, self.row = req, row
        self.pos = len(req.prompt)  # the slot the next decode step writes
        self.prefilled = 0  # prompt tokens in the cache
        self.tokens: list[int] = []
        self.logprobs: list[tuple] = []  # the tokens' logprobs not yet sent
        self.prompt_logprobs: list[tuple] = []
        self.prompt_text: TextTracker | None = None  # echo: the prompt's text, for its tokens' offsets
        self.penalties: Penalties | None = None  # made at the first sample, where the request has any
        self.text = TextTracker(tokenizer, req.stop, req.skip_special) if tokenizer is not None else None
        self.gen = None
        if req.temperature > 0:
            self.gen = torch.Generator(device=device)
            if req.seed is not None:
                self.gen.manual_seed(req.seed)
            else:
                self.gen.seed()
        self.last_t = 0.0


def buckets(max_batch: int) -> list[int]:
    """Decode batch sizes: powers of two below max_batch, and max_batch."""
    out, n = [], 1
    while n < max_batch:
        out.append(n)
        n *= 2
    return out + [max_batch]


class Scheduler:
    """Owns `engine` on its own thread; `submit` requests from any thread."""

    def __init__(self, engine, max_batch: int, max_queue: int, context: int | None = None, metrics=None,
                 prefill_chunk: int | None = None, prefix_caching: bool = True, prefix_block: int | None = None):
        """context: cache slots per row (prompt + completion), at most the model's positions
        (None: all of them); prefill_chunk: prompt tokens per prefill pass (None: whole prompts);
        prefix_caching: a prompt's first whole blocks of prefix_block tokens (None: of prefill_chunk) that a row
        already holds are not prefilled again."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        if prefix_block is not None and prefix_block < 1:
            raise ValueError(f"prefix_block must be >= 1, got {prefix_block}")
        self.engine, self.spec, self.dec = engine, engine.spec, engine.decoder
        self.max_batch, self.max_queue, self.metrics = max_batch, max_queue, metrics
        self.chunk = prefill_chunk or self.spec.max_positions  # None: whole prompts
        self._prefilling: _Seq | None = None  # the request whose prompt is being prefilled
        try:
            self.tokenizer = engine.tokenizer
        except Exception:  # noqa: BLE001 - no tokenizer: token ids only, no text
            self.tokenizer = None
        self.context = min(context or self.spec.max_positions, self.spec.max_positions)
        self.buckets = buckets(max_batch)
        self.rows: list[_Seq | None] = [None] * max_batch
        # the prompt tokens whose K/V each row holds from its prefills (kept after the request ends)
        self.cached: list[list[int]] = [[] for _ in range(max_batch)]
        self.prefix_caching = prefix_caching
        self.block = prefix_block or self.chunk
        self.waiting: deque[Request] = deque()
        self.cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.graphs: dict[int, object] = {}
        self.steps = 0
        self.error: str | None = None

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Allocate the cache (and capture the CUDA graphs), then start the thread."""
        eng, dec = self.engine, self.dec
        eng._graph = None  # the engine's own single-batch graph is not used by the server
        dec.setup(self.max_batch, self.context)
        if eng.use_graphs:
            from dejavu.runtime.graphs import DecodeGraph

            with torch.inference_mode():
                for n in self.buckets:  # before any row is live: warm-up writes garbage at the last slot
                    dec.use_rows(n)
                    self.graphs[n] = DecodeGraph(dec)
                dec.use_rows(self.max_batch)
                dec.empty_cache()
        self._thread = threading.Thread(target=self._run, name="dejavu-scheduler", daemon=True)
        self._thread.start()

    def submit(self, reqs: list[Request]) -> None:
        """Queue requests (all or none); QueueFull when the queue cannot take them all."""
        with self.cv:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(reqs) > self.max_queue:
                raise QueueFull(f"the queue holds {len(self.waiting)} of {self.max_queue} requests")
            self.waiting.extend(reqs)
            self.cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after its current step; requests still waiting or running get an error."""
        with self.cv:
            self._stop = True
            self.cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.rows)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while True:
                with self.cv:
                    while not self._stop and not self.waiting and self.running == 0:
                        self.cv.wait()
                    if self._stop:
                        break
                try:
                    self._iteration()
                except Exception as e:  # noqa: BLE001 - fail the batch's requests, keep serving
                    log.error("decode step failed:\n%s", traceback.format_exc())
                    self.error = f"{type(e).__name__}: {e}"
                    for i, s in enumerate(self.rows):
                        if s is not None:
                            self._finish(i, ("error", f"internal error in the decode step ({self.error})"))
        for i, s in enumerate(self.rows):
            if s is not None:
                self._finish(i, ("error", "the server is shutting down"))
        with self.cv:
            rest, self.waiting = list(self.waiting), deque()
        for r in rest:
            r.sink(("error", "the server is shutting down"))

    def _iteration(self) -> None:
        for i, s in enumerate(self.rows):
            if s is not None and s.req.cancelled:
                self._finish(i, None)
        spent = 0
        while spent < self.chunk:
            if self._prefilling is None and None in self.rows:
                with self.cv:
                    while self.waiting and self._prefilling is None:
                        req = self.waiting.popleft()
                        if not req.cancelled:
                            self._prefilling = self._admit(req)
            if self._prefilling is None:
                break
            spent += self._prefill(self._prefilling)
        live = [s for s in self.rows if s is not None and s.tokens]
        if live:
            self._step(live)

    def _admit(self, req: Request) -> _Seq:
        """req's row: the lowest free one (decode steps run on rows 0..n-1), the first whole blocks of its prompt
        that a row holds copied there where another holds more, and not prefilled again (prefix caching)."""
        row = self.rows.index(None)
        seq = self.rows[row] = _Seq(req, row, self.tokenizer, self.engine.device)
        held = [0] * self.max_batch
        if self.prefix_caching and req.prompt_logprobs is None:  # prompt logprobs need every position's logits
            held = [self._held(c, req.prompt) for c in self.cached]
        src = max(range(self.max_batch), key=lambda r: (held[r], r == row))
        n = held[src]
        if n and src != row:
            self.dec.copy_prefix(src, row, n)
        self.dec.keep_prefix(row, n)
        self.cached[row] = req.prompt[:n]
        seq.prefilled = req.cached_tokens = n
        if self.metrics is not None and n:
            self.metrics.cached_tokens(n)
        return seq

    def _held(self, cached: list[int], prompt: list[int]) -> int:
        # the tokens of prompt's first whole blocks that `cached` starts with, its last token never (its logits give
        # the first new token)
        n, c, end = 0, self.block, min(len(cached), len(prompt) - 1)
        while n + c <= end and cached[n:n + c] == prompt[n:n + c]:
            n += c
        return n

    def _prefill(self, seq: _Seq) -> int:
        """The next chunk of seq's prompt into its row (after the last, its first token); its tokens. Chunks end at
        multiples of the chunk from the prompt's start, where a prefix it holds ends elsewhere too."""
        dev, prompt = self.engine.device, seq.req.prompt
        a = seq.prefilled
        b = min(len(prompt), (a // self.chunk + 1) * self.chunk)
        ids = torch.tensor([prompt[a:b]], dtype=torch.long, device=dev)
        self.dec.use_rows(self.max_batch)
        every = seq.req.prompt_logprobs is not None
        logits = self.dec.prefill(ids, torch.tensor([b - a], device=dev), rows=torch.tensor([seq.row], device=dev),
                                  start=a, every=every)  # [1, V] (every: [1, b - a, V])
        if every:
            self._prompt_logprobs(seq, logits[0], a)
            logits = logits[:, -1]
        seq.prefilled = b
        self.cached[seq.row] = prompt[:b]
        if self.metrics is not None:
            self.metrics.prompt_tokens(b - a)
        if b == len(prompt):
            self._prefilling = None
            if every:
                seq.req.sink(("prompt", seq.prompt_logprobs))
            self._emit(seq, self._sample(seq, logits[0], None), logits[0])
        return b - a

    def _prompt_logprobs(self, seq: _Seq, logits: torch.Tensor, a: int) -> None:
        """Entries (as _emit's) of the prompt tokens that positions a.. of logits [S, V] predict; the first token's
        logprob None. Offsets: the characters of the prompt's text before each token."""
        prompt, n = seq.req.prompt, seq.req.prompt_logprobs
        if a == 0:
            seq.prompt_text = TextTracker(self.tokenizer, ()) if self.tokenizer is not None else None
            seq.prompt_logprobs.append((prompt[0], None, [], 0))
            self._count_text(seq, prompt[0])
        lp = torch.log_softmax(logits.float(), -1)
        nxt = torch.tensor(prompt[a + 1:a + 1 + lp.shape[0]], dtype=torch.long, device=lp.device)
        own = lp[torch.arange(nxt.numel(), device=lp.device), nxt].tolist()
        top = lp[:nxt.numel()].topk(n) if n else None
        for i, (t, v) in enumerate(zip(nxt.tolist(), own)):
            alts = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else []
            seq.prompt_logprobs.append((t, v, alts, seq.prompt_text.length() if seq.prompt_text else a + 1 + i))
            self._count_text(seq, t)

    @staticmethod
    def _count_text(seq: _Seq, token: int) -> None:
        if seq.prompt_text is not None:  # the prompt's text so far, a token at a time (no decode of every prefix)
            seq.prompt_text.add(token)

    def _step(self, live: list[_Seq]) -> None:
        n = next(b for b in self.buckets if b > max(s.row for s in live))
        dev = self.engine.device
        tokens = [0] * n
        pos = [0] * n
        for s in live:
            tokens[s.row], pos[s.row] = s.tokens[-1], s.pos
        for r in range(n):  # a free row: the slot after the prefix it holds (left as it is for the next prompt)
            if self.rows[r] is None:
                pos[r] = len(self.cached[r])
        pre = self._prefilling
        if pre is not None and pre.row < n:  # the slot its next chunk overwrites
            pos[pre.row] = pre.prefilled
        self.dec.use_rows(n)
        tok_t = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        step = self.graphs[n].run if n in self.graphs else self.dec.decode_step
        logits = step(tok_t, pos_t)  # [n, V]
        greedy = logits.argmax(dim=-1).tolist()
        self.steps += 1
        if self.metrics is not None:
            self.metrics.batch(len(live))
        for s in live:
            s.pos += 1
            self._emit(s, self._sample(s, logits[s.row], greedy[s.row]), logits[s.row])

    def _sample(self, seq: _Seq, logits: torch.Tensor, greedy: int | None) -> int:
        r = seq.req
        if Penalties.wanted(r.repetition_penalty, r.presence_penalty, r.frequency_penalty, r.logit_bias):
            if seq.penalties is None:
                seq.penalties = Penalties([r.prompt], logits.numel(), logits.device, r.repetition_penalty,
                                          r.presence_penalty, r.frequency_penalty, r.logit_bias)
            logits, greedy = seq.penalties(logits[None])[0], None
        if r.min_tokens > len(seq.tokens):  # the ends held back, as vLLM holds them
            ends = (*(self.spec.stop_ids if r.stop_at_eos else ()), *r.stop_ids)
            ends = torch.tensor(ends, dtype=torch.long, device=logits.device)
            logits, greedy = logits.index_fill(0, ends, float("-inf")), None
        if r.temperature == 0.0:
            return int(logits.argmax()) if greedy is None else greedy
        return int(sample_next(logits[None], r.temperature, r.top_k, r.top_p, seq.gen, r.min_p)[0])

    def _emit(self, seq: _Seq, token: int, logits: torch.Tensor) -> None:
        """Hand token to the request; free its row when it is done."""
        r, now = seq.req, time.perf_counter()
        seq.tokens.append(token)
        if seq.penalties is not None:
            seq.penalties.add(torch.tensor([token]))
        if self.metrics is not None:
            self.metrics.token(now - r.arrival if len(seq.tokens) == 1 else None,
                               now - seq.last_t if len(seq.tokens) > 1 else None)
        seq.last_t = now
        eos = r.stop_at_eos and token in self.spec.stop_ids
        if r.logprobs is not None and not eos:  # the end token is not text, so not listed
            lp = torch.log_softmax(logits.float(), -1)
            top = lp.topk(r.logprobs) if r.logprobs else None
            seq.logprobs.append((token, float(lp[token]),
                                 list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
                                 seq.text.length() if seq.text is not None else len(seq.tokens) - 1))
        stopped = False  # by a stop string
        delta = ""
        if seq.text is not None and not eos:
            delta, stopped = seq.text.add(token)
        if delta or (seq.text is None and not eos):
            r.sink(("token", delta, token, self._take(seq)))
        if eos or stopped or token in r.stop_ids:
            reason = "stop"
        elif len(seq.tokens) >= r.max_tokens or seq.pos >= self.context:
            reason = "length"
        else:
            return
        tail = seq.text.flush() if seq.text is not None and not stopped else ""
        if tail or seq.logprobs:  # the text still held, and the logprobs of tokens whose text a stop string cut
            r.sink(("token", tail, None, self._take(seq)))
        self._finish(seq.row, ("done", reason, len(seq.tokens), list(seq.tokens)))

    @staticmethod
    def _take(seq: _Seq) -> list[tuple]:
        out, seq.logprobs = seq.logprobs, []
        return out

    def _finish(self, row: int, event: tuple | None) -> None:
        seq, self.rows[row] = self.rows[row], None
        if seq is self._prefilling:
            self._prefilling = None
        # an idle row keeps its prompt's K/V (prefix caching) and decodes a pad token after them until the next
        # prefill: nothing after them counts as held
        self.dec.keep_prefix(row, len(self.cached[row]))
        if event is not None:
            seq.req.sink(event)
        if self.metrics is not None:
            self.metrics.finished(seq.req, event)

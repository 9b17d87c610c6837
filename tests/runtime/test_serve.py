"""`dejavu-serve` with real clients on loopback (CPU, the tiny test engine): the official
`openai` package, raw SSE framing through httpx, errors, the queue, disconnects, SIGTERM, and
a load test whose every token sequence must equal the prompt's solo greedy run."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from dejavu.engine_file import write_engine  # noqa: E402
from dejavu.runtime import Engine  # noqa: E402
from dejavu.runtime.serve import ServeSettings, Server, bind, main  # noqa: E402
from dejavu.runtime.openai_protocol import SamplingDefaults  # noqa: E402
from runtime_helpers import engine_from_dense, tiny_model, tiny_tokenizer_json  # noqa: E402

KEY = "sk-test"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


class Live:
    """A Server under uvicorn on a free loopback port, in a thread of this process."""

    def __init__(self, engine, name="tiny", **settings):
        self.server = Server(engine, ServeSettings(**settings), name)
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, log_level="error", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.uv.started:
            assert self.thread.is_alive() and time.time() - t0 < 30, "server did not start"
            time.sleep(0.01)

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_model(seed=11, vocab_size=300)
    header, tensors = engine_from_dense(model, 0.5, 0.5, tokenizer_json=tiny_tokenizer_json())
    path = tmp_path_factory.mktemp("serve") / "tiny.engine"
    write_engine(path, header, tensors)
    return path, header, tensors


@pytest.fixture(scope="module")
def ref(tiny):
    """A second engine for solo greedy references (the served one belongs to its scheduler)."""
    return Engine.from_tensors(tiny[1], tiny[2])


@pytest.fixture(scope="module")
def live(tiny):
    torch.set_num_threads(1)
    srv = Live(Engine.from_tensors(tiny[1], tiny[2]), api_key=KEY, max_batch=8, max_queue=512, max_context=64,
               prefill_chunk=4, prefix_block=3)  # prompts of 3-7 tokens: many are prefilled in chunks, some
    # after a cached prefix that ends inside a chunk
    yield srv
    srv.close()


def solo(ref, prompt, n) -> list[int]:
    ids = ref.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return ref.generate([ids], n)[0]


def post(live, path, body=None, content=None, key=KEY):
    return httpx.post(live.url + path, json=body, content=content, timeout=30,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


def test_openai_client_completion_stream_models(live, ref):
    c = live.client()
    want = solo(ref, "The game", 12)
    text = ref.tokenizer.decode(want)
    r = c.completions.create(model="tiny", prompt="The game", max_tokens=12, temperature=0)
    assert r.choices[0].text == text and r.object == "text_completion"
    assert r.choices[0].finish_reason == ("stop" if want[-1] == ref.spec.eos_id else "length")
    n_prompt = len(ref.tokenizer.encode("The game"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, len(want), n_prompt + len(want))
    chunks = list(c.completions.create(model="tiny", prompt="The game", max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    # a list of prompts (token ids too): one choice each, in order
    other = [5, 17, 42, 7]
    r = c.completions.create(model="tiny", prompt=[[5, 17, 42, 7], [9, 9, 31]], max_tokens=6, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[0].text == ref.tokenizer.decode(solo(ref, other, 6))
    assert r.usage.prompt_tokens == 7
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_sampling_seeded_and_stop(live, ref):
    c = live.client()
    a = c.completions.create(model="tiny", prompt="In 1990", max_tokens=10, temperature=0.9, top_p=0.8, seed=3)
    b = c.completions.create(model="tiny", prompt="In 1990", max_tokens=10, temperature=0.9, top_p=0.8, seed=3)
    assert a.choices[0].text == b.choices[0].text  # seeded: reproducible
    want = ref.tokenizer.decode(solo(ref, "In 1990", 16))
    stop = want[4:6]
    cut = want[:want.find(stop)]
    r = c.completions.create(model="tiny", prompt="In 1990", max_tokens=16, temperature=0, stop=[stop, "\x00zz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    s = c.completions.create(model="tiny", prompt="In 1990", max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in s) == cut
    r = c.completions.create(model="tiny", prompt="In 1990", max_tokens=20, temperature=0.5,
                             extra_body={"ignore_eos": True, "top_k": 5})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (20, "length")


def test_stop_token_ids_end_at_the_token_and_keep_its_text(live, ref):
    """vLLM's stop_token_ids: the completion ends at the first of them, its text kept (vLLM keeps a stop token's
    text unless it is special), finish_reason stop; streamed the same; ignore_eos does not turn them off."""
    c = live.client()
    free = solo(ref, "The game", 16)
    k = next(i for i in range(3, 16) if free[i] not in free[:i] and free[i] not in ref.spec.stop_ids)
    want = ref.tokenizer.decode(free[:k + 1])
    for extra in ({"stop_token_ids": [free[k], 7]}, {"stop_token_ids": [free[k]], "ignore_eos": True}):
        r = c.completions.create(model="tiny", prompt="The game", max_tokens=16, temperature=0, extra_body=extra)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (want, "stop", k + 1)
    s = c.completions.create(model="tiny", prompt="The game", max_tokens=16, temperature=0, stream=True,
                             extra_body={"stop_token_ids": [free[k]]})
    assert "".join(ch.choices[0].text for ch in s) == want


def test_sse_framing(live):
    body = {"model": "tiny", "prompt": "The game", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    assert len({o["id"] for o in objs}) == 1 and all(o["object"] == "text_completion" for o in objs)
    assert objs[-1]["choices"][0]["finish_reason"] is not None and objs[-1]["usage"]["completion_tokens"] >= 1
    assert all(o["choices"][0]["finish_reason"] is None for o in objs[:-1])


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"prompt": [7] * 200, "max_tokens": 1}, 400, "prompt"),
    ({"prompt": [7, 300]}, 400, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),  # Python's json reads NaN
    (b'{"prompt": "x", "top_p": NaN}', 400, "top_p"),
    (b'{"prompt": "x", "min_p": NaN}', 400, "min_p"),
    (b'{"prompt": "x", "repetition_penalty": NaN}', 400, "repetition_penalty"),
    (b'{"prompt": "x", "presence_penalty": NaN}', 400, "presence_penalty"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 129}, 400, "n"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "user": 5}, 400, "user"),
    ({"prompt": "x", "response_format": {"type": "text"}}, 400, "response_format"),  # chat's field
    ({"prompt": "x", "stop": ["a", 3]}, 400, "stop"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": "x", "stop_token_ids": [3, "a"]}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": 3}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ([1, 2], 400, None),
])
def test_bad_requests_get_openai_errors(live, body, status, param):
    r = post(live, "/v1/completions", content=body) if isinstance(body, bytes) else post(live, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_errors_through_openai_client_and_server_keeps_serving(live, ref):
    c = live.client()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model="tiny", prompt="x", max_tokens=100)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        live.client(key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert post(live, "/v1/models", key=None).status_code == 405  # GET only
    assert httpx.get(live.url + "/v1/models").status_code == 401
    assert httpx.get(live.url + "/nowhere").json()["error"]["type"] == "not_found_error"
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}  # open without the key
    r = c.completions.create(model="tiny", prompt="The game", max_tokens=4, temperature=0)
    assert r.choices[0].text == ref.tokenizer.decode(solo(ref, "The game", 4))


def test_metrics_prometheus_text(live):
    live.client().completions.create(model="tiny", prompt="The", max_tokens=3, temperature=0)
    text = httpx.get(live.url + "/metrics").text
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    vals = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}
    assert vals['dejavu_requests_total{endpoint="/v1/completions",code="200"}'] >= 1
    assert vals["dejavu_generation_tokens_total"] >= 3 and vals["dejavu_prompt_tokens_total"] >= 2
    assert vals["dejavu_queue_depth"] == 0 and vals["dejavu_running_sequences"] == 0
    for h in ("dejavu_time_to_first_token_seconds", "dejavu_time_per_output_token_seconds", "dejavu_batch_size"):
        assert f"# TYPE {h} histogram" in text
        assert vals[f'{h}_bucket{{le="+Inf"}}'] == vals[f"{h}_count"] >= 1


def stream_all(url, model, cases, clients):
    """(text, completion tokens) of each (prompt, max_tokens) case, streamed greedily by `clients` concurrent
    clients on one event loop (threads would fight the server for the GIL), client k taking cases k, k + clients..."""
    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)

        async def one(case):
            prompt, n = case
            stream = await c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens

        async def worker(k):
            return [await one(case) for case in cases[k::clients]]

        per = await asyncio.gather(*(worker(k) for k in range(clients)))
        await c.close()
        out = [None] * len(cases)
        for k, rs in enumerate(per):
            out[k::clients] = rs
        return out

    return asyncio.run(run())


def test_load_32_streaming_clients_equal_solo(live, ref):
    """200 short streaming requests from 32 concurrent clients (max batch 8): every one completes,
    its streamed text is its tokens' text, and its tokens are the solo greedy run's."""
    rng = random.Random(0)
    words = ["The game", "In 1990 the", "He said", "A new", "It was the", "She", "They were not", "On the"]
    cases = [(rng.choice(words) + " " * rng.randint(0, 2), rng.randint(1, 12)) for _ in range(200)]
    full = {w: solo(ref, w, 12) for w in {w for w, _ in cases}}  # greedy: n tokens = the first n of 12
    want = {(w, n): full[w][:n] for w, n in set(cases)}
    got = stream_all(live.url, "tiny", cases, clients=32)
    for case, (text, n) in zip(cases, got):
        assert (text, n) == (ref.tokenizer.decode(want[case]), len(want[case])), case
    h = live.server.metrics.batch_size
    assert h.bounds[1] == 2 and h.count > h.counts[1]  # steps with more than 2 rows (how many: timing)


class _Gate:
    """Holds the scheduler's iterations until opened (and slows each by `delay` s)."""

    def __init__(self, scheduler, delay=0.0):
        self.open, self.delay, inner = threading.Event(), delay, scheduler._iteration

        def iteration():
            self.open.wait()
            time.sleep(self.delay)
            inner()
        scheduler._iteration = iteration


def test_full_queue_answers_429_then_serves(tiny, ref):
    srv = Live(Engine.from_tensors(tiny[1], tiny[2]), max_batch=1, max_queue=2)
    try:
        gate = _Gate(srv.server.scheduler)
        body = {"prompt": "The game", "max_tokens": 3, "temperature": 0}
        with cf.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, srv, "/v1/completions", body, None, None) for _ in range(2)]
            t0 = time.time()
            while srv.server.scheduler.queue_depth < 2:
                assert time.time() - t0 < 10
                time.sleep(0.01)
            r = post(srv, "/v1/completions", body, key=None)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "dejavu_queue_depth 2" in httpx.get(srv.url + "/metrics").text
            gate.open.set()
            texts = [f.result().json()["choices"][0]["text"] for f in held]
        assert texts == [ref.tokenizer.decode(solo(ref, "The game", 3))] * 2
    finally:
        srv.server.scheduler._iteration = lambda: None
        srv.close()


def test_client_disconnect_frees_row(tiny):
    srv = Live(Engine.from_tensors(tiny[1], tiny[2]), max_batch=1)
    try:
        gate = _Gate(srv.server.scheduler, delay=0.02)
        gate.open.set()
        body = {"prompt": "The game", "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            next(r.iter_lines())  # the first token arrived; leave
        t0 = time.time()
        m = srv.server.metrics
        while m.finish.get("cancelled", 0) < 1:
            assert time.time() - t0 < 5, "the row was not freed"
            time.sleep(0.02)
        assert srv.server.scheduler.running == 0 and m.generation_total < 100
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        srv.close()


def test_chat_template_engine(tiny, ref):
    header = {**tiny[1], "chat_template": CHAT_TEMPLATE}
    srv = Live(Engine.from_tensors(header, tiny[2]), name="tiny-chat")
    try:
        c = srv.client()
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The game"}]
        ids = ref.tokenizer.encode("system: Be brief.\nuser: The game\nassistant:", add_bos=False)  # as the template writes it
        want = ref.tokenizer.decode(solo(ref, ids, 8))
        r = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
        chunks = list(c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=8, temperature=0,
                                                stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
        assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="tiny-chat", messages=[{"content": "no role"}])
    finally:
        srv.close()


def test_sigterm_finishes_inflight_stream(tiny, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dejavu.runtime.serve", str(tiny[0]), "--port", "0",
                             "--max-batch", "2", "--max-context", "64"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert line.startswith("dejavu-serve: tiny on http://127.0.0.1:"), line
        url = line.split(" on ")[1].split(" ")[0]
        t0 = time.time()
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() - t0 < 60
            time.sleep(0.05)
        body = {"prompt": "The game", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [first] + list(lines)
        data = [ln for ln in rest if ln]
        assert data[-1] == "data: [DONE]"  # the in-flight stream finished
        assert json.loads(data[-2][6:])["usage"]["completion_tokens"] == 40
        # uvicorn ends by re-raising the signal it handled, after its graceful shutdown
        assert proc.wait(30) in (0, -signal.SIGTERM)
        err = proc.stderr.read()
        assert "Traceback" not in err and "ERROR" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.mark.parametrize("argv,msg", [
    (["/nonexistent.engine"], "not found"),
    (["{engine}", "--max-batch", "0"], "max-batch"),
    (["{engine}", "--port", "70000"], "port"),
    (["{engine}", "--max-context", "1000"], "exceeds"),
])
def test_cli_errors_one_line_exit_2(tiny, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        main([a.replace("{engine}", str(tiny[0])) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("dejavu: error:") and msg in err and err.count("\n") == 1


def test_opt_mini_text_through_openai_client():
    """The shipped opt-mini (its weights and BPE tokenizer, random predictors at MLP density 0.3,
    dense heads: no compile in a test): real text, streamed and whole, equals the solo run."""
    from dejavu.models.loader import load_model
    from dejavu.models.presets import resolve

    folder = resolve("opt-mini")
    model, _ = load_model(folder)
    header, tensors = engine_from_dense(model.float().eval(), 0.3, 1.0,
                                        tokenizer_json=(folder / "tokenizer.json").read_text(encoding="utf-8"))
    ref_eng = Engine.from_tensors(header, tensors)
    prompt = "The king said unto them,"
    want = ref_eng.tokenizer.decode(ref_eng.generate([prompt], 16)[0])
    srv = Live(Engine.from_tensors(header, tensors), name="opt-mini", max_context=128)
    try:
        c = srv.client()
        r = c.completions.create(model="opt-mini", prompt=prompt, max_tokens=16, temperature=0)
        s = c.completions.create(model="opt-mini", prompt=prompt, max_tokens=16, temperature=0, stream=True)
        assert r.choices[0].text == "".join(ch.choices[0].text for ch in s) == want and want.strip()
    finally:
        srv.close()


def test_graph_per_bucket_path_with_a_stand_in(tiny, ref, monkeypatch):
    """The CUDA path's bookkeeping, on the CPU: with graphs on, start() captures one graph per
    bucket, on views of that many rows, and each step replays its bucket's graph. The stand-in
    does what the real warm-up does (decode steps at the last slot, marking garbage valid), so
    the tokens also show that the cache is emptied after capture."""
    import dejavu.runtime.graphs as graphs
    from dejavu.runtime.scheduler import Request, Scheduler

    captured, replayed = [], []

    class StandIn:
        def __init__(self, dec):
            self.dec, self.n = dec, dec.batch
            captured.append((dec.batch, dec.k_cache[0].shape[0]))
            dec.decode_step(torch.zeros(self.n, dtype=torch.long), torch.full((self.n,), dec.max_seq - 1))

        def run(self, tokens, pos):
            assert self.dec.batch == self.n == tokens.shape[0]
            replayed.append(self.n)
            return self.dec.decode_step(tokens, pos)

    monkeypatch.setattr(graphs, "DecodeGraph", StandIn)
    eng = Engine.from_tensors(tiny[1], tiny[2])
    eng.use_graphs = True
    sched = Scheduler(eng, 4, 8, 64, prefill_chunk=4)
    with torch.inference_mode():
        sched.start()
    try:
        assert captured == [(1, 1), (2, 2), (4, 4)]
        prompts = ["The game", "In 1990 the", "He said"]
        got = {}
        done = threading.Semaphore(0)

        def sink(i):
            def put(ev):
                if ev[0] != "token":
                    got[i] = ev[3] if ev[0] == "done" else ev
                    done.release()
            return put

        sched.submit([Request(prompt=ref.tokenizer.encode(p), max_tokens=8, sink=sink(i))
                      for i, p in enumerate(prompts)])
        for _ in prompts:
            assert done.acquire(timeout=60)
        assert set(replayed) <= {1, 2, 4} and 4 in replayed
        assert [got[i] for i in range(3)] == [solo(ref, p, 8) for p in prompts]
    finally:
        sched.stop()


def test_llama_engine_chat_from_its_folders_template(tmp_path):
    """A Llama folder's chat_template.jinja reaches the engine header; /v1/chat/completions renders it as
    transformers does (the template writes BOS: no second one) and completes as the engine does alone. Its
    generation_config.json's temperature and top_p are the server's defaults (a request that leaves them out
    samples as one that names them), OpenAI's with --sampling-defaults openai."""
    from llama_helpers import write_tiny_llama
    from transformers.utils.chat_template_utils import render_jinja_template

    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig

    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] | trim }}\n"
                "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    folder = write_tiny_llama(tmp_path / "llama", seed=3)
    (folder / "chat_template.jinja").write_text(template)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    path = tmp_path / "llama.engine"
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=512, calib_window=128, dtype="float32"), path,
                 progress=False)
    ref = Engine.load(path)
    assert ref.header["chat_template"] == template
    assert ref.header["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.9}
    msgs = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "The game"}]
    text = render_jinja_template(conversations=[msgs], chat_template=template, add_generation_prompt=True,
                                 bos_token="<s>", eos_token="</s>")[0][0]
    ids = ref.tokenizer.encode(text, add_bos=False)
    assert ids[0] == ref.spec.bos_id and ids.count(ref.spec.bos_id) == 1
    want = ref.tokenizer.decode(solo(ref, ids, 8))
    srv = Live(Engine.load(path), name="llama-chat")
    try:
        c = srv.client()
        r = c.chat.completions.create(model="llama-chat", messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
        assert srv.server.defaults == SamplingDefaults(temperature=0.6, top_p=0.9)

        def sampled(**kw):
            return c.completions.create(model="llama-chat", prompt="The game", max_tokens=12, seed=5, **kw
                                        ).choices[0].text
        assert sampled() == sampled(temperature=0.6, top_p=0.9) != sampled(temperature=1.0, top_p=1.0)
    finally:
        srv.close()
    assert Server(ref, ServeSettings(sampling_defaults="openai"), "x").defaults == SamplingDefaults()


def test_llama_engine_served_equals_solo(tmp_path):
    """A Llama-family engine (GQA, thresholded inputs) behind the server: 24 streaming requests from 8 concurrent
    clients, prompts prefilled in chunks of 4 (the first chunk holds the thresholded first position) while other
    rows decode, every completion equal to its prompt's solo greedy run."""
    from llama_helpers import write_tiny_llama

    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig

    folder = write_tiny_llama(tmp_path / "llama", seed=3)
    path = tmp_path / "llama.engine"
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=512, calib_window=128, dtype="float32"), path,
                 progress=False)
    ref = Engine.load(path)
    assert type(ref).__name__ == "LlamaEngine"
    rng = random.Random(1)
    cases = [([rng.randrange(3, 320) for _ in range(rng.randint(1, 9))], rng.randint(1, 10)) for _ in range(24)]
    want = [solo(ref, p, n) for p, n in cases]
    srv = Live(Engine.load(path), name="llama", api_key=KEY, max_batch=4, max_queue=64, max_context=64,
               prefill_chunk=4)
    try:
        got = stream_all(srv.url, "llama", cases, clients=8)
        # echo's prompt logprobs from the chunked prefill equal one whole prefill's (the first position thresholded,
        # the rest dense), and the last one the logits generate samples the first token from
        prompt = [rng.randrange(3, 320) for _ in range(11)]
        lp = srv.client().completions.create(model="llama", prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                             logprobs=1).choices[0].logprobs
        with torch.inference_mode():  # the engine's cache is an inference tensor
            ref.decoder.use_rows(1)
            whole = ref.decoder.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), every=True)[0]
        whole = whole.double().log_softmax(-1)
        want_lp = whole[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(prompt)], dtype=torch.float64), want_lp, atol=1e-4)
        last = ref.decode_logits([prompt], prompt_len=len(prompt))[0, -1].double().log_softmax(-1)
        assert torch.allclose(whole[-1], last, atol=1e-4) and lp.token_logprobs[-1] == pytest.approx(
            last.max().item(), abs=1e-4)
    finally:
        srv.close()
    for case, w, (text, n) in zip(cases, want, got):
        assert (text, n) == (ref.tokenizer.decode(w), len(w)), case


def _want_logprobs(ref, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    # each token's log-softmax row through the decode loop generate runs (the prompt prefilled, then decode steps)
    lg = ref.decode_logits([prompt + tokens], prompt_len=len(prompt))[0].double().log_softmax(-1)
    return lg[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def _raw(token: str) -> bytes:
    # a completions token string back to its bytes (OpenAI's "bytes:\\xNN..." for a piece of a character)
    return bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:") else token.encode()


def test_logprobs_of_completions_and_chat_equal_the_engines(tiny, ref, live):
    """OpenAI's logprobs (vLLM's: the model's distribution before temperature / top-k / top-p): completions'
    `logprobs: n` and chat's `logprobs: true, top_logprobs: n` list each generated token's logprob, equal to the
    engine's own decode-loop logits, with the n most likely tokens (the greedy token the first of them), streamed or
    not; the tokens' bytes make the text (a piece of a character as "bytes:\\xNN", OpenAI's form); completions'
    text_offset counts the characters before each token; a bad count is a 400."""
    c = live.client()
    prompt = ref.tokenizer.encode("The game")
    tokens = solo(ref, prompt, 10)
    want = _want_logprobs(ref, prompt, tokens)
    n_text = len([t for t in tokens if t not in ref.spec.stop_ids])
    r = c.completions.create(model="tiny", prompt="The game", max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n_text == r.usage.completion_tokens - (n_text < len(tokens))
    text = ref.tokenizer.decode(tokens[:n_text], skip_special=False)  # the random model writes a lone byte
    assert b"".join(_raw(t) for t in lp.tokens).decode(errors="replace") == text
    assert any(t.startswith("bytes:") for t in lp.tokens + [k for top in lp.top_logprobs for k in top])
    assert torch.allclose(torch.tensor(lp.token_logprobs, dtype=torch.float64),
                          want[torch.arange(n_text), torch.tensor(tokens[:n_text])], atol=1e-3)
    for i, top in enumerate(lp.top_logprobs):
        best = want[i].topk(3)
        assert len(top) == 3 and max(top.values()) == pytest.approx(best.values[0].item(), abs=1e-3)
        assert top[lp.tokens[i]] == lp.token_logprobs[i] == max(top.values())  # greedy: the most likely
    assert lp.text_offset == [len(ref.tokenizer.decode(tokens[:i])) for i in range(n_text)]
    chunks = list(c.completions.create(model="tiny", prompt="The game", max_tokens=10, temperature=0, logprobs=3,
                                       stream=True))
    got = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert sum((g.tokens for g in got), []) == lp.tokens and sum((g.text_offset for g in got), []) == lp.text_offset
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].logprobs is None
    header = {**tiny[1], "chat_template": CHAT_TEMPLATE}
    srv = Live(Engine.from_tensors(header, tiny[2]), name="tiny-chat")
    try:
        msgs = [{"role": "user", "content": "The game"}]
        ids = ref.tokenizer.encode("user: The game\nassistant:", add_bos=False)
        tokens = solo(ref, ids, 6)
        want = _want_logprobs(ref, ids, tokens)
        r = srv.client().chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        text = ref.tokenizer.decode(tokens[:len(content)], skip_special=False)
        assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == text
        for i, e in enumerate(content):
            assert e.logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-3) and _raw(e.token) == bytes(e.bytes)
            assert [a.logprob for a in e.top_logprobs] == pytest.approx(want[i].topk(2).values.tolist(), abs=1e-3)
        for body in ({"logprobs": 1}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
            with pytest.raises(openai.BadRequestError):
                srv.client().chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=2, extra_body=body)
    finally:
        srv.close()
    for body, param in (({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                        ({"top_logprobs": 2}, "top_logprobs")):
        r = post(live, "/v1/completions", {"prompt": "x", **body})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text


def test_n_choices_per_prompt(live, ref):
    """`n` choices a prompt, indexed prompt by prompt (OpenAI's order); greedy ones are alike; choice j of a seeded
    request equals the request with seed + j; the prompt's tokens count once in usage; streamed too."""
    c = live.client()
    r = c.completions.create(model="tiny", prompt=["The game", [5, 17, 42]], max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    want = [ref.tokenizer.decode(solo(ref, p, 6)) for p in ("The game", [5, 17, 42])]
    assert [ch.text for ch in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode("The game")) + 3
    assert r.usage.completion_tokens == sum(len(solo(ref, p, 6)) for p in ("The game", [5, 17, 42])) * 2
    kw = dict(model="tiny", prompt="In 1990", max_tokens=8, temperature=1.0)
    many = c.completions.create(**kw, n=3, seed=7)
    single = [c.completions.create(**kw, seed=7 + j).choices[0].text for j in range(3)]
    assert [ch.text for ch in many.choices] == single and len(set(single)) > 1
    chunks = list(c.completions.create(**kw, n=3, seed=7, stream=True))
    streamed = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == j)
                for j in range(3)]
    assert streamed == single


@pytest.mark.parametrize("pen", [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.2, "presence_penalty": 0.7},
                                 {"repetition_penalty": 0.8, "presence_penalty": -1.0}])
def test_penalties_steer_greedy_as_vllm_applies_them(live, ref, pen):
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty: the served greedy tokens equal a
    reference loop over the engine's decode-loop logits with transformers' RepetitionPenaltyLogitsProcessor (prompt
    and generated tokens) and OpenAI's formula (logit - frequency * count - presence * [count > 0], generated
    tokens) applied at every step; each changes the text; out of range is a 400."""
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, n = ref.tokenizer.encode("The tower"), 12  # its greedy tokens repeat
    rp = RepetitionPenaltyLogitsProcessor(pen.get("repetition_penalty", 1.0))
    out = []
    for _ in range(n):
        lg = ref.decode_logits([prompt + out], prompt_len=len(prompt))[0, -1].double()  # as generate runs them
        lg = rp(torch.tensor([prompt + out]), lg[None])[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=lg.numel()).double()
        lg = lg - pen.get("frequency_penalty", 0) * counts - pen.get("presence_penalty", 0) * (counts > 0).double()
        out.append(int(lg.argmax()))
        if out[-1] in ref.spec.stop_ids:
            break
    c = live.client()
    r = c.completions.create(model="tiny", prompt="The tower", max_tokens=n, temperature=0, extra_body=pen)
    assert r.choices[0].text == ref.tokenizer.decode(out)
    assert r.choices[0].text != ref.tokenizer.decode(solo(ref, prompt, n))
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": "x"}, {"repetition_penalty": 0}):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=bad)


def test_logit_bias_moves_the_choice(live, ref):
    """OpenAI's logit_bias: +100 on a token makes every greedy step choose it; −100 on the greedy first token makes
    the first token the engine's second most likely; keys that are not token ids, or values beyond ±100, are a
    400."""
    c = live.client()
    prompt = ref.tokenizer.encode("The game")
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logit_bias={"42": 100})
    assert r.choices[0].text == ref.tokenizer.decode([42] * 5)
    first = solo(ref, prompt, 1)[0]
    second = int(ref.decode_logits([prompt], prompt_len=len(prompt))[0, -1].topk(2).indices[1])
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(first): -100},
                             logprobs=0)
    assert r.choices[0].logprobs.tokens == [ref.tokenizer.decode([second], skip_special=False)]
    for bad in ({"x": 1}, {"5": 101}, {"5": "1"}, {"300": 1}, [5]):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"logit_bias": bad})


def test_echo_with_prompt_logprobs_as_lm_eval_reads_them(live, ref):
    """OpenAI's echo: the prompt's text before the completion; with logprobs, the prompt's tokens first (the first
    one's logprob null), each the dense model's log-probability given the tokens before it (the prefill's logits:
    what lm-eval's local-completions reads as a continuation's loglikelihood, with max_tokens 1), then the generated
    ones, their offsets after the prompt's text; streamed alike; prompts prefilled in chunks of 4."""
    from runtime_helpers import tiny_model

    dense = tiny_model(seed=11, vocab_size=300)
    c = live.client()
    prompt = ref.tokenizer.encode("The game began in 1990 and")
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp, text = r.choices[0].logprobs, ref.tokenizer.decode(prompt)
    gen = solo(ref, prompt, 3)
    assert r.choices[0].text == text + ref.tokenizer.decode(gen)
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        want = dense(torch.tensor([prompt]))[0].double().log_softmax(-1)
    got = torch.tensor(lp.token_logprobs[1:len(prompt)], dtype=torch.float64)
    assert torch.allclose(got, want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4)
    for i in range(1, len(prompt)):
        assert list(lp.top_logprobs[i].values())[:2] == pytest.approx(want[i - 1].topk(2).values.tolist(), abs=1e-4)
    assert lp.text_offset[:len(prompt)] == [len(ref.tokenizer.decode(prompt[:i])) for i in range(len(prompt))]
    assert lp.text_offset[len(prompt)] == len(text)
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    plain = c.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == r.choices[0].text and plain.choices[0].logprobs is None


# Qwen2.5's chat template, its tool parts as the checkpoint ships them (the system prompt shortened)
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags"
    "<|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == \"tool\" %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
              {"role": "user", "content": "And Lyon?"}]


class Scripted(Live):
    """A Live server whose model's tokens are a script (the tokens of `reply`, or the ids themselves, then EOS),
    whatever the logits say: what is under test is how the server reads the reply, not the model."""

    def __init__(self, engine, reply: str | list[int], **settings):
        super().__init__(engine, **settings)
        ids = engine.tokenizer.encode(reply, add_bos=False) if isinstance(reply, str) else reply
        script = ids + [engine.spec.eos_id]
        self.server.scheduler._sample = lambda seq, logits, greedy: script[len(seq.tokens)]


@pytest.fixture(scope="module")
def tool_engine():
    """The tiny engine with 2,048 positions (a prompt with tools is long) and Qwen2.5's tool template."""
    model = tiny_model(seed=11, vocab_size=300, max_position_embeddings=2048)
    header, tensors = engine_from_dense(model, 0.5, 0.5, tokenizer_json=tiny_tokenizer_json())
    return {**header, "chat_template": QWEN_TOOLS}, tensors


def test_tools_reach_the_template_as_transformers_renders_them(tool_engine):
    """A request's tools and its earlier calls (arguments sent as JSON text, handed to the template as objects, as
    vLLM hands them) and tool results render as transformers' apply_chat_template renders them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from dejavu.runtime.openai_protocol import ChatTemplate, SamplingDefaults, chat_params

    eng = Engine.from_tensors(*tool_engine)
    template = ChatTemplate(QWEN_TOOLS, eng.tokenizer)
    as_objects = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"city": "Paris"}}}
                                       for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in TOOL_TURNS]
    text = render_jinja_template(conversations=[as_objects], tools=WEATHER, chat_template=QWEN_TOOLS,
                                 add_generation_prompt=True)[0][0]
    assert '"arguments": {"city": "Paris"}' in text and '<tools>\n{"type": "function"' in text
    for choice_ in ("auto", "none"):
        p = chat_params({"messages": TOOL_TURNS, "tools": WEATHER, "tool_choice": choice_}, eng.tokenizer, template,
                        SamplingDefaults(), "hermes")
        assert p.prompts[0] == eng.tokenizer.encode(text, add_bos=False)
        assert p.tool_parser == ("hermes" if choice_ == "auto" else None)
    plain = chat_params({"messages": TOOL_TURNS[:1]}, eng.tokenizer, template, SamplingDefaults(), "hermes")
    assert plain.tool_parser is None and "<tools>" not in eng.tokenizer.decode(plain.prompts[0])


def test_tool_calls_as_vllms_hermes_parser_returns_them(tool_engine):
    """A reply of text then two <tool_call> blocks (the model's tokens scripted): the openai client reads the
    content, both calls and finish_reason "tool_calls", whole and streamed; streamed, no tool markup reaches the
    content."""
    reply = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice", "unit": "°C"}}\n</tool_call>')
    srv = Scripted(Engine.from_tensors(*tool_engine), reply, tool_call_parser="hermes")
    try:
        c = srv.client()
        r = c.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER, max_tokens=200)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me check."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
            ("get_weather", {"city": "Lyon"}), ("get_weather", {"city": "Nice", "unit": "°C"})]
        assert len({t.id for t in m.tool_calls}) == 2 and all(t.type == "function" for t in m.tool_calls)
        chunks = list(c.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER, max_tokens=200,
                                                stream=True))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        calls = _merged([t.model_dump(exclude_none=True) for ch in chunks for t in ch.choices[0].delta.tool_calls
                         or []])
        assert content == "Let me check." and [c["name"] for c in calls] == ["get_weather", "get_weather"]
        assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Lyon"}, {"city": "Nice", "unit": "°C"}]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the conversation goes on with the calls sent back
        again = TOOL_TURNS + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                                  "content": "15 C"}]
        assert c.chat.completions.create(model="tiny", messages=again, tools=WEATHER, max_tokens=200).choices
    finally:
        srv.close()


def test_fields_that_ask_nothing_of_the_model_are_accepted_and_ignored(tool_engine):
    """OpenAI's `user`, `store`, `metadata` and `service_tier`, and `response_format` {"type": "text"}, change
    nothing (the reply is the same), as vLLM ignores them; a value of another type, or a structured response_format
    (which needs constrained decoding), is a 400 naming the field."""
    srv = Scripted(Engine.from_tensors(*tool_engine), "Lyon is cloudy.")
    try:
        c = srv.client()
        base = dict(model="tiny", messages=TOOL_TURNS, max_tokens=20)
        plain = c.chat.completions.create(**base).choices[0].message.content
        extra = dict(user="alice", store=False, metadata={"app": "test"}, service_tier="auto",
                     response_format={"type": "text"})
        assert plain == "Lyon is cloudy." == c.chat.completions.create(**base, **extra).choices[0].message.content
        assert c.completions.create(model="tiny", prompt="x", max_tokens=3, user="alice").choices[0].text
        for bad, param in (({"user": 5}, "user"), ({"store": "yes"}, "store"), ({"metadata": [1]}, "metadata"),
                           ({"response_format": {"type": "json_object"}}, "response_format")):
            r = post(srv, "/v1/chat/completions", {**base, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        srv.close()


def test_a_reply_without_calls_is_content_and_llama3_json_calls(tool_engine):
    """With tools the reply stays content where it holds no call (finish "stop"), streamed alike; Llama 3.1's form
    ("parameters", calls separated by "; ") under llama3_json; Llama 3.2's pythonic list under pythonic."""
    srv = Scripted(Engine.from_tensors(*tool_engine), "It is <b>sunny</b> {maybe}.", tool_call_parser="hermes")
    try:
        c = srv.client()
        r = c.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER, max_tokens=100)
        assert r.choices[0].message.content == "It is <b>sunny</b> {maybe}." and r.choices[0].finish_reason == "stop"
        assert not r.choices[0].message.tool_calls
        chunks = list(c.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER, max_tokens=100,
                                                stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "It is <b>sunny</b> {maybe}."
    finally:
        srv.close()
    reply = '{"name": "get_weather", "parameters": {"city": "Lyon"}}; {"name": "get_time", "parameters": {}}'
    srv = Scripted(Engine.from_tensors(*tool_engine), reply, tool_call_parser="llama3_json")
    try:
        for stream in (False, True):
            out = srv.client().chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER,
                                                       max_tokens=100, stream=stream)
            if stream:
                chunks = list(out)
                calls = _merged([t.model_dump(exclude_none=True) for ch in chunks
                                 for t in ch.choices[0].delta.tool_calls or []])
                assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
                finish = chunks[-1].choices[0].finish_reason
            else:
                calls = [{"name": t.function.name, "arguments": t.function.arguments}
                         for t in out.choices[0].message.tool_calls]
                finish = out.choices[0].finish_reason
                assert out.choices[0].message.content is None
            assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
                ("get_weather", {"city": "Lyon"}), ("get_time", {})] and finish == "tool_calls"
    finally:
        srv.close()
    srv = Scripted(Engine.from_tensors(*tool_engine), '[get_weather(city="Lyon", days=[1, 2]), get_time()]',
                   tool_call_parser="pythonic")
    try:
        m = srv.client().chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER,
                                                 max_tokens=100).choices[0].message
        assert m.content is None and [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
            ("get_weather", {"city": "Lyon", "days": [1, 2]}), ("get_time", {})]
    finally:
        srv.close()


def test_tool_requests_the_server_cannot_answer_are_400(tiny, tool_engine):
    """tool_choice "auto" (the default with tools) without --enable-auto-tool-choice is vLLM's 400; "required" and a
    named function (constrained decoding) are a 400; malformed tools or calls are a 400."""
    srv = Live(Engine.from_tensors(*tool_engine))
    try:
        c = srv.client()
        with pytest.raises(openai.BadRequestError, match="requires --enable-auto-tool-choice"):
            c.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER, max_tokens=2)
        r = c.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER, tool_choice="none",
                                      max_tokens=2)
        assert r.choices[0].message.tool_calls is None
        bad = [dict(tools=WEATHER, tool_choice="required"),
               dict(tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
               dict(tools=[{"type": "function"}], tool_choice="none"), dict(tool_choice="none", tools=[]),
               dict(extra_body={"tool_choice": "auto"}), dict(extra_body={"tool_choice": "sometimes"})]
        for kw in bad:
            with pytest.raises(openai.BadRequestError):
                c.chat.completions.create(model="tiny", messages=TOOL_TURNS, max_tokens=2, **kw)
        broken = [dict(TOOL_TURNS[1], tool_calls=[{"id": "x", "type": "function",
                                                   "function": {"name": "f", "arguments": "{not json"}}])]
        with pytest.raises(openai.BadRequestError, match="not JSON"):
            c.chat.completions.create(model="tiny", messages=TOOL_TURNS[:1] + broken, max_tokens=2)
    finally:
        srv.close()
    with pytest.raises(SystemExit):
        main([str(tiny[0]), "--enable-auto-tool-choice"])


def _merged(deltas: list[dict]) -> list[dict]:
    # a stream's tool-call deltas merged by index as the openai client merges them: the first holds the id, type and
    # name, the arguments are the concatenation of every delta's
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": d.get("id"), "type": d.get("type"), "name": None, "arguments": ""})
        c["name"] = c["name"] or d["function"].get("name")
        c["arguments"] += d["function"].get("arguments", "")
        assert ("id" in d) == (d is next(x for x in deltas if x["index"] == d["index"]))  # the id once, first
    return [calls[j] for j in sorted(calls)]


def _stream_gate(parser: str, reply: str, step: int = 1):
    # reply fed `step` characters at a time: (content sent, deltas sent as the reply went, finish's result)
    from dejavu.runtime.tool_calls import StreamGate

    gate, sent, early = StreamGate(parser), "", []
    for a in range(0, len(reply), step):
        sent += gate.add(reply[a:a + step])
        early += gate.tool_deltas()
    return sent, early, gate.finish()


@pytest.mark.parametrize("parser, reply", [
    ("hermes", 'ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call><tool_call>{"name": "g", '
               '"arguments": {}}'),  # the second block unclosed (vLLM reads it too)
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", "a < b and <tool_ is not a call"),
    ("llama3_json", '<|python_tag|>{"name": "f", "arguments": {"a": 1}}'),
    ("llama3_json", ' {"name": "f"} starts with a space: content'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} trailing'),
    ("pythonic", '[get_weather(city="Lyon", days=[1, 2]), get_time()]'),
    ("pythonic", '[__import__("os").system("ls")]'),  # not a call of a name with literals: content, never run
    ("pythonic", "Sure: [a list] of things"),
    ("pythonic", '[f(**{"a": 1})]'),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": "x"}}, {"name": "g", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}] and text after'),
    ("mistral", "[TOOL_ is not [TOOL_CALLS] followed by calls"),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),  # cut short: content
    ("mistral", "[TOOL_CALLS]get_time{}"),  # no [ARGS]: content
])
def test_stream_gate_sends_what_the_whole_parse_returns(parser, reply):
    """Fed a character at a time, the streamed content and the calls (their deltas merged by index, as the openai
    client merges them) equal parsing the whole reply."""
    from dejavu.runtime.tool_calls import parse

    sent, early, (rest, late, has_calls) = _stream_gate(parser, reply)
    content, want = parse(parser, reply)
    assert sent + rest == (content or "") and has_calls == bool(want)
    if want:
        got = _merged(early + late)
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == [
            (c.name, json.loads(c.arguments)) for c in want]
        assert all(c["type"] == "function" and c["id"] for c in got) and len({c["id"] for c in got}) == len(got)
        assert "<tool" not in sent and "{" not in sent
    elif parser == "pythonic":  # a call that breaks under the others sent its first deltas already (as vLLM's)
        assert not early


def test_calls_stream_as_they_are_written():
    """Under hermes a call's id and name go out once its name is whole and its arguments object as it is written,
    before the reply ends, whatever the key order or the braces and quotes inside strings; the deltas merge into the
    whole parse's calls, their arguments the object's text as the model wrote it. A call whose JSON then breaks
    leaves the reply content (the deltas already sent stay sent, as under vLLM). Mistral's forms and llama3_json
    likewise."""
    from dejavu.runtime.tool_calls import parse

    reply = ('Checking.<tool_call>\n{"name": "search", "arguments": {"query": "a \\"}\\" {x}", "limit": 5, '
             '"tags": ["x", {"y": null}]}}\n</tool_call>\n<tool_call>\n{"arguments": {"n": 1}, "name": "count"}'
             '\n</tool_call>')
    content, want = parse("hermes", reply)
    assert content == "Checking." and [c.name for c in want] == ["search", "count"]
    for step in (1, 3, 7):
        sent, early, (rest, late, has_calls) = _stream_gate("hermes", reply, step)
        got = _merged(early + late)
        assert sent + rest == "Checking." and has_calls
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == [
            (c.name, json.loads(c.arguments)) for c in want]
        assert got[0]["arguments"] == '{"query": "a \\"}\\" {x}", "limit": 5, "tags": ["x", {"y": null}]}'
        first = [d for d in early if d["index"] == 0 and d["function"].get("arguments")]
        assert len(first) >= (8 if step == 1 else 3)  # the first call's arguments in many pieces, as written
        assert all(d["index"] == 1 for d in late) or not late  # the first call was whole before the reply ended
    # arguments written before the name: they go out after the name's delta, from where the stream stands
    sent, early, (_, late, _) = _stream_gate("hermes", '<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}')
    assert early[0]["function"] == {"name": "f", "arguments": ""} and _merged(early + late)[0]["arguments"] == (
        '{"a": [1, 2]}')
    # arguments that are not an object go out whole at the end, as the whole parse writes them
    _, early, (_, late, _) = _stream_gate("hermes", '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')
    assert _merged(early + late)[0]["arguments"] == '"{}"' and late
    # the JSON breaks after the name went out: the reply is content
    broken = '<tool_call>{"name": "f", "arguments": {"a": 1}, oops}</tool_call>'
    sent, early, (rest, late, has_calls) = _stream_gate("hermes", broken)
    assert early and not has_calls and not late and sent + rest == broken
    # Mistral's v11 form likewise, its ids nine letters and digits; its array form before v11 whole at the end
    reply = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}[TOOL_CALLS]get_time[ARGS]{}'
    content, want = parse("mistral", reply)
    sent, early, (rest, late, has_calls) = _stream_gate("mistral", reply)
    got = _merged(early + late)
    assert sent + rest == content == "Sure." and has_calls and [(c["name"], json.loads(c["arguments"])) for c in got] \
        == [(c.name, json.loads(c.arguments)) for c in want] and all(len(c["id"]) == 9 for c in got)
    assert got[0]["arguments"] == '{"city": "Paris", "days": [1, 2]}'
    assert len([d for d in early if d["index"] == 0 and d["function"].get("arguments")]) >= 8
    # its array form before v11 likewise, object by object (spaces around the commas, text after the array)
    reply = 'Ok.[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, "]"]}} ,\n {"arguments": {}, "name": "g"}] then'
    content, want = parse("mistral", reply)
    for step in (1, 5):
        sent, early, (rest, late, has_calls) = _stream_gate("mistral", reply, step)
        got = _merged(early + late)
        assert sent + rest == content == "Ok." and has_calls and [(c["name"], json.loads(c["arguments"]))
                                                                   for c in got] == [("f", {"a": [1, "]"]}), ("g", {})]
        assert got[0]["arguments"] == '{"a": [1, "]"]}' and all(len(c["id"]) == 9 for c in got)
        assert [d["function"]["name"] for d in early if "id" in d] == ["f", "g"] and not late
    # llama3_json's calls one after another ("parameters", "; " between, after the python tag)
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lyon", "days": [1, 2]}}; {"name": "t"}'
    content, want = parse("llama3_json", reply)
    sent, early, (rest, late, has_calls) = _stream_gate("llama3_json", reply)
    got = _merged(early + late)
    assert sent + rest == "" and content is None and has_calls and [
        (c["name"], json.loads(c["arguments"])) for c in got] == [(c.name, json.loads(c.arguments)) for c in want]
    assert got[0]["arguments"] == '{"city": "Lyon", "days": [1, 2]}' and got[1]["arguments"] == "{}"
    assert len([d for d in early if d["index"] == 0 and d["function"].get("arguments")]) >= 8


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_stream_gate_scans_each_character_once(parser, monkeypatch):
    """A long call streamed a character at a time: the scanners step over each character of the reply a bounded
    number of times (once for the call, once more for its arguments, once more for llama3_json's object), not again
    on every token, so a 16 KB call costs what its length costs; its arguments arrive whole and in order."""
    from dejavu.runtime import tool_calls

    steps = [0]
    for cls in (tool_calls._CallScan, tool_calls._ValueEnd):
        def counted(self, s, stop=None, _orig=cls.__call__):
            before = self.i
            out = _orig(self, s, stop) if stop is not None else _orig(self, s)
            steps[0] += self.i - before
            return out
        monkeypatch.setattr(cls, "__call__", counted)
    args = json.dumps({"text": 'a \\"}{[ ' * 1600, "n": [1, {"b": "]"}]})
    reply = {"hermes": '<tool_call>{"name": "write", "arguments": ' + args + "}</tool_call>",
             "llama3_json": '{"name": "write", "parameters": ' + args + "}",
             "mistral": "[TOOL_CALLS]write[ARGS]" + args}[parser]
    sent, early, (rest, late, has_calls) = _stream_gate(parser, reply)
    assert has_calls and _merged(early + late)[0]["arguments"] == args and len(early) > 1000
    assert len(reply) > 16_000 and steps[0] <= 3 * len(reply)


def test_prefix_cache_reaches_usage_and_metrics(live, ref):
    """A prompt sent again is served from the row that holds it: usage's prompt_tokens_details.cached_tokens counts
    its whole prefix blocks (3 tokens each here) but the last token, /metrics counts them, the text is the same."""
    c = live.client()
    prompt = list(range(40, 53))  # 13 tokens: four whole blocks before the last token
    first = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    again = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens in (0, 12)  # another test's prompt may share its start
    assert again.usage.prompt_tokens_details.cached_tokens == 12
    assert again.choices[0].text == first.choices[0].text == ref.tokenizer.decode(solo(ref, prompt, 5))
    text = httpx.get(live.url + "/metrics").text
    hits = [line for line in text.splitlines() if line.startswith("dejavu_prefix_cache_hit_tokens_total ")]
    assert hits and int(hits[0].split()[1]) >= 12
    from dejavu.runtime.serve import _settings, build_parser

    default = _settings(build_parser().parse_args(["x.engine"]))
    assert default.prefix_caching and default.prefix_block == 16  # vLLM's block size
    assert not _settings(build_parser().parse_args(["x.engine", "--no-enable-prefix-caching"])).prefix_caching
    assert _settings(build_parser().parse_args(["x.engine", "--prefix-block", "256"])).prefix_block == 256
    from dejavu.errors import DejavuError

    with pytest.raises(DejavuError, match="--prefix-block must be >= 1"):
        _settings(build_parser().parse_args(["x.engine", "--prefix-block", "0"]))


def test_min_p_and_min_tokens_as_vllm_applies_them(live, ref):
    """vLLM's min_p: at 1.0 only the most likely token stays, so sampling at temperature 1 is greedy; min_tokens: the
    end-of-generation id is not chosen before that many tokens (here EOS is pushed to +100 by logit_bias, so without
    it the completion is EOS alone); out of range is a 400."""
    c = live.client()
    prompt = ref.tokenizer.encode("The tower")
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=5,
                             extra_body={"min_p": 1.0, "ignore_eos": True})
    assert r.choices[0].text == ref.tokenizer.decode(ref.generate([prompt], 8, stop_at_eos=False)[0])
    eos = {str(ref.spec.eos_id): 100}
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logit_bias=eos)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logit_bias=eos,
                             extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    for bad in ({"min_p": 1.5}, {"min_p": -0.1}, {"min_tokens": -1}):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=bad)


def test_tokenize_and_detokenize_as_vllm_answers(live, ref, tool_engine):
    """vLLM's /tokenize (a prompt with the tokenizer's special-token rule or without; a chat request rendered as the
    chat endpoint renders it, tools included) and /detokenize (special tokens written); bad bodies are a 400, and the
    API key is needed."""
    text = "The game began"
    r = post(live, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    ids = ref.tokenizer.encode(text)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 64
    assert r["token_strs"] == [ref.tokenizer.tokenizer.id_to_token(t) for t in ids]
    bare = post(live, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == ref.tokenizer.encode(text, add_bos=False)
    assert post(live, "/detokenize", {"tokens": ids}).json()["prompt"] == ref.tokenizer.decode(ids, skip_special=False)
    for path, body in (("/tokenize", {"prompt": 5}), ("/tokenize", {"prompt": "x", "max_tokens": 3}),
                       ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}), ("/detokenize", {"tokens": [-1]}),
                       ("/detokenize", {"tokens": [10 ** 6]}), ("/detokenize", {"tokens": "1 2"})):
        assert post(live, path, body).status_code == 400
    assert post(live, "/tokenize", {"prompt": text}, key=None).status_code == 401
    srv = Live(Engine.from_tensors(*tool_engine))
    try:
        got = httpx.post(srv.url + "/tokenize", json={"messages": TOOL_TURNS, "tools": WEATHER}).json()["tokens"]
        from dejavu.runtime.openai_protocol import SamplingDefaults, chat_params

        want = chat_params({"messages": TOOL_TURNS, "tools": WEATHER, "tool_choice": "none"}, srv.server.tokenizer,
                           srv.server.template, SamplingDefaults()).prompts[0]
        assert got == want and "<tools>" in srv.server.tokenizer.decode(got)
    finally:
        srv.close()


@pytest.mark.parametrize("reply, content, want", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ('Let me look.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}', "Let me look.\n",
     [("get_weather", {"city": "Paris", "days": [1, 2]})]),
    ('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {}}]', "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": CET}', None, []),
    ('[TOOL_CALLS]get_weather[ARGS]["Paris"]', None, []),
    ('[TOOL_CALLS][ARGS]{"city": "Paris"}', None, []),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', None, []),  # a form not read: content
])
def test_mistral_parser_reads_both_forms(reply, content, want):
    """The mistral parser reads v11's `[TOOL_CALLS]name[ARGS]{...}` (repeated per call) and the older JSON array;
    the text before the first [TOOL_CALLS] is content; a call that does not parse makes the whole reply content."""
    from dejavu.runtime.tool_calls import parse

    got_content, calls = parse("mistral", reply)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert got_content == (content if want else reply)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_mistral_tool_calls_keep_special_tokens_and_short_ids(tool_engine):
    """Under the mistral parser the reply is detokenized with its special tokens (vLLM's skip_special_tokens false:
    Mistral's [TOOL_CALLS] is one), the calls' ids are nine letters and digits; without tools, and by default, a
    special token is not text, and skip_special_tokens false (a request's own) keeps it."""
    eng = Engine.from_tensors(*tool_engine)
    tok = eng.tokenizer
    call = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}]'
    script = tok.encode("Hi", add_bos=False) + [1] + tok.encode(call, add_bos=False)  # id 1: <pad>, special
    srv = Scripted(eng, script, tool_call_parser="mistral")
    try:
        c = srv.client()
        for stream in (False, True):
            out = c.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=WEATHER, max_tokens=100,
                                            stream=stream)
            if stream:  # the call in pieces as it is written, merged as the openai client merges them
                chunks = list(out)
                content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
                calls = _merged([t.model_dump(exclude_none=True) for ch in chunks
                                 for t in ch.choices[0].delta.tool_calls or []])
            else:
                content = out.choices[0].message.content
                calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                         for t in out.choices[0].message.tool_calls]
            assert content == "Hi<pad>" and len(calls) == 1 and calls[0]["name"] == "get_weather"
            assert json.loads(calls[0]["arguments"]) == {"city": "Lyon"}
            assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
        plain = c.chat.completions.create(model="tiny", messages=TOOL_TURNS, max_tokens=100)
        assert plain.choices[0].message.content == "Hi" + call
        kept = c.chat.completions.create(model="tiny", messages=TOOL_TURNS, max_tokens=100,
                                         extra_body={"skip_special_tokens": False})
        assert kept.choices[0].message.content == "Hi<pad>" + call
    finally:
        srv.close()


def test_chat_template_file_replaces_the_engines(tiny, ref, tmp_path):
    """vLLM's --chat-template FILE: an engine without a template answers chat requests rendered by the file's; a file
    that is not Jinja, or not there, is one error line."""
    from dejavu.errors import DejavuError
    from dejavu.runtime.serve import _settings, build_parser

    f = tmp_path / "t.jinja"
    f.write_text(CHAT_TEMPLATE)
    settings = _settings(build_parser().parse_args([str(tiny[0]), "--chat-template", str(f)]))
    assert settings.chat_template == CHAT_TEMPLATE and "chat_template" not in tiny[1]
    srv = Live(Engine.from_tensors(tiny[1], tiny[2]), chat_template=settings.chat_template)
    try:
        msgs = [{"role": "user", "content": "The game"}]
        r = srv.client().chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
        prompt = ref.tokenizer.encode("user: The game\nassistant:", add_bos=False)
        assert r.usage.prompt_tokens == len(prompt)
        assert r.choices[0].message.content == ref.tokenizer.decode(solo(ref, prompt, 4))
    finally:
        srv.close()
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    for path, why in ((tmp_path / "bad.jinja", "not a Jinja template"), (tmp_path / "none.jinja", "cannot read")):
        with pytest.raises(DejavuError, match=why):
            _settings(build_parser().parse_args([str(tiny[0]), "--chat-template", str(path)]))

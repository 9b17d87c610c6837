"""Prefix caching in the serving scheduler: a prompt's first whole blocks that a cache row holds (an earlier prompt's,
in a free row or a running one) are copied, not prefilled again, and the request's tokens and logprobs are those of a
scheduler that prefills everything: with blocks of a prefill chunk the prefill the same computation, bit for bit, with
finer blocks equal within rounding (OPT engines with either K/V policy, a Llama engine)."""
from __future__ import annotations

import queue

import pytest
import torch

from dejavu.runtime import Engine
from dejavu.runtime.scheduler import Request, Scheduler
from runtime_helpers import engine_from_dense, tiny_model

CHUNK = 4


def _opt(kv_policy):
    header, tensors = engine_from_dense(tiny_model(seed=9), 0.5, 0.5)
    return lambda **kw: Engine.from_tensors(header, tensors, kv_policy=kv_policy, **kw)


def _llama(tmp_path_factory):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from llama_helpers import write_tiny_llama

    root = tmp_path_factory.mktemp("prefix")
    path = root / "l.engine"
    build_engine(write_tiny_llama(root / "tiny", seed=2), BuildConfig(density=0.6, calib_tokens=256, calib_window=64,
                                                                      dtype="float32"), path, progress=False)
    return lambda **kw: Engine.load(path, **kw)


@pytest.fixture(scope="module", params=["opt-deferred", "opt-full", "llama"])
def make_engine(request, tmp_path_factory):
    if request.param == "llama":
        return _llama(tmp_path_factory)
    return _opt(request.param.split("-")[1])


def _run(engine, prompts_in_waves, caching: bool, max_tokens: int = 6, block: int | None = None):
    """Serve each wave of prompts (submitted together, greedy, logprobs on) after the last has finished:
    [(token ids, their logprobs, cached_tokens)] in order, and the prompt tokens prefilled."""
    from dejavu.runtime.serve_metrics import ServeMetrics

    metrics = ServeMetrics(3)
    sch = Scheduler(engine, max_batch=3, max_queue=8, context=64, metrics=metrics, prefill_chunk=CHUNK,
                    prefix_caching=caching, prefix_block=block)
    sch.start()
    out = []
    try:
        for wave in prompts_in_waves:
            qs = [queue.Queue() for _ in wave]
            reqs = [Request(prompt=list(p), max_tokens=max_tokens, sink=q.put, stop_at_eos=False, logprobs=0)
                    for p, q in zip(wave, qs)]
            sch.submit(reqs)
            for r, q in zip(reqs, qs):
                lps = []
                while (ev := q.get(timeout=60))[0] != "done":
                    assert ev[0] == "token", ev
                    lps += [e[1] for e in ev[3]]
                out.append((ev[3], lps, r.cached_tokens))
    finally:
        sch.stop()
    return out, metrics.prompt_total, metrics.cached_total


@pytest.mark.parametrize("block", [None, 3], ids=["chunk", "block3"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: the Triton kernels and a CUDA graph per decode bucket"))])
def test_prefix_cache_is_the_same_computation(make_engine, device, block):
    kw = {} if device == "cpu" else {"device": "cuda", "batch_policy": "per_sequence"}
    g = torch.Generator().manual_seed(3)
    a = torch.randint(4, 90, (14,), generator=g).tolist()
    b = a[:10] + torch.randint(4, 90, (5,), generator=g).tolist()  # shares 10 tokens with a: two whole chunks
    c = torch.randint(4, 90, (9,), generator=g).tolist()
    # a alone (row 0); then b (row 0 again: the two chunks it shares with a) and c (row 1, nothing held); then b's
    # continuation b3 (row 0: three chunks of b), b2 (row 1: three chunks copied from b3's running row) and a again
    # (row 2: a's own chunks went with b; the two it shares with b, copied); then a's continuation (row 0, three
    # chunks copied from the free row 2). In blocks of 3 tokens: 9 of the 10 shared, b3 all 15 of b (its prefill
    # starts inside a chunk), b2 12, a 9, a's continuation 12
    b2, b3 = b[:12] + [5, 6], b + [7, 8, 9, 10]
    waves = [[a], [b, c], [b3, b2, a], [a + [3]]]
    got, prefilled, cached = _run(make_engine(**kw), waves, caching=True, block=block)
    want, prefilled_all, none = _run(make_engine(**kw), waves, caching=False)
    assert [g[0] for g in got] == [w[0] for w in want]
    # the first token's logprob (the prefill's logits) bit for bit with whole chunks; the decode steps' within
    # rounding (their batch sizes differ when fewer prompt tokens are prefilled between them), and so the first
    # with finer blocks (a prefill pass of other lengths)
    if block is None:
        assert [g[1][0] for g in got] == [w[1][0] for w in want]
    torch.testing.assert_close(torch.tensor([g[1] for g in got]), torch.tensor([w[1] for w in want]),
                               rtol=0, atol=1e-5 if device == "cpu" else 2e-3)  # CUDA: fp16 engines, other kernels
    held = [0, 8, 0, 12, 12, 8, 12] if block is None else [0, 9, 0, 15, 12, 9, 12]
    assert [g[2] for g in got] == held and cached == sum(held) and none == 0
    assert [w[2] for w in want] == [0] * 7
    assert prefilled == prefilled_all - cached
    assert len({tuple(g[0]) for g in got}) > 1  # not one answer for every prompt


def test_prompt_logprobs_and_switched_off_prefill_everything():
    """echo's prompt logprobs need every position's logits: such a request prefills its whole prompt."""
    eng = _opt("deferred")()
    sch = Scheduler(eng, max_batch=2, max_queue=4, context=64, prefill_chunk=CHUNK)
    sch.start()
    try:
        p = list(range(10, 23))
        for want, kw in ((0, {}), (12, {}), (0, {"prompt_logprobs": 1})):
            q = queue.Queue()
            r = Request(prompt=p, max_tokens=2, sink=q.put, **kw)
            sch.submit([r])
            while q.get(timeout=60)[0] != "done":
                pass
            assert r.cached_tokens == want
    finally:
        sch.stop()

"""The side-stream protocol of PredictorRunner, checked on CPU with fake CUDA streams/events.

Under CUDA-graph capture every piece of side-stream work must be joined back into the main
stream (else capture fails), and layer l's indices must be waited for before they are used.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from dejavu.runtime import Engine
from dejavu.runtime.predictors import PredictorRunner
from runtime_helpers import engine_from_dense, tiny_model

PROMPT = [2, 17, 40, 5, 88, 63, 9]


class FakeCuda:
    def __init__(self):
        self.log, self.main, self.streams = [], SimpleNamespace(name="main"), []
        self.cur = self.main
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = f"side{len(fake.streams) or ''}"  # side, side1, ...
                fake.streams.append(self)

            def wait_event(self, ev):
                fake.log.append(("wait", self.name, ev))

        class Event:
            def record(self, stream=None):
                fake.log.append(("record", (stream or fake.cur).name, self))

        self.Stream, self.Event = Stream, Event
        self.main.wait_event = lambda ev: self.log.append(("wait", "main", ev))

    def current_stream(self, device=None):
        return self.cur

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.cur = self.cur, s
        try:
            yield
        finally:
            self.cur = prev


def _fake_cuda_engine(monkeypatch, header, tensors):
    """(fake, engine, decoder): a CPU engine with overlap on whose PredictorRunner believes it
    runs on CUDA, its streams and events the FakeCuda's (which logs every record and wait)."""
    fake = FakeCuda()
    for name in ("Stream", "Event", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    eng = Engine.from_tensors(header, tensors, "cpu", overlap=True)
    dec = eng.decoder
    old = dec.pred
    dec.pred = PredictorRunner(old.preds, old.ks, {k: list(v) for k, v in _plan(eng).items()}, old.topk,
                               SimpleNamespace(type="cuda"), overlap=True)
    return fake, eng, dec


SIDE_CASES = [("attn_in", 1, (0.5, 0.5)), ("mlp_in", 1, (0.5, 0.5)), ("attn_in", 0, (0.5, 0.5)),
              ("attn_in", 1, (0.5, 1.0)), ("attn_in", 1, (1.0, 0.5)), ("attn_in", 1, (1.0, 1.0))]


@pytest.mark.parametrize("source,lookahead,dens", SIDE_CASES)
def test_side_stream_joins_and_selects_the_same(monkeypatch, source, lookahead, dens):
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, dens[0], dens[1], source, lookahead)
    plain = Engine.from_tensors(header, tensors, "cpu", overlap=False)
    want = plain.generate([PROMPT, PROMPT[:3]], 10, stop_at_eos=False)

    fake, eng, dec = _fake_cuda_engine(monkeypatch, header, tensors)
    assert dec.pred.overlapping == (dens != (1.0, 1.0))
    assert eng.generate([PROMPT, PROMPT[:3]], 10, stop_at_eos=False) == want
    if not dec.pred.overlapping:
        assert fake.log == []
        return
    side = {s.name for s in fake.streams}
    assert side == {"side"}
    # every event recorded on the side stream is waited for by the main stream later on
    for i, (op, stream, ev) in enumerate(fake.log):
        if op == "record" and stream in side:
            assert any(o == "wait" and s == "main" and e is ev for o, s, e in fake.log[i + 1:])
    # the side stream starts each batch of work by waiting for an event the main stream recorded
    for i, (op, stream, ev) in enumerate(fake.log):
        if op == "wait" and stream in side:
            assert any(o == "record" and s == "main" and e is ev for o, s, e in fake.log[:i])
    # the last thing the side stream does in a step is joined: nothing on it after its last wait by main
    for name in side:
        last = max(i for i, (op, s, _) in enumerate(fake.log) if s == name)
        assert fake.log[last][0] == "record"


def _plan(eng):
    from dejavu.runtime.predictors import schedule

    s = eng.spec
    return schedule(s.num_layers, s.source, s.lookahead)


def test_heads_are_waited_for_before_attention_and_neurons_after(monkeypatch):
    """A layer's head predictor runs first with its own event: the main stream waits for it
    before the layer's attention and for the neuron predictor only after. Same tokens as inline."""
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "attn_in", 1)
    want = Engine.from_tensors(header, tensors, "cpu", overlap=False).generate([PROMPT], 6, stop_at_eos=False)
    fake, eng, dec = _fake_cuda_engine(monkeypatch, header, tensors)
    attn = eng.ops.sparse_attn_deferred

    def logged_attn(*a, **k):
        fake.log.append(("attn_begin", "main", None))
        return attn(*a, **k)
    eng.ops.sparse_attn_deferred = logged_attn
    assert eng.generate([PROMPT], 6, stop_at_eos=False) == want
    both = [l for l in range(eng.spec.num_layers) if eng.spec.sparse_attn(l) and eng.spec.sparse_mlp(l)]
    assert both
    for l in both:
        ev = dec.pred.done[l]
        recs = [i for i, (op, s, e) in enumerate(fake.log) if op == "record" and s == "side" and e in ev.values()]
        order = [next(k for k, e in ev.items() if e is fake.log[i][2]) for i in recs[:2]]
        assert order == ["attn", "mlp"]
        waits = {k: [i for i, (op, s, e) in enumerate(fake.log) if op == "wait" and s == "main" and e is ev[k]]
                 for k in ev}
        begins = [i for i, (op, _, _) in enumerate(fake.log) if op == "attn_begin"]
        # the first step's waits: is there an attention start between the heads' and the neurons' wait?
        a, m = waits["attn"][0], waits["mlp"][0]
        between = any(a < b < m for b in begins)
        assert between

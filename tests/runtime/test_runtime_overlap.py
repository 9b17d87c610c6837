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
        self.log, self.main = [], SimpleNamespace(name="main")
        self.cur = self.main
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

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


@pytest.mark.parametrize("source,lookahead,dens", [("attn_in", 1, (0.5, 0.5)), ("mlp_in", 1, (0.5, 0.5)),
                                                    ("attn_in", 0, (0.5, 0.5)), ("attn_in", 1, (0.5, 1.0)),
                                                    ("attn_in", 1, (1.0, 1.0))])
def test_side_stream_joins_and_selects_the_same(monkeypatch, source, lookahead, dens):
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, dens[0], dens[1], source, lookahead)
    plain = Engine.from_tensors(header, tensors, "cpu", overlap=False)
    want = plain.generate([PROMPT, PROMPT[:3]], 10, stop_at_eos=False)

    fake = FakeCuda()
    for name in ("Stream", "Event", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    eng = Engine.from_tensors(header, tensors, "cpu", overlap=True)
    old = eng.decoder.pred
    eng.decoder.pred = PredictorRunner(old.preds, old.ks, {k: list(v) for k, v in _plan(eng).items()}, old.topk,
                                       SimpleNamespace(type="cuda"), overlap=True)
    assert eng.decoder.pred.overlapping == (dens != (1.0, 1.0))
    assert eng.generate([PROMPT, PROMPT[:3]], 10, stop_at_eos=False) == want
    if not eng.decoder.pred.overlapping:
        assert fake.log == []
        return
    # every event recorded on the side stream is waited for by the main stream later on
    for i, (op, stream, ev) in enumerate(fake.log):
        if op == "record" and stream == "side":
            assert any(o == "wait" and s == "main" and e is ev for o, s, e in fake.log[i + 1:])
    # the side stream starts each batch of work by waiting for an event the main stream recorded
    for i, (op, stream, ev) in enumerate(fake.log):
        if op == "wait" and stream == "side":
            assert any(o == "record" and s == "main" and e is ev for o, s, e in fake.log[:i])
    # the last thing the side stream does in a step is joined: nothing on it after its last wait by main
    last_side = max(i for i, (op, s, _) in enumerate(fake.log) if s == "side")
    assert fake.log[last_side][0] == "record"


def _plan(eng):
    from dejavu.runtime.predictors import schedule

    s = eng.spec
    return schedule(s.num_layers, s.source, s.lookahead)

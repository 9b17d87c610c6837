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


SIDE_CASES = [("attn_in", 1, (0.5, 0.5), "attn_in", False), ("mlp_in", 1, (0.5, 0.5), "attn_in", False),
              ("attn_in", 0, (0.5, 0.5), "attn_in", False), ("attn_in", 1, (0.5, 1.0), "attn_in", False),
              ("attn_in", 1, (1.0, 1.0), "attn_in", False),
              # predictors held until after Q/K/V, and the L2 prefetch stream (fake prefetch op)
              ("attn_in", 1, (0.5, 0.5), "after_qkv", False), ("attn_in", 0, (0.5, 0.5), "after_qkv", True),
              ("mlp_in", 1, (0.5, 0.5), "after_qkv", True), ("attn_in", 1, (0.5, 0.5), "after_qkv", True),
              ("attn_in", 1, (0.5, 0.5), "attn_in", True), ("attn_in", 1, (1.0, 0.5), "after_qkv", True),
              # held until after the attention op (the predictors then overlap the MLP)
              ("attn_in", 1, (0.5, 0.5), "after_attn", False), ("mlp_in", 1, (0.5, 0.5), "after_attn", False),
              ("attn_in", 0, (0.5, 0.5), "after_attn", False),
              # only the neuron predictors held (after Q/K/V, after the attention op)
              ("attn_in", 1, (0.5, 0.5), "split_qkv", False), ("attn_in", 1, (0.5, 0.5), "split_attn", False),
              ("mlp_in", 1, (0.5, 0.5), "split_qkv", False), ("attn_in", 0, (0.5, 0.5), "split_attn", False),
              ("attn_in", 1, (0.5, 0.5), "split_qkv", True)]


@pytest.mark.parametrize("source,lookahead,dens,window,prefetch", SIDE_CASES)
def test_side_stream_joins_and_selects_the_same(monkeypatch, source, lookahead, dens, window, prefetch):
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, dens[0], dens[1], source, lookahead)
    plain = Engine.from_tensors(header, tensors, "cpu", overlap=False)
    want = plain.generate([PROMPT, PROMPT[:3]], 10, stop_at_eos=False)

    fake, eng, dec = _fake_cuda_engine(monkeypatch, header, tensors)
    dec.pred_window = window
    fetched = []
    if prefetch:  # a fake L2 warm-up op: logs which weight, rows and stream
        dec.side_streams = True
        dec.l2_prefetch = {"out": 1 << 30, "fc1": 1 << 30}

        def fake_prefetch(w, idx, group, *, max_bytes, out):
            fetched.append((w, idx.clone(), group, fake.cur.name))
            fake.log.append(("prefetch", fake.cur.name, None))
        eng.ops.prefetch_rows = fake_prefetch
    attn = eng.ops.sparse_attn_deferred

    def logged_attn(*a, **k):  # marks where each deferred attention op starts and ends
        fake.log.append(("attn_begin", "main", None))
        y = attn(*a, **k)
        fake.log.append(("attn_end", "main", None))
        return y
    eng.ops.sparse_attn_deferred = logged_attn
    assert dec.pred.overlapping == (dens != (1.0, 1.0))
    assert eng.generate([PROMPT, PROMPT[:3]], 10, stop_at_eos=False) == want
    if window == "after_qkv" and (source, lookahead) == ("attn_in", 1) and dens[1] < 1.0:
        # predictor launches (the side stream's waits) happen inside the attention op, except
        # those reading layer 0's input (layer 0's own indices are needed before its attention)
        inside, n = False, 0
        first = dec.pred.src_ready[("attn_in", 0)]
        for op, stream, ev in fake.log:
            inside = {"attn_begin": True, "attn_end": False}.get(op, inside)
            if op == "wait" and stream == "side" and ev is not first:
                n += 1
                assert inside
        assert n > 0
    if window == "after_attn" and (source, lookahead) == ("attn_in", 1) and dens[1] < 1.0:
        # the predictors reading layer j's input are launched (the side stream waits for it)
        # only once layer j's attention op has been issued, outside any attention op (layer 0's
        # input excepted: layer 0's own indices are needed before its attention)
        key = {id(e): k for k, e in dec.pred.src_ready.items()}
        inside, done, n, first = False, 0, 0, dec.pred.src_ready[("attn_in", 0)]
        for op, stream, ev in fake.log:
            inside = {"attn_begin": True, "attn_end": False}.get(op, inside)
            done += op == "attn_end"
            if op == "wait" and stream == "side" and ev is not first and id(ev) in key:
                n += 1
                assert not inside and done % len(dec.layers) > key[id(ev)][1] or done % len(dec.layers) == 0
        assert n > 0
    if window.startswith("split") and (source, lookahead) == ("attn_in", 1) and dens[1] < 1.0:
        # each layer input after the first is waited for twice by the side stream: for the head
        # predictors outside any attention op (at the point), then for the neuron predictors inside
        # the attention op that reads it (split_qkv) or after it (split_attn)
        waits = {}
        inside = False
        for op, stream, ev in fake.log:
            inside = {"attn_begin": True, "attn_end": False}.get(op, inside)
            if op == "wait" and stream == "side":
                waits.setdefault(id(ev), []).append(inside)
        first = dec.pred.src_ready[("attn_in", 0)]
        later = [v for k, v in waits.items() if k != id(first)]
        assert later and all(len(v) % 2 == 0 for v in later)
        for v in later:
            for a, b in zip(v[::2], v[1::2]):
                assert not a and b == (window == "split_qkv")
    if not dec.pred.overlapping:
        assert fake.log == []
        return
    side = {s.name for s in fake.streams}
    # every event recorded on a side stream is waited for by the main stream later on
    for i, (op, stream, ev) in enumerate(fake.log):
        if op == "record" and stream in side:
            assert any(o == "wait" and s == "main" and e is ev for o, s, e in fake.log[i + 1:])
    # a side stream starts each batch of work by waiting for an event the main stream recorded
    for i, (op, stream, ev) in enumerate(fake.log):
        if op == "wait" and stream in side:
            assert any(o == "record" and s == "main" and e is ev for o, s, e in fake.log[:i])
    # the last thing each side stream does in a step is joined: nothing on it after its last wait by main
    for name in side:
        last = max(i for i, (op, s, _) in enumerate(fake.log) if s == name)
        assert fake.log[last][0] == "record"
    sparse_attn = [l for l in range(eng.spec.num_layers) if eng.spec.sparse_attn(l)]
    if not prefetch or not sparse_attn:
        assert fetched == []
        return
    # the prefetch stream reads the selected heads' output-projection rows (and fc1's rows when
    # the layer's neurons are known before its attention: not with mlp_in / lookahead 0 ... of
    # the same layer), never on the main or predictor stream
    assert {f[3] for f in fetched} == {"side1"} and len(side) == 2
    wo = {id(dec.layers[l].wo_t): l for l in sparse_attn}
    w1 = {id(dec.layers[l].w1): l for l in range(eng.spec.num_layers)}
    outs = [f for f in fetched if id(f[0]) in wo]
    assert outs and all(f[2] == eng.spec.head_dim for f in outs)
    fc1 = [f for f in fetched if id(f[0]) in w1]
    early = [dec._neurons_early[l] for l in sparse_attn]
    assert bool(fc1) == any(early)
    assert all(f[2] == 1 and f[1].shape[-1] == eng.spec.mlp_k[w1[id(f[0])]] for f in fc1)


def _plan(eng):
    from dejavu.runtime.predictors import schedule

    s = eng.spec
    return schedule(s.num_layers, s.source, s.lookahead)


@pytest.mark.parametrize("heads_first,neurons_first", [(True, False), (False, False), (True, True)],
                         ids=["heads-first", "old-schedule", "neurons-first"])
def test_heads_are_waited_for_before_attention_and_neurons_after(monkeypatch, heads_first, neurons_first):
    """A layer's head predictor runs first with its own event: the main stream waits for it
    before the layer's attention and for the neuron predictor only after (heads_first False:
    the older schedule, both waited for before the attention; neurons_first: the neuron predictor
    runs first on the side stream, the waits as heads_first's). Same tokens either way."""
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "attn_in", 1)
    want = Engine.from_tensors(header, tensors, "cpu", overlap=False).generate([PROMPT], 6, stop_at_eos=False)
    fake, eng, dec = _fake_cuda_engine(monkeypatch, header, tensors)
    dec.pred.heads_first, dec.pred.neurons_first = heads_first, neurons_first
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
        assert order == (["attn", "mlp"] if heads_first and not neurons_first else ["mlp", "attn"])
        waits = {k: [i for i, (op, s, e) in enumerate(fake.log) if op == "wait" and s == "main" and e is ev[k]]
                 for k in ev}
        begins = [i for i, (op, _, _) in enumerate(fake.log) if op == "attn_begin"]
        # the first step's waits: is there an attention start between the heads' and the neurons' wait?
        a, m = waits["attn"][0], waits["mlp"][0]
        between = any(a < b < m for b in begins)
        assert between == heads_first

"""runtime/graphs.py on a CPU machine: the decode graph is warmed up and captured on one stream
of SparseDecoder.graph_priority (None: the device's highest). torch.cuda's stream, graph and
sync calls are replaced by recorders; the decoder is a stand-in that logs the stream it ran on."""
from types import SimpleNamespace

import pytest
import torch

from dejavu.runtime import graphs


class _Stream:
    made: list = []

    def __init__(self, device=None, priority=0):
        self.priority = priority
        _Stream.made.append(self)

    @staticmethod
    def priority_range():
        return (0, -5)  # (least, greatest), as CUDA reports them

    def wait_stream(self, other):
        pass


class _Ctx:
    """A context manager that logs itself and makes `stream` current while open."""

    def __init__(self, log, what, current, stream):
        self.log, self.what, self.current, self.stream = log, what, current, stream

    def __enter__(self):
        self.log.append(("enter", self.what))
        self.current["s"] = self.stream

    def __exit__(self, *exc):
        self.log.append(("exit", self.what))
        self.current["s"] = None


@pytest.fixture
def fake_cuda(monkeypatch):
    log: list = []
    _Stream.made = []
    current = {"s": None}
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _Ctx(log, ("stream", s), current, s))
    # torch.cuda.graph captures on `stream` (on a stream of its own when None)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, stream=None, **kw: _Ctx(log, ("graph", stream), current,
                                                                               stream or _Stream()))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: _Stream(priority=0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)
    return log, current


def _decoder(current, priority):
    ran = []

    def step(tokens, pos):
        ran.append(current["s"])
        return torch.zeros(tokens.shape[0], 7)
    return SimpleNamespace(batch=2, max_seq=8, device=torch.device("cpu"), graph_priority=priority,
                           decode_step=step), ran


@pytest.mark.parametrize("priority,want", [(None, -5), (0, 0), (-2, -2)])
def test_capture_stream_has_the_decoder_priority(fake_cuda, priority, want):
    log, current = fake_cuda
    dec, ran = _decoder(current, priority)
    g = graphs.DecodeGraph(dec, warmup=2)
    assert len(ran) == 3  # two warm-up steps and the captured one
    s = ran[-1]
    assert s is not None and s.priority == want
    assert all(r is s for r in ran)  # warm-up and capture on the same stream
    assert ("enter", ("graph", s)) in log
    assert g.logits.shape == (2, 7)

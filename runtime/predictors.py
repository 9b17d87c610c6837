"""When each layer's predictors run, and the one place that overlaps them on a side stream.

Lookahead convention (docs/ARCHITECTURE.md): the predictors of layer l read src[l - lookahead]
(src = "attn_in" or "mlp_in" of that layer; layer 0's "attn_in" when l - lookahead < 0).
The decoder calls `point(kind, j, x)` at every source point and `heads(l)` / `neurons(l)`
right before it needs layer l's indices. The same code orders the predictor calls whether
the overlap is on or off; with `overlap=False` (or on CPU) they run inline on the current
stream, with it on they run on a side CUDA stream, fenced by per-layer events. Streams,
events and index buffers are created once, in `__init__` (engine activation).

`point(..., hold=True)` keeps the launch pending until `flush()` (the decoder calls it
from inside the attention op, after the Q/K/V kernels: the side stream's predictor reads
then overlap the latency-bound attention kernels instead of the bandwidth-bound Q/K/V
kernel). `hold_kinds` says which predictors a hold keeps back (default both; ("mlp",): the
head predictors launch at once, the neuron predictors at the flush). The predictors still
read the same x; a layer whose indices are asked for while pending is flushed first, so
holding never changes what is selected.

A layer's head predictor runs before its neuron predictor, each with its own event: the main
stream waits only for the heads before that layer's attention, so the neuron predictor's
work overlaps the attention too. `on_heads(l, idx)`, when set, is called right after a layer's
head top-k, before its event: work that needs the heads and must be done before the layer's
attention (the decoder's deferred K/V catch-up) then runs on the side stream too.
"""
from __future__ import annotations

import torch


KINDS = ("attn", "mlp")  # the order a layer's predictors run in (heads are needed first)


def schedule(num_layers: int, source: str, lookahead: int) -> dict[tuple[str, int], list[int]]:
    """{(point kind, layer j): [layers whose predictors read that point]}."""
    out: dict[tuple[str, int], list[int]] = {}
    for l in range(num_layers):
        j = l - lookahead
        key = (source, j) if j >= 0 else ("attn_in", 0)
        out.setdefault(key, []).append(l)
    return out


class PredictorRunner:
    """Runs predictor + top-k per layer; `overlap` puts them on a side stream (CUDA only).

    preds[l] = {"mlp": (a, b, bias) | None, "attn": (a, b, bias) | None}; ks[l] = (k_mlp, k_attn).
    `topk(x, a, b, bias, k, shared=...)` is the op; `shared` selects one index set per batch.
    """

    def __init__(self, preds, ks, plan, topk, device: torch.device, overlap: bool, shared: bool = False):
        self.preds, self.ks, self.topk, self.shared = preds, ks, topk, shared
        # Only layers with a predictor are launched: every launch is then consumed by heads()
        # or neurons(), so under CUDA-graph capture the side stream always rejoins the main one.
        active = lambda l: preds[l]["mlp"] is not None or preds[l]["attn"] is not None  # noqa: E731
        self.plan = {key: [l for l in ls if active(l)] for key, ls in plan.items()}
        self.plan = {key: ls for key, ls in self.plan.items() if ls}
        L = len(preds)
        self.idx: list[dict[str, torch.Tensor | None]] = [{"mlp": None, "attn": None} for _ in range(L)]
        self.trace: list | None = None  # tests: append (layer, kind, idx) for every call
        self._keep: list[torch.Tensor] = []
        self._pending: list[tuple] = []  # held point() calls: (kind, j, layers, x2, kinds)
        self.hold_kinds: tuple[str, ...] = KINDS  # the predictors a hold keeps back
        self.side = None
        # False: the schedule before 2026-12-02 (neurons first, the main stream waits for both
        # of a layer's predictors before its attention); kept for the benchmark's ablation
        self.heads_first = True
        # True: a layer's neuron predictor runs before its head predictor on the side stream, each kind's
        # indices still awaited on their own event (heads_first's waits); changes timing only
        self.neurons_first = False
        self.on_heads = None  # callable(l, idx) after a layer's head top-k (module docstring)
        if overlap and device.type == "cuda" and self.plan:
            self.side = torch.cuda.Stream(device=device)
            self.src_ready = {key: torch.cuda.Event() for key in self.plan}
            # one event per layer and kind: the head predictor runs first and its event lets the
            # main stream start that layer's attention while the neuron predictor still runs
            self.done = [{kind: torch.cuda.Event() for kind in KINDS if preds[l][kind] is not None}
                         for l in range(L)]

    @property
    def overlapping(self) -> bool:
        return self.side is not None

    def begin_step(self) -> None:
        """Start a forward pass (every index of the previous one has been consumed)."""
        self._keep.clear()
        self._pending.clear()

    def point(self, kind: str, j: int, x: torch.Tensor, hold: bool = False) -> None:
        """x: [..., D] is layer j's `kind` input; launch the predictors that read it (hold:
        at the next `flush()`, or when one of their layers' indices is asked for)."""
        layers = self.plan.get((kind, j))
        if not layers:
            return
        x2 = x.reshape(-1, x.shape[-1])  # [rows, D]
        if hold:
            now = tuple(k for k in KINDS if k not in self.hold_kinds)
            held = tuple(k for k in KINDS if k in self.hold_kinds)
            if now:
                self._launch(kind, j, layers, x2, now)
            if held:
                self._pending.append((kind, j, layers, x2, held))
            return
        self._launch(kind, j, layers, x2, KINDS)

    def flush(self) -> None:
        """Launch the held predictors (in the order they were held)."""
        pending, self._pending = self._pending, []
        for args in pending:
            self._launch(*args)

    def _launch(self, kind, j, layers, x2, kinds) -> None:
        if self.side is None:
            for l in layers:
                self._predict(l, x2, kinds=kinds)
            return
        # Overlap: the side stream waits for x, then runs these layers' predictors while the
        # main stream goes on; x stays referenced until the step ends (no allocator reuse).
        ev = self.src_ready[(kind, j)]
        ev.record()
        self.side.wait_event(ev)
        self._keep.append(x2)
        with torch.cuda.stream(self.side):
            for l in layers:
                self._predict(l, x2, self.done[l], kinds)

    def _predict(self, l: int, x: torch.Tensor, done: dict | None = None, kinds=KINDS) -> None:
        """Layer l's indices of `kinds`, heads first (needed first); done: per-kind events to record."""
        for kind in (KINDS if self.heads_first and not self.neurons_first else KINDS[::-1]):
            p = self.preds[l][kind]
            if p is None or kind not in kinds:
                continue
            k_mlp, k_attn = self.ks[l]
            idx = self.topk(x, *p, k_attn if kind == "attn" else k_mlp, shared=self.shared)
            self.idx[l][kind] = idx
            if kind == "attn" and self.on_heads is not None:
                self.on_heads(l, idx)
            if done is not None:
                done[kind].record()
            if self.trace is not None:
                self.trace.append((l, kind, idx.detach().clone()))

    def _get(self, l: int, kind: str) -> torch.Tensor | None:
        if self.preds[l][kind] is None:
            return None
        need = [k for k in ((kind,) if self.heads_first else KINDS) if self.preds[l][k] is not None]
        if any(l in p[2] and any(k in p[4] for k in need) for p in self._pending):
            self.flush()
        if self.side is not None:
            for k in need:  # the events of those predictors
                torch.cuda.current_stream().wait_event(self.done[l][k])
        return self.idx[l][kind]

    def heads(self, l: int) -> torch.Tensor | None:
        """Selected heads of layer l ([rows, Kh] or [Kh]); None = all heads (dense)."""
        return self._get(l, "attn")

    def neurons(self, l: int) -> torch.Tensor | None:
        """Selected MLP neurons of layer l ([rows, K] or [K]); None = all (dense)."""
        return self._get(l, "mlp")

"""When each layer's predictors run, and the one place that overlaps them on a side stream.

Lookahead convention (docs/ARCHITECTURE.md): the predictors of layer l read src[l - lookahead]
(src = "attn_in" or "mlp_in" of that layer; layer 0's "attn_in" when l - lookahead < 0).
The decoder calls `point(kind, j, x)` at every source point and `heads(l)` / `neurons(l)`
right before it needs layer l's indices. The same code orders the predictor calls whether
the overlap is on or off; with `overlap=False` (or on CPU) they run inline on the current
stream, with it on they run on a side CUDA stream, fenced by per-layer events. Streams,
events and index buffers are created once, in `__init__` (engine activation).

A layer's head predictor runs before its neuron predictor, each with its own event: the main
stream waits only for the heads before that layer's attention, so the neuron predictor's
work overlaps the attention too (6.59 vs 6.74 ms/token at OPT-30B d0.3 against waiting for both;
the neuron predictor first measured the same, 6.24 vs 6.23). `on_heads(l, idx)`, when set, is called
right after a layer's head top-k, before its event: work that needs the heads and must be done
before the layer's attention (the decoder's refresh-head pick) then runs on the side stream too.
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

    preds[l] = {"mlp": (a, b, bias, scales) | None, "attn": ... | None}; ks[l] = (k_mlp, k_attn); scales:
    None, or (a_scale, b_scale) of int8 a and b. `topk(x, a, b, bias, k, shared=..., scales=...)` is the op;
    `shared` selects one index set per batch.
    shares[l]: (min_share, k_max) of layer l's per-token K (None: k_mlp rows, every one kept): its
    top-k_max then also gives n [rows] int32 (`kept(l)`): the first n of each row's indices are kept. With one
    set for the batch (`shared`, more than one row) there is no per-token count: k_mlp rows, all kept.
    """

    def __init__(self, preds, ks, plan, topk, device: torch.device, overlap: bool, shared: bool = False,
                 shares=None):
        self.preds, self.ks, self.topk, self.shared = preds, ks, topk, shared
        self.shares = shares or [None] * len(preds)
        # Only layers with a predictor are launched: every launch is then consumed by heads()
        # or neurons(), so under CUDA-graph capture the side stream always rejoins the main one.
        active = lambda l: preds[l]["mlp"] is not None or preds[l]["attn"] is not None  # noqa: E731
        self.plan = {key: [l for l in ls if active(l)] for key, ls in plan.items()}
        self.plan = {key: ls for key, ls in self.plan.items() if ls}
        L = len(preds)
        self.idx: list[dict[str, torch.Tensor | None]] = [{"mlp": None, "attn": None} for _ in range(L)]
        self.n_kept: list[torch.Tensor | None] = [None] * L  # [rows] int32 where shares[l] is set
        self.trace: list | None = None  # tests: append (layer, kind, idx) for every call
        self._keep: list[torch.Tensor] = []
        self.side = None
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

    def point(self, kind: str, j: int, x: torch.Tensor) -> None:
        """x: [..., D] is layer j's `kind` input; launch the predictors that read it."""
        layers = self.plan.get((kind, j))
        if not layers:
            return
        x2 = x.reshape(-1, x.shape[-1])  # [rows, D]
        if self.side is None:
            for l in layers:
                self._predict(l, x2)
            return
        # Overlap: the side stream waits for x, then runs these layers' predictors while the
        # main stream goes on; x stays referenced until the step ends (no allocator reuse).
        ev = self.src_ready[(kind, j)]
        ev.record()
        self.side.wait_event(ev)
        self._keep.append(x2)
        with torch.cuda.stream(self.side):
            for l in layers:
                self._predict(l, x2, self.done[l])

    def _predict(self, l: int, x: torch.Tensor, done: dict | None = None) -> None:
        """Layer l's indices, heads first (needed first); done: per-kind events to record."""
        for kind in KINDS:
            p = self.preds[l][kind]
            if p is None:
                continue
            k_mlp, k_attn = self.ks[l]
            a, b, bias, scales = p
            share = self.shares[l] if kind == "mlp" and not (self.shared and x.shape[0] > 1) else None
            self.n_kept[l] = None
            if share is None:
                idx = self.topk(x, a, b, bias, k_attn if kind == "attn" else k_mlp, shared=self.shared, scales=scales)
            else:  # per sequence (or batch 1, where the shared set is the row's own)
                idx, self.n_kept[l] = self.topk(x, a, b, bias, share[1], min_share=share[0], scales=scales)
                idx = idx[0] if self.shared else idx  # n_kept stays [1]
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
        if self.side is not None:  # the event of that predictor
            torch.cuda.current_stream().wait_event(self.done[l][kind])
        return self.idx[l][kind]

    def heads(self, l: int) -> torch.Tensor | None:
        """Selected heads of layer l ([rows, Kh] or [Kh]); None = all heads (dense)."""
        return self._get(l, "attn")

    def neurons(self, l: int) -> torch.Tensor | None:
        """Selected MLP neurons of layer l ([rows, K] or [K]); None = all (dense)."""
        return self._get(l, "mlp")

    def kept(self, l: int) -> torch.Tensor | None:
        """n [rows] int32: the first n of layer l's selected neurons are kept (a per-token K; call after
        neurons(l), whose event covers it); None: every selected neuron is kept."""
        return self.n_kept[l]


def runner_for(spec, tensors: dict[str, torch.Tensor], topk, device: torch.device, overlap: bool,
               shared: bool = False) -> PredictorRunner:
    """The PredictorRunner of an engine: each layer's predictor weights (a, b, bias, scales) where that
    layer is sparse (scales: (a_scale, b_scale) of an int8 kind, spec.int8_predictors), K per layer and
    the lookahead schedule from the spec."""
    def weights(l: int, kind: str):
        p = f"layers.{l}.pred_{kind}."
        scales = (tensors[p + "a_scale"], tensors[p + "b_scale"]) if kind in spec.int8_predictors else None
        return tensors[p + "a"], tensors[p + "b"], tensors[p + "bias"], scales

    preds = [{"mlp": weights(l, "mlp") if spec.sparse_mlp(l) else None,
              "attn": weights(l, "attn") if spec.sparse_attn(l) else None} for l in range(spec.num_layers)]
    ks = list(zip(spec.mlp_k, spec.attn_k))
    shares = [spec.token_k[l] if spec.token_k is not None and spec.sparse_mlp(l) else None
              for l in range(spec.num_layers)]  # (min_share, k_max)
    plan = schedule(spec.num_layers, spec.source, spec.lookahead)
    return PredictorRunner(preds, ks, plan, topk, device, overlap, shared, shares)

"""The sparse OPT decoder over engine tensors (kernel layout, docs/ARCHITECTURE.md).

Three passes over the same weights:
- `prefill(ids)`: dense over a right-padded prompt batch, K/V of every head into the cache.
- `decode_step(tokens, pos)`: one token per sequence, sparse heads and neurons chosen by the
  predictors, static shapes and no host sync (so a CUDA graph can capture it; graphs.py).
- `forward_tokens(ids)`: token-parallel sparse logits for evaluation; every position gets
  its own selection, as if decoded one token at a time from an empty cache.
Layers whose K equals N run dense (no predictor), so density 1.0 is the dense model.

The pieces it drives: the K/V policy (runtime/kv_policy.py: the static cache and, at batch 1, the
refresh-head pick) and the predictor runner (runtime/predictors.py: when each layer's predictors
run, on a side stream with the overlap on). This file is the layer loop.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from dejavu.runtime.kv_policy import KV_POLICIES, REFRESH_AUTO, KVCache, RefreshHeads
from dejavu.runtime.ops import Ops, PendingLN, attend, skips_zero
from dejavu.runtime.predictors import runner_for
from dejavu.runtime.spec import EngineSpec

__all__ = ["DecodeOptions", "KV_POLICIES", "REFRESH_AUTO", "SparseDecoder"]

POSITION_OFFSET = 2  # OPT's learned positions are shifted by 2


def _layer_weights(t: dict[str, torch.Tensor], l: int) -> SimpleNamespace:
    p = f"layers.{l}."
    g = lambda n: t[p + n]  # noqa: E731
    return SimpleNamespace(
        ln_attn=(g("ln_attn.weight"), g("ln_attn.bias")), ln_mlp=(g("ln_mlp.weight"), g("ln_mlp.bias")),
        wq=g("attn.wq"), bq=g("attn.bq"), wkv=g("attn.wkv"), bkv=g("attn.bkv"), wo_t=g("attn.wo_t"),
        bo=g("attn.bo"), w1=g("mlp.w1"), b1=g("mlp.b1"), w2_t=g("mlp.w2_t"), b2=g("mlp.b2"))


@dataclass(frozen=True)
class DecodeOptions:
    """How a SparseDecoder runs a decode step (none of it changes what is computed).

    overlap: the predictors on a side CUDA stream (runtime/predictors.py); off: inline.
    kv_policy: "deferred" (K/V of the selected heads only) or "full" (runtime/kv_policy.py).
    shared_index: one index set for the batch (the batch policy "shared") instead of one per row.
    graph_priority: the priority of the stream the decode step's CUDA graph is captured on (graphs.py;
        PyTorch instantiates graphs with per-node priorities, so the main stream's kernels keep it while
        the predictor side stream stays at the default 0, the lowest). Lower numbers are higher
        priorities; None: the highest the device allows, so the block scheduler gives freed SM slots to
        the main stream's queued kernels (the latency-bound attention chain) before the predictors'. On
        the H200 (OPT-30B shape, batch 1): 6.58 vs 6.73 ms/token at density 0.3, 4.04 vs 4.12 at 0.1 with
        0 (BENCHMARKS.md, 2026-12-03).
    kv_refresh: deferred K/V at batch 1: after each layer's head top-k (on the predictors' side stream),
        pick up to this many heads that do not attend but lag hist_slots or more slots behind
        (ops.kv_refresh, plugins/refresh_heads.py); the attention op computes their K/V too, in
        the same Q/K/V launches (no Q, no attention), so a head selected later never has more missing
        slots than the partials hold (no serial slow path). Same outputs. 0: off. None: REFRESH_AUTO[0]
        where it paid on the H200 (random predictors; BENCHMARKS.md, 2026-12-04): the Triton attention
        op, hidden size >= REFRESH_AUTO[2] and at least REFRESH_AUTO[1] of the heads attending (OPT-30B
        shape: head density 0.5 2.7% faster, 0.3 within 0.5%, 0.2 1.2% slower; opt-mini's launch-bound
        shape 7-8% slower: the pick's launch per layer).
    kv_refresh_lags: (lag, max_lag) of the pick (None: hist_slots and any); (None, "hist"): only heads at
        exactly hist_slots missing slots, never one already past the partials (that would take the slow
        path for a head that may not attend again). The pick runs only on layers whose attention op takes
        refresh heads (plugins/refresh_heads.refresh_route).
    defer_ln_attn: pre-LN, one rank, batch 1: the LayerNorm before a deferred-K/V attention layer is left
        to its Q/K/V kernel: the previous layer's fc2 split-K reduction stores per-block statistics
        (ln_defer) and the shared-set Q/K/V kernel normalises the slice of x each program reads, and
        stores LN(x) into x_hist (plugins/deferred_kv.py); one launch fewer per layer. On the H200
        (OPT-30B shape, batch 1): 6.385 vs 6.572 ms/token at density 0.3, 3.830 vs 3.949 at 0.1
        (BENCHMARKS.md, 2026-12-03).
    """
    overlap: bool = True
    kv_policy: str = "deferred"
    shared_index: bool = False
    graph_priority: int | None = None
    kv_refresh: int | None = None
    kv_refresh_lags: tuple = (None, "hist")
    defer_ln_attn: bool = True

    def __post_init__(self):
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}")


class SparseDecoder:
    """Holds the weights, the static KV cache and the predictor runner of one engine; `options`
    (DecodeOptions) says how a step runs."""

    def __init__(self, spec: EngineSpec, tensors: dict[str, torch.Tensor], device: torch.device,
                 ops: Ops, overlap: bool = True, shared_index: bool = False, kv_policy: str = "deferred",
                 options: DecodeOptions | None = None):
        options = options or DecodeOptions(overlap=overlap, kv_policy=kv_policy, shared_index=shared_index)
        self.options = options
        self.spec, self.t, self.device, self.ops = spec, tensors, device, ops
        self.layers = [_layer_weights(tensors, l) for l in range(spec.num_layers)]
        self.pred = runner_for(spec, tensors, ops.predictor_topk, device, options.overlap, options.shared_index)
        self.cache = KVCache(spec, device, [self.deferred(l) for l in range(spec.num_layers)])
        self.refresh = RefreshHeads(spec, ops, self.cache)
        self.pred.on_heads = self.refresh.on_heads
        # Tensor parallel (runtime/tp.py): `reduce(y)` all-reduces (sums) the partial output of
        # each row-parallel op (attention out-proj, fc2) before the residual add; None = one rank.
        # With it set, the residual is not fused into the kernels (it would be summed n times).
        self.reduce = None
        self._pending_ops = ("sparse_fc2", "sparse_attn_deferred")

    @property
    def kv_policy(self) -> str:
        return self.options.kv_policy

    @property
    def graph_priority(self) -> int | None:
        return self.options.graph_priority

    def set_options(self, **changes) -> DecodeOptions:
        """Replace fields of `options` that take effect at the next step (graph_priority: at the next
        capture; kv_refresh, kv_refresh_lags, defer_ln_attn); the others are fixed when the decoder is
        built (overlap, kv_policy, shared_index: build another engine). Returns the new options."""
        fixed = {"overlap", "kv_policy", "shared_index"} & set(changes)
        if fixed:
            raise ValueError(f"set_options: {sorted(fixed)} are fixed when the decoder is built")
        self.options = dataclasses.replace(self.options, **changes)
        self.refresh.forget_routes()
        return self.options

    def _add(self, x, y, b=None):
        """x + y + b (the residual plus an unfused output and its bias); under tensor parallelism
        x + all_reduce(y + b). The one-rank order is kept (same bits as before the hook)."""
        if self.reduce is None:
            return x + y if b is None else x + y + b
        return x + self.reduce(y if b is None else y + b)

    def deferred(self, l: int) -> bool:
        """Layer l computes K/V of the selected heads only (deferred policy, sparse attention)."""
        return self.kv_policy == "deferred" and self.spec.sparse_attn(l)

    # ------------------------------------------------------------------ cache (runtime/kv_policy.py)
    k_cache = property(lambda self: self.cache.k_cache)  # per layer [B, H, T, hd]
    v_cache = property(lambda self: self.cache.v_cache)
    x_hist = property(lambda self: self.cache.x_hist)  # deferred layers [B, T, D], else None
    valid_len = property(lambda self: self.cache.valid_len)  # deferred layers [B, H] int32, else None
    batch = property(lambda self: self.cache.batch)
    max_seq = property(lambda self: self.cache.max_seq)

    def setup(self, batch: int, max_seq: int) -> None:
        """Allocate the static KV cache: per layer k, v: [batch, H, max_seq, hd]; with the
        deferred policy also x_hist [batch, max_seq, D] and valid_len [batch, H] (int32, 0)
        for the sparse-attention layers (None for the others)."""
        if self.cache.setup(batch, max_seq):
            self.refresh.forget_routes()

    def empty_cache(self, rows: torch.Tensor | None = None) -> None:
        """Start the next sequence at slot 0 without a prefill: no slot of any head holds K/V
        (a decode step at pos writes slot pos of every head it computes; the deferred layers
        recompute the slots a selected head is missing). rows: only these cache rows."""
        self.cache.empty(rows)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """A server's prefix cache: row dst holds row src's first n slots (a prefill's) and nothing after."""
        self.cache.copy_prefix(src, dst, n)

    def keep_prefix(self, row: int, n: int) -> None:
        """A server's prefix cache: row `row` keeps its first n slots (a prefill's), nothing after."""
        self.cache.keep_prefix(row, n)

    def release(self) -> None:
        """Drop the caches (the next `setup` allocates again)."""
        self.cache.release()

    def use_rows(self, n: int) -> None:
        """Decode steps (and a CUDA graph captured now) run on the first n rows of the cache
        `setup` allocated: the caches become views of rows 0..n-1 (no copy; n = the allocated
        batch restores them whole). A server's continuous batching keeps its live sequences in
        the lowest rows and steps only as many rows as the highest one needs."""
        self.cache.use_rows(n)
        self.refresh.forget_routes()

    # ------------------------------------------------------------------ pieces
    def _ln(self, x, wb):
        return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], 1e-5)

    def _ln_step(self, x, wb):
        """LayerNorm of the decode step's rows [B, D]: the Triton kernel on the GPU (PyTorch's
        runs one block per row: ~12 us at D 7168), PyTorch's on the CPU path."""
        return self.ops.layer_norm(x, wb[0], wb[1])

    def _materialize(self, h):
        """h, or a PendingLN's LayerNorm computed now (for ops that take a plain input)."""
        return self._ln_step(h.x, (h.weight, h.bias)) if isinstance(h, PendingLN) else h

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., D] from tokens [...] at positions [...] (0-based)."""
        x = F.embedding(tokens, self.t["embed_tokens"])  # [..., E]
        if "project_in" in self.t:
            x = F.linear(x, self.t["project_in"])
        # the shifted table is a view: no launch for positions + POSITION_OFFSET in the decode graph
        return x + F.embedding(positions, self.t["embed_positions"][POSITION_OFFSET:])

    def head(self, x: torch.Tensor, ln=None, x_ln=None) -> torch.Tensor:
        """logits [..., V] from the last hidden state x [..., D] (ln: the LayerNorm to use;
        x_ln: final_ln(x), already computed by the last layer's MLP op)."""
        if x_ln is not None:
            x = x_ln
        elif self.spec.final_ln:
            x = (ln or self._ln)(x, (self.t["final_ln.weight"], self.t["final_ln.bias"]))
        if "project_out" in self.t:
            x = F.linear(x, self.t["project_out"])
        return F.linear(x, self.t["embed_tokens"])

    def _mlp(self, w, h, x, idx, ln=None, ops=None, n_kept=None):
        # h: [rows, D] MLP input after LN; x: residual; idx: [rows, K] | [K] | None (dense)
        # ln: (weight, bias) of the next LayerNorm, left pending by fc2's split-K reduction (defer_ln_attn):
        # returns (x, PendingLN or LN(x)) then; x alone otherwise. ops: the layer's (Ops.layer)
        # n_kept: [rows] int32 (a per-token K, kept rows first): fc1 stops there. With it, and with a fixed K for
        # per-sequence sets and at batch 1 (skips_zero), h's nonzero rows are put first (compact_rows) and fc2
        # stops at their count
        if idx is None:
            return self._add(x, torch.relu(F.linear(h, w.w1, w.b1)) @ w.w2_t, w.b2)
        ops = ops or self.ops
        a = ops.sparse_fc1(h, w.w1, w.b1, idx) if n_kept is None else ops.sparse_fc1(h, w.w1, w.b1, idx, n_kept)
        kw = {}
        if n_kept is not None or skips_zero(idx, h.shape[0]):
            a, idx, nonzero = ops.compact_rows(a, idx)
            kw = {"n_kept": nonzero}
        if self.reduce is not None:
            return self._add(x, ops.sparse_fc2(a, w.w2_t, w.b2, idx, None, **kw))
        if ln is not None:
            return ops.sparse_fc2(a, w.w2_t, w.b2, idx, x, ln=ln, ln_defer=True, **kw)
        return ops.sparse_fc2(a, w.w2_t, w.b2, idx, x, **kw)

    def _defers_attn_ln(self, l: int) -> bool:
        """Layer l's sparse MLP leaves the next layer's attention LayerNorm pending
        (defer_ln_attn; the next layer has deferred K/V and both ops run as kernels)."""
        return (self.options.defer_ln_attn and self.spec.pre_ln and self.reduce is None
                and self.batch == 1 and l + 1 < len(self.layers) and self.x_hist[l + 1] is not None
                and all(self.ops.kernels.get(n) == "triton" for n in self._pending_ops))

    def _next_ln(self, l: int):
        """(weight, bias) of the LayerNorm after layer l's MLP in a pre-LN decoder: the next
        layer's ln_attn, or final_ln after the last layer (None without one)."""
        if l + 1 < len(self.layers):
            return self.layers[l + 1].ln_attn
        return (self.t["final_ln.weight"], self.t["final_ln.bias"]) if self.spec.final_ln else None

    # ------------------------------------------------------------------ decode
    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """logits [B, V] for tokens [B] at cache slots / positions pos [B] (int64, device).

        Writes this token's K/V at slot pos[b] (kv_policy "full": every head; "deferred": the
        selected heads, plus their missing earlier slots); attends to slots <= pos[b].

        Pre-LN, one rank, batch 1 (options.defer_ln_attn): a sparse MLP op leaves the next layer's
        attention LayerNorm pending (its split-K reduction's block statistics) and that layer's Q/K/V
        kernel applies it; `h_ln` carries it."""
        self.refresh.begin_step(self.options, pos)
        try:
            return self._decode_step(tokens, pos)
        finally:
            self.refresh.end_step()

    def _decode_step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        s, run, c = self.spec, self.pred, self.cache
        B, H, hd = tokens.shape[0], s.num_heads, s.head_dim
        valid = None  # [B, T] slots <= pos, made for the first dense layer (none in a sparse step)
        x = self.embed(tokens, pos)  # [B, D]
        h_ln = None  # LN of x for the next LayerNorm, when the last op left it pending
        run.begin_step()
        for l, w in enumerate(self.layers):
            ops = self.ops.layer(l)  # the layer's kernel settings (resolved from its K)
            run.point("attn_in", l, x)
            h = h_ln if h_ln is not None else (self._ln_step(x, w.ln_attn) if s.pre_ln else x)
            h_ln = None
            kc, vc = c.k_cache[l], c.v_cache[l]
            idx = run.heads(l)
            if idx is None or c.x_hist[l] is None:  # ops that take a plain input
                h = self._materialize(h)
            if idx is None:  # dense: K/V and Q of every head
                kv = F.linear(h, w.wkv, w.bkv).view(B, 2, H, hd)
                kc[c.rows, :, pos] = kv[:, 0]  # [B, H, hd] at slot pos[b]
                vc[c.rows, :, pos] = kv[:, 1]
                q = F.linear(h, w.wq, w.bq).view(B, H, hd)
                if valid is None:
                    valid = c.slots[None, :] <= pos[:, None]
                x = self._add(x, attend(q, kc, vc, valid).reshape(B, -1) @ w.wo_t, w.bo)
            else:
                res = x if self.reduce is None else None  # tensor parallel: residual after the all-reduce
                if c.x_hist[l] is not None:  # deferred: K/V of the selected heads' missing slots
                    picked = self.refresh.picked[l]
                    kw = {"refresh": picked} if picked is not None else {}
                    y = ops.sparse_attn_deferred(h, w.wq, w.bq, w.wkv, w.bkv, w.wo_t, w.bo, idx, kc, vc,
                                                      c.x_hist[l], c.valid_len[l], pos, res, **kw)
                else:  # K/V of every head written at pos; Q, attention, output of selected heads
                    y = ops.sparse_attn(h, w.wq, w.bq, w.wkv, w.bkv, w.wo_t, w.bo, idx, kc, vc, pos, res)
                x = y if res is not None else self._add(x, y)
            if not s.pre_ln:
                x = self._ln_step(x, w.ln_attn)
            run.point("mlp_in", l, x)
            h = self._ln_step(x, w.ln_mlp) if s.pre_ln else x
            idx = run.neurons(l)
            ln = self._next_ln(l) if idx is not None and self._defers_attn_ln(l) else None
            x = self._mlp(w, h, x, idx, ln, ops, run.kept(l))
            if ln is not None:
                x, h_ln = x
            if not s.pre_ln:
                x = self._ln_step(x, w.ln_mlp)
        return self.head(x, self._ln_step, x_ln=h_ln)

    # ------------------------------------------------------------------ sequences
    def forward_tokens(self, ids: torch.Tensor, sparse: bool = True, write_cache: bool = False,
                       last: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                       start: int = 0) -> torch.Tensor:
        """logits for ids [B, S] at positions 0..S-1: [B, S, V], or [B, V] at positions `last` [B].

        sparse=False: the dense model (prefill). sparse=True: per-token selection (masked
        heads / neurons), equal to decoding the tokens one by one from an empty cache.
        write_cache: store K/V of every head at slots 0..S-1 (needs `setup` with this batch), and
        the attention inputs into x_hist (deferred layers); with `rows` [B] (long, device) into
        those cache rows instead of rows 0..B-1. start > 0 (with write_cache): the ids sit at
        positions start..start+S-1 and attend to the cache's slots before them too (a prompt
        prefilled in chunks)."""
        s, run = self.spec, self.pred
        B, S = ids.shape
        H, hd = s.num_heads, s.head_dim
        if start and not write_cache:
            raise ValueError("forward_tokens: start > 0 needs write_cache (earlier slots come from the cache)")
        pos = torch.arange(start, start + S, device=ids.device)
        x = self.embed(ids, pos[None, :].expand(B, S))  # [B, S, D]
        shared, run.shared = run.shared, False  # token-parallel: one selection per row
        try:
            run.begin_step()
            for l, w in enumerate(self.layers):
                if sparse:
                    run.point("attn_in", l, x)
                h = self._ln(x, w.ln_attn) if s.pre_ln else x
                q = F.linear(h, w.wq, w.bq).view(B, S, H, hd).transpose(1, 2)  # [B, H, S, hd]
                k, v = F.linear(h, w.wkv, w.bkv).view(B, S, 2, H, hd).permute(2, 0, 3, 1, 4)
                if write_cache:
                    at = slice(None) if rows is None else rows
                    self.k_cache[l][at, :, start:start + S] = k
                    self.v_cache[l][at, :, start:start + S] = v
                    if self.x_hist and self.x_hist[l] is not None:
                        self.x_hist[l][at, start:start + S] = h
                if start:  # this chunk's queries over every slot up to their own
                    k, v = self.k_cache[l][at, :, :start + S], self.v_cache[l][at, :, :start + S]
                    mask = torch.arange(start + S, device=ids.device)[None, :] <= pos[:, None]  # [S, start + S]
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
                o = o.transpose(1, 2)  # [B, S, H, hd]
                idx = run.heads(l) if sparse else None
                if idx is not None:  # zero the unselected heads of each token
                    keep = torch.zeros(B * S, H, dtype=o.dtype, device=o.device).scatter_(1, idx.long(), 1)
                    o = o * keep.view(B, S, H, 1)
                x = self._add(x, o.reshape(B, S, -1) @ w.wo_t, w.bo)
                if not s.pre_ln:
                    x = self._ln(x, w.ln_attn)
                if sparse:
                    run.point("mlp_in", l, x)
                h = self._ln(x, w.ln_mlp) if s.pre_ln else x
                a = torch.relu(F.linear(h, w.w1, w.b1))  # [B, S, F]
                idx = run.neurons(l) if sparse else None
                if idx is not None:  # the selected rows, those a per-token K keeps (run.kept)
                    n = run.kept(l)
                    src = 1 if n is None else (torch.arange(idx.shape[-1], device=a.device) < n[:, None]).to(a.dtype)
                    keep = torch.zeros(B * S, s.ffn_dim, dtype=a.dtype, device=a.device).scatter_(1, idx.long(), src)
                    a = a * keep.view(B, S, -1)
                x = self._add(x, a @ w.w2_t, w.b2)
                if not s.pre_ln:
                    x = self._ln(x, w.ln_mlp)
        finally:
            run.shared = shared
        if last is not None:
            x = x[torch.arange(B, device=x.device), last]  # [B, D]
        return self.head(x)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | None = None,
                start: int = 0, every: bool = False) -> torch.Tensor:
        """Dense prefill of right-padded ids [B, S] (real lengths [B]): last-token logits [B, V] (every: each
        position's, [B, S, V]).

        Every head's K/V is written at slots 0..S-1, so (deferred policy) valid_len[b, :] =
        lengths[b]: a sequence's padding slots count as missing and are recomputed from its
        own inputs when a head needs them. rows [B] (long, device): the cache rows to fill
        (default 0..B-1); the other rows are left as they are (a server admitting a newcomer
        beside running sequences). start: ids continue a prompt whose first `start` tokens are
        in the cache already (chunked prefill; then valid_len = start + lengths)."""
        out = self.forward_tokens(ids, sparse=False, write_cache=True, last=None if every else lengths - 1, rows=rows,
                                  start=start)
        self.cache.filled(lengths, rows, start)
        return out

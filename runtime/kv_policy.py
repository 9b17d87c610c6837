"""K/V policy of the sparse-attention layers: the static cache and the refresh-head pick.

- "full": every decode step projects K/V of every head into the cache (the contract's
  description, plugins/sparse_attention.py).
- "deferred" (default): the layer keeps `x_hist[l]` [B, S, D], its attention inputs after
  LayerNorm, and `valid_len[l]` [B, H] int32, the cache slots already filled per head; a
  decode step computes K/V only for the selected heads, over their missing slots
  (plugins/deferred_kv.py). Same output in exact arithmetic (K/V of slot p depend only on
  the input at p); fewer bytes read. Dense prefill fills every head: valid_len = length.

`KVCache` owns the tensors (allocation, row views, emptying, the prefill's valid_len);
`RefreshHeads` picks, at batch 1, heads that do not attend but lag behind, so the attention
op computes their K/V in the same launches (DecodeOptions.kv_refresh).
"""
from __future__ import annotations

import torch

KV_POLICIES = ("deferred", "full")

# DecodeOptions.kv_refresh None: (refresh heads per layer, least fraction of the heads attending, least hidden
# size) where refresh heads are on (BENCHMARKS.md, 2026-12-04)
REFRESH_AUTO = (4, 0.4, 4096)


class KVCache:
    """Per layer k, v: [batch, H, max_seq, hd]; deferred layers (`deferred[l]`) also x_hist
    [batch, max_seq, D] and valid_len [batch, H] int32 (None for the others)."""

    def __init__(self, spec, device: torch.device, deferred: list[bool]):
        self.spec, self.device, self.deferred = spec, device, deferred
        self.release()

    def setup(self, batch: int, max_seq: int) -> bool:
        """Allocate the static cache for (batch, max_seq), zeroed; False if it already is."""
        s = self.spec
        if (batch, max_seq) == (self.batch, self.max_seq):
            return False
        self.release()  # free the old cache before allocating the new one
        shape = (batch, s.num_heads, max_seq, s.head_dim)
        kw = dict(dtype=s.dtype, device=self.device)
        L, d = s.num_layers, self.deferred
        self.k_cache = [torch.zeros(shape, **kw) for _ in range(L)]
        self.v_cache = [torch.zeros(shape, **kw) for _ in range(L)]
        self.x_hist = [torch.zeros(batch, max_seq, s.hidden_size, **kw) if d[l] else None for l in range(L)]
        self.valid_len = [torch.zeros(batch, s.num_heads, dtype=torch.int32, device=self.device) if d[l] else None
                          for l in range(L)]
        self.rows = torch.arange(batch, device=self.device)  # [B]
        self.slots = torch.arange(max_seq, device=self.device)  # [T]
        self.batch, self.max_seq = batch, max_seq
        self._all_rows = (self.k_cache, self.v_cache, self.x_hist, self.valid_len, self.rows, batch)
        return True

    def release(self) -> None:
        """Drop the tensors (the next `setup` allocates again)."""
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.x_hist: list[torch.Tensor | None] = []
        self.valid_len: list[torch.Tensor | None] = []
        self.batch = self.max_seq = 0
        self._all_rows = None  # setup's whole-cache tensors (use_rows takes views of them)

    def empty(self, rows: torch.Tensor | None = None) -> None:
        """No slot of any head holds K/V (rows: only these cache rows)."""
        for vl in self.valid_len:
            if vl is not None:
                if rows is None:
                    vl.zero_()
                else:
                    vl[rows] = 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row dst's slots [0, n) become row src's, which a prefill wrote (every head), and hold all dst holds."""
        k, v, x, _, _, _ = self._all_rows
        for t in (*k, *v):
            t[dst, :, :n] = t[src, :, :n]
        for t in x:
            if t is not None:
                t[dst, :n] = t[src, :n]
        self.keep_prefix(dst, n)

    def keep_prefix(self, row: int, n: int) -> None:
        """Row `row` holds every head's K/V of slots [0, n) (a prefill wrote them) and none after."""
        for vl in self._all_rows[3]:
            if vl is not None:
                vl[row] = n

    def use_rows(self, n: int) -> None:
        """The caches become views of rows 0..n-1 of those `setup` allocated (no copy)."""
        k, v, x, vl, rows, full = self._all_rows
        if not 1 <= n <= full:
            raise ValueError(f"use_rows: n must be in [1, {full}], got {n}")
        self.k_cache, self.v_cache = [t[:n] for t in k], [t[:n] for t in v]
        self.x_hist = [None if t is None else t[:n] for t in x]
        self.valid_len = [None if t is None else t[:n] for t in vl]
        self.rows, self.batch = rows[:n], n

    def filled(self, lengths: torch.Tensor, rows: torch.Tensor | None = None, start: int = 0) -> None:
        """After a dense prefill of every head: valid_len[rows] = start + lengths [B]."""
        for vl in self.valid_len:
            if vl is not None:
                n = (lengths.to(vl.device, torch.int32) + start)[:, None].expand(-1, vl.shape[1])
                if rows is None:
                    vl.copy_(n)
                else:
                    vl[rows] = n


class RefreshHeads:
    """Deferred K/V at batch 1: after each layer's head top-k (PredictorRunner.on_heads, on the
    predictors' stream), pick up to `DecodeOptions.kv_refresh` unselected heads lagging behind
    (ops.kv_refresh, plugins/refresh_heads.py); `picked[l]` goes to layer l's attention op."""

    def __init__(self, spec, ops, cache: KVCache):
        self.spec, self.ops, self.cache = spec, ops, cache
        self.options = None
        self.pos: torch.Tensor | None = None  # this decode step's pos while refresh heads may be picked
        self.picked: list = []  # this step's refresh heads per layer (None: none launched)
        self._takes: dict = {}  # layer -> whether its attention op takes refresh heads

    def begin_step(self, options, pos: torch.Tensor) -> None:
        self.options = options
        self.picked = [None] * self.spec.num_layers
        self.pos = pos if self.active(options, self.cache.batch) else None

    def end_step(self) -> None:
        self.pos = None

    def forget_routes(self) -> None:
        """Ask the attention ops again (shapes or settings changed)."""
        self._takes = {}

    def active(self, options, batch: int) -> bool:
        """A decode step may pick refresh heads (per layer: `slots`, `takes`)."""
        n = options.kv_refresh
        return (n is None or n > 0) and options.kv_policy == "deferred" and batch == 1

    def slots(self, options, idx: torch.Tensor) -> int:
        """Refresh heads for a layer with head set idx: kv_refresh, or (None) REFRESH_AUTO's rule."""
        if options.kv_refresh is not None:
            return options.kv_refresh
        n, frac, min_d = REFRESH_AUTO
        s = self.spec
        on = (self.ops.kernels.get("sparse_attn_deferred") == "triton" and s.hidden_size >= min_d
              and idx.shape[-1] >= frac * s.num_heads)
        return n if on else 0

    def takes(self, l: int, idx: torch.Tensor) -> bool:
        """Layer l's attention op uses refresh heads (the reference op always does; the kernels on
        `refresh_route`). Asked once per layer and engine activation (static shapes)."""
        takes = self._takes.get(l)
        if takes is None:
            takes = True
            if self.ops.kernels.get("sparse_attn_deferred") == "triton":
                from dejavu.plugins import refresh_route
                s = self.spec
                takes = refresh_route(1, self.cache.max_seq, s.hidden_size, s.head_dim, idx,
                                      settings=self.ops.layer(l).settings)
            self._takes[l] = takes
        return takes

    def on_heads(self, l: int, idx: torch.Tensor) -> None:
        """PredictorRunner.on_heads: pick layer l's refresh heads (in a decode step, on the stream the head
        top-k ran on)."""
        if self.pos is None or self.cache.x_hist[l] is None:
            return
        r = self.slots(self.options, idx)
        if r > 0 and self.takes(l, idx):
            lag, max_lag = self.options.kv_refresh_lags
            if max_lag == "hist" or lag is None:
                from dejavu.plugins import hist_slots
                hist = hist_slots(1, idx, settings=self.ops.layer(l).settings)
                lag = hist if lag is None else lag
                max_lag = hist if max_lag == "hist" else max_lag
            self.picked[l] = self.ops.layer(l).kv_refresh(idx, self.cache.valid_len[l], self.pos, r, lag=lag, max_lag=max_lag)

"""The decode step captured in one CUDA graph (GPU only; never imported on the CPU path).

Static inputs: token ids [B] and positions [B] (device tensors; the position is data, so
one graph serves every step). Warm-up runs on a side stream before capture (lazy init,
Triton compilation, cuBLAS handles and the top-k's barrier counters, which must not be
first allocated during capture, stay out of the graph). The predictor side stream
and its events are part of the captured work: the graph keeps the fork/join edges.
"""
from __future__ import annotations

import torch

from dejavu.runtime.decoder import SparseDecoder


class DecodeGraph:
    """`run(tokens, pos) -> logits [B, V]` by replaying a captured `decoder.decode_step`."""

    def __init__(self, decoder: SparseDecoder, warmup: int = 2):
        B, T = decoder.batch, decoder.max_seq
        dev = decoder.device
        self.tokens = torch.zeros(B, dtype=torch.long, device=dev)
        # Warm-up and capture write K/V at the last slot: any real step reaches a slot only
        # after writing it, so that garbage is never read. (Deferred K/V policy: warm-up also
        # fills the selected heads' earlier slots from a garbage x_hist and marks them valid;
        # prefill resets valid_len to the prompt lengths, so they are recomputed before use.)
        self.pos = torch.full((B,), T - 1, dtype=torch.long, device=dev)
        # warm-up and capture on one stream of decoder.graph_priority (the captured kernels keep it)
        prio = decoder.graph_priority
        if prio is None:
            prio = torch.cuda.Stream.priority_range()[1]  # (least, greatest): the highest
        s = torch.cuda.Stream(device=dev, priority=prio)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(warmup):
                decoder.decode_step(self.tokens, self.pos)
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize(dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=s):
            self.logits = decoder.decode_step(self.tokens, self.pos)  # [B, V], static
        torch.cuda.synchronize(dev)

    def run(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Copy tokens [B] and pos [B] into the static buffers and replay (no host sync)."""
        self.tokens.copy_(tokens, non_blocking=True)
        self.pos.copy_(pos, non_blocking=True)
        self.graph.replay()
        return self.logits

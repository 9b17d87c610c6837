"""Tensor-parallel decode over torch.distributed: one process per rank, one shard engine each.

    torchrun --nproc-per-node 2 -m dejavu.runtime.tp OUT.engine --prompt "Hello" --device cpu
    # in Python, under torchrun (or with torch.distributed already initialised):
    eng = TPEngine.load("OUT.engine", device="cuda")      # loads OUT.rank{r}-of-{n}.engine
    eng.generate(["Hello"], 32)                            # same result on every rank

Each rank runs the single-rank decoder (runtime/decoder.py) on its shard (H/n heads, F/n
neurons, compiler/tensor_parallel.py) with `decoder.reduce` set to a sum all-reduce, applied
to the partial outputs of the attention out-projection and of fc2 before the residual add
(the residual is not fused into those kernels under TP). Every rank then holds the full
hidden state, so LayerNorms, the predictors' inputs and the logits are replicated; rank 0's
sampled tokens are broadcast each step anyway (`agree_tokens`), so sampling agrees too.
Predictors stay on the side stream (GPU, overlap on); the all-reduce is issued from the main
stream, so the next layer's predictors overlap it. CUDA graphs are off by default here
(NCCL inside a captured graph is untested in this project). Backend: gloo on CPU, NCCL on
CUDA (keep NCCL_NVLS_ENABLE=0 on multi-GPU H100 / H200 hosts, NVLink multicast off: docs/tensor_parallel.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from dejavu.errors import DejavuError, cli_entry
from dejavu.runtime.engine import Engine
from dejavu.runtime.llama_decoder import llama_spec_from_header
from dejavu.runtime.llama_engine import LlamaEngine
from dejavu.runtime.spec import EngineSpec, spec_from_header
from dejavu.shards import shard_path, tp_info


@dataclasses.dataclass(frozen=True)
class ShardSpec(EngineSpec):
    """A rank's spec: num_heads / ffn_dim / mlp_k / attn_k are the shard's; hidden size, vocab
    and head_dim are the full model's."""

    shard_head_dim: int = 0
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def head_dim(self) -> int:
        return self.shard_head_dim


def shard_spec(header: dict) -> ShardSpec:
    """The decoder spec of a shard engine (a plain engine is rank 0 of 1)."""
    full = spec_from_header(header)
    f = {fl.name: getattr(full, fl.name) for fl in dataclasses.fields(EngineSpec)}
    tp = tp_info(header)
    if tp is None:
        return ShardSpec(**f, shard_head_dim=full.head_dim)
    kpr = tp["k_per_rank"]
    f.update(num_heads=tp["num_heads"], ffn_dim=tp["ffn_dim"], mlp_k=tuple(kpr["mlp"]), attn_k=tuple(kpr["attn"]))
    return ShardSpec(**f, shard_head_dim=full.head_dim, tp_size=tp["size"], tp_rank=tp["rank"])


def init_distributed(device: str | torch.device = "cpu") -> bool:
    """Initialise the default process group from torchrun's environment if needed
    (gloo on CPU, NCCL on CUDA); True when this call initialised it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise DejavuError("torch.distributed is not initialised and RANK/WORLD_SIZE are not set: run under torchrun")
    dist.init_process_group(backend="nccl" if torch.device(device).type == "cuda" else "gloo")
    return True


def _rank_device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


class _Rank:
    """What one rank of a tensor-parallel engine adds to an engine: its process group, the all-reduce its
    decoder sums o's / the MLP's partial outputs with, rank 0's sampled tokens on every rank, and `load`."""

    def _join(self, group, size: int, rank: int) -> None:
        if not dist.is_initialized():
            raise DejavuError("TPEngine needs torch.distributed initialised (init_distributed or torchrun)")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if (size, rank) != (self.world, self.rank):
            raise DejavuError(f"engine is shard {rank} of {size} but this process is rank {self.rank} of {self.world}")

    def _all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        # y: [..., D] partial sum of this rank's heads / neurons (+ the bias on rank 0)
        y = y.contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def agree_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] as sampled on rank 0 (called by generate after each sampling step)."""
        tokens = tokens.contiguous()
        dist.broadcast(tokens, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return tokens

    @classmethod
    def load(cls, path_pattern_or_paths, device="cpu", overlap: bool = True, **kw):
        """This rank's engine (a `LlamaTPEngine` for a Llama-family shard): a list of paths (one per rank), a
        pattern with `{rank}` (and `{size}`), or the base name `OUT.engine` of `OUT.rank{r}-of-{n}.engine`."""
        from dejavu.engine_file import read_engine

        init_distributed(device)
        rank, world = dist.get_rank(kw.get("group")), dist.get_world_size(kw.get("group"))
        if isinstance(path_pattern_or_paths, (list, tuple)):
            if len(path_pattern_or_paths) != world:
                raise DejavuError(f"{len(path_pattern_or_paths)} engine paths for {world} ranks")
            path = str(path_pattern_or_paths[rank])
        else:
            path = shard_path(path_pattern_or_paths, rank, world)
        if not os.path.isfile(path):
            raise DejavuError(f"engine file not found for rank {rank} of {world}: {path}")
        dev = _rank_device(device)
        header, tensors = read_engine(path, "cpu" if dev.type == "cpu" else dev)
        klass = LlamaTPEngine if header.get("model_family") == "llama" else cls
        return klass(header, tensors, dev, overlap=overlap, **kw)

    def describe(self) -> dict:
        return {**super().describe(), "tp": {"size": self.world, "rank": self.rank}}


class TPEngine(_Rank, Engine):
    """One rank of a tensor-parallel engine; the same API as `Engine` (generate, logits, ...)."""

    _spec = staticmethod(shard_spec)

    def __init__(self, header: dict, tensors: dict[str, torch.Tensor], device="cpu", group=None,
                 use_graphs: bool = False, **kw):
        spec = shard_spec(header)
        self._join(group, spec.tp_size, spec.tp_rank)
        super().__init__(header, tensors, device, use_graphs=use_graphs, **kw)
        self.decoder.reduce = self._all_reduce


class LlamaTPEngine(_Rank, LlamaEngine):
    """One rank of a tensor-parallel Llama engine (compiler/tensor_parallel: H/n heads, Hkv/n KV heads, F/n
    neurons, the thresholds of the whole model): o's and down's outputs all-reduced before the residual add, the
    residual stream in the engine dtype (not the fp32 stream that o and down add into in place on one GPU)."""

    _spec = staticmethod(llama_spec_from_header)  # a shard's own header: H/n heads, Hkv/n KV heads, F/n neurons

    def __init__(self, header: dict, tensors: dict[str, torch.Tensor], device="cpu", group=None,
                 use_graphs: bool = False, **kw):
        tp = header.get("build_config", {}).get("tp") or {"size": 1, "rank": 0}
        if not (isinstance(tp, dict) and type(tp.get("size")) is int and type(tp.get("rank")) is int):
            raise DejavuError(f"engine header: build_config.tp is not a shard's {{size, rank}}: {tp!r}")
        self._join(group, tp["size"], tp["rank"])
        super().__init__(header, tensors, device, use_graphs=use_graphs, **kw)
        self.decoder.reduce = self._all_reduce


# ----------------------------------------------------------------------------- entry point

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dejavu.runtime.tp",
                                description="Tensor-parallel generation; run under torchrun, one process per rank.")
    p.add_argument("engine", help="OUT.engine (reads OUT.rank{r}-of-{n}.engine) or a pattern with {rank}")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (NCCL, cuda:LOCAL_RANK)")
    p.add_argument("--dtype", default=None, help="override the engine dtype (e.g. float32 on CPU)")
    return p


@cli_entry
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    mine = init_distributed(args.device)
    try:
        eng = TPEngine.load(args.engine, args.device, dtype=args.dtype)
        text = eng.complete([args.prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed)[0]
        if eng.rank == 0:
            print(args.prompt + text, flush=True)
    finally:
        if mine:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`LlamaEngine`: an `Engine` (runtime/engine.py) over a Llama-family engine file.

`Engine.load` / `Engine(...)` pick it from the header's `model_family`; everything else of the
public API (generate, complete, logits, decode_logits, activate, release) is Engine's own,
driving `LlamaDecoder` (runtime/llama_decoder.py) instead of the OPT decoder.
"""
from __future__ import annotations

import dataclasses

import torch

from dejavu.errors import DejavuError
from dejavu.runtime.engine import Engine, _device, refuse_shard
from dejavu.runtime.ops import settings_for
from dejavu.runtime.llama_decoder import LlamaDecoder, LlamaOps, check_llama_tensors, llama_spec_from_header
from dejavu.runtime.spec import DTYPES


class LlamaEngine(Engine):
    """A TEAL-sparse Llama engine on one device (CPU: masked dense; CUDA: Triton kernels + graph).

    batch_policy and kv_policy are accepted for the same call signature and have no effect:
    every sequence has its own index lists, and every step writes the K/V of every KV head."""

    def __init__(self, header: dict, tensors: dict[str, torch.Tensor], device="cpu", overlap: bool = True,
                 batch_policy: str | None = None, use_graphs: bool = True, dtype=None,
                 backend: str | None = None, kv_policy: str | None = None, kernel_settings=None):
        self.device = _device(device)
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise DejavuError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        self.header = header
        spec = self._spec(header)
        if dtype is not None and dtype != spec.dtype:
            spec = dataclasses.replace(spec, dtype=dtype)
        check_llama_tensors(header, tensors)
        self.spec = spec
        self.tensors = {n: t.to(device=self.device, dtype=spec.dtype) for n, t in tensors.items()}
        on_gpu = self.device.type == "cuda"
        # the header's kernel settings where they fit this GPU (else resolved here); kernel_settings replaces them
        self.ops = LlamaOps(backend or ("triton" if on_gpu else "ref"),
                            kernel_settings or settings_for(header.get("target"), self.device))
        self.kernel_check = self.ops.verify(spec, self.tensors)
        self.overlap, self.batch_policy, self.kv_policy = False, "per_sequence", "full"
        self.use_graphs = use_graphs and on_gpu
        self.decoder = LlamaDecoder(spec, self.tensors, self.device, self.ops)
        self._graph = None
        self._tokenizer = None
        self.stats = None

    @staticmethod
    def _spec(header: dict):
        """The Llama spec; a tensor-parallel shard is refused, as Engine's is (runtime/tp.LlamaTPEngine reads it)."""
        refuse_shard(header)
        return llama_spec_from_header(header)

    def describe(self) -> dict:
        s = self.spec
        return {"family": "llama", "layers": s.num_layers, "hidden": s.hidden_size, "ffn": s.intermediate_size,
                "heads": s.num_attention_heads, "kv_heads": s.num_key_value_heads,
                "dtype": str(s.dtype).replace("torch.", ""), "device": str(self.device),
                "sparsity": "teal", "skip": s.skip, "mlp_density": round(1 - s.skip, 4),
                "attn_density": round(1 - s.skip, 4), "kernels": dict(self.ops.kernels),
                "kernel_check": self.kernel_check, "overlap": False, "cuda_graph": self.use_graphs,
                "batch_policy": self.batch_policy}

    def _programmatic_launch(self) -> bool:
        return False

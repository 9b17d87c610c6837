"""`Engine`: a loaded `.engine` file ready to generate (the runtime's public API).

    engine = Engine.load("opt-mini-0.3.engine", device="cuda")       # or "cpu"
    outs = engine.generate(["Hello"], max_new_tokens=32)              # new token ids per prompt
    texts = engine.complete("Hello")                                  # decoded (one prompt or a list)
    logits = engine.logits(ids)                                       # token-parallel sparse [B, S, V]
    logits = engine.decode_logits(ids)                                # the same through the decode loop

On CPU everything runs through PyTorch reference ops; on CUDA the sparse ops are the
`dejavu.plugins` Triton kernels, each decode step is one CUDA-graph replay, and the
predictors of the next layer run on a side stream (`overlap=False` runs them inline).
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import torch

from dejavu.errors import DejavuError
from dejavu.generation import GENERATION
from dejavu.runtime.decoder import KV_POLICIES, SparseDecoder
from dejavu.runtime.ops import Ops, layer_settings_for
from dejavu.runtime.spec import DTYPES, check_tensors, spec_from_header

BATCH_POLICIES = ("per_sequence", "shared")
# per_sequence: [B, K] index sets, the masked-dense semantics of each sequence exactly.
# shared: one [K] set for the batch (top-k of the batch's max score), weights read once per
# step; at B = 8, density 0.3 the sparse MLP is 2.63x faster than dense where per-sequence
# sets are 0.46x (benchmarks/results/kernels-2026-12-02.json, BENCHMARKS.md). At B = 1 both are the
# same. None picks shared on CUDA and per_sequence on CPU (the reference path, where
# exactness is what is wanted). An engine with a per-token MLP K (build_config.token_k) keeps
# each token's rows per sequence and at batch 1; a shared set at B > 1 has no per-token count
# and takes the K_l rows of an engine without it (runtime/predictors.py).
DEFAULT_BATCH_POLICY = None
DEFAULT_KV_POLICY = "deferred"  # K/V of the selected heads only, missing slots recomputed (same output)


def refuse_shard(header) -> None:
    """DejavuError for a tensor-parallel shard's header: one rank's heads and neurons are not a model."""
    tp = (header.get("build_config") or {}).get("tp") if isinstance(header, dict) else None
    if tp:
        raise DejavuError(f"this engine is tensor-parallel shard {tp.get('rank')} of {tp.get('size')}: "
                          "run it with dejavu.runtime.tp (torchrun), see docs/tensor_parallel.md")


def _device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DejavuError(f"unknown device {device!r} (use 'cpu' or 'cuda')") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DejavuError("device 'cuda' requested but no CUDA GPU is available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise DejavuError(f"unsupported device {device!r} (use 'cpu' or 'cuda')")
    return dev


class Engine:
    """A sparse engine on one device. Build with `load` (file) or `from_tensors` (memory).
    A Llama-family header gives a `LlamaEngine` (runtime/llama_engine.py)."""

    def __new__(cls, header=None, *args, **kw):
        if cls is Engine and isinstance(header, dict) and header.get("model_family") == "llama":
            from dejavu.runtime.llama_engine import LlamaEngine
            return super().__new__(LlamaEngine)
        return super().__new__(cls)

    def __init__(self, header: dict, tensors: dict[str, torch.Tensor], device="cpu", overlap: bool = True,
                 batch_policy: str | None = DEFAULT_BATCH_POLICY, use_graphs: bool = True, dtype=None,
                 backend: str | None = None, kv_policy: str = DEFAULT_KV_POLICY, kernel_settings=None):
        self.device = _device(device)
        if batch_policy is None:
            batch_policy = "shared" if self.device.type == "cuda" else "per_sequence"
        if batch_policy not in BATCH_POLICIES:
            raise DejavuError(f"batch_policy must be one of {BATCH_POLICIES}, got {batch_policy!r}")
        if kv_policy not in KV_POLICIES:
            raise DejavuError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
        self.kv_policy = kv_policy
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise DejavuError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        self.header = header
        spec = self._spec(header)
        if dtype is not None and dtype != spec.dtype:
            import dataclasses
            spec = dataclasses.replace(spec, dtype=dtype)
        check_tensors(spec, tensors)
        self.spec = spec
        # int8 predictors' row scales stay fp16 (the kernels read them so; plugins/predictor.py)
        self.tensors = {n: t.to(device=self.device, dtype=spec.dtype if t.is_floating_point() and
                                not n.endswith("_scale") else t.dtype) for n, t in tensors.items()}
        on_gpu = self.device.type == "cuda"
        # the header's kernel settings, per layer, where they fit this GPU (else resolved here from each
        # layer's K); kernel_settings (plugins.KernelSettings) replaces the header's: benchmarks' ablations
        self.ops = Ops(backend or ("triton" if on_gpu else "ref"),
                       *layer_settings_for(header.get("target"), self.device, spec, kernel_settings))
        # each Triton kernel once against its reference on this engine's weights
        self.kernel_check = self.ops.verify(self.tensors, spec, 2, batch_policy == "shared")
        self.overlap, self.batch_policy = overlap, batch_policy
        self.use_graphs = use_graphs and on_gpu
        # Activation: streams, events and index buffers are created here, once.
        self.decoder = SparseDecoder(spec, self.tensors, self.device, self.ops, overlap,
                                     shared_index=batch_policy == "shared", kv_policy=kv_policy)
        self._graph = None
        self._tokenizer = None
        self.stats = None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _spec(header: dict):
        """The decoder's spec (runtime/tp.py overrides this for a shard's heads and neurons)."""
        refuse_shard(header)
        return spec_from_header(header)

    @classmethod
    def load(cls, path: str | os.PathLike, device="cpu", overlap: bool = True, **kw) -> "Engine":
        """Read and verify an engine file, then activate it on `device`."""
        from dejavu.engine_file import read_engine

        if not os.path.isfile(path):
            raise DejavuError(f"engine file not found: {path}")
        dev = _device(device)
        header, tensors = read_engine(path, "cpu" if dev.type == "cpu" else dev)
        return cls(header, tensors, dev, overlap=overlap, **kw)

    @classmethod
    def from_tensors(cls, header: dict, tensors: dict[str, torch.Tensor], device="cpu", **kw) -> "Engine":
        """An engine built in memory (header dict + kernel-layout tensors, no file)."""
        return cls(header, tensors, device, **kw)

    @property
    def tokenizer(self):
        """`dejavu.models.tokenizer.TextTokenizer` from the header's `tokenizer_json`."""
        if self._tokenizer is None:
            from dejavu.models.tokenizer import TextTokenizer, prompt_bos

            tj = self.header.get("tokenizer_json")
            if not tj:
                raise DejavuError("this engine carries no tokenizer (header field tokenizer_json); pass token ids")
            s = self.spec
            self._tokenizer = TextTokenizer(tj, s.bos_id, s.stop_ids, s.pad_id, add_bos=prompt_bos(self.header))
        return self._tokenizer

    @property
    def sampling_defaults(self) -> dict:
        """The temperature / top_p / top_k / min_p / repetition_penalty the checkpoint's authors ship (its
        generation_config.json or GGUF metadata, kept in the header's `sampling_defaults`): those it names."""
        from dejavu.generation import model_sampling

        return model_sampling(self.header.get("sampling_defaults"), "engine header: sampling_defaults")

    # ------------------------------------------------------------------ running
    def activate(self, batch: int, need: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Size the KV cache for `batch` sequences of `need` tokens; the decode-step function.

        The cache is rounded up to a multiple of 64 slots, and a larger cache of the same batch
        is reused, so nearby lengths share one CUDA graph. If capture fails, decode runs
        eagerly (same kernels) with a warning."""
        dec = self.decoder
        if batch != dec.batch or need > dec.max_seq:
            self._graph = None  # release the old graph's memory before the new cache
            dec.setup(batch, min(-(-need // 64) * 64, self.spec.max_positions))
        if not self.use_graphs:
            return dec.decode_step
        if self._graph is None:
            from dejavu.runtime.graphs import DecodeGraph

            try:
                self._graph = DecodeGraph(dec)
            except Exception as e:  # noqa: BLE001 - keep serving without the graph
                import warnings

                warnings.warn(f"CUDA-graph capture failed ({type(e).__name__}: {e}); decoding eagerly")
                self.use_graphs = False
                torch.cuda.synchronize(self.device)
                return dec.decode_step
        return self._graph.run

    def release(self) -> None:
        """Free the KV cache and the CUDA graph (the weights stay); the next call re-activates."""
        self._graph = None
        self.decoder.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 max_new_tokens: int = GENERATION.max_new_tokens, temperature: float | None = GENERATION.temperature,
                 top_k: int = GENERATION.top_k, top_p: float = GENERATION.top_p, seed: int | None = GENERATION.seed,
                 stream: Callable[[list[int | None]], None] | None = None,
                 stop_at_eos: bool = True, repetition_penalty: float | None = GENERATION.repetition_penalty,
                 min_p: float = GENERATION.min_p, presence_penalty: float = GENERATION.presence_penalty,
                 frequency_penalty: float = GENERATION.frequency_penalty) -> list[list[int]]:
        """New token ids for each prompt (one text, texts, or token-id lists). Defaults:
        `dejavu.generation.GenerationSettings` (temperature None: greedy, or 1.0 with top_k /
        top_p; repetition_penalty None: the checkpoint's, as transformers' generate applies its
        generation_config, else off). See runtime/generate.py."""
        from dejavu.runtime.generate import generate

        if repetition_penalty is None:
            repetition_penalty = self.sampling_defaults.get("repetition_penalty", 1.0)
        return generate(self, self._encode(prompts), max_new_tokens, temperature, top_k, top_p, seed,
                        stream, stop_at_eos, repetition_penalty, min_p, presence_penalty, frequency_penalty)

    def complete(self, prompts: str | Sequence[str], max_new_tokens: int = GENERATION.max_new_tokens,
                 **kw) -> list[str]:
        """Generated text (without the prompt) for each text prompt (a bare string is one prompt)."""
        return [self.tokenizer.decode(t) for t in self.generate(prompts, max_new_tokens, **kw)]

    @torch.inference_mode()
    def logits(self, input_ids) -> torch.Tensor:
        """Token-parallel sparse logits [B, S, V] (float32) for input_ids [B, S] (or one list):
        each position gets its own selection, as token-by-token decode from an empty cache."""
        ids = self._check_ids(input_ids)
        return self.decoder.forward_tokens(ids.to(self.device), sparse=True).float()

    def decode_logits(self, input_ids, prompt_len=0) -> torch.Tensor:
        """Logits [B, S, V] (float32) of input_ids [B, S] (or one list) through the decode loop
        `generate` runs, fed these tokens (runtime/generate.py `decode_logits`). prompt_len 0:
        every token through a sparse decode step (`logits`' quantity, through the decode
        kernels); p >= 1 (or one per row): the prefill of each row's first p tokens (dense; a Llama
        engine thresholds the first position: LlamaDecoder.prefill), then the decode steps (positions before p - 1 are NaN)."""
        from dejavu.runtime.generate import decode_logits

        ids = self._check_ids(input_ids)
        return decode_logits(self, ids, prompt_len)

    def _check_ids(self, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise DejavuError(f"input_ids must be [B, S] with S >= 1, got {list(ids.shape)}")
        if ids.shape[1] > self.spec.max_positions:
            raise DejavuError(f"{ids.shape[1]} tokens exceed max_position_embeddings {self.spec.max_positions}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise DejavuError(f"token ids must be in [0, {self.spec.vocab_size})")
        return ids

    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str):  # one prompt
            prompts = [prompts]
        if isinstance(prompts, bytes) or not isinstance(prompts, Sequence) or not prompts:
            raise DejavuError("prompts must be a non-empty list of strings or of token-id lists")
        if all(isinstance(p, str) for p in prompts):
            return [self.tokenizer.encode(p) for p in prompts]
        try:
            return [[int(t) for t in p] for p in prompts]
        except (TypeError, ValueError):
            raise DejavuError("prompts must be a non-empty list of strings or of token-id lists") from None

    def describe(self) -> dict:
        """Settings worth logging: dims, densities, kernels, overlap, graphs, programmatic launch."""
        s = self.spec
        return {"layers": s.num_layers, "hidden": s.hidden_size, "ffn": s.ffn_dim, "heads": s.num_heads,
                "dtype": str(s.dtype).replace("torch.", ""), "device": str(self.device),
                "mlp_density": round(s.density[0], 4), "attn_density": round(s.density[1], 4),
                "predictor_input": {"source": s.source, "lookahead": s.lookahead},
                "kernels": dict(self.ops.kernels), "kernel_check": self.kernel_check, "overlap": self.decoder.pred.overlapping,
                "cuda_graph": self.use_graphs, "graph_priority": self.decoder.graph_priority,
                "batch_policy": self.batch_policy,
                "kv_policy": self.kv_policy, "programmatic_launch": self._programmatic_launch()}

    def _programmatic_launch(self) -> bool:
        """Whether the decode kernels launch with PDL here (plugins.pdl_args: sm_90+ CUDA,
        the kernel settings' pdl on, the Triton kernels in use)."""
        if self.device.type != "cuda" or self.ops.kernels.get("sparse_fc1") != "triton":
            return False
        from dejavu.plugins import pdl_args

        return bool(pdl_args(self.device, "fc1", self.ops.settings.pdl))

"""Batched generation: dense prefill (a Llama engine thresholds the first position), sparse decode steps,
sampling, streaming, timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dejavu.errors import DejavuError
from dejavu.generation import GENERATION, check_openai_penalty, check_repetition_penalty, resolve_temperature
from dejavu.models.sampling import Penalties, sample_next


@dataclass
class GenerationStats:
    """Wall times of the last generate call (seconds; device-synchronised at the edges)."""

    batch: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0  # tokens generated per sequence (the longest; the first from the prefill)
    decode_steps: int = 0  # sparse decode steps run (new_tokens - 1 when every token was needed)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    setup_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ms_per_token(self) -> float:
        """Decode latency per step (one token for every sequence of the batch)."""
        return 1e3 * self.decode_s / max(self.decode_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def right_pad(prompts: Sequence[Sequence[int]], pad_id: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, S_max] right-padded with pad_id, and lengths [B]."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DejavuError("every prompt needs at least one token")
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        row = torch.as_tensor(list(p), dtype=torch.long)
        if int(row.min()) < 0 or int(row.max()) >= vocab:
            raise DejavuError(f"prompt {b}: token ids must be in [0, {vocab})")
        ids[b, :len(p)] = row
    return ids, torch.tensor([len(p) for p in prompts], dtype=torch.long)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def generate(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float | None = GENERATION.temperature, top_k: int = GENERATION.top_k,
             top_p: float = GENERATION.top_p, seed: int | None = GENERATION.seed,
             stream: Callable[[list[int | None]], None] | None = None,
             stop_at_eos: bool = True, repetition_penalty: float = 1.0, min_p: float = GENERATION.min_p,
             presence_penalty: float = GENERATION.presence_penalty,
             frequency_penalty: float = GENERATION.frequency_penalty) -> list[list[int]]:
    """New tokens per prompt (the prompt excluded; ends with EOS when one was produced).

    The first new token comes from the dense prefill (a Llama engine thresholds each sequence's first
    position: LlamaDecoder.prefill); every later one from a sparse decode
    step (a CUDA-graph replay on GPU). `stream`, if given, is called after each step with one
    entry per sequence: its new token, or None once it has finished. Without `stream` and
    with stop_at_eos=False the loop never waits for the device (benchmark mode). temperature
    None: greedy, or 1.0 when top_k / top_p ask for sampling (`dejavu.generation`). repetition_penalty: a
    prompt's or generated token's logit divided by it where positive, multiplied where negative, before sampling
    (transformers' RepetitionPenaltyLogitsProcessor; 1.0: off); presence_penalty / frequency_penalty: OpenAI's, in
    [-2, 2], subtracted from a generated token's logit once / per occurrence (models/sampling.Penalties; 0: off)."""
    temperature = resolve_temperature(temperature, top_k, top_p, min_p)
    check_repetition_penalty(repetition_penalty)
    presence_penalty = check_openai_penalty(presence_penalty, "presence_penalty")
    frequency_penalty = check_openai_penalty(frequency_penalty, "frequency_penalty")
    if max_new_tokens < 0:
        raise DejavuError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    spec, dec, dev = engine.spec, engine.decoder, engine.device
    ids, lengths = right_pad(prompts, spec.pad_id if spec.pad_id is not None else 0, spec.vocab_size)
    B, S = ids.shape
    stats = engine.stats = GenerationStats(batch=B, prompt_tokens=int(lengths.sum()))
    if max_new_tokens == 0:
        return [[] for _ in range(B)]
    need = int(lengths.max()) + max_new_tokens
    if need > spec.max_positions:
        raise DejavuError(f"prompt ({int(lengths.max())}) + max_new_tokens ({max_new_tokens}) = {need} "
                          f"exceeds the model's max_position_embeddings {spec.max_positions}")
    t0 = _sync(dev)
    step_fn = engine.activate(B, need)
    ids, pos = ids.to(dev), lengths.to(dev)
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    stops = frozenset(spec.stop_ids if stop_at_eos else ())
    t1 = _sync(dev)
    logits = dec.prefill(ids, pos)  # [B, V]
    t2 = _sync(dev)
    out_dev = torch.empty(B, max_new_tokens, dtype=torch.long, device=dev)
    penalties = None
    if Penalties.wanted(repetition_penalty, presence_penalty, frequency_penalty):
        penalties = Penalties(prompts, spec.vocab_size, dev, repetition_penalty, presence_penalty, frequency_penalty)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    host_loop = stream is not None or bool(stops)
    agree = getattr(engine, "agree_tokens", None)  # tensor parallel: rank 0's tokens on every rank
    steps = made = 0
    for step in range(max_new_tokens):
        nxt = sample_next(logits if penalties is None else penalties(logits), temperature, top_k, top_p, gen,
                          min_p)  # [B]
        if agree is not None:
            nxt = agree(nxt)
        if penalties is not None:
            penalties.add(nxt)
        out_dev[:, step] = nxt
        made += 1
        if host_loop:
            emitted: list[int | None] = []
            for b, t in enumerate(nxt.tolist()):
                if done[b]:
                    emitted.append(None)
                    continue
                out[b].append(t)
                emitted.append(t)
                done[b] = t in stops
            if stream is not None:
                stream(emitted)
            if all(done):
                break
        if step == max_new_tokens - 1:
            break
        logits = step_fn(nxt, pos)
        pos = pos + 1
        steps += 1
    t3 = _sync(dev)
    stats.setup_s, stats.prefill_s, stats.decode_s = t1 - t0, t2 - t1, t3 - t2
    stats.new_tokens, stats.decode_steps = made, steps
    if not host_loop:
        out = out_dev.tolist()
    return out


@torch.inference_mode()
def decode_logits(engine, ids: torch.Tensor, prompt_len: int | Sequence[int] | torch.Tensor = 0) -> torch.Tensor:
    """Logits [B, S, V] (float32, on the engine's device) of ids [B, S] through the loop that
    `generate` runs, fed the given tokens instead of sampled ones (teacher forcing).

    prompt_len 0: every token through a sparse decode step from an empty cache, position 0
    included: the quantity `Engine.logits` computes token-parallel with masked dense ops,
    here through the kernels users run (on CUDA: the Triton kernels, one CUDA-graph replay
    per step, the predictors on the side stream). prompt_len p >= 1 (one for all rows, or one
    per row): what `generate` does with a p-token prompt: the first p tokens of the row through
    the dense prefill (a Llama engine's first position thresholded; its logits fill position p - 1;
    earlier positions are NaN, the prefill
    returns its last only), every later token through a sparse decode step. Rows are decoded
    side by side at their own positions; a row that has reached its end repeats its last
    token until the longest is done (its logits are dropped; with the engine's "shared" batch
    policy such rows still take part in the batch's selection)."""
    spec, dec, dev = engine.spec, engine.decoder, engine.device
    B, S = ids.shape
    plen = torch.as_tensor(prompt_len, dtype=torch.long).reshape(-1)
    if plen.numel() not in (1, B):
        raise DejavuError(f"prompt_len must be one length or one per row ({B}), got {plen.numel()}")
    plen = plen.expand(B).clone()
    every = bool((plen == 0).all())
    if not every and not (int(plen.min()) >= 1 and int(plen.max()) <= S):
        raise DejavuError(f"prompt_len must be 0, or between 1 and the sequence length {S} for every row, "
                          f"got {plen.tolist()}")
    step_fn = engine.activate(B, S)
    ids = ids.to(dev)
    rows = torch.arange(B, device=dev)
    out = torch.full((B, S + 1, spec.vocab_size), float("nan"), dtype=torch.float32, device=dev)  # S: dropped
    pos = plen.to(dev)
    if every:
        dec.empty_cache()
    else:
        p = int(plen.max())
        out[rows, pos - 1] = dec.prefill(ids[:, :p], pos).float()
    for _ in range(S - int(plen.min())):
        at = pos.clamp(max=S - 1)
        out[rows, pos.clamp(max=S)] = step_fn(ids[rows, at], at).float()
        pos = pos + 1
    return out[:, :S]

"""Autoregressive generation with the dense model and its static KV cache."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from dejavu.errors import DejavuError
from dejavu.generation import GENERATION, check_openai_penalty, check_repetition_penalty, resolve_temperature
from dejavu.models.opt import OPTForCausalLM
from dejavu.models.sampling import Penalties, sample_next
from dejavu.models.tokenizer import end_ids


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [B, S_max] left-padded with pad_id, and mask [B, S_max] (1 = real), None if no padding."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DejavuError("every prompt needs at least one token")
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), S), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, S - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, S - len(p):] = 1
    return ids, (None if bool(mask.all()) else mask)


@torch.inference_mode()
def generate(model: OPTForCausalLM, input_ids: torch.Tensor | Sequence[Sequence[int]],
             max_new_tokens: int, temperature: float | None = GENERATION.temperature, top_k: int = GENERATION.top_k,
             top_p: float = GENERATION.top_p, seed: int | None = GENERATION.seed, eos_id=None,
             stream: Callable[[list[int | None]], None] | None = None,
             repetition_penalty: float = 1.0, min_p: float = GENERATION.min_p,
             presence_penalty: float = GENERATION.presence_penalty,
             frequency_penalty: float = GENERATION.frequency_penalty) -> list[list[int]]:
    """New tokens for each prompt (prompt not included; ends with eos_id when it was produced: one id, or several
    of which any ends a sequence).

    input_ids: [B, S] (all real tokens) or a list of B token lists of any lengths (left-padded
    with an attention mask). Greedy when temperature == 0 (or None without top_k / top_p:
    `dejavu.generation.resolve_temperature`); otherwise sampled with top_k/top_p
    from a generator seeded with `seed`. `stream`, if given, is called after each step with one
    entry per sequence: the new token, or None once that sequence has finished. repetition_penalty: a prompt's
    or generated token's logit divided by it where positive, multiplied where negative, before sampling
    (transformers' RepetitionPenaltyLogitsProcessor over the real tokens; 1.0: off); presence_penalty /
    frequency_penalty: OpenAI's, in [-2, 2], subtracted from a generated token's logit once / per occurrence, after
    the repetition penalty (models/sampling.Penalties; 0: off).
    """
    temperature = resolve_temperature(temperature, top_k, top_p, min_p)
    check_repetition_penalty(repetition_penalty)
    presence_penalty = check_openai_penalty(presence_penalty, "presence_penalty")
    frequency_penalty = check_openai_penalty(frequency_penalty, "frequency_penalty")
    if max_new_tokens < 0:
        raise DejavuError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg = model.config
    device = model.lm_head.weight.device
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise DejavuError(f"input_ids must be [B, S] with S >= 1, got {list(input_ids.shape)}")
        ids, mask = input_ids.to(device=device, dtype=torch.long), None
    else:
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        ids, mask = left_pad(input_ids, pad)
        ids, mask = ids.to(device), (mask.to(device) if mask is not None else None)
    B, S = ids.shape
    if max_new_tokens == 0:
        return [[] for _ in range(B)]
    if int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
        raise DejavuError(f"token ids must be in [0, {cfg.vocab_size}), "
                          f"got {int(ids.min())}..{int(ids.max())}")
    total = S + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise DejavuError(f"prompt ({S}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                          f"model's max_position_embeddings {cfg.max_position_embeddings}")
    full_mask = None
    if mask is not None:  # [B, total]: generated positions are all real tokens
        full_mask = torch.cat([mask, mask.new_ones(B, max_new_tokens)], dim=1)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)

    penalties = None
    if Penalties.wanted(repetition_penalty, presence_penalty, frequency_penalty):
        real = ids.tolist() if mask is None else [p[len(p) - int(m.sum()):] for p, m in zip(ids.tolist(), mask)]
        penalties = Penalties(real, cfg.vocab_size, device, repetition_penalty, presence_penalty, frequency_penalty)
    stops = frozenset(end_ids(eos_id))
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    model.setup_caches(B, total)
    try:
        logits = model(ids, 0, full_mask[:, :S] if full_mask is not None else None)[:, -1]  # [B, V]
        for step in range(max_new_tokens):
            nxt = sample_next(logits if penalties is None else penalties(logits), temperature, top_k, top_p, gen,
                              min_p)
            if penalties is not None:
                penalties.add(nxt)
            toks = nxt.tolist()
            emitted: list[int | None] = []
            for b, t in enumerate(toks):
                if done[b]:
                    emitted.append(None)
                    continue
                out[b].append(t)
                emitted.append(t)
                done[b] = t in stops
            if stream is not None:
                stream(emitted)
            if all(done) or step == max_new_tokens - 1:
                break
            pos = S + step
            am = full_mask[:, :pos + 1] if full_mask is not None else None
            logits = model(nxt[:, None], pos, am)[:, -1]
    finally:
        model.clear_caches()
    return out

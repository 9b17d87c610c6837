"""Next-token choice from logits, shared by dense generation and the sparse runtime (pure torch)."""
from __future__ import annotations

from typing import Sequence

import torch

from dejavu.generation import check_sampling  # noqa: F401 - re-exported (torch-free home)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None, min_p: float = 0.0) -> torch.Tensor:
    """Next token ids [B] (int64) from logits [B, V].

    temperature == 0 is greedy (argmax; top_k / top_p ignored). Otherwise logits / temperature,
    keep the top_k largest (0 = all), then the smallest set whose probability reaches top_p
    (always at least one token), then drop the tokens less likely than min_p times the most likely one
    (transformers' MinPLogitsWarper, vLLM's min_p; 0 = off), and draw with `generator` (seeded => reproducible).
    """
    check_sampling(temperature, top_k, top_p, min_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    x = logits.float() / temperature  # [B, V]
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]  # [B, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p  # the first token has before == 0 and always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class Penalties:
    """Penalties over a batch's tokens, as transformers and vLLM apply them, their state kept a token at a time
    (`add`): the repetition penalty on every token a row has seen, its prompt's and its generated ones (a positive
    logit divided by it, a negative one multiplied: transformers' RepetitionPenaltyLogitsProcessor, vLLM's
    repetition_penalty), then OpenAI's frequency penalty times each token's count in the row's generation and its
    presence penalty once per token generated, subtracted; then the logit bias ((id, bias) pairs) added."""

    def __init__(self, prompts: Sequence[Sequence[int]], vocab: int, device, repetition: float = 1.0,
                 presence: float = 0.0, frequency: float = 0.0, logit_bias: Sequence[tuple[int, float]] = ()):
        self.repetition, self.presence, self.frequency = repetition, presence, frequency
        rows = torch.tensor([b for b, p in enumerate(prompts) for _ in p], dtype=torch.long)
        cols = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        self.seen = torch.zeros(len(prompts), vocab, dtype=torch.bool)  # prompt and generated tokens
        self.seen[rows, cols] = True
        self.seen = self.seen.to(device)
        self.counts = torch.zeros(len(prompts), vocab, device=device) if presence or frequency else None
        ids, bias = zip(*logit_bias) if logit_bias else ((), ())
        self.bias_ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.bias = torch.tensor(bias, dtype=torch.float32, device=device)

    @staticmethod
    def wanted(repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0, logit_bias=()) -> bool:
        return bool(presence or frequency or repetition != 1.0 or logit_bias)

    def add(self, tokens: torch.Tensor) -> None:
        """The tokens [B] just generated, one a row."""
        col = tokens.to(self.seen.device, torch.long)[:, None]
        self.seen.scatter_(1, col, True)
        if self.counts is not None:
            self.counts.scatter_add_(1, col, torch.ones_like(col, dtype=self.counts.dtype))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized float32 logits [B, V] of logits [B, V]."""
        x, p = logits.float(), self.repetition
        if p != 1.0:
            x = torch.where(self.seen, torch.where(x > 0, x / p, x * p), x)
        if self.counts is not None:
            x = x - (self.frequency * self.counts + self.presence * (self.counts > 0).float())
        if len(self.bias):
            x = x.index_add(1, self.bias_ids, self.bias.expand(x.shape[0], -1))
        return x

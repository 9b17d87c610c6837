"""Next-token choice from logits, shared by dense generation and the sparse runtime (pure torch)."""
from __future__ import annotations

import torch

from dejavu.generation import check_sampling  # noqa: F401 - re-exported (torch-free home)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] (int64) from logits [B, V].

    temperature == 0 is greedy (argmax; top_k / top_p ignored). Otherwise logits / temperature,
    keep the top_k largest (0 = all), then the smallest set whose probability reaches top_p
    (always at least one token), and draw with `generator` (seeded => reproducible).
    """
    check_sampling(temperature, top_k, top_p)
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
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

"""Perplexity over a token stream, shared by the model card, dejavu-eval and the benchmarks."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F


def encode_document(tok, text: str) -> np.ndarray:
    """A text as one token stream starting with </s> (id 2), as OPT's tokenizer begins texts.

    `tok` is a `tokenizers.Tokenizer`; every line (split at \\n) is encoded followed by a
    newline, in one batch for speed (the byte-level pre-tokenizer splits at newlines anyway). Returns uint16 if the vocabulary fits.
    """
    lines = text.split("\n")
    enc = tok.encode_batch([ln + "\n" for ln in lines], add_special_tokens=False)
    ids = [2] + [i for e in enc for i in e.ids]
    return np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() < 65536 else np.int64)


def windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Split a 1-D token tensor into non-overlapping windows of `window` tokens (last may be shorter)."""
    return [ids[i:i + window] for i in range(0, ids.numel(), window) if ids[i:i + window].numel() > 1]


@torch.no_grad()
def perplexity(logits_fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, window: int,
               batch: int = 8, progress: bool = False) -> dict:
    """exp(mean NLL) of `ids` [N] under `logits_fn(input_ids[B,S]) -> logits[B,S,V]`.

    The stream is cut into non-overlapping windows of `window` tokens; inside each window
    every token but the first is predicted from the tokens before it in that window.
    Returns {"perplexity", "nll", "tokens"}.
    """
    chunks = windows(ids, window)
    total, count = 0.0, 0
    it = range(0, len(chunks), batch)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="perplexity", unit="batch")
    for i in it:
        group = chunks[i:i + batch]
        by_len: dict[int, list[torch.Tensor]] = {}
        for c in group:  # equal lengths batch together; the short tail runs alone
            by_len.setdefault(c.numel(), []).append(c)
        for seqs in by_len.values():
            x = torch.stack(seqs)  # [b, S]
            logits = logits_fn(x).float()  # [b, S, V]
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                  x[:, 1:].reshape(-1).to(logits.device), reduction="sum")
            total += nll.item()
            count += x[:, 1:].numel()
    nll = total / max(count, 1)
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": count}

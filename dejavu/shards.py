"""Tensor-parallel shard names and sizes, shared by the compiler (writes) and runtime (reads).

A shard engine keeps the full model's `model_config` and records its part in
`build_config.tp = {"size": n, "rank": r, "num_heads": H/n, "ffn_dim": F/n,
"k_per_rank": {"mlp": [L], "attn": [L]}}` (docs/tensor_parallel.md).
"""
from __future__ import annotations

import os
from pathlib import Path

from dejavu.errors import DejavuError


def shard_path(out: str | os.PathLike, rank: int, size: int) -> str:
    """The file of `rank` of `size`: `out` formatted when it holds `{rank}` (and optionally
    `{size}`), else `OUT.rank{r}-of-{n}.engine` beside `OUT.engine`."""
    s = str(out)
    if "{rank}" in s:
        return s.format(rank=rank, size=size)
    p = Path(s)
    return str(p.with_name(f"{p.stem}.rank{rank}-of-{size}{p.suffix or '.engine'}"))


def tp_info(header: dict) -> dict | None:
    """`build_config.tp` validated against `model_config` (None for a single-rank engine)."""
    bc = header.get("build_config") if isinstance(header, dict) else None
    tp = bc.get("tp") if isinstance(bc, dict) else None
    if tp is None:
        return None
    mc = header.get("model_config") or {}
    H, F, L = mc.get("num_attention_heads"), mc.get("ffn_dim"), mc.get("num_hidden_layers")
    ok = isinstance(tp, dict) and all(type(tp.get(k)) is int for k in ("size", "rank", "num_heads", "ffn_dim"))
    if ok:
        n, r = tp["size"], tp["rank"]
        ok = (n >= 1 and 0 <= r < n and type(H) is int and type(F) is int and H % n == 0 and F % n == 0
              and tp["num_heads"] == H // n and tp["ffn_dim"] == F // n)
    kpr = tp.get("k_per_rank") if ok else None
    ok = ok and isinstance(kpr, dict) and all(
        isinstance(kpr.get(kind), list) and len(kpr[kind]) == L
        and all(type(k) is int and 1 <= k <= cap for k in kpr[kind])
        for kind, cap in (("mlp", F // tp["size"]), ("attn", H // tp["size"])))
    if not ok:
        raise DejavuError(f"engine header: build_config.tp {tp!r} is not a valid tensor-parallel shard "
                          "description {size, rank, num_heads, ffn_dim, k_per_rank: {mlp, attn}}")
    return tp

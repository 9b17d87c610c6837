"""Corpus reading and tokenisation for calibration and perplexity studies.

A corpus is a text file, a `.jsonl` file (the `"text"` field of each record, or its first
string field), a folder of `.txt` files, or — when online and `datasets` is installed — a
Hugging Face dataset named `hf:NAME[:CONFIG[:SPLIT]]`. `None` means the calibration text
shipped in the package (`dejavu/data/calib/wikitext2-train-head.txt`).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from dejavu.datafiles import CALIB_TEXT
from dejavu.errors import DejavuError


def _read_jsonl(path: Path) -> str:
    parts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DejavuError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if isinstance(rec, str):
                parts.append(rec)
            elif isinstance(rec, dict):
                text = rec.get("text")
                if not isinstance(text, str):
                    text = next((v for v in rec.values() if isinstance(v, str)), None)
                if text is None:
                    raise DejavuError(f"{path}:{n}: record has no string field to read as text")
                parts.append(text)
            else:
                raise DejavuError(f"{path}:{n}: expected an object or a string, got {type(rec).__name__}")
    return "\n".join(parts)


def _read_hf(spec: str) -> str:
    name, *rest = spec[len("hf:"):].split(":")
    config = rest[0] if len(rest) > 0 and rest[0] else None
    split = rest[1] if len(rest) > 1 and rest[1] else "train"
    if os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE"):
        raise DejavuError(f"corpus {spec!r}: Hugging Face datasets are offline (HF_*_OFFLINE is set)")
    try:
        import datasets
    except ImportError:
        raise DejavuError(f"corpus {spec!r}: the 'datasets' package is not installed") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - network / missing dataset: one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DejavuError(f"corpus {spec!r}: cannot load ({first})") from None
    col = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n".join(str(t) for t in ds[col])


def read_corpus(source: str | os.PathLike | None = None) -> tuple[str, str]:
    """(text, display name) of a corpus; raises DejavuError when missing or empty."""
    if source is None:
        source = CALIB_TEXT
    spec = str(source)
    if spec.startswith("hf:"):
        text = _read_hf(spec)
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise DejavuError(f"corpus folder {path} holds no .txt files")
            text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
        elif path.is_file():
            if path.suffix == ".jsonl":
                text = _read_jsonl(path)
            else:
                text = path.read_text(encoding="utf-8", errors="replace")
        else:
            raise DejavuError(f"corpus {spec!r} not found (a text file, .jsonl, folder of .txt, "
                              f"or hf:NAME[:CONFIG[:SPLIT]])")
    if not text.strip():
        raise DejavuError(f"corpus {spec!r} is empty")
    return text, spec


def encode_text(tokenizer, text: str, bos_id: int | None = 2, max_tokens: int | None = None) -> np.ndarray:
    """Token ids [N] int32 of a document: BOS, then each line (with its newline) BPE-encoded.

    Lines are encoded in batches (what `train_opt_mini.encode_stream` does), stopping once
    `max_tokens` are reached so a huge corpus is not tokenised whole.
    """
    lines = text.split("\n")
    out: list[int] = [bos_id] if bos_id is not None else []
    i, step = 0, 64
    while i < len(lines) and (max_tokens is None or len(out) < max_tokens):
        chunk = [ln + "\n" for ln in lines[i:i + step]]
        for e in tokenizer.encode_batch(chunk, add_special_tokens=False):
            out.extend(e.ids)
        i, step = i + step, min(2 * step, 4096)  # small first chunks: short runs stay cheap
    ids = np.asarray(out if max_tokens is None else out[:max_tokens], dtype=np.int32)
    return ids


def corpus_tokens(tokenizer, source: str | os.PathLike | None, n_tokens: int,
                  bos_id: int | None = 2) -> tuple[np.ndarray, str]:
    """The first `n_tokens` token ids [n_tokens] of a corpus; DejavuError if it is too short."""
    if n_tokens < 2:
        raise DejavuError(f"--calib-tokens must be at least 2, got {n_tokens}")
    text, name = read_corpus(source)
    ids = encode_text(tokenizer, text, bos_id, max_tokens=n_tokens)
    if len(ids) < n_tokens:
        raise DejavuError(f"corpus {name!r} has {len(ids)} tokens, fewer than the {n_tokens} "
                          f"requested (lower --calib-tokens or give a longer corpus)")
    return ids, name


def fingerprint_tokens(ids: np.ndarray) -> str:
    """sha256 of a token stream (covers both the corpus text and the tokenizer)."""
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).hexdigest()

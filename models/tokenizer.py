"""A small text <-> ids wrapper over a `tokenizers.Tokenizer` (what the CLIs and runtime use).

What goes before a prompt's ids is chosen once, by `add_bos`: OPT's `</s>` always (a tokenizer.json with or without
OPT's template gives the same ids), or for the Llama family what the tokenizer's own post-processor writes
(`special_affixes`: Llama's BOS, nothing for Qwen's or SmolLM2's byte-level vocabularies; and an EOS after the text
where its template appends one), as transformers and vLLM encode a prompt.
"""
from __future__ import annotations

import os


def end_ids(eos) -> tuple[int, ...]:
    """The ids that end a generation, from a config's `eos_token_id`: one id, a list of them (Llama 3.1's
    end_of_text, eom and eot; transformers and vLLM stop at any), or None (none). The first is the tokenizer's
    EOS. DejavuError for anything else."""
    from dejavu.errors import DejavuError

    ids = [] if eos is None else [eos] if not isinstance(eos, (list, tuple)) else list(eos)
    if not all(type(i) is int and i >= 0 for i in ids):
        raise DejavuError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(dict.fromkeys(ids))


def eos_field(ids) -> int | tuple[int, ...] | None:
    """`eos_token_id` as a config writes it, of the ids end_ids reads (in any number, repeats once): one id, several
    (a tuple; JSON writes a list), or None."""
    ids = end_ids(list(ids))
    return ids[0] if len(ids) == 1 else ids or None


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a `tokenizers.Tokenizer`'s post-processor writes before a text (its BOS, where it adds one) and after
    it (its EOS, where a template appends one: a tokenizer that adds EOS to every text)."""
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    i = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    return ([], []) if i is None else (full[:i], full[i + len(bare):])


def special_prefix(tokenizer) -> list[int]:
    """The ids a `tokenizers.Tokenizer`'s post-processor writes before a text (its BOS, where it adds one)."""
    return special_affixes(tokenizer)[0]


def prompt_bos(header: dict) -> bool | None:
    """`TextTokenizer`'s add_bos for an engine header: OPT's </s> always; a Llama-family engine's as its tokenizer's
    post-processor."""
    return None if header.get("model_family", "opt") == "llama" else True


class TextTokenizer:
    """encode / decode with OPT's special ids (bos = eos = `</s>`, pad = `<pad>`). eos_id: one id or several
    (`stop_ids`: every id that ends a generation; `eos_id`: the first)."""

    def __init__(self, tokenizer, bos_id: int | None = None, eos_id=None, pad_id: int | None = None,
                 add_bos: bool | None = True):
        from tokenizers import Tokenizer

        from dejavu.errors import DejavuError

        if isinstance(tokenizer, str):
            try:
                tokenizer = Tokenizer.from_str(tokenizer)
            except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
                raise DejavuError(f"unreadable tokenizer JSON ({str(e).splitlines()[0]})") from None
        self.tokenizer = tokenizer
        eos_tok = tokenizer.token_to_id("</s>")
        self.bos_id = bos_id if bos_id is not None else eos_tok
        self.stop_ids = end_ids(eos_id) or end_ids(eos_tok)
        self.eos_id = self.stop_ids[0] if self.stop_ids else None
        self.pad_id = pad_id if pad_id is not None else tokenizer.token_to_id("<pad>")
        if self.bos_id is None or self.eos_id is None:
            raise DejavuError("tokenizer has no '</s>' token; pass bos_id and eos_id explicitly")
        # before a prompt: bos_id (add_bos True), nothing (False), or what the post-processor writes (None), and
        # after it what the post-processor writes there (None only)
        self.prefix, self.suffix = [self.bos_id] if add_bos else [], []
        if add_bos is None:
            self.prefix, self.suffix = special_affixes(tokenizer)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike) -> "TextTokenizer":
        """From a model folder / preset / hub id; special ids from its config.json when present."""
        from dejavu.models.loader import load_config, load_tokenizer

        cfg = load_config(name_or_path)
        return cls(load_tokenizer(name_or_path), cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The whole tokenizer.json text (what an engine header stores)."""
        return self.tokenizer.to_str()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """add_bos None: the prefix (and suffix) this tokenizer was made with; True: bos_id first; False: the text's
        ids alone."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            return self.prefix + ids + self.suffix
        return ([self.bos_id] if add_bos else []) + ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

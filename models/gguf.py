"""Read a llama.cpp GGUF file (Llama, Qwen2 or Qwen3 architecture) into `dejavu.models.llama`, with its tokenizer.

Uses the `gguf` package (`pip install gguf`, or the `smollm2` extra) and nothing else:
- config: the `llama.*` (`qwen2.*`, `qwen3.*`) metadata turned into the Hugging Face config.json fields;
- weights: every tensor dequantized (Q4_0/Q4_1/Q8_0/K-quants/F16/F32, whatever `gguf.quants`
  knows) to fp32, then cast to the requested dtype, renamed to Hugging Face names. llama.cpp's
  converter permutes the rows of Q and K of Llama files (rotary pairs interleaved, not split in halves);
  `_unpermute` undoes it so the weights fit the half-split RoPE of `dejavu.models.llama` (Qwen2 and Qwen3 files
  keep the checkpoint's rows: llama.cpp runs them with the half-split "NEOX" rotation);
- tokenizer: a byte-level BPE `tokenizers.Tokenizer` from `tokenizer.ggml.tokens/merges`, with
  the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`.
The file is memory-mapped by `gguf.GGUFReader`; one tensor at a time is dequantized.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Iterator

import torch

from dejavu.errors import DejavuError

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
PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "llama-bpe", "llama3", "llama-v3", "qwen2")
ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture -> model_type of the same name


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
    """The Hugging Face config.json fields of a Llama (Qwen2, Qwen3) GGUF file's metadata."""
    arch = _check_arch(reader, path)
    a = arch + "."

    def need(key):
        v = _field(reader, a + key)
        if v is None:
            raise DejavuError(f"{path}: GGUF metadata lacks {a + key!r}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise DejavuError(f"{path}: per-frequency RoPE factors (rope_freqs) are not supported")
    vocab = _field(reader, a + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    d = {
        "model_type": arch, "hidden_act": "silu", "vocab_size": int(vocab), "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv", heads)),
        "intermediate_size": int(need("feed_forward_length")),
        "max_position_embeddings": int(need("context_length")),
        "head_dim": int(_field(reader, a + "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, a + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        # Qwen2: q/k/v biases by its type; Llama's and Qwen3's attention_bias: q/k/v's and o's where the file has them
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    kind = _field(reader, a + "rope.scaling.type")
    if kind not in (None, "none"):
        d["rope_scaling"] = {"rope_type": kind, "factor": float(_field(reader, a + "rope.scaling.factor", 1.0))}
    return d


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: w [n_head * hd, D], rows (pairs interleaved) → halves."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name (None: not a Llama tensor)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
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
        name = hf_name(t.name)
        if name is None:
            raise DejavuError(f"{path}: unexpected GGUF tensor {t.name!r}")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)  # fp32 numpy, [rows, cols]
        except Exception as e:  # noqa: BLE001 - unknown quantization types raise NotImplementedError
            raise DejavuError(f"{path}: cannot dequantize {t.name!r} ({t.tensor_type.name}: {e})") from None
        w = torch.from_numpy(arr.copy()).float()
        if cfg["model_type"] != "llama":
            pass  # Qwen2, Qwen3: the checkpoint's rows
        elif ".attn_q." in t.name:
            w = _unpermute(w, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute(w, cfg["num_key_value_heads"])
        yield name, w.to(dtype or stored.get(t.tensor_type.name, torch.float16))


def build_tokenizer(reader, path="GGUF file"):
    """A byte-level BPE `tokenizers.Tokenizer` from the file's vocabulary, merges and token types."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise DejavuError(f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
                          "'gpt2'); use the Hugging Face folder's tokenizer.json")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise DejavuError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                          f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    if pre in ("llama-bpe", "llama3", "llama-v3", "qwen2"):
        steps = [pre_tokenizers.Split(Regex(_QWEN2_REGEX if pre == "qwen2" else _LLAMA3_REGEX), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:  # GPT-2's regex (ByteLevel's own); smollm: llama.cpp isolates every digit first
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # CONTROL (3) and USER_DEFINED (4) tokens are matched whole, before BPE
    special = [AddedToken(t, special=ty == 3, normalized=False)
               for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_tokens(special)
    return tok


def special_ids(reader) -> dict:
    """bos / eos / pad ids of the file, and the document separator used to start scored text."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eot = tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else None
    return {"bos_id": _field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_id": _field(reader, "tokenizer.ggml.eos_token_id"),
            "pad_id": _field(reader, "tokenizer.ggml.padding_token_id"),
            "document_id": eot}

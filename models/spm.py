"""SentencePiece BPE vocabularies as `tokenizers.Tokenizer`s: a folder's `tokenizer.model` (the Llama-2 family's
SentencePiece file, where a folder has no tokenizer.json: Vicuna, Yi, OpenLLaMA) as transformers 5 builds a Llama
tokenizer from it, and a GGUF file's "llama" vocabulary as llama.cpp tokenizes it.

`tokenizer.model` is a protobuf message (sentencepiece_model.proto's ModelProto), read here from its wire format
without the sentencepiece or protobuf packages and without executing anything from the file:

    ModelProto       1: pieces (repeated SentencePiece)   2: trainer_spec   3: normalizer_spec
    SentencePiece    1: piece (string)   2: score (float)   3: type (1 normal, 2 unknown, 3 control,
                     4 user defined, 5 unused, 6 byte; GGUF's token types are the same numbers)
    TrainerSpec      3: model_type (1 unigram, the default; 2 BPE)   35: byte_fallback (bool)
    NormalizerSpec   3: add_dummy_prefix (bool, default true)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from dejavu.errors import DejavuError

BPE = 2
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4


@dataclass
class SpmModel:
    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = 1
    byte_fallback: bool = False
    add_dummy_prefix: bool = True


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one message: value an int (varint, fixed32 / fixed64 as raw bits) or
    the bytes of a length-delimited field."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"wire type {wire}")
        if i > len(buf):
            raise ValueError("truncated field")
        yield field, wire, value


def read_model_proto(path: str | Path) -> SpmModel:
    """A SentencePiece `tokenizer.model`'s pieces, scores, types and the settings a tokenizer needs."""
    path = Path(path)
    try:
        buf = path.read_bytes()
        m = SpmModel([], [], [])
        for field, wire, value in _fields(buf):
            if field == 1 and wire == 2:
                piece, score, kind = None, 0.0, 1
                for f, w, v in _fields(value):
                    if f == 1 and w == 2:
                        piece = v.decode("utf-8")
                    elif f == 2 and w == 5:
                        score = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                    elif f == 3 and w == 0:
                        kind = v
                if piece is None:
                    raise ValueError("a piece without its text")
                m.pieces.append(piece)
                m.scores.append(score)
                m.types.append(kind)
            elif field == 2 and wire == 2:
                for f, w, v in _fields(value):
                    if f == 3 and w == 0:
                        m.model_type = v
                    elif f == 35 and w == 0:
                        m.byte_fallback = bool(v)
            elif field == 3 and wire == 2:
                for f, w, v in _fields(value):
                    if f == 3 and w == 0:
                        m.add_dummy_prefix = bool(v)
    except OSError as e:
        raise DejavuError(f"{path}: unreadable ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DejavuError(f"{path}: not a SentencePiece model file ({e})") from None
    if not m.pieces:
        raise DejavuError(f"{path}: not a SentencePiece model file (no pieces)")
    if m.model_type != BPE:
        kind = {1: "unigram", 3: "word", 4: "char"}.get(m.model_type, str(m.model_type))
        raise DejavuError(f"{path}: SentencePiece {kind} models are not supported (BPE, as the Llama family's); "
                          "use the folder's tokenizer.json")
    return m


def bpe_tokenizer(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool = True,
                  merges: list[tuple[str, str]] | None = None, byte_fallback: bool = True,
                  prepend_scheme: str | None = None):
    """SentencePiece's BPE as a `tokenizers.Tokenizer`: spaces as "▁", and one "▁" before the text unless
    add_space_prefix is false: with prepend_scheme None, prepended by a normalizer (llama.cpp's SPM tokenizer, and
    transformers 4's legacy conversion: before every segment between added tokens, even one that starts with a
    space); "always" / "first", by a Metaspace pre-tokenizer as transformers 5's LlamaTokenizer builds it (legacy
    / not legacy: before every segment / the first one, and never before one that starts with a space). Adjacent
    pieces merged best score first (a merge for every split of a token into two tokens, ranked by the token's
    score, as transformers recovers them); a character outside the vocabulary as its bytes' <0xXX> tokens
    (byte_fallback), the unknown token (type 2) otherwise. UNKNOWN, CONTROL and USER_DEFINED tokens are matched
    whole, the first two as special tokens (llama.cpp's special-token parsing, transformers' `<unk>`)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = merges or _merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    space = normalizers.Replace(" ", "\u2581")
    if prepend_scheme is None:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if add_space_prefix else space
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                     prepend_scheme=prepend_scheme if add_space_prefix else "never")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    tok.add_tokens(matched_whole(tokens, types))
    return tok


def matched_whole(tokens: list[str], types: list[int]) -> list:
    """The `AddedToken`s of a vocabulary's UNKNOWN, CONTROL and USER_DEFINED tokens: matched whole before the model
    runs, as llama.cpp parses special tokens (the first two special)."""
    from tokenizers import AddedToken

    return [AddedToken(t, special=ty != USER_DEFINED, normalized=False)
            for t, ty in zip(tokens, types) if ty in (UNKNOWN, CONTROL, USER_DEFINED)]


def _merges_from_scores(vocab: dict, scores: dict) -> list[tuple[str, str]]:
    # every (left, right) of two tokens whose concatenation is a token, best-scoring concatenation first; within a
    # score the longer left piece first, then the pieces' ids (transformers' generate_merges, the same order)
    merges = []
    for merged, score in scores.items():
        pairs = [(merged[:i], merged[i:]) for i in range(1, len(merged)) if merged[:i] in vocab and merged[i:] in vocab]
        merges += [(left, right, score) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def folder_tokenizer(folder: Path):
    """The tokenizer of a folder whose vocabulary is its `tokenizer.model` alone, with the tokens its
    tokenizer_config.json adds after the model's pieces (`added_tokens_decoder`, else an older folder's
    added_tokens.json), its `add_bos_token` (prompts start with BOS unless it is false), its `add_eos_token` (they
    end with EOS where it is true) and its `legacy` flag, read as
    transformers 5 reads such a folder (legacy false, its default: no "▁" before the text after a special token,
    as SentencePiece itself tokenizes)."""
    from tokenizers import AddedToken

    m = read_model_proto(folder / "tokenizer.model")
    cfg_path = folder / "tokenizer_config.json"
    cfg = _json_object(cfg_path) if cfg_path.is_file() else {}
    tok = bpe_tokenizer(m.pieces, m.scores, m.types, add_space_prefix=m.add_dummy_prefix,
                        byte_fallback=m.byte_fallback, prepend_scheme="always" if cfg.get("legacy") else "first")
    added, source = cfg.get("added_tokens_decoder"), cfg_path
    if added is None and (folder / "added_tokens.json").is_file():
        added, source = _added_tokens_json(folder / "added_tokens.json", cfg), folder / "added_tokens.json"
    added = added or {}
    try:
        extra = sorted((int(i), a) for i, a in added.items() if int(i) >= len(m.pieces))
        for want, a in extra:
            content = a["content"]
            if want != tok.get_vocab_size(with_added_tokens=True):
                raise DejavuError(f"{source}: added token {content!r} has id {want}, not the next id "
                                  f"{tok.get_vocab_size(with_added_tokens=True)}")
            tok.add_tokens([AddedToken(content, special=bool(a.get("special")), normalized=False,
                                       lstrip=bool(a.get("lstrip")), rstrip=bool(a.get("rstrip")))])
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise DejavuError(f"{source}: unreadable added tokens ({e!r})") from None
    # a prompt starts with BOS unless add_bos_token says not, as SentencePiece Llamas were trained and as
    # transformers 4 and llama.cpp read such a folder (transformers 5 adds none where add_bos_token is unset)
    # and ends with EOS where add_eos_token says so (transformers reads both flags of such a folder)
    ends = []
    for key, default, add in (("bos_token", "<s>", cfg.get("add_bos_token", True) is not False),
                              ("eos_token", "</s>", cfg.get("add_eos_token") is True)):
        t = cfg.get(key, default)
        t = t.get("content") if isinstance(t, dict) else t
        ends.append((t, tok.token_to_id(t)) if add and isinstance(t, str) and tok.token_to_id(t) is not None else None)
    return with_affixes(tok, *ends) if any(ends) else tok


def _added_tokens_json(path: Path, cfg: dict) -> dict:
    """An older folder's added_tokens.json ({token: id}) in added_tokens_decoder's form, read as transformers reads
    it where tokenizer_config.json has no added_tokens_decoder: special where it is one of the config's named
    special tokens."""
    d = _json_object(path)
    named = {v.get("content") if isinstance(v, dict) else v for k, v in cfg.items()
             if k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
    return {i: {"content": t, "special": t in named} for t, i in d.items()}


def _json_object(path: Path) -> dict:
    import json

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DejavuError(f"{path}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise DejavuError(f"{path}: not a JSON object")
    return d


def with_affixes(tok, bos: tuple[str, int] | None, eos: tuple[str, int] | None = None):
    """The `tokenizers.Tokenizer` with a post-processor that writes BOS (its text and id) before a text and EOS after
    it, each where given (what models.tokenizer.special_affixes reads back)."""
    import json

    from tokenizers import Tokenizer

    def seq(x: str, type_id: int) -> list[dict]:
        return [*([{"SpecialToken": {"id": bos[0], "type_id": type_id}}] if bos else []),
                {"Sequence": {"id": x, "type_id": type_id}},
                *([{"SpecialToken": {"id": eos[0], "type_id": type_id}}] if eos else [])]

    special = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in filter(None, (bos, eos))}
    d = json.loads(tok.to_str())  # the JSON form: a token's text may hold a colon (the string form's type id)
    d["post_processor"] = {"type": "TemplateProcessing", "single": seq("A", 0), "pair": seq("A", 0) + seq("B", 1),
                           "special_tokens": special}
    return Tokenizer.from_str(json.dumps(d))

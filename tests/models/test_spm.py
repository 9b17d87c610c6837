"""Folders whose vocabulary is a SentencePiece tokenizer.model alone (Vicuna, Yi, OpenLLaMA): read from the
protobuf's wire format (models/spm.py), tokenized as transformers 5 tokenizes the same folder and as SentencePiece
itself does, and compiled into an engine."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dejavu.errors import DejavuError

spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")  # transformers converts tokenizer.model with it

DATA = Path(__file__).resolve().parents[2] / "dejavu" / "data" / "calib" / "wikitext2-train-head.txt"
TEXTS = ["Hello  world,\n 1234 é ü 😀 naïve <|user|> hi <ctl> x</s>y", " leading space", "", "<s>start",
         "tabs\tand\u3000wide ①", "   ", "The game's 3rd act.", "a <|im_start|> b<|im_start|>c <|x|>"]
# tokens tokenizer_config.json adds after the model's pieces, as a chat fine-tune's folder does
ADDED = {"600": {"content": "<|im_start|>", "special": True}, "601": {"content": "<|x|>", "special": False}}


def _train(model_type: str = "bpe", vocab_size: int = 600) -> bytes:
    # a model as Llama's tokenizer.model is made: BPE, byte fallback, digits split, no normalization
    lines = DATA.read_text(encoding="utf-8").splitlines()[:300]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=vocab_size, model_type=model_type,
        byte_fallback=True, character_coverage=0.995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=["<|user|>"], control_symbols=["<ctl>"])
    return out.getvalue()


@pytest.fixture(scope="module")
def proto() -> bytes:
    return _train()


def _folder(path: Path, proto: bytes, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(proto)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "added_tokens_decoder": ADDED, **config}))
    return path


def test_model_proto_read_as_sentencepiece_reads_it(proto, tmp_path):
    from dejavu.models.spm import BPE, read_model_proto

    (tmp_path / "tokenizer.model").write_bytes(proto)
    m = read_model_proto(tmp_path / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_proto=proto)
    assert m.pieces == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert m.scores == [sp.get_score(i) for i in range(sp.get_piece_size())]  # float32 both
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             4 if m.pieces[i] == "<|user|>" else 1 for i in range(sp.get_piece_size())]
    assert m.types == kinds and m.types.count(6) == 256
    assert (m.model_type, m.byte_fallback, m.add_dummy_prefix) == (BPE, True, True)


@pytest.mark.parametrize("legacy", [None, True, False], ids=["legacy-unset", "legacy", "not-legacy"])
def test_folder_tokenizes_as_transformers_does(proto, tmp_path, legacy):
    import transformers
    from transformers import AutoTokenizer

    from dejavu.models.loader import load_tokenizer

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the reference is transformers 5's Llama tokenizer (4's legacy default differs)")
    folder = _folder(tmp_path / "f", proto, **({} if legacy is None else {"legacy": legacy}))
    ref, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    for text in TEXTS:
        ids = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False).ids == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.get_vocab_size(with_added_tokens=True) == len(ref) == 602
    if legacy:  # transformers' legacy form puts "▁" before the text after a special token
        assert ours.encode("a <|im_start|> b", add_special_tokens=False).tokens[-1] == "\u2581b"


def test_plain_text_as_sentencepiece_encodes_it(proto, tmp_path):
    from dejavu.models.loader import load_tokenizer

    ours, sp = load_tokenizer(_folder(tmp_path / "f", proto)), spm.SentencePieceProcessor(model_proto=proto)
    # lines the model was not trained on, without what the two read otherwise: a leading space (SentencePiece's
    # dummy prefix goes before it, transformers 5's Metaspace does not) and "<unk>" (text to SentencePiece, the
    # special token to transformers)
    text = [t.strip().replace("<unk>", "unk") for t in DATA.read_text(encoding="utf-8").splitlines()[400:440]]
    for line in text + ["naïve 😀 ①②", "x  y\nz"]:
        assert ours.encode(line, add_special_tokens=False).ids == sp.encode(line), line


def test_bad_tokenizer_models_are_one_error(proto, tmp_path):
    from dejavu.models.loader import load_tokenizer

    f = _folder(tmp_path / "unigram", _train("unigram", 400))
    with pytest.raises(DejavuError, match="SentencePiece unigram models are not supported"):
        load_tokenizer(f)
    for name, data in (("garbage", b"\xff" * 64), ("cut", proto[:1000]), ("empty", b"")):
        f = _folder(tmp_path / name, data)
        with pytest.raises(DejavuError, match="not a SentencePiece model file"):
            load_tokenizer(f)
    f = _folder(tmp_path / "gap", proto, added_tokens_decoder={"605": {"content": "<|y|>"}})
    with pytest.raises(DejavuError, match="has id 605, not the next id 600"):
        load_tokenizer(f)
    f = _folder(tmp_path / "list", proto)
    (f / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(DejavuError, match="tokenizer_config.json: not a JSON object"):
        load_tokenizer(f)
    (tmp_path / "none").mkdir()
    with pytest.raises(DejavuError, match=r"no tokenizer \(tokenizer.json, vocab.json \+ merges.txt, or tokenizer"):
        load_tokenizer(tmp_path / "none")


def test_a_tokenizer_model_folder_compiles_and_generates(proto, tmp_path):
    from transformers import AutoTokenizer

    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.runtime import Engine
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "llama", seed=1, vocab_size=640, bos_token_id=1, eos_token_id=2,
                              pad_token_id=None)
    (folder / "tokenizer.json").unlink()
    _folder(folder, proto)
    out = tmp_path / "e.engine"
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=256, calib_window=64, dtype="float32"), out,
                 progress=False)
    engine, ref = Engine.load(out), AutoTokenizer.from_pretrained(folder)
    prompt = "The game's 3rd act <|im_start|> began"
    assert engine.tokenizer.encode(prompt) == [1] + ref(prompt, add_special_tokens=False)["input_ids"]
    ids = engine.generate([prompt], 6, stop_at_eos=False)[0]
    assert len(ids) == 6 and engine.tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add", [None, True, False], ids=["unset", "true", "false"])
@pytest.mark.parametrize("eos", [None, True], ids=["", "eos"])
def test_folder_prompt_starts_with_bos_unless_add_bos_token_says_not(proto, tmp_path, add, eos):
    """A prompt starts with BOS as tokenizer_config.json's add_bos_token says, as transformers starts it; where the
    field is unset, with BOS, as SentencePiece Llamas were trained, transformers 4 and llama.cpp read such a folder
    (transformers 5 adds none there). It ends with EOS where add_eos_token is true, as transformers ends it."""
    from transformers import AutoTokenizer

    from dejavu.models.loader import load_tokenizer
    from dejavu.models.tokenizer import TextTokenizer

    flags = {**({} if add is None else {"add_bos_token": add}), **({} if eos is None else {"add_eos_token": eos})}
    folder = _folder(tmp_path / "f", proto, **flags)
    ours, ref = TextTokenizer(load_tokenizer(folder), 1, 2, add_bos=None), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        bare = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ([] if add is False else [1]) + bare + ([2] if eos else []), text
        if add is not None:
            assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.encode(text, add_bos=False) == bare


def test_added_tokens_json_of_older_folders(proto, tmp_path):
    """An older folder lists its added tokens in added_tokens.json ({token: id}) instead of tokenizer_config.json's
    added_tokens_decoder: read as transformers reads it (special where it names a special token of the config),
    the ids and text equal transformers'; a malformed file is one error line."""
    from transformers import AutoTokenizer

    from dejavu.models.loader import load_tokenizer

    folder = _folder(tmp_path / "f", proto, pad_token="<|pad|>")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["added_tokens_decoder"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "added_tokens.json").write_text(json.dumps({"<|im_start|>": 600, "<|pad|>": 601, "<s>": 1}))
    ref, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert ours.get_vocab_size(with_added_tokens=True) == len(ref) == 602
    for text in TEXTS + ["a<|pad|>b <|im_start|>x"]:
        ids = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    for bad, msg in (("[1]", "added_tokens.json: not a JSON object"), ("{", "added_tokens.json: not JSON"),
                     ('{"<|y|>": 605}', "added token '<|y|>' has id 605, not the next id 600")):
        (folder / "added_tokens.json").write_text(bad)
        with pytest.raises(DejavuError, match=msg):
            load_tokenizer(folder)

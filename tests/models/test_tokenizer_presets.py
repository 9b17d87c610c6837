"""Tokenizer loading (tokenizer.json, GPT-2 vocab/merges like facebook/opt-*), presets, resolve."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import dejavu.models.presets as presets
from dejavu.errors import DejavuError
from dejavu.models.loader import load_model, load_tokenizer
from dejavu.models.presets import PRESETS, resolve
from dejavu.models.tokenizer import TextTokenizer

TEXT = "Hello world, the  café  </s> x\n\nNew line"


def test_text_tokenizer_round_trip(tiny_opt_dir):
    tok = TextTokenizer.from_pretrained(tiny_opt_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 2, 1)
    ids = tok.encode(TEXT)
    assert ids[0] == 2 and tok.encode(TEXT, add_bos=False) == ids[1:]
    assert tok.decode(ids) == TEXT.replace("</s>", "")  # specials are skipped
    # the runtime builds it from the engine header's tokenizer_json string
    same = TextTokenizer(tok.to_json())
    assert same.encode(TEXT) == ids and same.bos_id == 2


def test_gpt2_vocab_merges_like_opt(tmp_path, tiny_opt_dir):
    """facebook/opt-* ship vocab.json + merges.txt: we build the same ids as transformers."""
    Tokenizer.from_file(str(tiny_opt_dir / "tokenizer.json")).model.save(str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {"vocab.json", "merges.txt"}
    tok = load_tokenizer(tmp_path)
    ids = tok.encode(TEXT).ids
    assert ids[0] == 2  # </s> prepended, like OPT's tokenizer
    assert tok.decode(ids, skip_special_tokens=True) == TEXT.replace("</s>", "")
    assert TextTokenizer(tok).encode(TEXT) == ids

    transformers = pytest.importorskip("transformers")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({  # as in facebook/opt-125m
        "add_bos_token": True, "add_prefix_space": False, "bos_token": "</s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "</s>", "tokenizer_class": "GPT2Tokenizer"}))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf(TEXT)["input_ids"] == ids


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DejavuError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DejavuError, match=r"tokenizer\.json: unreadable tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(DejavuError, match="unreadable tokenizer JSON"):
        TextTokenizer("{not json")


def test_presets_are_names_only():
    sizes = ["125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b", "175b"]
    assert set(PRESETS) == {f"opt-{s}" for s in sizes} | {"opt-mini"}
    assert all(PRESETS[f"opt-{s}"] == f"facebook/opt-{s}" for s in sizes)
    import dejavu.models

    assert Path(PRESETS["opt-mini"]) == Path(dejavu.models.__file__).resolve().parent / "opt-mini"


def test_resolve_folder_and_unknown_names(tiny_opt_dir, tmp_path):
    assert resolve(tiny_opt_dir) == tiny_opt_dir
    assert resolve(str(tiny_opt_dir)) == tiny_opt_dir
    with pytest.raises(DejavuError, match=r"model 'gpt-foo' not found.*presets: opt-125m, opt-350m"):
        resolve("gpt-foo")
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(DejavuError, match="is a file, expected a model folder"):
        resolve(f)


def test_resolve_offline_cache_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DejavuError, match=r"model 'opt-125m' \(facebook/opt-125m\) not found: not in the .*HF_HUB_OFFLINE is set"):
        resolve("opt-125m", cache_dir=tmp_path)
    with pytest.raises(DejavuError, match=r"model 'someone/opt-x' not found"):
        resolve("someone/opt-x", cache_dir=tmp_path)


def test_resolve_and_load_from_hf_cache(tiny_opt_dir, tmp_path, monkeypatch):
    """A preset is found in the local Hugging Face cache (hub layout: refs + snapshots)."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    repo = tmp_path / "models--facebook--opt-125m"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in tiny_opt_dir.iterdir():
        (snap / f.name).symlink_to(f)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("opt-125m", cache_dir=tmp_path) == snap
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    model, cfg = load_model("facebook/opt-125m")
    assert cfg.hidden_size == 32  # sizes come from the cached config.json, not the preset name


def test_opt_mini_missing_folder_is_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setattr(presets, "OPT_MINI_DIR", tmp_path / "opt-mini")
    monkeypatch.setitem(presets.PRESETS, "opt-mini", str(tmp_path / "opt-mini"))
    with pytest.raises(DejavuError, match="shipped folder .* is missing"):
        resolve("opt-mini")


def test_opt_mini_preset():
    assert presets.OPT_MINI_DIR.is_dir(), "the shipped opt-mini folder is part of the package"
    model, cfg = load_model("opt-mini")
    tok = TextTokenizer.from_pretrained("opt-mini")
    ids = tok.encode("The king said unto them,")
    assert ids[0] == cfg.bos_token_id and max(ids) < cfg.vocab_size
    x = torch.tensor([ids])
    with torch.no_grad():
        ours = model(x)
    assert ours.shape == (1, len(ids), cfg.vocab_size)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        presets.OPT_MINI_DIR, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        err = (hf(input_ids=x).logits - ours).abs().max().item()
    assert err <= 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(presets.OPT_MINI_DIR)
    assert hf_tok("The king said unto them,", add_special_tokens=False)["input_ids"] == ids[1:]


@pytest.mark.parametrize("form", ["llama3", "qwen2", "none", "bos_eos"])
def test_llama_prompt_starts_as_transformers_encodes_it(tmp_path, form):
    """A Llama-family prompt starts with what its tokenizer.json's post-processor writes, as transformers'
    tokenizer(text) and vLLM encode a prompt: Llama 3's template its BOS, Qwen2's ByteLevel step and a missing one
    nothing; a template that also appends EOS ends it with EOS (a tokenizer that adds EOS to every text). An
    engine's tokenizer (the header's tokenizer_json) encodes it alike; OPT's engines keep their </s>; a chat's
    rendered text (add_bos False) is the text's ids alone, as transformers' apply_chat_template encodes it."""
    import sys

    from transformers import AutoTokenizer

    from dejavu.models.auto import load_text_tokenizer
    from dejavu.models.tokenizer import prompt_bos

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "f", seed=0, bos_token_id=0, eos_token_id=2)
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["post_processor"] = {
        "llama3": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                            {"Sequence": {"id": "A", "type_id": 0}}],
                   "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                   "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
        "qwen2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "none": None,
        "bos_eos": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                             {"Sequence": {"id": "A", "type_id": 0}},
                                                             {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                                       "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}}}[form]
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    ref, ours = AutoTokenizer.from_pretrained(folder), load_text_tokenizer(folder)
    engine_tok = TextTokenizer(ours.to_json(), 0, 2, None, add_bos=prompt_bos({"model_family": "llama"}))
    for text in (TEXT, "x", "<s> hi"):
        want = ref(text)["input_ids"]
        assert ours.encode(text) == engine_tok.encode(text) == want, text
        bare = ref(text, add_special_tokens=False)["input_ids"]
        assert want == ([0] if form in ("llama3", "bos_eos") else []) + bare + ([2] if form == "bos_eos" else [])
        assert ours.encode(text, add_bos=False) == bare and ours.encode(text, add_bos=True) == [0] + bare
    opt = TextTokenizer(ours.to_json(), 0, 2, None, add_bos=prompt_bos({"model_family": "opt"}))
    assert opt.encode("x") == [0] + ours.encode("x", add_bos=False)

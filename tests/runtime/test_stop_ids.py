"""Every id that ends a generation: config.json's eos_token_id list, generation_config.json's, GGUF's eot / eom.

A checkpoint such as Llama-3.1-Instruct ends a chat turn with <|eot_id|>, the second or third of its
eos_token_id list; transformers' and vLLM's generate stop at any of them. Each path here generates with the
stop ids and is compared with the same generation run without stopping."""
from __future__ import annotations

import json
import threading

import pytest

from dejavu.errors import DejavuError
from dejavu.models.tokenizer import end_ids
from llama_helpers import write_tiny_llama

PROMPT = [0, 17, 93, 5]


def test_end_ids_reads_one_id_a_list_or_none():
    assert end_ids(2) == (2,) and end_ids(None) == () and end_ids([]) == ()
    assert end_ids([128001, 128008, 128009, 128001]) == (128001, 128008, 128009)  # order kept, repeats once
    for bad in ("2", [2, None], -1, [1.5], True):
        with pytest.raises(DejavuError, match="eos_token_id must be a token id or a list of them"):
            end_ids(bad)


def _stop_after(tokens: list[int], taken: set[int]) -> int:
    # the position of the first token, past the first two, that has not come earlier and is not in `taken`
    return next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in taken)


@pytest.fixture(scope="module")
def folder_and_free_run(tmp_path_factory):
    """A tiny Llama folder whose config.json lists eos [2, 300] and whose generation_config.json adds the
    greedy continuation's k-th token X; (folder, the 12 tokens generated with no stop, k, X)."""
    from dejavu.models.auto import load_llama
    from dejavu.models.generate import generate

    folder = write_tiny_llama(tmp_path_factory.mktemp("stops") / "tiny", seed=3)
    model, _ = load_llama(folder)
    free = generate(model, [PROMPT], 12, temperature=0.0)[0]
    k = _stop_after(free, {2, 300})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [2, 300]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [300, free[k]], "do_sample": False}))
    return folder, free, k, free[k]


def test_folder_stop_ids_join_config_and_generation_config(folder_and_free_run):
    from dejavu.models.auto import load_llama, load_text_tokenizer
    from dejavu.models.generate import generate

    folder, free, k, x = folder_and_free_run
    tok = load_text_tokenizer(folder)
    assert tok.stop_ids == (2, 300, x) and tok.eos_id == 2
    model, cfg = load_llama(folder)
    assert cfg.eos_token_id == (2, 300, x) and cfg.to_hf_dict()["eos_token_id"] == (2, 300, x)
    assert generate(model, [PROMPT], 12, temperature=0.0, eos_id=tok.stop_ids)[0] == free[:k + 1]
    assert generate(model, [PROMPT], 12, temperature=0.0, eos_id=tok.eos_id)[0] == free  # one id: runs on


def test_engine_header_runtime_and_scheduler_stop_at_any_id(folder_and_free_run, tmp_path):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.engine_file import read_header
    from dejavu.runtime import Engine
    from dejavu.runtime.scheduler import Request, Scheduler

    folder, free, k, x = folder_and_free_run
    path = tmp_path / "d1.engine"
    build_engine(folder, BuildConfig(density=1.0, calib_tokens=512, calib_window=128, dtype="float32"), path,
                 progress=False)
    assert read_header(path)["model_config"]["eos_token_id"] == [2, 300, x]
    eng = Engine.load(path)
    assert (eng.spec.eos_id, eng.spec.stop_ids) == (2, (2, 300, x))
    assert eng.generate([PROMPT], 12, stop_at_eos=False)[0] == free  # the engine is the dense model
    assert eng.generate([PROMPT], 12)[0] == free[:k + 1]
    assert eng.tokenizer.stop_ids == (2, 300, x)

    sched, done, got = Scheduler(eng, max_batch=2, max_queue=4, context=64), threading.Event(), []
    sched.start()
    try:
        sched.submit([Request(PROMPT, 12, lambda ev: (got.append(ev), ev[0] in ("done", "error") and done.set()))])
        assert done.wait(120)
    finally:
        sched.stop()
    assert got[-1][:2] == ("done", "stop") and list(got[-1][3]) == free[:k + 1]


def test_header_with_a_bad_eos_list_is_one_error(folder_and_free_run, tmp_path):
    from dejavu.runtime.llama_decoder import llama_spec_from_header
    from dejavu.runtime.spec import spec_from_header

    with pytest.raises(DejavuError, match="engine header: model_config: eos_token_id must be a token id"):
        llama_spec_from_header({"model_config": {**json.loads((folder_and_free_run[0] / "config.json").read_text()),
                                                 "eos_token_id": [2, "eot"]}})
    with pytest.raises(DejavuError, match="engine header: model_config: eos_token_id must be a token id"):
        spec_from_header({"model_config": {"vocab_size": 8, "hidden_size": 4, "ffn_dim": 8, "num_attention_heads": 2,
                                           "num_hidden_layers": 1, "max_position_embeddings": 8,
                                           "eos_token_id": [2, "eot"]},
                          "build_config": {"mlp_k": [8], "attn_k": [2]}})


def test_generation_config_that_is_not_json_is_one_error(tmp_path):
    from dejavu.models.auto import load_text_tokenizer

    folder = write_tiny_llama(tmp_path / "tiny")
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(DejavuError, match="generation_config.json: not valid JSON"):
        load_text_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(DejavuError, match="eos_token_id must be a token id"):
        load_text_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))  # no ids: config.json's
    assert load_text_tokenizer(folder).stop_ids == (2,)

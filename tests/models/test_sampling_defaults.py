"""The sampling settings a checkpoint ships (generation_config.json, a GGUF file's general.sampling.*), which the
compiler keeps in the engine header for dejavu-serve's defaults (tests/runtime/test_serve.py serves them)."""
from __future__ import annotations

import json

import pytest

from dejavu.errors import DejavuError
from dejavu.generation import model_sampling


def test_model_sampling_keeps_the_fields_present_and_checks_them():
    assert model_sampling({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}, "f") == {
        "temperature": 0.6, "top_p": 0.9}
    assert model_sampling({"top_k": 20, "temperature": 1}, "f") == {"top_k": 20, "temperature": 1.0}
    assert model_sampling(None, "f") == {} and model_sampling({"temperature": None}, "f") == {}
    for bad, why in (({"temperature": 2.5}, "temperature 2.5 is not a number in"), ({"top_p": 0}, "top_p 0 is not"),
                     ({"top_k": 2.0}, "top_k 2.0 is not an integer"), ({"temperature": "0.7"}, "temperature '0.7'"),
                     ({"top_k": True}, "top_k True"), ({"min_p": 1.2}, "min_p 1.2 is not a number in")):
        with pytest.raises(DejavuError, match=f"^where: {why}"):
            model_sampling(bad, "where")


def test_folder_generation_config(tmp_path):
    from dejavu.models.auto import load_sampling_defaults
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "f")
    assert load_sampling_defaults(folder) == {}
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [2, 5],
                                                               "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                               "repetition_penalty": 1.05,  # Qwen2.5-Instruct's
                                                               "min_p": 0.05}))
    assert load_sampling_defaults(folder) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                              "repetition_penalty": 1.05, "min_p": 0.05}
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(DejavuError, match="generation_config.json: top_p 1.5 is not a number in"):
        load_sampling_defaults(folder)


def test_gguf_general_sampling(tmp_path):
    import gguf

    from dejavu.models.auto import load_sampling_defaults

    def write(path, **kv):
        w = gguf.GGUFWriter(str(path), "llama")
        for k, v in kv.items():
            (w.add_int32 if isinstance(v, int) else w.add_float32)(k, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "a.gguf", **{"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                 "general.sampling.top_p": 0.95, "general.sampling.penalty_repeat": 1.1,
                                 "general.sampling.min_p": 0.05})
    got = load_sampling_defaults(str(tmp_path / "a.gguf"))
    assert got == {"temperature": pytest.approx(0.6), "top_p": pytest.approx(0.95), "top_k": 20,
                   "repetition_penalty": pytest.approx(1.1), "min_p": pytest.approx(0.05)}
    write(tmp_path / "b.gguf")
    assert load_sampling_defaults(str(tmp_path / "b.gguf")) == {}


def test_a_models_repetition_penalty_is_the_servers_default():
    """The engine header's repetition_penalty (its checkpoint's generation_config.json) is a request's default, as
    vLLM takes the model's; a request's own value wins; a value <= 0 in the config is one error line."""
    from dejavu.runtime.openai_protocol import SamplingDefaults, completion_params

    d = SamplingDefaults.of_engine({"sampling_defaults": {"temperature": 0.7, "repetition_penalty": 1.05}})
    assert (d.temperature, d.repetition_penalty) == (0.7, 1.05)
    assert completion_params({"prompt": [1]}, None, 10, d).repetition_penalty == 1.05
    assert completion_params({"prompt": [1], "repetition_penalty": 1.0}, None, 10, d).repetition_penalty == 1.0
    assert completion_params({"prompt": [1]}, None, 10, SamplingDefaults()).repetition_penalty == 1.0
    with pytest.raises(DejavuError, match="repetition_penalty 0 is not a number > 0"):
        SamplingDefaults.of_engine({"sampling_defaults": {"repetition_penalty": 0}})

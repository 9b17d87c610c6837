"""Checkpoint loading: HF folders (single / sharded safetensors, .bin), key prefixes, errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dejavu.errors import DejavuError
from dejavu.models.loader import load_config, load_model

transformers = pytest.importorskip("transformers")

HF_KW = dict(vocab_size=67, hidden_size=24, num_hidden_layers=2, ffn_dim=40, num_attention_heads=3,
             max_position_embeddings=32, dropout=0.0)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(**HF_KW, word_embed_proj_dim=16, attn_implementation="eager")
    m = transformers.OPTForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, HF_KW["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(5))


def assert_same_logits(folder, hf_model, ids, dtype=torch.float32):
    model, cfg = load_model(folder, dtype=dtype)
    assert cfg.word_embed_proj_dim == 16 and cfg.num_attention_heads == 3
    assert model.lm_head.weight is model.decoder.embed_tokens.weight  # tie restored
    assert all(p.dtype == dtype and not p.is_meta for p in model.parameters())
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits
        out = model(ids).float()
    tol = 1e-5 if dtype == torch.float32 else 0.1 * ref.abs().max().item()
    assert (out - ref).abs().max().item() <= tol
    return model


def hf_state_without_lm_head(hf_model):
    return {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}


def test_load_single_safetensors_from_save_pretrained(tmp_path, hf_model, ids):
    hf_model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert_same_logits(tmp_path, hf_model, ids)


def test_load_sharded_safetensors(tmp_path, hf_model, ids):
    hf_model.save_pretrained(tmp_path, max_shard_size="10KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_same_logits(tmp_path, hf_model, ids)


def test_load_bfloat16_cast(tmp_path, hf_model, ids):
    hf_model.save_pretrained(tmp_path)
    assert_same_logits(tmp_path, hf_model, ids, dtype=torch.bfloat16)


def test_load_pytorch_bin_single_and_sharded(tmp_path, hf_model, ids):
    # transformers 5 always writes safetensors, so write the .bin layout it used to write.
    sd = hf_model.state_dict()
    single = tmp_path / "single"
    single.mkdir()
    hf_model.config.save_pretrained(single)
    torch.save(dict(sd), single / "pytorch_model.bin")  # lm_head included: must be accepted
    assert_same_logits(single, hf_model, ids)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    hf_model.config.save_pretrained(sharded)
    keys = sorted(hf_state_without_lm_head(hf_model))
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        name = f"pytorch_model-0000{i}-of-00002.bin"
        torch.save({k: sd[k] for k in part}, sharded / name)
        weight_map.update({k: name for k in part})
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same_logits(sharded, hf_model, ids)


def test_load_bare_decoder_prefix(tmp_path, hf_model, ids):
    """facebook/opt-* checkpoints saved from OPTModel name tensors `decoder.*`."""
    hf_model.config.save_pretrained(tmp_path)
    sd = {k.removeprefix("model."): v for k, v in hf_state_without_lm_head(hf_model).items()}
    assert all(k.startswith("decoder.") for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    assert_same_logits(tmp_path, hf_model, ids)


def test_transformers_loads_our_fixture(tiny_opt_dir):
    """The shared fixture is a real HF folder: transformers and our loader agree on it."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_opt_dir, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    model, _ = load_model(tiny_opt_dir)
    x = torch.arange(3, 20)[None]
    with torch.no_grad():
        err = (model(x) - hf(input_ids=x).logits).abs().max().item()
    assert err <= 1e-4


# ---- errors: one line, naming what is wrong --------------------------------------------

def test_truncated_safetensors_names_the_file(make_tiny_opt_dir):
    folder = make_tiny_opt_dir()
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(DejavuError, match=r"model\.safetensors.*truncated or corrupt") as e:
        load_model(folder)
    assert "\n" not in str(e.value)


def test_corrupt_bin_names_the_file(make_tiny_opt_dir):
    folder = make_tiny_opt_dir()
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 this is not a zip archive" * 10)
    with pytest.raises(DejavuError, match=r"pytorch_model\.bin.*truncated, corrupt or unsafe"):
        load_model(folder)


def test_bin_with_code_is_refused(make_tiny_opt_dir):
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled code ran",))

    folder = make_tiny_opt_dir()
    (folder / "model.safetensors").unlink()
    torch.save({"x": Evil()}, folder / "pytorch_model.bin")
    with pytest.raises(DejavuError, match=r"pytorch_model\.bin"):
        load_model(folder)


def test_llama_config_names_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
        "vocab_size": 32000, "hidden_act": "silu"}))
    with pytest.raises(DejavuError, match=r"config\.json.*'model_type' is 'llama'"):
        load_config(tmp_path)
    with pytest.raises(DejavuError, match="model_type"):
        load_model(tmp_path)


def test_config_missing_field(make_tiny_opt_dir):
    folder = make_tiny_opt_dir()
    d = json.loads((folder / "config.json").read_text())
    del d["ffn_dim"]
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(DejavuError, match="'ffn_dim'"):
        load_model(folder)


def test_missing_folder():
    with pytest.raises(DejavuError, match=r"model '/no/such/dir/opt' not found: not a folder"):
        load_model("/no/such/dir/opt")


def test_missing_config_and_missing_weights(tmp_path, make_tiny_opt_dir):
    with pytest.raises(DejavuError, match="no config.json"):
        load_model(tmp_path)
    folder = make_tiny_opt_dir()
    (folder / "model.safetensors").unlink()
    with pytest.raises(DejavuError, match="no weights"):
        load_model(folder)


def test_shape_mismatch_names_tensor_and_shapes(make_tiny_opt_dir):
    folder = make_tiny_opt_dir()
    d = json.loads((folder / "config.json").read_text())
    d["ffn_dim"] = 96  # the weights have 128
    (folder / "config.json").write_text(json.dumps(d))
    pattern = r"tensor 'model\.decoder\.layers\.0\.fc1\.\w+' has shape \[128.*implies \[96"
    with pytest.raises(DejavuError, match=pattern):
        load_model(folder)


def test_missing_and_unexpected_tensors_are_named(make_tiny_opt_dir):
    folder = make_tiny_opt_dir()
    sd = load_file(folder / "model.safetensors")
    del sd["model.decoder.layers.1.fc2.weight"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(DejavuError, match=r"missing.*layers\.1\.fc2\.weight"):
        load_model(folder)
    sd["model.decoder.layers.1.fc2.weight"] = torch.zeros(32, 128)
    sd["model.decoder.layers.7.fc9.weight"] = torch.zeros(2)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(DejavuError, match=r"unexpected.*layers\.7\.fc9\.weight"):
        load_model(folder)


def test_index_listing_a_missing_shard(make_tiny_opt_dir):
    folder = make_tiny_opt_dir()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.decoder.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(DejavuError, match=r"model-00001-of-00002\.safetensors, which is missing"):
        load_model(folder)


def test_in_place_edits_do_not_touch_the_file(make_tiny_opt_dir):
    """Weights may stay memory-mapped; writing to them must not write through to the checkpoint."""
    folder = make_tiny_opt_dir()
    model, _ = load_model(folder)
    w = model.decoder.layers[0].fc1.weight
    before = w.detach().clone()
    with torch.no_grad():
        w.add_(1.0)
    again, _ = load_model(folder)
    assert torch.equal(again.decoder.layers[0].fc1.weight.detach(), before)

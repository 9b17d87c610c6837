"""Calibration: recorded tensors, cache + resume, corpus errors (tiny random OPT, CPU)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dejavu.compiler.calibrate import Calibration, calibrate
from dejavu.compiler.config import CalibSettings
from dejavu.compiler.text import corpus_tokens, read_corpus
from dejavu.errors import DejavuError
from dejavu.models.loader import load_model, load_tokenizer

ARRAYS = ("attn_in", "mlp_in", "mlp_active", "head_norm", "tokens")



@pytest.fixture(scope="module")
def tiny(tiny_opt_dir):
    model, cfg = load_model(tiny_opt_dir)
    return model, load_tokenizer(tiny_opt_dir)


def _settings(tmp_path, name="cache", **kw) -> CalibSettings:
    return CalibSettings(**{"calib_tokens": 1000, "window": 64, "batch_size": 3,
                            "cache_dir": str(tmp_path / name), **kw})


def _arrays(cal: Calibration) -> dict:
    return {n: np.array(np.load(cal.folder / f"{n}.npy")) for n in ARRAYS}


def test_records_what_the_model_computes(tiny, tmp_path):
    model, tok = tiny
    cal = calibrate(model, tok, _settings(tmp_path), progress=False)
    cfg = cal.cfg
    assert cal.complete and cal.n_tokens == 1000 and cal.n_windows == 16  # 15 x 64 + 40
    assert json.loads((cal.folder / "manifest.json").read_text())["n_tokens"] == 1000
    # recompute the last (short) window with plain hooks
    ids = torch.from_numpy(cal.tokens[960:].astype(np.int64))[None]
    seen = {}
    layer = model.decoder.layers[1]
    hs = [layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0])),
          layer.activation_fn.register_forward_hook(lambda m, a, o: seen.__setitem__("h", o)),
          layer.self_attn.out_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("y", a[0]))]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    np.testing.assert_array_equal(cal.source("attn_in", 1)[960:], seen["x"][0].half().numpy())
    np.testing.assert_array_equal(cal.mlp_labels(1)[960:], (seen["h"][0] > 0).numpy())
    yh = seen["y"][0].double().unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))  # [S, H, hd]
    wo = layer.self_attn.out_proj.weight.detach().double().unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
    norms = torch.einsum("dhi,shi->shd", wo, yh).norm(dim=-1)  # each head's contribution ||W_o[:, h] y_h||
    np.testing.assert_allclose(cal.head_importance(1)[960:], norms.numpy(), rtol=1e-4, atol=1e-6)
    assert 0.2 < cal.mlp_labels(0).mean() < 0.8  # random ReLU model: about half active
    assert cal.predictor_input(0, "mlp_in", 1) is not None  # l - 1 < 0 reads layer 0's attn_in
    np.testing.assert_array_equal(cal.predictor_input(0, "mlp_in", 1), cal.source("attn_in", 0))
    np.testing.assert_array_equal(cal.predictor_input(2, "mlp_in", 1), cal.source("mlp_in", 1))


def test_resume_after_interrupt_equals_uninterrupted(tiny, tmp_path):
    model, tok = tiny
    full = calibrate(model, tok, _settings(tmp_path, "a"), progress=False)

    calls = {"n": 0}

    def crash(m, a):  # the 3rd forward dies half-way (after layer 0 has written its rows)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    h = model.decoder.layers[1].register_forward_pre_hook(crash)
    with pytest.raises(KeyboardInterrupt):
        calibrate(model, tok, _settings(tmp_path, "b"), progress=False)
    h.remove()
    part = Calibration(next((tmp_path / "b").iterdir()))
    assert part.windows_done == 6 and not part.complete  # two batches of 3 windows committed

    again = calibrate(model, tok, _settings(tmp_path, "b"), progress=False, stop_after=4)
    assert again.windows_done == 10
    done = calibrate(model, tok, _settings(tmp_path, "b"), progress=False)
    assert done.complete and done.folder.name == full.folder.name
    a, b = _arrays(full), _arrays(done)
    for n in ARRAYS:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


def test_cache_is_reused_and_keyed(tiny, tmp_path):
    model, tok = tiny
    first = calibrate(model, tok, _settings(tmp_path), progress=False)
    stamp = (first.folder / "attn_in.npy").stat().st_mtime_ns
    second = calibrate(model, tok, _settings(tmp_path), progress=False)
    assert second.folder == first.folder
    assert (second.folder / "attn_in.npy").stat().st_mtime_ns == stamp  # nothing recomputed
    other = calibrate(model, tok, _settings(tmp_path, window=32), progress=False)
    assert other.folder != first.folder


def test_corpus_formats(tmp_path, tiny):
    _, tok = tiny
    (tmp_path / "c.jsonl").write_text('{"text": "hello world"}\n\n{"id": 3, "body": "second line"}\n')
    text, _ = read_corpus(tmp_path / "c.jsonl")
    assert text == "hello world\nsecond line"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("bee")
    (tmp_path / "d" / "a.txt").write_text("ay")
    assert read_corpus(tmp_path / "d")[0] == "ay\nbee"
    ids, _ = corpus_tokens(tok, None, 500)  # the shipped default corpus
    assert ids.shape == (500,) and ids[0] == 2  # starts with BOS </s>


def test_empty_corpus_is_an_error(tiny, tmp_path):
    model, tok = tiny
    (tmp_path / "empty.txt").write_text("  \n\n ")
    with pytest.raises(DejavuError, match=r"corpus .*empty\.txt.* is empty"):
        calibrate(model, tok, _settings(tmp_path, corpus=str(tmp_path / "empty.txt")), progress=False)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DejavuError, match="is empty"):
        read_corpus(tmp_path / "empty.jsonl")


def test_short_or_missing_corpus_is_an_error(tiny, tmp_path):
    model, tok = tiny
    (tmp_path / "short.txt").write_text("just a few words here\n")
    with pytest.raises(DejavuError, match=r"has \d+ tokens, fewer than the 1000 requested"):
        calibrate(model, tok, _settings(tmp_path, corpus=str(tmp_path / "short.txt")), progress=False)
    with pytest.raises(DejavuError, match="not found"):
        read_corpus(tmp_path / "nope.txt")
    with pytest.raises(DejavuError, match="not valid JSON"):
        (tmp_path / "bad.jsonl").write_text("{nope\n")
        read_corpus(tmp_path / "bad.jsonl")


def test_head_gram_built_once_per_layer_not_per_batch(tiny, tmp_path, monkeypatch):
    import dejavu.compiler.calibrate as calibrate_mod

    model, tok = tiny
    calls = []
    real = calibrate_mod.head_gram
    monkeypatch.setattr(calibrate_mod, "head_gram", lambda wo, h: calls.append(1) or real(wo, h))
    cal = calibrate(model, tok, _settings(tmp_path), progress=False)  # 16 windows in 6 batches
    assert cal.complete and len(calls) == cal.cfg.num_hidden_layers

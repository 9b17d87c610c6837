"""benchmarks/llama_skip_by_position.py on a tiny Llama: its per-position counts against gated_sparsity's own."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "llama_skip_by_position", Path(__file__).resolve().parents[1] / "benchmarks" / "llama_skip_by_position.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_position_buckets_add_up_to_the_whole_text_count(tmp_path):
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=1)
    out = tmp_path / "r.json"
    res = study.main(["--model", str(folder), "--skip", "0.4", "--calib-tokens", "256", "--window", "64",
                      "--test-windows", "2", "--examples", "3", "--tasks", "copa", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    names = [r["text"] for r in res["texts"]]
    assert names == ["wikitext-2 test, 2 x 64", "calibration, 4 x 64", "copa, 3 examples"]
    for r in res["texts"]:
        # gated_sparsity counts the bytes read over the whole text its own way: the buckets must add up to it
        rows = r["by_position"].values()
        read = sum((1 - b["skip"]) * b["token_layers"] for b in rows) / sum(b["token_layers"] for b in rows)
        assert 1 - read == pytest.approx(r["skip_counted"], abs=2e-4)
        assert r["skip"] == pytest.approx(r["skip_counted"], abs=1e-4)
    wiki = res["texts"][0]["by_position"]
    assert list(wiki) == ["0-1", "1-8", "8-32", "32-64"] and wiki["0-1"]["token_layers"] == 2 * 2  # 2 windows, 2 layers


def test_counter_counts_kept_entries_per_position():
    """One projection input by hand: positions 0 and 1 of a [1, 2, 4] input, a threshold of 0.5."""
    from llama_helpers import tiny_llama

    model = tiny_llama(seed=0)
    L = len(model.layers)
    t = {k: [0.5] * L for k in study.KEYS}
    c = study.PositionCounter(model, t, 4)
    hook = c.hook("attn_in", 0)
    x = torch.tensor([[[0.1, 0.9, -0.7, 0.2], [1.0, 1.0, 1.0, -0.6]]])
    hook(None, (x,))
    assert c.kept["attn_in"][:2].tolist() == [0.5, 1.0] and c.rows[:2].tolist() == [1.0, 1.0]
    assert c.read[0] == 0.5 * c.nbytes["attn_in"] and c.dense[1] == c.nbytes["attn_in"]

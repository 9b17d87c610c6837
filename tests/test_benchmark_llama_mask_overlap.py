"""benchmarks/llama_mask_overlap.py: the reuse of the previous token's kept set, by hand on one input and on a
tiny Llama."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "llama_mask_overlap", Path(__file__).resolve().parents[1] / "benchmarks" / "llama_mask_overlap.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_counter_by_hand():
    """Layer 0's q input [1, 3, 4] at threshold 0.5: kept {0, 1}, {1, 2, 3}, {2}: positions 1 and 2 keep 3 + 1,
    the tokens before them 2 + 3, both 1 + 1."""
    from llama_helpers import tiny_llama

    model = tiny_llama(seed=0)
    t = {k: [0.5] * len(model.layers) for k in ("attn_in", "o_in", "mlp_in", "down_in")}
    counter = study.OverlapCounter(model, t)
    x = torch.tensor([[[0.9, 0.6, 0.0, 0.1], [0.2, -0.7, 0.8, -0.9], [0.0, 0.3, 0.51, 0.5]]])
    counter.hook("attn_in", 0)(None, (x,))
    assert counter.sums["attn_in"][0].tolist() == [4.0, 5.0, 2.0, 8.0]
    got = counter.summary()["attn_in"]
    assert got["by_layer"]["reuse"][0] == 0.5 and got["by_layer"]["waste"][0] == pytest.approx(0.6)
    assert got["by_layer"]["kept"][0] == 0.5


def test_tiny_llama_run(tmp_path):
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=1)
    out = tmp_path / "r.json"
    res = study.main(["--model", str(folder), "--skips", "0.3", "0.6", "--calib-tokens", "256", "--window", "64",
                      "--windows", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert [lv["skip"] for lv in res["levels"]] == [0.3, 0.6]
    for lv in res["levels"]:
        for k, v in lv["kinds"].items():
            assert 0 <= v["waste"] <= 1 and 0 < v["reuse"] <= 1
            assert v["kept"] == pytest.approx(1 - lv["skip"], abs=0.25), k  # calibrated on other text, roughly
            assert len(v["by_layer"]["reuse"]) == 2

"""benchmarks/write_shards.py: both shard writers on a tiny Llama, the same bytes, one layout a tensor against tp."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_one_pass_lays_each_tensor_out_once_and_writes_the_per_rank_bytes(tmp_path):
    import write_shards

    out = tmp_path / "ws.json"
    assert write_shards.main(["--hidden", "64", "--ffn", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                              "--vocab", "97", "--tp", "2", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["same_bytes"] and r["forms"]["one_pass"]["bytes"] == r["forms"]["per_rank"]["bytes"] > 0
    assert r["forms"]["one_pass"]["layouts_per_tensor"] == 1 and r["forms"]["per_rank"]["layouts_per_tensor"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ws.json"]  # the shards' folder is gone

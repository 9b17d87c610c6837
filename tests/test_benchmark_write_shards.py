"""benchmarks/write_shards.py: both shard writers on a tiny Llama, the same bytes, one layout a tensor against tp."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(  # by file: benchmarks/kernels.py must not shadow HF's `kernels`
    "write_shards", Path(__file__).resolve().parents[1] / "benchmarks" / "write_shards.py")
write_shards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(write_shards)


def test_one_pass_lays_each_tensor_out_once_and_writes_the_per_rank_bytes(tmp_path):
    out = tmp_path / "ws.json"
    assert write_shards.main(["--hidden", "64", "--ffn", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                              "--vocab", "97", "--tp", "2", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["same_bytes"] and r["forms"]["one_pass"]["bytes"] == r["forms"]["per_rank"]["bytes"] > 0
    assert r["forms"]["one_pass"]["layouts_per_tensor"] == 1 and r["forms"]["per_rank"]["layouts_per_tensor"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ws.json"]  # the shards' folder is gone

"""benchmarks/sm90_offline.py: the batch-1 weight kernels compiled for sm_90 on the CPU."""
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_weight_kernels_compile_and_a_clean_tree_matches_head():
    pytest.importorskip("triton")
    import sm90_offline as S

    rows = S.compile_tree(S.ROOT)
    assert set(rows) == set(S.KERNELS)
    tile = 64 * 128 * 2  # the Q/K/V partial kernel's weight tile: multi-buffered through cp.async
    assert rows["qkv_partial_p32"]["cp_async"] and rows["qkv_partial_p32"]["shared"] >= 2 * tile
    assert all(len(r["ptx_md5"]) == 32 for r in rows.values())
    clean = subprocess.run(["git", "-C", str(S.ROOT), "diff", "--quiet", "HEAD", "--", "plugins"]).returncode == 0
    if not clean:
        pytest.skip("plugins/ differs from HEAD: the same-tree comparison needs a clean checkout")
    with tempfile.TemporaryDirectory() as tmp:
        base = S.compile_tree(S.tree_at("HEAD", Path(tmp)))
    assert {n: r["ptx_md5"] for n, r in base.items()} == {n: r["ptx_md5"] for n, r in rows.items()}

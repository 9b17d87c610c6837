"""benchmarks/sm90_offline.py: the batch-1 weight kernels compiled for sm_90 on the CPU."""
import importlib.util
import subprocess
import tempfile
from pathlib import Path

import pytest

# loaded from its file: benchmarks/ stays off sys.path (a top-level "kernels" module there would be taken
# for Hugging Face's `kernels` package by transformers in the same process)
_SPEC = importlib.util.spec_from_file_location(
    "dejavu_bench_sm90_offline", Path(__file__).resolve().parents[1] / "benchmarks" / "sm90_offline.py")
S = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(S)


def test_weight_kernels_compile_and_a_clean_tree_matches_head():
    pytest.importorskip("triton")

    rows = S.compile_tree(S.ROOT)
    assert set(rows) == set(S.KERNELS)
    tile = 64 * 128 * 2  # the Q/K/V partial kernel's weight tile: multi-buffered through cp.async
    assert rows["qkv_partial_p32"]["cp_async"] and rows["qkv_partial_p32"]["shared"] >= 2 * tile
    assert all(len(r["ptx_md5"]) == 32 for r in rows.values())
    try:
        rc = subprocess.run(["git", "-C", str(S.ROOT), "diff", "--quiet", "HEAD", "--", "plugins"],
                            capture_output=True).returncode
    except FileNotFoundError:
        pytest.skip("no git here: the same-tree comparison needs a git checkout")
    if rc not in (0, 1):
        pytest.skip("not a git checkout: the same-tree comparison needs one")
    if rc == 1:
        pytest.skip("plugins/ differs from HEAD: the same-tree comparison needs a clean checkout")
    with tempfile.TemporaryDirectory() as tmp:
        base = S.compile_tree(S.tree_at("HEAD", Path(tmp)))
    assert {n: r["ptx_md5"] for n, r in base.items()} == {n: r["ptx_md5"] for n, r in rows.items()}

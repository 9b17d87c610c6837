"""plugins/prefetch.py: the L2 warm-up kernel reads exactly the gathered rows (float64 sums)."""
import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins.prefetch import prefetch_plan, prefetch_rows, prefetch_rows_ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R,D,group,n_idx,block_d", [(40, 300, 1, 13, 128), (48, 129, 8, 5, 64), (12, 77, 4, 3, 32)])
def test_sums_match_gathered_rows(triton_interp, dtype, R, D, group, n_idx, block_d):
    w = torch.randn(R, D).to(dtype)
    idx = torch.randperm(R // group)[:n_idx].to(torch.int32)
    cfg = {"BLOCK_R": 4, "BLOCK_D": block_d}
    got = prefetch_rows(w, idx, group, config=cfg)
    want = prefetch_rows_ref(w, idx, group, config=cfg)
    assert got.shape == want.shape == (-(-n_idx * group // 4),)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)
    # another row set gives other sums: the kernel reads idx, not the first rows
    assert not torch.allclose(prefetch_rows_ref(w, torch.arange(n_idx, dtype=torch.int32), group, config=cfg), want) \
        or torch.equal(idx.sort().values, torch.arange(n_idx, dtype=torch.int32))


def test_max_bytes_limits_whole_rows(triton_interp):
    w = torch.randn(64, 100)
    idx = torch.tensor([[7, 1, 3, 0]], dtype=torch.int64)  # [B, K]: flattened in order
    cfg = {"BLOCK_R": 4, "BLOCK_D": 64}
    cap = 9 * 100 * 4 + 50  # nine whole rows (and half a row more: not read)
    out = torch.full((16,), float("nan"))
    got = prefetch_rows(w, idx, 4, max_bytes=cap, out=out, config=cfg)
    assert prefetch_plan(4, 4, 100, 4, cap, cfg) == (9, 3)
    rows = torch.tensor([28, 29, 30, 31, 4, 5, 6, 7, 12])
    assert got.shape == (3,)
    torch.testing.assert_close(got.double().sum(), w[rows].double().sum(), rtol=1e-6, atol=1e-4)
    assert torch.isnan(out[3:]).all()  # nothing past the programs is written


def test_bad_inputs_rejected(triton_interp):
    w = torch.randn(16, 8)
    with pytest.raises(DejavuError, match="group"):
        prefetch_rows(w, torch.tensor([0], dtype=torch.int32), 3)
    with pytest.raises(DejavuError, match="out of range"):
        prefetch_rows(w, torch.tensor([4], dtype=torch.int32), 4, validate=True)
    with pytest.raises(DejavuError, match="dtype"):
        prefetch_rows(w, torch.tensor([0.0]), 1)
    with pytest.raises(DejavuError, match="contiguous"):
        prefetch_rows(w.t(), torch.tensor([0], dtype=torch.int32), 1)
    with pytest.raises(DejavuError, match="out"):
        prefetch_rows(w, torch.tensor([0, 1], dtype=torch.int32), 1, out=torch.empty(0))

"""A per-token MLP K in the engine header (build_config.token_k): read and run (reference backend here; the Triton
backend in tests/runtime/test_runtime_triton_interp.py), per sequence and with one set for the batch."""
from __future__ import annotations

import copy

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.plugins import predictor_topk_ref, sparse_fc1_ref
from dejavu.runtime.engine import Engine
from dejavu.runtime.spec import spec_from_header
from runtime_helpers import engine_from_dense, record_steps, tiny_model

IDS = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]])


def _with_token_k(header, threshold, k_max):
    h = copy.deepcopy(header)
    h["build_config"]["token_k"] = {"form": "share", "threshold": threshold, "k_max": k_max}
    return h


def test_engines_without_the_field_or_with_null_run_as_before():
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, 0.25, 0.5, "attn_in", 1)
    assert spec_from_header(header).token_k is None
    want = Engine.from_tensors(header, tensors, "cpu").decode_logits(IDS)
    h = copy.deepcopy(header)
    h["build_config"]["token_k"] = None
    torch.testing.assert_close(Engine.from_tensors(h, tensors, "cpu").decode_logits(IDS), want, atol=0, rtol=0)
    # every row kept (threshold 0, k_max = K): the fixed-K engine exactly
    L, K = len(header["build_config"]["mlp_k"]), header["build_config"]["mlp_k"][0]
    same = Engine.from_tensors(_with_token_k(header, [0.0] * L, [K] * L), tensors, "cpu")
    torch.testing.assert_close(same.decode_logits(IDS), want, atol=0, rtol=0)


def test_threshold_one_keeps_each_tokens_best_row():
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, 0.25, 0.5, "attn_in", 1)
    L = len(header["build_config"]["mlp_k"])
    one = Engine.from_tensors(_with_token_k(header, [1.0] * L, [32] * L), tensors, "cpu")
    h1 = copy.deepcopy(header)
    h1["build_config"]["mlp_k"] = [1] * L
    torch.testing.assert_close(one.decode_logits(IDS), Engine.from_tensors(h1, tensors, "cpu").decode_logits(IDS),
                               atol=1e-5, rtol=1e-5)
    mid = Engine.from_tensors(_with_token_k(header, [0.03] * L, [32] * L), tensors, "cpu")
    # token-parallel (forward_tokens) = every position decoded from an empty cache
    torch.testing.assert_close(mid.logits(IDS), mid.decode_logits(IDS), atol=1e-4, rtol=1e-4)


def test_reference_ops_keep_and_drop_rows():
    g = torch.Generator().manual_seed(0)
    x, a, b, bias = torch.randn(5, 16, generator=g), torch.randn(4, 16, generator=g), 3 * torch.randn(40, 4, generator=g), torch.zeros(40)
    idx, got = predictor_topk_ref(x, a, b, bias, 12, min_share=0.05)
    s = ((x @ a.T) @ b.T).double()
    p = torch.softmax(s, -1)
    n = (p >= 0.05).sum(-1).clamp(1, 12)
    assert torch.equal(got, n.to(torch.int32)) and (p.gather(-1, idx.long())[:, :-1] >= p.gather(-1, idx.long())[:, 1:]).all()
    keep = torch.arange(12) < n[:, None]  # the kept rows first (idx in score order)
    w1, b1 = torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    h = sparse_fc1_ref(x, w1, b1, idx, got)
    assert torch.equal(h[~keep], torch.zeros_like(h[~keep])) and torch.equal(h[keep], sparse_fc1_ref(x, w1, b1, idx)[keep])
    with pytest.raises(DejavuError, match="per sequence"):
        predictor_topk_ref(x, a, b, bias, 12, shared=True, min_share=0.05)


@pytest.mark.parametrize("tk,msg", [({"form": "mass", "threshold": [0.5] * 3, "k_max": [32] * 3}, "form"),
                                    ({"form": "share", "threshold": [0.5] * 2, "k_max": [32] * 3}, "threshold"),
                                    ({"form": "share", "threshold": [1.5] * 3, "k_max": [32] * 3}, "threshold"),
                                    ({"form": "share", "threshold": [0.5] * 3, "k_max": [8] * 3}, "k_max"),
                                    ({"form": "share", "threshold": [0.5] * 3, "k_max": [65] * 3}, "k_max"),
                                    ([1, 2], "token_k")])
def test_bad_token_k_headers(tk, msg):
    header, _ = engine_from_dense(tiny_model(seed=2), 0.25, 0.5, "attn_in", 1)
    header["build_config"]["token_k"] = tk
    with pytest.raises(DejavuError, match=msg):
        spec_from_header(header)


def test_shared_batch_policy_keeps_per_token_rows_at_batch_one_and_k_rows_above():
    model = tiny_model(seed=2)
    header, tensors = engine_from_dense(model, 0.25, 0.5, "attn_in", 1)
    h = _with_token_k(header, [0.03] * 3, [32] * 3)
    per = Engine.from_tensors(h, tensors, "cpu")
    shared = Engine.from_tensors(h, tensors, "cpu", batch_policy="shared")
    P = [[2, 40, 41, 42, 43], [2, 50, 51]]
    got, want = [], []
    for eng, out in ((shared, got), (per, want)):  # batch 1: the row's own set and its per-token rows
        record_steps(eng.decoder, out)
        eng.generate(P[:1], 8, stop_at_eos=False)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-5, rtol=1e-5)
    # batch 2: one set of K_l rows for the batch, as an engine without the field selects it
    fixed = Engine.from_tensors(header, tensors, "cpu", batch_policy="shared")
    assert shared.generate(P, 8, stop_at_eos=False) == fixed.generate(P, 8, stop_at_eos=False)
    assert per.generate(P, 8, stop_at_eos=False) != fixed.generate(P, 8, stop_at_eos=False)

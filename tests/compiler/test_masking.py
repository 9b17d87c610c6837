"""Masked-dense simulation: exactness invariants and per-token selection (tiny random OPT, CPU)."""
from __future__ import annotations

import pytest
import torch

from dejavu.compiler.density import resolve_density
from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.predictors import Predictors
from dejavu.errors import DejavuError
from dejavu.models.loader import load_model



@pytest.fixture(scope="module")
def tiny(tiny_opt_dir):
    model, cfg = load_model(tiny_opt_dir)
    ids = torch.randint(4, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    return model, cfg, ids


def random_predictors(cfg, source="attn_in", lookahead=1, seed=0) -> Predictors:
    g = torch.Generator().manual_seed(seed)
    D, F, H = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads
    mk = lambda n, r: {"a": torch.randn(r, D, generator=g), "b": torch.randn(n, r, generator=g),
                       "bias": torch.randn(n, generator=g)}
    L = cfg.num_hidden_layers
    return Predictors([mk(F, 8) for _ in range(L)], [mk(H, 4) for _ in range(L)],
                      {"source": source, "lookahead": lookahead})


def _mlp_outputs(model, ids):
    outs, acts = [], []
    hs = [m.fc2.register_forward_hook(lambda m, a, o: outs.append(o) or acts.append(a[0]))
          for m in model.decoder.layers]
    try:
        with torch.no_grad():
            logits = model(ids)
    finally:
        for h in hs:
            h.remove()
    return logits, outs, acts


def test_oracle_keeping_every_nonzero_neuron_is_exact(tiny):
    model, cfg, ids = tiny
    ref_logits, ref_mlp, acts = _mlp_outputs(model, ids)
    k = [int((a > 0).sum(-1).max()) for a in acts]  # the most neurons any token fires
    assert all(1 <= v < cfg.ffn_dim for v in k)  # so the masking hooks are really installed
    with masked_sparsity(model, k, [cfg.num_attention_heads] * cfg.num_hidden_layers, "oracle"):
        logits, mlp, _ = _mlp_outputs(model, ids)
    for a, b in zip(mlp, ref_mlp):
        assert torch.equal(a, b)  # fp32, bit for bit: the zeros were already zero
    assert torch.equal(logits, ref_logits)
    # one neuron fewer than that changes the output
    with masked_sparsity(model, [v - 1 for v in k], [cfg.num_attention_heads] * cfg.num_hidden_layers, "oracle"):
        assert not torch.equal(model(ids), ref_logits)


@pytest.mark.parametrize("mode", ["predicted", "oracle", "random"])
def test_density_one_equals_dense(tiny, mode):
    model, cfg, ids = tiny
    mlp_k, attn_k = resolve_density(cfg, 1.0)
    assert mlp_k == [cfg.ffn_dim] * cfg.num_hidden_layers and attn_k == [cfg.num_attention_heads] * cfg.num_hidden_layers
    with torch.no_grad():
        ref = model(ids)
        with masked_sparsity(model, mlp_k, attn_k, mode, random_predictors(cfg)):
            assert torch.equal(model(ids), ref)
        assert torch.equal(model(ids), ref)  # hooks are gone after the context


def test_head_and_neuron_counts_per_token(tiny):
    model, cfg, ids = tiny
    H, hd = cfg.num_attention_heads, cfg.head_dim
    seen = {"heads": [], "neurons": []}
    layer = model.decoder.layers[1]
    with masked_sparsity(model, [5] * cfg.num_hidden_layers, [2] * cfg.num_hidden_layers, "predicted",
                         random_predictors(cfg)):
        # registered after the masking hooks, so these see the masked tensors
        h1 = layer.self_attn.out_proj.register_forward_pre_hook(
            lambda m, a: seen["heads"].append((a[0].unflatten(-1, (H, hd)).abs().sum(-1) > 0).sum(-1)))
        h2 = layer.activation_fn.register_forward_hook(lambda m, a, o: seen["neurons"].append((o > 0).sum(-1)))
        with torch.no_grad():
            model(ids)
        h1.remove(), h2.remove()
    assert (seen["heads"][0] == 2).all()  # exactly K heads per token
    assert (seen["neurons"][0] <= 5).all()  # at most K (a selected neuron may be inactive)


@pytest.mark.parametrize("source,lookahead", [("attn_in", 0), ("attn_in", 1), ("mlp_in", 1)])
def test_per_token_selection_equals_token_by_token_decode(tiny, source, lookahead):
    model, cfg, ids = tiny
    preds = random_predictors(cfg, source, lookahead)
    L = cfg.num_hidden_layers
    x = ids[:1, :12]
    with torch.no_grad(), masked_sparsity(model, [9] * L, [2] * L, "predicted", preds):
        full = model(x)  # [1, 12, V], each position its own selection
        model.setup_caches(1, 16)
        try:
            steps = torch.cat([model(x[:, t:t + 1], start_pos=t) for t in range(x.shape[1])], dim=1)
        finally:
            model.clear_caches()
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_oracle_beats_random_and_random_is_seeded(tiny):
    model, cfg, ids = tiny
    L = cfg.num_hidden_layers
    k = ([cfg.ffn_dim // 4] * L, [2] * L)
    with torch.no_grad():
        ref = model(ids)
        with masked_sparsity(model, *k, "oracle"):
            err_oracle = (model(ids) - ref).norm()
        outs = []
        for seed in (0, 0, 1):
            with masked_sparsity(model, *k, "random", seed=seed):
                outs.append(model(ids))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert err_oracle < 0.5 * (outs[0] - ref).norm()


def test_bad_arguments(tiny):
    model, cfg, _ = tiny
    L = cfg.num_hidden_layers
    with pytest.raises(DejavuError, match="selection mode"):
        with masked_sparsity(model, [1] * L, [1] * L, "topk"):
            pass
    with pytest.raises(DejavuError, match="needs trained predictors"):
        with masked_sparsity(model, [1] * L, [1] * L, "predicted"):
            pass
    with pytest.raises(DejavuError, match=r"mlp_k entries must be in \[1, "):
        with masked_sparsity(model, [0] * L, [1] * L, "oracle"):
            pass
    with pytest.raises(DejavuError, match="one per layer"):
        with masked_sparsity(model, [1], [1] * L, "oracle"):
            pass

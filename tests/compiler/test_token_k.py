"""Per-token MLP K from the predicted mass: counts, the fitted threshold, the masked model."""
from __future__ import annotations

import pytest
import torch

from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.predictors import Predictors
from dejavu.compiler.token_k import (TokenK, fit_tau, fit_theta, fit_token_k, share_counts, share_mask, token_counts,
                                     token_mask)
from dejavu.errors import DejavuError
from dejavu.models.loader import load_model
from helpers_compiler import random_predictors


def _counts_ref(scores: torch.Tensor, tau: float, k_max: int) -> torch.Tensor:
    """float64, one token at a time: add rows best first until their share reaches tau."""
    out = []
    for row in scores.reshape(-1, scores.shape[-1]).double():
        p, got, k = torch.softmax(row, -1).sort(descending=True).values, 0.0, 0
        while got < tau and k < len(p):
            got += p[k].item()
            k += 1
        out.append(min(max(k, 1), k_max))
    return torch.tensor(out).view(scores.shape[:-1])


@pytest.mark.parametrize("tau,k_max", [(0.3, 50), (0.7, 37), (0.95, 61), (0.0, 20), (1.0, 45)])
def test_counts_match_the_float64_reference(tau, k_max):
    s = 2.5 * torch.randn(3, 41, 97, generator=torch.Generator().manual_seed(int(tau * 100) + k_max))
    got = token_counts(s, tau, k_max)
    assert torch.equal(got, _counts_ref(s, tau, k_max))
    assert got.min() >= 1 and got.max() <= k_max
    if 0.0 < tau < 1.0:
        assert got.unique().numel() > 3  # the count really varies per token
    m = token_mask(s, tau, k_max)
    assert torch.equal(m.sum(-1).long(), got)
    # the kept rows are each token's best-scored ones
    worst_kept = torch.where(m.bool(), s, torch.inf).amin(-1)
    best_dropped = torch.where(m.bool(), -torch.inf, s).amax(-1)
    assert (worst_kept > best_dropped).all()


@pytest.mark.parametrize("k_mean,k_max", [(10, 20), (25, 40), (6, 97)])
def test_fitted_tau_spends_the_mean_budget(k_mean, k_max):
    s = 2.0 * torch.randn(4000, 97, generator=torch.Generator().manual_seed(k_mean))
    tau = fit_tau(s, k_mean, k_max)
    mean = token_counts(s, tau, k_max).float().mean().item()
    assert k_mean - 0.01 <= mean <= k_mean  # never above the budget, and spends it
    tk = fit_token_k(lambda l: s, [k_mean, 97], cap=2.0)
    assert tk.k_max == (min(97, 2 * k_mean), 97) and tk.k_mean == (k_mean, 97) and tk.threshold[1] == 1.0


@pytest.fixture(scope="module")
def tiny(tiny_opt_dir):
    model, cfg = load_model(tiny_opt_dir)
    ids = torch.randint(4, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    # b scaled up: scores spread over several units, so the counts differ from token to token
    sd = {n: t * 8 if n.endswith(".b") else t for n, t in random_predictors(cfg).items()}
    return model, cfg, ids, Predictors.from_state_dict(sd, {"source": "attn_in", "lookahead": 1})


def test_masked_model_keeps_each_tokens_count(tiny):
    model, cfg, ids, preds = tiny
    L, F, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    k_max = [F // 2, F // 3] + [F // 4] * (L - 2)
    tk = TokenK(tuple(k_max), tuple([0.4, 0.6] + [0.5] * (L - 2)), tuple(k // 2 for k in k_max))
    grab = {}
    hooks = []
    for l, layer in enumerate(model.decoder.layers):
        hooks += [layer.register_forward_pre_hook(lambda m, a, l=l: grab.__setitem__(("x", l), a[0])),
                  layer.fc1.register_forward_hook(lambda m, a, o, l=l: grab.__setitem__(("h", l), torch.relu(o))),
                  layer.fc2.register_forward_pre_hook(lambda m, a, l=l: grab.__setitem__(("kept", l), a[0]))]
    try:
        with torch.no_grad(), masked_sparsity(model, list(tk.k_mean), [H] * L, "predicted", preds, token_k=tk):
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    for l in range(L):
        x = grab[("x", max(l - 1, 0))]  # lookahead 1 (layer 0 reads its own input)
        s = preds.scores("mlp", l, x.double())  # float64 scores, the rows ranked independently
        k = _counts_ref(s, tk.threshold[l], tk.k_max[l])
        assert k.unique().numel() > 1
        order = s.argsort(-1, descending=True)
        ref = torch.zeros_like(s).scatter_(-1, order, (torch.arange(F) < k[..., None]).double())
        h, kept = grab[("h", l)], grab[("kept", l)]
        assert torch.equal(kept, h * ref.to(h.dtype))


def test_counts_at_the_cap_equal_the_fixed_top_k(tiny):
    model, cfg, ids, preds = tiny
    L, F, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    for tau, k in ((1.0, F // 3), (0.0, 1)):  # every token at the cap | every token at one row
        tk = TokenK(tuple([F // 3] * L), tuple([tau] * L), tuple([F // 3] * L))
        with torch.no_grad():
            with masked_sparsity(model, list(tk.k_mean), [H] * L, "predicted", preds, token_k=tk):
                got = model(ids)
            with masked_sparsity(model, [k] * L, [H] * L, "predicted", preds):
                want = model(ids)
        assert torch.equal(got, want)
    with pytest.raises(DejavuError, match="per-token K"):
        with masked_sparsity(model, [1] * L, [H] * L, "oracle", token_k=tk):
            pass


def _share_counts_ref(scores: torch.Tensor, theta: float, k_max: int) -> torch.Tensor:
    """float64, one row at a time: the rows whose share is >= theta, clamped to [1, k_max]."""
    out = [min(max(sum(1 for p in torch.softmax(r, -1).tolist() if p >= theta), 1), k_max)
           for r in scores.reshape(-1, scores.shape[-1]).double()]
    return torch.tensor(out).view(scores.shape[:-1])


@pytest.mark.parametrize("theta,k_max", [(0.02, 50), (0.005, 37), (0.0, 20), (1.0, 45)])
def test_share_rule_matches_the_float64_reference(theta, k_max):
    s = 2.5 * torch.randn(3, 41, 97, generator=torch.Generator().manual_seed(int(theta * 1000) + k_max), dtype=torch.float64)
    want = _share_counts_ref(s, theta, k_max)
    assert torch.equal(share_counts(s, theta, k_max), want)
    m = share_mask(s, theta, k_max)
    assert torch.equal(m.sum(-1).long(), want)
    worst_kept = torch.where(m.bool(), s, torch.inf).amin(-1)
    best_dropped = torch.where(m.bool(), -torch.inf, s).amax(-1)
    assert (worst_kept > best_dropped).all()  # each token's best rows
    if 0.0 < theta < 1.0:
        assert want.unique().numel() > 3


def test_fitted_theta_spends_the_mean_budget():
    s = 2.0 * torch.randn(4000, 97, generator=torch.Generator().manual_seed(3))
    for k_mean, k_max in ((10, 20), (25, 50)):
        th = fit_theta(s, k_mean, k_max)
        mean = share_counts(s, th, k_max).float().mean().item()
        assert k_mean - 0.05 <= mean <= k_mean
    tk = fit_token_k(lambda l: s, [10, 97], form="share")
    assert tk.form == "share" and tk.k_max == (20, 97) and tk.threshold[1] == 0.0


def test_engine_with_a_per_token_k_decodes_as_the_masked_reference(tiny_opt_dir, tmp_path):
    # dejavu-compile --token-k share: thresholds fitted on the held-out windows, recorded in the header;
    # the CPU runtime's decode (every position from an empty cache) equals the masked-dense model
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.engine_file import read_header
    from dejavu.runtime.engine import Engine

    cfg = load_model(tiny_opt_dir)[1]
    L, F, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    sd = {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in random_predictors(cfg).items()}
    preds = Predictors.from_state_dict(sd, {"source": "attn_in", "lookahead": 1})
    kw = dict(mlp_density=0.25, attn_density=0.5, dtype="float32", heldout_tokens=512)
    out = {}
    for form in ("off", "share"):
        out[form] = tmp_path / f"{form}.engine"
        build_engine(tiny_opt_dir, BuildConfig(token_k=form, **kw), out[form], progress=False, predictors=preds)
    bc, bc_off = read_header(out["share"])["build_config"], read_header(out["off"])["build_config"]
    assert "token_k" not in bc_off and bc["mlp_k"] == bc_off["mlp_k"]
    rec = bc["token_k"]
    tk = TokenK(tuple(rec["k_max"]), tuple(rec["threshold"]), tuple(rec["k_mean"]), rec["form"])
    assert rec["form"] == "share" and list(tk.k_max) == [min(F, 2 * k) for k in bc["mlp_k"]]
    rows = rec["heldout"]["mean_rows"]
    # fitted to a mean of K_l on the first held-out set, measured on the second
    assert all(0.75 * k <= r <= 1.25 * k for r, k in zip(rows, bc["mlp_k"])), (rows, bc["mlp_k"])
    assert bc["bytes_per_token"] == rec["bytes_per_token"]

    model = load_model(tiny_opt_dir)[0].float()
    ids = torch.randint(4, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    eng = Engine.load(out["share"], "cpu")
    got = eng.decode_logits(ids)
    with torch.no_grad(), masked_sparsity(model, bc["mlp_k"], bc["attn_k"], "predicted", preds, token_k=tk):
        want = model(ids)
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    with torch.no_grad(), masked_sparsity(model, bc["mlp_k"], bc["attn_k"], "predicted", preds):
        fixed = model(ids)
    assert (got - fixed).abs().max() > 1e-3  # the per-token K is not the fixed K
    torch.testing.assert_close(Engine.load(out["off"], "cpu").decode_logits(ids), fixed.float(), atol=1e-4, rtol=1e-4)


def test_build_rejects_what_cannot_carry_a_per_token_k(tiny_opt_dir, tmp_path):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig

    with pytest.raises(DejavuError, match="--token-k must be one of off, share"):
        BuildConfig(density=0.5, token_k="mass")
    with pytest.raises(DejavuError, match="--tp"):
        BuildConfig(density=0.5, token_k="share", tp=2)
    from llama_helpers import write_tiny_llama

    with pytest.raises(DejavuError, match="needs an OPT model"):
        build_engine(write_tiny_llama(tmp_path / "llama"), BuildConfig(density=0.7, token_k="share"),
                     tmp_path / "e.engine", progress=False)
    assert not (tmp_path / "e.engine").exists()

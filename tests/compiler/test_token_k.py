"""Per-token MLP K from the predicted mass: counts, the fitted threshold, the masked model."""
from __future__ import annotations

import pytest
import torch

from dejavu.compiler.masking import masked_sparsity
from dejavu.compiler.predictors import Predictors, int8_rows
from dejavu.compiler.token_k import (TokenK, fit_tau, fit_theta, fit_theta_read, fit_token_k, read_rows, share_counts,
                                     share_mask, token_counts, token_mask)
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
    preds = Predictors([int8_rows(p) for p in preds.mlp], preds.attn, preds.predictor_input)  # as the engines hold
    bc, bc_off = read_header(out["share"])["build_config"], read_header(out["off"])["build_config"]
    assert "token_k" not in bc_off and bc["mlp_k"] == bc_off["mlp_k"]
    rec = bc["token_k"]
    tk = TokenK(tuple(rec["k_max"]), tuple(rec["threshold"]), tuple(rec["k_mean"]), rec["form"])
    assert rec["form"] == "share" and list(tk.k_max) == [min(F, 2 * k) for k in bc["mlp_k"]]
    held = rec["heldout"]
    read = [a + b for a, b in zip(held["mean_rows"], held["mean_rows_fc2"])]
    # the default rows measure: fitted to a mean of 2 K_l rows read (fc1's kept + fc2's nonzero) on the first
    # held-out set, measured on the second
    assert rec["rows"] == "read" and all(1.5 * k <= r <= 2.5 * k for r, k in zip(read, bc["mlp_k"])), (read, bc)
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


def _read_rows_ref(scores: torch.Tensor, h: torch.Tensor, theta: float, k_max: int) -> tuple[list, list]:
    """float64, one token at a time: the top-k_max rows with share >= theta (at least the best), and
    those of them whose h is not 0."""
    kept, nz = [], []
    for s, hr in zip(scores.reshape(-1, scores.shape[-1]).double(), h.reshape(-1, h.shape[-1])):
        p = torch.softmax(s, -1)
        order = p.argsort(descending=True)[:k_max].tolist()
        rows = [j for j in order if p[j].item() >= theta] or order[:1]
        kept.append(len(rows)), nz.append(sum(1 for j in rows if hr[j].item() != 0))
    return kept, nz


def _scores_and_h(seed: int, T: int = 3000, F: int = 97):
    g = torch.Generator().manual_seed(seed)
    s = 2.0 * torch.randn(T, F, generator=g, dtype=torch.float64)
    # h: ReLU zeros, more of them among the low-scored rows (as in a trained model's MLP)
    h = torch.relu(torch.randn(T, F, generator=g, dtype=torch.float64) + 0.3 * s - 0.8)
    return s, h


@pytest.mark.parametrize("theta,k_max", [(0.01, 50), (0.03, 30), (0.0, 20), (1.0, 40)])
def test_read_rows_match_the_float64_reference(theta, k_max):
    s, h = _scores_and_h(int(theta * 1000) + k_max, T=200)
    kept, nz = read_rows(share_mask(s, theta, k_max), h)
    want_kept, want_nz = _read_rows_ref(s, h, theta, k_max)
    assert kept.tolist() == want_kept and nz.tolist() == want_nz
    assert (nz < kept).any() and (nz <= kept).all()  # fc2 skips some kept rows, never adds one


@pytest.mark.parametrize("k,k_max", [(10, 40), (20, 60), (30, 97)])
def test_fit_theta_read_spends_twice_k_in_rows_read(k, k_max):
    s, h = _scores_and_h(k)
    th = fit_theta_read(s, h, 2 * k, k_max)
    kept, nz = (torch.tensor(v, dtype=torch.float64) for v in _read_rows_ref(s, h, th, k_max))
    read = (kept + nz).mean().item()
    assert 2 * k - 0.05 <= read <= 2 * k, read  # never above the budget, and spends it
    assert kept.mean() > k  # more rows selected than the budget K: fc2 skips the zeros
    # the selected-rows fit of the same budget keeps fewer rows (K of them on average)
    assert share_counts(s, fit_theta(s, k, k_max), k_max).double().mean() < kept.mean() - 1


def test_fit_theta_read_at_the_cap_keeps_every_row():
    s, h = _scores_and_h(7)
    th = fit_theta_read(s, h, 2 * 40, 30)  # 30 rows and their nonzero ones cannot reach 80
    kept, _ = read_rows(share_mask(s, th, 30), h)
    assert th < 1e-15 and (kept == 30).all()


def _tiny_build(tiny_opt_dir, tmp_path, rows_of: dict, **over):
    """Engines built from one set of random predictors: {name: (token_k, token_k_rows)} -> (paths, preds)."""
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig

    cfg = load_model(tiny_opt_dir)[1]
    sd = {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in random_predictors(cfg).items()}
    preds = Predictors.from_state_dict(sd, {"source": "attn_in", "lookahead": 1})
    kw = dict(mlp_density=0.25, attn_density=0.5, dtype="float32", heldout_tokens=512, **over)
    out = {}
    for name, (form, rows) in rows_of.items():
        out[name] = tmp_path / f"{name}.engine"
        build_engine(tiny_opt_dir, BuildConfig(token_k=form, token_k_rows=rows, **kw), out[name], progress=False,
                     predictors=preds)
    if BuildConfig(**kw).predictor_dtype == "int8":  # what the engines carry: the MLP rows' dequantized values
        preds = Predictors([int8_rows(p) for p in preds.mlp], preds.attn, preds.predictor_input)
    return out, preds


def test_fit_through_the_engine_reaches_its_target_on_the_heldout_windows(tiny_opt_dir):
    # resolve_token_k's fit (layer by layer, earlier layers at their per-token K), measured again on the
    # windows it was fitted to with the thresholds it chose: fc1 + nonzero fc2 rows = 2 K_l per layer
    from dejavu.compiler.allocate import heldout_windows, model_parts
    from dejavu.compiler.token_k import CAP, _engine_pass
    from dejavu.models.loader import load_tokenizer

    model, cfg = load_model(tiny_opt_dir)
    model = model.float()
    L, F, H = cfg.num_hidden_layers, cfg.ffn_dim, cfg.num_attention_heads
    sd = {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in random_predictors(cfg).items()}
    preds = Predictors.from_state_dict(sd, {"source": "attn_in", "lookahead": 1})
    ids, _ = heldout_windows(load_tokenizer(tiny_opt_dir), None, 0, 1024, 64, cfg.bos_token_id)
    mlp_k, attn_k = [F // 4] * L, [H // 2] * L
    parts = lambda: model_parts(model)  # noqa: E731
    with torch.no_grad():
        for rows in ("read", "selected"):
            _, tk, _, _ = _engine_pass(parts, preds, ids, mlp_k, attn_k, None, CAP, rows)
            _, again, kept, nz = _engine_pass(parts, preds, ids, mlp_k, attn_k, tk, CAP)
            assert again == tk
            got = [a + b for a, b in zip(kept, nz)] if rows == "read" else kept
            want = [2 * k for k in mlp_k] if rows == "read" else mlp_k
            # "selected" counts softmax >= theta in its fit (fit_theta), the rule compares in log form
            # (share_keep): a token at the boundary may differ
            over = 0.0 if rows == "read" else 2 / ids.numel()
            assert all(w - 0.05 <= g <= w + over for g, w in zip(got, want)), (rows, got, want)
            assert all(n < a for a, n in zip(kept, nz))  # the random model's ReLU zeros: fc2 reads fewer


def test_engine_fitted_to_rows_read_decodes_as_the_masked_reference(tiny_opt_dir, tmp_path):
    # dejavu-compile --token-k-rows read: the same share rule, thresholds fitted to rows read; the CPU
    # runtime's decode equals the masked-dense model with the header's thresholds; bytes count rows read
    from dejavu.compiler.summary import token_k_line
    from dejavu.engine_file import read_engine, read_header
    from dejavu.runtime.engine import Engine

    out, preds = _tiny_build(tiny_opt_dir, tmp_path, {"read": ("share", "read"), "sel": ("share", "selected")})
    model, cfg = load_model(tiny_opt_dir)
    model = model.float()
    D = cfg.hidden_size
    bc, bc_sel = read_header(out["read"])["build_config"], read_header(out["sel"])["build_config"]
    rec, sel = bc["token_k"], bc_sel["token_k"]
    assert bc["mlp_k"] == bc_sel["mlp_k"] and bc["settings"]["token_k_rows"] == "read"
    assert rec["rows"] == "read" and sel["rows"] == "selected" and rec["form"] == sel["form"] == "share"
    assert rec["bytes_per_token"]["counts"] == "read" and sel["bytes_per_token"]["counts"] == "selected"
    assert rec["bytes_per_token"]["rows"] != sel["bytes_per_token"]["rows"]
    held, held_sel = rec["heldout"], sel["heldout"]
    k = bc["mlp_k"]
    # measured on the second held-out set: rows read near 2 K_l; more rows selected than the "selected" fit
    read = [a + b for a, b in zip(held["mean_rows"], held["mean_rows_fc2"])]
    assert all(1.75 * kk <= r <= 2.25 * kk for r, kk in zip(read, k)), (read, k)
    assert sum(held["mean_rows"]) > 1.1 * sum(held_sel["mean_rows"])
    # bytes (fp32; all else the same in both engines): "read" counts a W1 row with its bias per kept row and a
    # W2 column per nonzero one, "selected" both for every kept row
    b = 1 if cfg.enable_bias else 0
    read_bytes = sum(r1 * 4 * (D + b) + r2 * 4 * D for r1, r2 in zip(held["mean_rows"], held["mean_rows_fc2"]))
    sel_bytes = sum(r * 4 * (2 * D + b) for r in held_sel["mean_rows"])
    diff = rec["bytes_per_token"]["engine"] - sel["bytes_per_token"]["engine"]
    assert abs(diff - (read_bytes - sel_bytes)) <= 1, (diff, read_bytes - sel_bytes)
    assert bc["bytes_per_token"] == rec["bytes_per_token"]
    assert "rows read" in token_k_line(rec, bc["heldout"])[0] and "rows read" not in token_k_line(sel, None)[0]

    tk = TokenK(tuple(rec["k_max"]), tuple(rec["threshold"]), tuple(rec["k_mean"]), rec["form"])
    ids = torch.randint(4, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    got = Engine.load(out["read"], "cpu").decode_logits(ids)
    with torch.no_grad(), masked_sparsity(model, bc["mlp_k"], bc["attn_k"], "predicted", preds, token_k=tk):
        want = model(ids)
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    assert (got - Engine.load(out["sel"], "cpu").decode_logits(ids)).abs().max() > 1e-3  # other thresholds

    # a header before the field (no rows, counts, mean_rows_fc2) loads and decodes the same; its summary
    # line is the one of "selected"
    header, tensors = read_engine(out["read"])
    for d, key in ((header["build_config"]["token_k"], "rows"), (header["build_config"]["token_k"]["heldout"],
                   "mean_rows_fc2"), (header["build_config"]["bytes_per_token"], "counts")):
        del d[key]
    torch.testing.assert_close(Engine.from_tensors(header, tensors, "cpu").decode_logits(ids), got, atol=0, rtol=0)
    old = header["build_config"]["token_k"]
    assert token_k_line(old, None) == [f"per-token K share: up to {sum(old['k_max'])} MLP rows, held-out mean "
                                       f"{sum(old['heldout']['mean_rows']):.0f} of K {sum(old['k_mean'])}"]


def test_bad_token_k_rows_is_one_error(tiny_opt_dir, tmp_path):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig

    with pytest.raises(DejavuError, match="--token-k-rows must be one of read, selected, got 'all'"):
        BuildConfig(density=0.5, token_k_rows="all")
    # settings without the field (recorded before it) get the default; an engine's own rule is its token_k
    # record's "rows" (none: "selected", test_engine_fitted_to_rows_read_decodes_as_the_masked_reference)
    assert BuildConfig.from_dict({"density": 0.5}).token_k_rows == "read"
    for kw in ({"token_k": "off"}, {"tp": 2}):  # the default rows measure is no error without a per-token K
        assert BuildConfig(density=0.7, **kw).resolve_token_k_form(True) == "off"
        with pytest.raises(DejavuError, match="--token-k-rows selected needs a per-token K"):
            build_engine(tiny_opt_dir, BuildConfig(density=0.7, token_k_rows="selected", **kw),
                         tmp_path / "e.engine", progress=False)
    assert not (tmp_path / "e.engine").exists()

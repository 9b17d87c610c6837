"""TEAL input sparsity simulated on a tiny random Llama: dense at skip 0, the masked MLP equals a
reference computed by hand, the realized skip matches the target on the calibration text."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dejavu.compiler.gated_sparsity import (KEYS, GatedSparsity, Reads, calibrate, gated_sparsity, projection_bytes,
                                            thresholds)
from dejavu.errors import DejavuError
from dejavu.models.llama import LlamaConfig, LlamaForCausalLM

CFG = dict(model_type="llama", vocab_size=89, hidden_size=48, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_hf_dict(CFG)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    ids = torch.randint(0, 89, (4, 48), generator=torch.Generator().manual_seed(1))
    return model, ids, calibrate(model, ids)


def mlp_inputs(model, ids):
    """The (post-norm) MLP input of every layer in a dense forward: {layer: [B, S, D]}."""
    got, hs = {}, []
    for l, layer in enumerate(model.layers):
        hs.append(layer.mlp.register_forward_pre_hook(lambda m, a, l=l: got.__setitem__(l, a[0].clone())))
    model(ids)
    for h in hs:
        h.remove()
    return got


@torch.no_grad()
def test_skip_zero_is_the_dense_model(setup):
    model, ids, calib = setup
    dense = model(ids)
    with gated_sparsity(model, calib, GatedSparsity("teal", 0.0)) as reads:
        assert torch.equal(model(ids), dense)
    assert reads.skipped == 0.0


@torch.no_grad()
def test_realized_skip_matches_target_on_calibration_text(setup):
    model, ids, calib = setup
    for skip in (0.25, 0.4, 0.5):
        with gated_sparsity(model, calib, GatedSparsity("teal", skip)) as reads:
            out = model(ids)
        # the first layer sees exactly the calibrated activations; later ones shift a little
        assert abs(reads.skipped - skip) < 0.03, (skip, reads.skipped)
        assert torch.isfinite(out).all()


@torch.no_grad()
def test_teal_masks_each_projection_input(setup):
    model, ids, calib = setup
    s = GatedSparsity("teal", 0.5)
    x = mlp_inputs(model, ids)[1]
    mlp = model.layers[1].mlp
    t_in, t_down = calib.threshold("mlp_in", 1, 0.5), calib.threshold("down_in", 1, 0.5)
    xm = x * (x.abs() > t_in)
    h = F.silu(mlp.gate_proj(xm)) * mlp.up_proj(xm)
    ref = mlp.down_proj(h * (h.abs() > t_down))
    with gated_sparsity(model, calib, s):
        out = mlp(x)
    assert (out - ref).abs().max().item() <= 1e-5
    assert (out - mlp(x)).abs().max().item() > 1e-3  # the hooks are gone outside the context


def test_byte_budget_and_errors():
    cfg = LlamaConfig.from_hf_dict(CFG)
    b = projection_bytes(cfg)
    assert b["attn_in"] == 48 * (48 + 2 * 16) and b["gate"] == b["up"] == b["down"] == 48 * 128
    with pytest.raises(DejavuError, match="method must be"):
        GatedSparsity("cats", 0.4)
    with pytest.raises(DejavuError, match="skip must be"):
        GatedSparsity("teal", 1.0)
    assert Reads().skipped == 0.0
    calib = calibrate(LlamaForCausalLM(cfg).eval(), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(DejavuError, match="calibrated range"):
        calib.threshold("mlp_in", 0, 0.995)


def test_thresholds_per_layer_and_input(setup):
    _, _, calib = setup
    t = thresholds(calib, 0.4)
    assert set(t) == set(KEYS) and all(len(v) == 2 for v in t.values())
    assert t["down_in"][1] == calib.threshold("down_in", 1, 0.4) > 0.0
    assert thresholds(calib, 0.0)["mlp_in"] == [0.0, 0.0]
    with pytest.raises(DejavuError, match="skip must be"):
        thresholds(calib, 1.0)


@torch.no_grad()
@pytest.mark.parametrize("zero", [None, "attn_in", "mlp_in"])
def test_shared_masks_and_uncounted_hooks_are_the_model_masked_per_projection(setup, zero):
    """Each projection given its own input masked by hand (|x| <= t zeroed) is the model the hooks
    make, bit for bit: counted or not (count=False leaves a 0 threshold's input alone), with q, k, v
    and gate, up sharing one masked tensor; an uncounted Reads stays empty."""
    model, ids, calib = setup
    t = thresholds(calib, 0.4)
    if zero is not None:
        t[zero] = [0.0] * len(t[zero])
    handles = []
    for l, layer in enumerate(model.layers):
        at, mlp = layer.self_attn, layer.mlp
        for key, mods in (("attn_in", (at.q_proj, at.k_proj, at.v_proj)), ("o_in", (at.o_proj,)),
                          ("mlp_in", (mlp.gate_proj, mlp.up_proj)), ("down_in", (mlp.down_proj,))):
            handles += [m.register_forward_pre_hook(lambda m, a, t=t[key][l]: (a[0] * (a[0].abs() > t),))
                        for m in mods]
    ref = model(ids)
    for h in handles:
        h.remove()
    with gated_sparsity(model, t, GatedSparsity(), count=True) as counted:
        assert torch.equal(model(ids), ref)
    with gated_sparsity(model, t, GatedSparsity(), count=False) as uncounted:
        assert torch.equal(model(ids), ref)
    assert 0.2 < counted.skipped < 0.6 and uncounted.read == uncounted.dense == 0.0
    assert not torch.equal(model(ids), ref)  # the hooks are gone


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 100_003])
def test_quantiles_equal_torch_quantile(n):
    """The calibration's order-statistics quantiles are torch.quantile's, bit for bit, on fresh
    random magnitudes with ties; NaN anywhere gives NaN as torch's does."""
    from dejavu.compiler.gated_sparsity import LEVELS, quantiles

    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=g).abs()
    a[: n // 3] = a[n // 2]  # ties
    assert torch.equal(quantiles(a, LEVELS), torch.quantile(a, LEVELS))
    q = torch.rand(13, generator=g)
    assert torch.equal(quantiles(a, q), torch.quantile(a, q))
    a[n // 2] = float("nan")
    assert quantiles(a, LEVELS).isnan().all() and torch.quantile(a, LEVELS).isnan().all()

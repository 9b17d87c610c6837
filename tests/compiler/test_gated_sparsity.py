"""TEAL input sparsity simulated on a tiny random Llama: dense at skip 0, the masked MLP equals a
reference computed by hand, the realized skip matches the target on the calibration text, the
error curves are what masking one input does, and the greedy allocation spends exactly the
budget, cheapest error per byte first."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dejavu.compiler.gated_sparsity import (ERROR_LEVELS, KEYS, Calibration, GatedSparsity, Reads, calibrate,
                                            fractions, gated_sparsity, input_bytes, projection_bytes,
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
    return model, ids, calibrate(model, ids, error_tokens=96)


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
    t = thresholds(calib, 0.5)
    t_in, t_down = t["mlp_in"][1], t["down_in"][1]
    assert t_in > 0 and t_down > 0
    xm = x * (x.abs() > t_in)
    h = F.silu(mlp.gate_proj(xm)) * mlp.up_proj(xm)
    ref = mlp.down_proj(h * (h.abs() > t_down))
    with gated_sparsity(model, calib, s):
        out = mlp(x)
    assert (out - ref).abs().max().item() <= 1e-5
    assert (out - mlp(x)).abs().max().item() > 1e-3  # the hooks are gone outside the context


@torch.no_grad()
def test_error_curve_is_the_masked_mlp_change(setup):
    # errors["mlp_in"][l, i]: mean over tokens of |mlp(x masked at fraction f) - mlp(x)|^2, x on the
    # calibration rows used for the curves (96 tokens = the first 2 rows)
    model, ids, calib = setup
    x = mlp_inputs(model, ids)[1][:2].double()
    mlp = model.layers[1].mlp
    w = {k: getattr(mlp, k).weight.double() for k in ("gate_proj", "up_proj", "down_proj")}
    dense = F.linear(F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])
    for i in (3, 9, 15):
        t = calib.threshold("mlp_in", 1, float(ERROR_LEVELS[i]))
        xm = x * (x.abs() > t)
        out = F.linear(F.silu(F.linear(xm, w["gate_proj"])) * F.linear(xm, w["up_proj"]), w["down_proj"])
        ref = (out - dense).pow(2).sum(-1).mean().item()
        assert calib.errors["mlp_in"][1, i].item() == pytest.approx(ref, rel=1e-4)
    for k in KEYS:  # more skipped, more error (up to the noise of small fractions)
        e = calib.errors[k]
        assert (e[:, -1] > e[:, 0]).all(), k


def _synthetic(errors: dict[str, list[float]], L: int = 1) -> Calibration:
    n = len(ERROR_LEVELS)
    return Calibration(tables={k: torch.linspace(0, 1, 100).repeat(L, 1) for k in KEYS},
                       errors={k: torch.tensor([errors[k]] * L) for k in KEYS},
                       norms={"attn": torch.ones(L), "mlp": torch.ones(L)},
                       bytes={"attn_in": 100, "o_in": 100, "mlp_in": 400, "down_in": 200})


def test_allocation_spends_the_budget_cheapest_first():
    f = ERROR_LEVELS.tolist()
    # down_in costs nothing up to 0.5, then a lot; mlp_in is expensive; attention moderate
    calib = _synthetic({"attn_in": [1.0 * x for x in f], "o_in": [2.0 * x for x in f],
                        "mlp_in": [50.0 * x for x in f], "down_in": [0.0 if x <= 0.5 else 100 * x for x in f]})
    total = sum(calib.bytes.values())
    for skip in (0.1, 0.25, 0.4):
        fr = fractions(calib, skip)
        spent = sum(fr[k][0] * calib.bytes[k] for k in KEYS)
        assert spent == pytest.approx(skip * total, rel=1e-9)
    fr = fractions(calib, 0.1)  # 80 bytes: all from down_in's free range
    assert fr["down_in"][0] == pytest.approx(0.4) and fr["attn_in"][0] == fr["mlp_in"][0] == 0.0
    fr = fractions(calib, 0.25)  # 200 bytes: down_in to 0.5 (100), then attn_in (cheaper than o_in) fully
    assert fr["down_in"][0] == pytest.approx(0.5) and fr["attn_in"][0] == pytest.approx(0.95)
    assert fr["o_in"][0] == pytest.approx(0.05) and fr["mlp_in"][0] == 0.0
    t = thresholds(calib, 0.1)
    assert t["attn_in"] == [0.0] and t["down_in"][0] == pytest.approx(calib.threshold("down_in", 0, 0.4))


def test_byte_budget_and_errors():
    cfg = LlamaConfig.from_hf_dict(CFG)
    b = projection_bytes(cfg)
    assert b["attn_in"] == 48 * (48 + 2 * 16) and b["gate"] == b["up"] == b["down"] == 48 * 128
    assert input_bytes(cfg)["mlp_in"] == 2 * 48 * 128
    with pytest.raises(DejavuError, match="method must be"):
        GatedSparsity("cats", 0.4)
    with pytest.raises(DejavuError, match="skip must be"):
        GatedSparsity("teal", 1.0)
    assert Reads().skipped == 0.0
    calib = calibrate(LlamaForCausalLM(cfg).eval(), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(DejavuError, match="calibrated range"):
        calib.threshold("mlp_in", 0, 0.995)

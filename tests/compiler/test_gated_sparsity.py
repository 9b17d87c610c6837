"""Gated-MLP sparsity simulation on a tiny random Llama: dense at skip 0, each method's masked MLP
equals a reference computed by hand, the realized skip matches the target on the calibration text."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dejavu.compiler.gated_sparsity import (GatedSparsity, Reads, calibrate, gated_sparsity, mlp_keep,
                                            projection_bytes)
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
    return model, ids, calibrate(model, ids, rank=CFG["hidden_size"])


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
    for method in ("teal", "cats", "lowrank"):
        with gated_sparsity(model, calib, GatedSparsity(method, 0.0, CFG["hidden_size"])) as reads:
            assert torch.equal(model(ids), dense)
        assert reads.skipped == 0.0


@torch.no_grad()
@pytest.mark.parametrize("method", ["teal", "cats", "lowrank"])
def test_realized_skip_matches_target_on_calibration_text(setup, method):
    model, ids, calib = setup
    for skip in (0.25, 0.4):
        with gated_sparsity(model, calib, GatedSparsity(method, skip, CFG["hidden_size"])) as reads:
            out = model(ids)
        # the first layer sees exactly the calibrated activations; later ones shift a little
        assert abs(reads.skipped - skip) < 0.03, (method, skip, reads.skipped)
        assert torch.isfinite(out).all()


@torch.no_grad()
@pytest.mark.parametrize("method", ["cats", "lowrank"])
def test_masked_mlp_equals_reference(setup, method):
    """Layer 0's MLP under the hooks = down(mask * SiLU(gate) * up) with the mask by hand: cats
    thresholds |SiLU(gate)|; lowrank at full rank predicts the gate exactly, so its top-k is the
    true top-k of |SiLU(gate)|."""
    model, ids, calib = setup
    s = GatedSparsity(method, 0.4, CFG["hidden_size"])
    x = mlp_inputs(model, ids)[0]
    mlp = model.layers[0].mlp
    act = F.silu(mlp.gate_proj(x))
    if method == "cats":
        keep = act.abs() > calib.threshold("act", 0, 1.0 - mlp_keep(s, model.config))
    else:
        k = round(mlp_keep(s, model.config) * CFG["intermediate_size"])
        keep = torch.zeros_like(act, dtype=torch.bool).scatter_(-1, act.abs().topk(k, -1).indices, True)
    ref = mlp.down_proj(act * keep * mlp.up_proj(x))
    with gated_sparsity(model, calib, s):
        out = mlp(x)
    assert (out - ref).abs().max().item() <= 1e-4
    assert (out - mlp(x)).abs().max().item() > 1e-3  # the hooks are gone outside the context


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


def test_byte_budget_and_errors():
    cfg = LlamaConfig.from_hf_dict(CFG)
    b = projection_bytes(cfg)
    assert b["attn_in"] == 48 * (48 + 2 * 16) and b["gate"] == b["up"] == b["down"] == 48 * 128
    # cats: (1 - k) * (up + down) = skip * (gate + up + down)
    assert mlp_keep(GatedSparsity("cats", 0.4), cfg) == pytest.approx(1 - 0.4 * 1.5)
    with pytest.raises(DejavuError, match="cannot skip"):
        mlp_keep(GatedSparsity("cats", 0.7), cfg)
    with pytest.raises(DejavuError, match="method must be"):
        GatedSparsity("relu", 0.4)
    with pytest.raises(DejavuError, match="skip must be"):
        GatedSparsity("teal", 1.0)
    assert Reads().skipped == 0.0

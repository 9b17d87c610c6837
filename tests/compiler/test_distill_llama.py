"""Sparsity-aware distillation on a tiny random Llama: the distilled masked model is closer to the
dense one on the windows it trained on, the gradient reaches only the kept entries, the embedding
stays, bad input is one error. (On random tokens there is nothing that generalises to held-out
windows; the held-out gain is measured on SmolLM2, docs/llama.md.)"""
from __future__ import annotations

import pytest
import torch

from dejavu.compiler.distill_llama import distill_llama, kl_to_dense
from dejavu.compiler.gated_sparsity import GatedSparsity, calibrate, thresholds
from dejavu.errors import DejavuError
from dejavu.models.llama import LlamaConfig, LlamaForCausalLM

CFG = dict(model_type="llama", vocab_size=89, hidden_size=48, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_hf_dict(CFG)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _ids(seed: int, n: int, s: int = 40) -> torch.Tensor:
    # tokens from a skewed distribution, so that the windows share statistics the way text does
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(CFG["vocab_size"], generator=torch.Generator().manual_seed(7)) ** 4
    return torch.multinomial(probs, n * s, replacement=True, generator=g).view(n, s)


def test_distillation_lowers_the_kl_of_the_windows_it_trained_on():
    model = _model()
    train = _ids(1, 8)
    t = thresholds(calibrate(model, train), GatedSparsity("teal", 0.5).skip)
    dense = _model()  # the same weights: the teacher, untouched
    with torch.no_grad():
        before = float(kl_to_dense(dense, model, t, train))
        embed = model.model.embed_tokens.weight.clone()
    lines = []
    info = distill_llama(model, t, train, 64, lr_weight=1e-3, lr_norm=1e-3, progress=lines.append)
    with torch.no_grad():
        after = float(kl_to_dense(dense, model, t, train))
    assert [ln.split(":")[0] for ln in lines] == [f"distill step {k}/64" for k in (10, 20, 30, 40, 50, 60, 64)]
    kls = [float(ln.split("KL ")[1].split(",")[0]) for ln in lines]  # each the mean since the line before
    assert kls[0] > kls[-1] and kls[-1] < 0.7 * before, (kls, before)
    assert before > 1e-3  # the masks do change the model
    assert after < 0.7 * before, (before, after)
    assert info["steps"] == 64 and info["tokens"] == 64 * 40
    assert torch.equal(model.model.embed_tokens.weight, embed)  # only the blocks and the final norm train
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # as they were before


def test_a_step_takes_batch_windows_in_order_cycled(monkeypatch):
    # 3 windows, 2 a step, 3 steps: [0, 1], [2, 0], [1, 2]; the report counts every window's tokens
    import dejavu.compiler.distill_llama as dl

    seen, real = [], dl.kl_to_dense
    monkeypatch.setattr(dl, "kl_to_dense", lambda te, st, t, ids: seen.append(ids.clone()) or real(te, st, t, ids))
    model, train = _model(), _ids(2, 3)
    t = thresholds(calibrate(model, train), 0.3)
    info = distill_llama(model, t, train, 3, batch=2)
    assert [[int(torch.nonzero((train == w).all(1))[0]) for w in ids] for ids in seen] == [[0, 1], [2, 0], [1, 2]]
    assert info["batch"] == 2 and info["tokens"] == 3 * 2 * 40


def test_gradient_flows_through_the_kept_entries_only():
    # layer 0's down_proj input fully masked (threshold inf): its weight gets no gradient at all, nor do
    # gate / up, whose only way to the output it was; layer 1's and the attention's do (the masks are
    # constants for autograd)
    model = _model()
    ids = _ids(5, 2)
    t = thresholds(calibrate(model, ids), 0.3)
    t["down_in"][0] = float("inf")
    for p in model.parameters():
        p.requires_grad_(True)
    kl_to_dense(_model(), model, t, ids).backward()
    assert torch.count_nonzero(model.layers[0].mlp.down_proj.weight.grad) == 0
    assert torch.count_nonzero(model.layers[1].mlp.down_proj.weight.grad) > 0
    assert torch.count_nonzero(model.layers[0].mlp.up_proj.weight.grad) == 0
    assert torch.count_nonzero(model.layers[0].self_attn.q_proj.weight.grad) > 0


def test_zero_thresholds_are_the_dense_model():
    # thresholds 0 mask nothing: the student is the teacher, KL 0
    model = _model()
    ids = _ids(3, 2)
    t = {k: [0.0, 0.0] for k in ("attn_in", "o_in", "mlp_in", "down_in")}
    info = distill_llama(model, t, ids, 1)
    assert info["first_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps must be a positive integer"),
    (dict(steps=2.5), "steps must be a positive integer"),
    (dict(ids=torch.zeros(8, dtype=torch.long)), "ids must be a long tensor"),
    (dict(ids=torch.zeros(2, 8)), "ids must be a long tensor"),
    (dict(batch=0), "batch must be a positive integer"),
    (dict(batch=True), "batch must be a positive integer"),
    (dict(lr_weight=0.0), "lr_weight must be a positive number"),
    (dict(lr_norm=float("nan")), "lr_norm must be a positive number"),
])
def test_bad_input_is_one_error(kwargs, match):
    model = _model()
    t = {k: [0.1, 0.1] for k in ("attn_in", "o_in", "mlp_in", "down_in")}
    args = {"thresholds": t, "ids": _ids(4, 2), "steps": 1, **kwargs}
    with pytest.raises(DejavuError, match=match):
        distill_llama(model, **args)

"""Our dense OPT equals transformers.OPTForCausalLM on the same weights (fp32, max abs <= 1e-4)."""
from __future__ import annotations

import pytest
import torch

from dejavu.models.opt import OPTConfig, OPTForCausalLM

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BASE = dict(vocab_size=101, num_hidden_layers=2, max_position_embeddings=40, dropout=0.0)
CONFIGS = {
    "pre_ln": dict(hidden_size=32, ffn_dim=80, num_attention_heads=4),
    "350m_like_post_ln_proj": dict(hidden_size=48, ffn_dim=96, num_attention_heads=4,
                                   word_embed_proj_dim=24, do_layer_norm_before=False),
    "no_bias_3_heads": dict(hidden_size=36, ffn_dim=72, num_attention_heads=3, enable_bias=False,
                            num_hidden_layers=3),
    "6_heads_no_final_ln": dict(hidden_size=48, ffn_dim=64, num_attention_heads=6,
                                _remove_final_layer_norm=True),
}


def make_pair(overrides: dict, seed: int = 0):
    """(hf_model, our_model) with the same random weights (LayerNorms and biases included)."""
    hf_cfg = transformers.OPTConfig(**{**BASE, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.OPTForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layer_norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1 if p.dim() == 1 else 0.15)
    ours = OPTForCausalLM(OPTConfig.from_hf_dict(hf_cfg.to_dict())).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def hf_logits(hf, ids, mask=None):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request):
    return make_pair(CONFIGS[request.param])


@torch.no_grad()
def test_prefill_matches_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf, ids)
    out = ours(ids)
    assert out.shape == ref.shape == (2, 13, 101)
    assert (out - ref).abs().max().item() <= ATOL
    assert ref.std() > 0.1  # not a degenerate comparison


@torch.no_grad()
def test_cached_decode_matches_transformers_and_recompute(pair):
    hf, ours = pair
    ids = torch.randint(0, 101, (2, 14), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids)  # [2, 14, V]
    recompute = ours(ids)
    prompt = 5
    ours.setup_caches(2, 16)
    try:
        steps = [ours(ids[:, :prompt], 0)]
        for t in range(prompt, ids.shape[1]):
            steps.append(ours(ids[:, t:t + 1], t))
    finally:
        ours.clear_caches()
    cached = torch.cat(steps, dim=1)
    assert (cached - ref).abs().max().item() <= ATOL
    assert (cached - recompute).abs().max().item() <= ATOL


@torch.no_grad()
def test_left_padded_batch_matches_transformers_and_single_sequences(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(3)
    lens = [4, 9]
    S, extra = max(lens), 5
    seqs = [torch.randint(3, 101, (n + extra,), generator=g) for n in lens]
    ids = torch.full((2, S + extra), 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (s, n) in enumerate(zip(seqs, lens)):
        ids[b, S - n:] = s
        mask[b, S - n:] = 1
    # full padded forward vs transformers with the same mask (real positions only)
    ref = hf_logits(hf, ids, mask)
    out = ours(ids, 0, mask)
    real = mask.bool()
    assert (out[real] - ref[real]).abs().max().item() <= ATOL
    # padded prefill + cached decode vs each sequence alone, unpadded, cached
    ours.setup_caches(2, S + extra)
    try:
        batched = [ours(ids[:, :S], 0, mask[:, :S])[:, -1]]
        for t in range(S, S + extra - 1):
            batched.append(ours(ids[:, t:t + 1], t, mask[:, :t + 1])[:, -1])
    finally:
        ours.clear_caches()
    for b, (s, n) in enumerate(zip(seqs, lens)):
        single = ours(s[None])[0]  # [n + extra, V]
        for i, logits in enumerate(batched):
            assert (logits[b] - single[n - 1 + i]).abs().max().item() <= ATOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.no_grad()
def test_half_precision_runs_close_to_fp32(dtype):
    _, ours = make_pair(CONFIGS["pre_ln"])
    ids = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(4))
    ref = ours(ids)
    low = ours.to(dtype)(ids)
    assert low.dtype == dtype
    err = (low.float() - ref).abs().max().item()
    assert err <= (0.05 if dtype == torch.float16 else 0.3) * ref.abs().max().item()

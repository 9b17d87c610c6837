"""Runtime correctness on CPU (fp32): masked-dense equality, density 1.0, KV cache, overlap."""
from __future__ import annotations

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.runtime import Engine
from runtime_helpers import MaskedDense, engine_from_dense, random_predictors, record_steps, tiny_model

PROMPT = [2, 17, 40, 5, 88, 63, 9]


@pytest.mark.parametrize("source,lookahead", [("attn_in", 1), ("mlp_in", 1), ("attn_in", 0)])
def test_greedy_64_equals_masked_dense(source, lookahead):
    model = tiny_model(seed=3)
    header, tensors = engine_from_dense(model, 0.5, 0.5, source, lookahead)
    eng = Engine.from_tensors(header, tensors, "cpu")
    ref = MaskedDense(model, header, tensors)
    want = ref.generate(PROMPT, 64)
    got = eng.generate([PROMPT], 64, stop_at_eos=False)[0]
    assert got == want
    assert len(set(got)) > 3  # a non-degenerate sequence


def _trace(eng, prompts, n):
    eng.decoder.pred.trace = []
    try:
        eng.generate(prompts, n, stop_at_eos=False)
        return [(l, k, i.sort(-1).values) for l, k, i in eng.decoder.pred.trace]
    finally:
        eng.decoder.pred.trace = None


@pytest.mark.parametrize("mlp_ranks", [None, [16, 8, 4]])  # None: rank 8 everywhere; else per layer
def test_selected_indices_match_reference_and_overlap_switch(mlp_ranks):
    model = tiny_model(seed=4)
    preds = None if mlp_ranks is None else random_predictors(model.config, rank=mlp_ranks)
    header, tensors = engine_from_dense(model, 0.4, 0.5, "attn_in", 1, preds=preds)
    if mlp_ranks is not None:
        assert [tensors[f"layers.{l}.pred_mlp.b"].shape[1] for l in range(3)] == mlp_ranks
    runs = [_trace(Engine.from_tensors(header, tensors, "cpu", overlap=o), [PROMPT], 20) for o in (True, False)]
    assert len(runs[0]) == len(runs[1]) == 19 * 3 * 2  # 19 decode steps x 3 layers x {mlp, attn}
    for (l0, k0, a), (l1, k1, b) in zip(*runs):
        assert (l0, k0) == (l1, k1) and torch.equal(a, b)
    # and they are the masked-dense reference's selections, layer by layer, step by step
    ref = MaskedDense(model, header, tensors)
    ref.generate(PROMPT, 20)
    per = lambda tr: {(l, k): [x for ll, kk, x in tr if (ll, kk) == (l, k)] for l, k, _ in tr}  # noqa: E731
    got, want = per(runs[0]), per(ref.selections)
    assert got.keys() == want.keys()
    for key in got:
        assert all(torch.equal(a, b) for a, b in zip(got[key], want[key])), key


def test_density_one_equals_dense():
    model = tiny_model(seed=5)
    header, tensors = engine_from_dense(model, 1.0, 1.0)
    eng = Engine.from_tensors(header, tensors, "cpu")
    ids = torch.tensor([PROMPT + [11, 12, 13]])
    with torch.no_grad():
        dense = model(ids)
    torch.testing.assert_close(eng.logits(ids), dense, atol=1e-5, rtol=1e-5)
    ref = MaskedDense(model, header, tensors)  # K = N: masks keep everything
    assert eng.generate([PROMPT], 40, stop_at_eos=False)[0] == ref.generate(PROMPT, 40)


def test_token_parallel_logits_equal_masked_dense_and_stepwise_decode():
    model = tiny_model(seed=6)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "mlp_in", 1)
    eng = Engine.from_tensors(header, tensors, "cpu")
    ids = torch.tensor([PROMPT + [30, 31, 32, 33, 34]])
    par = eng.logits(ids)  # [1, S, V]
    torch.testing.assert_close(par, MaskedDense(model, header, tensors).logits(ids), atol=1e-4, rtol=1e-4)
    dec = eng.decoder  # decode every token sparsely from an empty cache: same logits
    dec.setup(1, 64)
    with torch.no_grad():
        steps = torch.stack([dec.decode_step(ids[:, i], torch.tensor([i]))[0] for i in range(ids.shape[1])])
    torch.testing.assert_close(steps, par[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_policy", ["deferred", "full"])
def test_decode_logits_equal_masked_dense(kv_policy):
    # Engine.decode_logits (the decode loop fed given tokens, runtime/generate.py) against the
    # masked-dense reference: every position decoded sparse from an empty cache = the token-parallel
    # masked model; with per-row prompts = a dense pass over each prompt, then masked cached steps
    model = tiny_model(seed=6)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "attn_in", 1)
    eng = Engine.from_tensors(header, tensors, "cpu", kv_policy=kv_policy)
    ref = MaskedDense(model, header, tensors)
    ids = torch.tensor([PROMPT + [30, 31, 32, 33, 34], [2, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80]])
    eng.generate([[2, 90, 91, 92], [2, 93]], 20, stop_at_eos=False)  # a used cache of this batch: not to be read
    torch.testing.assert_close(eng.decode_logits(ids), ref.logits(ids), atol=1e-4, rtol=1e-4)
    plens = [len(PROMPT), 3]
    got = eng.decode_logits(ids, plens)
    for b, p in enumerate(plens):
        torch.testing.assert_close(got[b, p - 1:], ref.teacher_forced(ids[b:b + 1], p), atol=1e-4, rtol=1e-4)
        assert got[b, :p - 1].isnan().all()
    # the prompt's positions are dense there: the empty-cache form differs from it
    assert (got[1, 3:] - eng.decode_logits(ids)[1, 3:]).abs().max() > 1e-3


def test_decode_logits_replay_generate():
    # fed generate's own greedy tokens, the decode loop gives back generate's step logits (and argmax)
    model = tiny_model(seed=3)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "attn_in", 1)
    eng = Engine.from_tensors(header, tensors, "cpu")
    got: list = []
    record_steps(eng.decoder, got)
    new = eng.generate([PROMPT], 12, stop_at_eos=False)[0]
    del eng.decoder.decode_step
    seq = torch.tensor([PROMPT + new])
    out = eng.decode_logits(seq, len(PROMPT))[0]
    assert out[len(PROMPT) - 1:-1].argmax(-1).tolist() == new
    torch.testing.assert_close(out[len(PROMPT):-1], torch.cat(got), atol=1e-5, rtol=1e-5)


def test_decode_logits_errors():
    model = tiny_model(seed=3)
    eng = Engine.from_tensors(*engine_from_dense(model, 0.5, 0.5, "attn_in", 1), "cpu")
    ids = torch.tensor([PROMPT, PROMPT])
    for bad in (8, -1, [0, 2], [3, 3, 3]):
        with pytest.raises(DejavuError, match="prompt_len"):
            eng.decode_logits(ids, bad)
    with pytest.raises(DejavuError, match="token ids"):
        eng.decode_logits([[2, 10 ** 6]])


def test_decode_with_cache_equals_full_recompute():
    model = tiny_model(seed=7)
    header, tensors = engine_from_dense(model, 1.0, 1.0)
    eng = Engine.from_tensors(header, tensors, "cpu")
    ids = torch.tensor([PROMPT + [44, 45, 46, 47]])
    full = eng.logits(ids)[0]  # [S, V], no cache
    dec, n = eng.decoder, len(PROMPT)
    dec.setup(1, 64)
    with torch.no_grad():
        out = [dec.prefill(ids[:, :n], torch.tensor([n]))[0]]
        out += [dec.decode_step(ids[:, i], torch.tensor([i]))[0] for i in range(n, ids.shape[1])]
    torch.testing.assert_close(torch.stack(out), full[n - 1:], atol=1e-4, rtol=1e-4)


def test_batch_of_unequal_prompts_equals_one_by_one():
    model = tiny_model(seed=8)
    header, tensors = engine_from_dense(model, 0.5, 0.75, "attn_in", 1)
    eng = Engine.from_tensors(header, tensors, "cpu")
    prompts = [PROMPT, PROMPT[:3], [2, 70, 71, 72, 73, 74, 75, 76, 77, 78]]
    batch = eng.generate(prompts, 24, stop_at_eos=False)
    for p, got in zip(prompts, batch):
        assert eng.generate([p], 24, stop_at_eos=False)[0] == got


def test_shared_batch_policy_at_batch_one_equals_per_sequence():
    model = tiny_model(seed=9)
    header, tensors = engine_from_dense(model, 0.5, 0.5)
    a = Engine.from_tensors(header, tensors, "cpu").generate([PROMPT], 16, stop_at_eos=False)
    b = Engine.from_tensors(header, tensors, "cpu", batch_policy="shared").generate([PROMPT], 16, stop_at_eos=False)
    assert a == b
    eng = Engine.from_tensors(header, tensors, "cpu", batch_policy="shared")
    two = eng.generate([PROMPT, PROMPT[:4]], 8)
    assert len(two) == 2
    eng.release()
    assert eng.generate([PROMPT, PROMPT[:4]], 8) == two


def test_sampling_is_seeded_and_eos_stops():
    model = tiny_model(seed=10)
    header, tensors = engine_from_dense(model, 0.5, 0.5)
    eng = Engine.from_tensors(header, tensors, "cpu")
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=123, stop_at_eos=False)
    assert eng.generate([PROMPT], 12, **kw) == eng.generate([PROMPT], 12, **kw)
    seen = []
    out = eng.generate([PROMPT, PROMPT[:2]], 12, stream=seen.append)
    assert len(seen) >= 1 and all(len(s) == 2 for s in seen)
    eos = eng.spec.eos_id
    for seq in out:
        assert eos not in seq[:-1]


def test_errors():
    with pytest.raises(DejavuError, match="not found"):
        Engine.load("/nonexistent/x.engine")
    model = tiny_model()
    header, tensors = engine_from_dense(model, 0.5, 0.5, "mlp_in", 0)
    with pytest.raises(DejavuError, match="lookahead 0"):
        Engine.from_tensors(header, tensors)
    header, tensors = engine_from_dense(model, 0.5, 0.5)
    assert "predictor_form" not in header["build_config"]  # an engine from before the field loads
    Engine.from_tensors({**header, "build_config": {**header["build_config"], "predictor_form": "lowrank"}}, tensors)
    with pytest.raises(DejavuError, match="predictor_form 'two_layer'"):
        Engine.from_tensors({**header, "build_config": {**header["build_config"], "predictor_form": "two_layer"}},
                            tensors)
    with pytest.raises(DejavuError, match="batch_policy"):
        Engine.from_tensors(header, tensors, batch_policy="union-ish")
    no_input = {k: v for k, v in header["build_config"].items() if k != "predictor_input"}
    with pytest.raises(DejavuError, match="predictor_input is missing"):  # the runtime has no default of its own
        Engine.from_tensors({**header, "build_config": no_input}, tensors)
    dense_header, dense_tensors = engine_from_dense(model, 1.0, 1.0)
    dense_bc = {k: v for k, v in dense_header["build_config"].items() if k != "predictor_input"}
    Engine.from_tensors({**dense_header, "build_config": {**dense_bc, "predictors": False}}, dense_tensors)
    bad = dict(tensors)
    del bad["layers.1.mlp.w1"]
    with pytest.raises(DejavuError, match="layers.1.mlp.w1"):
        Engine.from_tensors(header, bad)
    eng = Engine.from_tensors(header, tensors)
    with pytest.raises(DejavuError, match="exceeds"):
        eng.generate([PROMPT], 500)
    with pytest.raises(DejavuError, match="token ids"):
        eng.generate([[5, 10_000]], 2)
    with pytest.raises(DejavuError, match="tokenizer"):
        eng.generate(["text needs a tokenizer"], 2)
    with pytest.raises(DejavuError, match="temperature"):
        eng.generate([PROMPT], 2, temperature=-1)


def test_reference_backend_is_the_plugins_references():
    """The CPU backend is the plugins' `_ref` functions (and PyTorch's LayerNorm): one set of references."""
    import dejavu.plugins as P

    eng = Engine.from_tensors(*engine_from_dense(tiny_model(seed=12), 0.5, 0.5), "cpu")
    assert set(eng.ops.kernels.values()) == {"ref"}
    assert eng.ops.sparse_attn is P.sparse_attn_decode_ref and eng.ops.sparse_fc1 is P.sparse_fc1_ref
    assert eng.ops.sparse_attn_deferred is P.sparse_attn_decode_deferred_ref
    assert eng.ops.kv_refresh is P.refresh_heads_ref


def test_post_ln_with_projections_350m_style():
    over = dict(do_layer_norm_before=False, word_embed_proj_dim=16)
    model = tiny_model(seed=13, **over)
    header, tensors = engine_from_dense(model, 1.0, 1.0)
    eng = Engine.from_tensors(header, tensors, "cpu")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(eng.logits(ids), model(ids), atol=1e-5, rtol=1e-5)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "attn_in", 1)
    eng = Engine.from_tensors(header, tensors, "cpu")
    assert eng.generate([PROMPT], 24, stop_at_eos=False)[0] == MaskedDense(model, header, tensors).generate(PROMPT, 24)

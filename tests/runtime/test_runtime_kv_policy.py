"""kv_policy "deferred" (K/V of selected heads only, missing slots recomputed) equals "full"."""
from __future__ import annotations

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.runtime import Engine
from runtime_helpers import MaskedDense, engine_from_dense, tiny_model

PROMPT = [2, 17, 40, 5, 88, 63, 9]


def _check_caches(deferred, full):
    """Every slot a deferred layer marks valid equals the full policy's cache there; heads
    selected at the last step are valid up to the last position."""
    dd, fd = deferred.decoder, full.decoder
    checked = 0
    for l in range(dd.spec.num_layers):
        vl = dd.valid_len[l]
        if vl is None:
            continue
        B, H = vl.shape
        for b in range(B):
            for h in range(H):
                n = int(vl[b, h])
                for mine, theirs in ((dd.k_cache[l], fd.k_cache[l]), (dd.v_cache[l], fd.v_cache[l])):
                    torch.testing.assert_close(mine[b, h, :n], theirs[b, h, :n], atol=1e-5, rtol=1e-5)
                checked += n
        last = dd.pred.idx[l]["attn"]  # the heads of the last decode step
        assert (vl.gather(1, last.long().expand(B, -1)) == vl.amax(1, keepdim=True)).all()
    assert checked > 0


@pytest.mark.parametrize("source,lookahead", [("attn_in", 1), ("mlp_in", 1)])
def test_deferred_equals_full_and_masked_dense_64_tokens(source, lookahead):
    model = tiny_model(seed=3)
    header, tensors = engine_from_dense(model, 0.5, 0.5, source, lookahead)
    deferred = Engine.from_tensors(header, tensors, "cpu", kv_policy="deferred")
    full = Engine.from_tensors(header, tensors, "cpu", kv_policy="full")
    assert Engine.from_tensors(header, tensors, "cpu").kv_policy == "deferred"  # the default
    want = MaskedDense(model, header, tensors).generate(PROMPT, 64)
    got_d = deferred.generate([PROMPT], 64, stop_at_eos=False)[0]
    got_f = full.generate([PROMPT], 64, stop_at_eos=False)[0]
    assert got_d == got_f == want
    assert len(set(got_d)) > 3
    # heads went unselected for a while and were recomputed: not every slot was filled each step
    vl = deferred.decoder.valid_len[0]
    assert int(vl.min()) < int(vl.max())
    _check_caches(deferred, full)


def test_deferred_batch_with_unequal_prompts_and_shared_policy():
    model = tiny_model(seed=8)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "attn_in", 1)
    prompts = [PROMPT, PROMPT[:3], [2, 70, 71, 72, 73, 74, 75, 76, 77, 78]]
    for policy in ("per_sequence", "shared"):
        d = Engine.from_tensors(header, tensors, "cpu", batch_policy=policy, kv_policy="deferred")
        f = Engine.from_tensors(header, tensors, "cpu", batch_policy=policy, kv_policy="full")
        assert d.generate(prompts, 24, stop_at_eos=False) == f.generate(prompts, 24, stop_at_eos=False)
        assert [int(x) for x in d.decoder.valid_len[1].min(1).values] != [0, 0, 0]  # prefill set lengths
        _check_caches(d, f)


def test_head_unselected_for_several_steps_then_selected_is_recomputed():
    model = tiny_model(seed=4)
    header, tensors = engine_from_dense(model, 0.5, 0.5, "attn_in", 1)
    engines = {kv: Engine.from_tensors(header, tensors, "cpu", kv_policy=kv) for kv in ("deferred", "full")}
    H, n, steps = engines["full"].spec.num_heads, len(PROMPT), 9

    def forced(step):  # head 0 left out for steps 0..6, then selected (with head 1) at 7 and 8
        return torch.tensor([[2, 3]] if step < 7 else [[0, 1]])

    ids = torch.tensor([PROMPT])
    toks = torch.tensor([[30 + i] for i in range(steps)])
    logits, head0_valid = {}, []
    for kv, eng in engines.items():
        dec = eng.decoder
        dec.setup(1, 64)
        out = []
        with torch.no_grad():
            dec.prefill(ids, torch.tensor([n]))
            for i in range(steps):
                dec.pred.heads = lambda l, i=i: forced(i)  # instance attribute shadows the method
                out.append(dec.decode_step(toks[i], torch.tensor([n + i])))
                if kv == "deferred":
                    head0_valid.append(int(dec.valid_len[0][0, 0]))
        logits[kv] = torch.stack(out)
    torch.testing.assert_close(logits["deferred"], logits["full"], atol=1e-5, rtol=1e-5)
    d, f = engines["deferred"].decoder, engines["full"].decoder
    last = n + steps - 1
    for l in range(d.spec.num_layers):
        vl = d.valid_len[l][0]
        assert int(vl[0]) == int(vl[1]) == last + 1  # recomputed from n (prompt end) to the last position
        assert int(vl[2]) == int(vl[3]) == n + 7  # last selected at step 6
        torch.testing.assert_close(d.k_cache[l][0, :2, :last + 1], f.k_cache[l][0, :2, :last + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.v_cache[l][0, :2, :last + 1], f.v_cache[l][0, :2, :last + 1], atol=1e-5, rtol=1e-5)
    assert H == 4 and head0_valid == [n] * 7 + [n + 8, n + 9]  # untouched while unselected, then caught up


def test_kv_policy_errors_and_describe():
    model = tiny_model()
    header, tensors = engine_from_dense(model, 0.5, 0.5)
    with pytest.raises(DejavuError, match="kv_policy"):
        Engine.from_tensors(header, tensors, kv_policy="lazy")
    eng = Engine.from_tensors(header, tensors, kv_policy="full")
    assert eng.describe()["kv_policy"] == "full"
    dense = Engine.from_tensors(*engine_from_dense(model, 1.0, 1.0))  # no sparse attention: no history
    dense.generate([PROMPT], 4)
    assert all(x is None for x in dense.decoder.x_hist)


def test_refresh_heads_default_rule():
    """kv_refresh None: REFRESH_AUTO's heads per layer only with the Triton attention op, a hidden size
    of at least its minimum and at least its fraction of the heads attending; an int overrides; a
    reference op or batch > 1 never refreshes by default."""
    from types import SimpleNamespace

    from dejavu.runtime.decoder import DecodeOptions
    from dejavu.runtime.kv_policy import REFRESH_AUTO, RefreshHeads
    n, frac, min_d = REFRESH_AUTO
    H = 56
    spec = SimpleNamespace(hidden_size=min_d, num_heads=H)
    triton = SimpleNamespace(kernels={"sparse_attn_deferred": "triton"})
    pick, opts = RefreshHeads(spec, triton, None), DecodeOptions()
    many, few = torch.zeros(int(frac * H) + 1, dtype=torch.int32), torch.zeros(int(frac * H) - 1, dtype=torch.int32)
    assert pick.slots(opts, many) == n and pick.slots(opts, few) == 0
    assert pick.active(opts, 1)
    small = RefreshHeads(SimpleNamespace(hidden_size=min_d // 2, num_heads=H), triton, None)
    assert small.slots(opts, many) == 0
    ref = RefreshHeads(spec, SimpleNamespace(kernels={"sparse_attn_deferred": "ref"}), None)
    assert ref.slots(opts, many) == 0
    for k in (0, 3):
        fixed = DecodeOptions(kv_refresh=k)
        assert pick.slots(fixed, few) == k and pick.active(fixed, 1) == (k > 0)
    assert not pick.active(opts, 2)
    assert not pick.active(DecodeOptions(kv_policy="full"), 1)

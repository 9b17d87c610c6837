"""The decoder's per-row API a serving scheduler uses: `prefill(rows=)` fills chosen cache rows
and leaves the others alone; `use_rows(n)` steps the first n rows as views. A sequence
prefilled into row r and decoded beside other rows gets the logits `decode_logits` gives it
alone (the generate path)."""
from __future__ import annotations

import pytest
import torch

from dejavu.runtime import Engine
from runtime_helpers import engine_from_dense, tiny_model


@pytest.mark.parametrize("kv_policy", ["deferred", "full"])
def test_prefill_rows_and_use_rows_match_solo_decode(kv_policy):
    header, tensors = engine_from_dense(tiny_model(seed=4), 0.5, 0.5)
    eng = Engine.from_tensors(header, tensors, kv_policy=kv_policy)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(4, 97, (1, 11), generator=g)  # 5 prompt tokens + 6 fed
    b = torch.randint(4, 97, (1, 9), generator=g)  # 3 prompt tokens + 6 fed
    want_a = eng.decode_logits(a, 5)[0, 4:]  # [7, V]
    want_b = eng.decode_logits(b, 3)[0, 2:]
    dec = eng.decoder
    dec.setup(4, 64)
    k0 = dec.k_cache[0].clone()
    got_a = [dec.prefill(a[:, :5], torch.tensor([5]), rows=torch.tensor([2]))[0]]
    assert torch.equal(dec.k_cache[0][[0, 1, 3]], k0[[0, 1, 3]])  # other rows untouched
    dec.use_rows(3)
    assert dec.batch == 3 and all(t.shape[0] == 3 for t in dec.k_cache + dec.valid_len if t is not None)
    got_b = []
    for i in range(6):  # row 2: a; row 0: b from step 1 on (a newcomer between steps); row 1 idle
        if i == 1:
            dec.use_rows(4)
            got_b.append(dec.prefill(b[:, :3], torch.tensor([3]), rows=torch.tensor([0]))[0])
            dec.use_rows(3)
        tokens = torch.tensor([b[0, 3 + i - 1] if i >= 1 else 0, 0, a[0, 5 + i]])
        pos = torch.tensor([3 + i - 1 if i >= 1 else 0, 0, 5 + i])
        out = dec.decode_step(tokens, pos)
        got_a.append(out[2])
        if i >= 1:
            got_b.append(out[0])
    torch.testing.assert_close(torch.stack(got_a), want_a[:7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(got_b), want_b[:6], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="use_rows"):
        dec.use_rows(5)


@pytest.mark.parametrize("kv_policy", ["deferred", "full"])
def test_chunked_prefill_equals_whole_prefill(kv_policy):
    """A prompt prefilled in chunks (start=) into row 1 gives the whole prefill's logits, cache
    and valid lengths, and the same decode steps after it."""
    header, tensors = engine_from_dense(tiny_model(seed=5), 0.5, 0.5)
    eng = Engine.from_tensors(header, tensors, kv_policy=kv_policy)
    dec = eng.decoder
    ids = torch.randint(4, 97, (1, 13), generator=torch.Generator().manual_seed(1))
    dec.setup(1, 32)
    want = dec.prefill(ids, torch.tensor([13]))
    want_k = [k[0, :, :13].clone() for k in dec.k_cache]
    want_step = dec.decode_step(torch.tensor([7]), torch.tensor([13]))
    dec.setup(2, 32)
    for a, b in ((0, 5), (5, 10), (10, 13)):
        got = dec.prefill(ids[:, a:b], torch.tensor([b - a]), rows=torch.tensor([1]), start=a)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for k, w in zip(dec.k_cache, want_k):
        torch.testing.assert_close(k[1, :, :13], w, rtol=1e-5, atol=1e-6)
    assert all(int(vl[1].min()) == 13 == int(vl[1].max()) for vl in dec.valid_len if vl is not None)
    step = dec.decode_step(torch.tensor([0, 7]), torch.tensor([0, 13]))
    torch.testing.assert_close(step[1:], want_step, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="write_cache"):
        dec.forward_tokens(ids, sparse=False, start=2)

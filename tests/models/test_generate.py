"""Dense generation with the static KV cache, and the shared sampler."""
from __future__ import annotations

import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.models.generate import generate, left_pad
from dejavu.models.loader import load_model
from dejavu.models.sampling import sample_next


@pytest.fixture(scope="module")
def model(tiny_opt_dir):
    return load_model(tiny_opt_dir)[0]


def greedy_by_recompute(model, prompt: list[int], n: int) -> list[int]:
    """argmax of a full forward over the whole sequence, one token at a time (no cache)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_equals_full_recompute(model):
    prompts = torch.tensor([[2, 40, 41, 42, 43], [2, 100, 7, 250, 9]])
    out = generate(model, prompts, max_new_tokens=12)
    assert [len(o) for o in out] == [12, 12]
    for p, o in zip(prompts.tolist(), out):
        assert o == greedy_by_recompute(model, p, 12)
    assert model.decoder.layers[0].self_attn.cache is None  # caches released


def test_left_padded_batch_equals_single_sequences(model):
    prompts = [[2, 5, 6], [2, 90, 91, 92, 93, 94, 95, 96], [2, 17]]
    batched = generate(model, prompts, max_new_tokens=10)
    for p, o in zip(prompts, batched):
        assert o == generate(model, [p], max_new_tokens=10)[0]
        assert o == greedy_by_recompute(model, p, 10)


def test_left_pad():
    ids, mask = left_pad([[5, 6], [7, 8, 9]], pad_id=1)
    assert ids.tolist() == [[1, 5, 6], [7, 8, 9]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert left_pad([[5, 6], [7, 8]], pad_id=1)[1] is None
    with pytest.raises(DejavuError, match="at least one token"):
        left_pad([[5], []], pad_id=1)


def test_sampling_reproducible_with_seed(model):
    kw = dict(max_new_tokens=20, temperature=1.5, top_k=50, top_p=0.95)
    a = generate(model, [[2, 40, 41]], seed=123, **kw)
    assert a == generate(model, [[2, 40, 41]], seed=123, **kw)
    assert a != generate(model, [[2, 40, 41]], seed=124, **kw)


def test_eos_stops_and_stream_reports(model):
    first = generate(model, [[2, 40, 41]], max_new_tokens=1)[0][0]
    seen = []
    out = generate(model, [[2, 40, 41], [2, 50, 51]], max_new_tokens=6, eos_id=first, stream=seen.append)
    assert out[0] == [first]
    assert len(seen) == len(out[1]) and all(s[0] is None for s in seen[1:])
    assert [s[1] for s in seen] == out[1]


def test_generate_errors(model):
    with pytest.raises(DejavuError, match="exceeds the model's max_position_embeddings 64"):
        generate(model, [[2] * 60], max_new_tokens=10)
    with pytest.raises(DejavuError, match="token ids must be in"):
        generate(model, [[2, 999]], max_new_tokens=2)
    with pytest.raises(DejavuError, match="top_p"):
        generate(model, [[2, 3]], max_new_tokens=2, temperature=1.0, top_p=0.0)
    assert generate(model, [[2, 3]], max_new_tokens=0) == [[]]


def test_sample_next_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    top2 = logits.topk(2).indices
    assert torch.equal(sample_next(logits), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 1.0, top_p=1e-6, generator=g), logits.argmax(-1))
    for _ in range(50):
        t = sample_next(logits, 2.0, top_k=2, generator=g)
        assert ((top2 == t[:, None]).any(-1)).all()
    # top_p keeps the smallest prefix reaching p: with probs (0.5, 0.3, 0.2), p=0.7 keeps 2
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    drawn = {int(sample_next(probs.log(), 1.0, top_p=0.7, generator=g)) for _ in range(200)}
    assert drawn == {0, 1}
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=1.5)):
        with pytest.raises(DejavuError):
            sample_next(logits, **{"temperature": 1.0, **bad})

"""Tensor-parallel engines on CPU: shards written to files, 2 gloo processes (mp.spawn).

One spawn runs every case (process start-up dominates); the tests then compare the ranks'
results with single-rank references computed here."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dejavu.compiler.tensor_parallel import k_per_rank, shard_engine, write_shards
from dejavu.engine_file import read_engine
from dejavu.errors import DejavuError
from dejavu.runtime import Engine
from dejavu.shards import shard_path
from runtime_helpers import MaskedDense, engine_from_dense, free_port, join_gloo, tiny_model

TP = 2
PROMPT = [2, 17, 40, 5, 88, 63, 9]
IDS = [PROMPT + [11, 12, 13, 70]]
CASES = {"dense": (1.0, 1.0), "sparse": (0.4, 0.5)}  # (mlp density, attn density)


def _worker(rank: int, port: int, folder: str) -> None:
    join_gloo(rank, port, TP)
    from dejavu.runtime.tp import TPEngine

    try:
        res = {}
        for name in CASES:
            eng = TPEngine.load(os.path.join(folder, name + ".engine"), "cpu")
            eng.decoder.pred.trace = []
            logits = eng.logits(torch.tensor(IDS))
            trace = eng.decoder.pred.trace
            eng.decoder.pred.trace = None
            tokens = eng.generate([PROMPT], 16, stop_at_eos=False)[0]
            # different seeds per rank: the broadcast of rank 0's tokens must make them agree
            sampled = eng.generate([PROMPT], 8, temperature=1.0, seed=100 + rank, stop_at_eos=False)[0]
            res[name] = {"logits": logits, "trace": trace, "tokens": tokens, "sampled": sampled,
                         "describe": eng.describe()}
        try:  # the Triton launchers on shard shapes, residual unfused, through the interpreter
            import triton  # noqa: F401
            eng = TPEngine.load(os.path.join(folder, "sparse.engine"), "cpu", backend="triton")
            res["triton"] = {"kernels": eng.ops.kernels, "tokens": eng.generate([PROMPT], 4, stop_at_eos=False)[0]}
        except ImportError:
            res["triton"] = None
        torch.save(res, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


class ShardMasked(MaskedDense):
    """Masked dense with the per-shard selection: top-k_r of each rank's block of scores."""

    def _select(self, l, kind):
        j = l - self.lookahead
        x = self.src[(self.source, j)] if j >= 0 else self.src[("attn_in", 0)]  # [B, S, D]
        p = f"layers.{l}.pred_{kind}."
        scores = (x @ self.t[p + "a"].T) @ self.t[p + "b"].T + self.t[p + "bias"]  # [B, S, N]
        N = scores.shape[-1]
        k = k_per_rank((self.mlp_k if kind == "mlp" else self.attn_k)[l], N, TP)
        blocks = scores.view(*scores.shape[:-1], TP, N // TP).topk(k, dim=-1).indices
        idx = (blocks + torch.arange(TP)[:, None] * (N // TP)).flatten(-2)  # [B, S, TP*k]
        self.selections.append((l, kind, idx.sort(-1).values.reshape(-1, TP * k)))
        return torch.zeros_like(scores).scatter_(-1, idx, 1.0)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    refs = {}
    for name, (dm, da) in CASES.items():
        model = tiny_model(seed=7)
        header, tensors = engine_from_dense(model, dm, da, "attn_in", 1)
        _, files = write_shards(folder / f"{name}.engine", header, tensors, TP)
        assert files == [str(folder / f"{name}.rank{r}-of-{TP}.engine") for r in range(TP)]
        refs[name] = (model, header, tensors)
    mp.spawn(_worker, args=(free_port(), str(folder)), nprocs=TP, join=True)
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(TP)]
    return refs, ranks, folder


def test_density_one_tp_equals_single_rank(tp_run):
    refs, ranks, _ = tp_run
    model, header, tensors = refs["dense"]
    eng = Engine.from_tensors(header, tensors, "cpu")
    want = eng.logits(torch.tensor(IDS))
    want_tokens = eng.generate([PROMPT], 16, stop_at_eos=False)[0]
    for r in ranks:
        torch.testing.assert_close(r["dense"]["logits"], want, atol=1e-5, rtol=1e-5)
        assert r["dense"]["tokens"] == want_tokens
        assert r["dense"]["trace"] == []  # K = N on every shard: no predictor runs
    assert ranks[0]["dense"]["describe"]["heads"] == 2 and ranks[1]["dense"]["describe"]["ffn"] == 32


def test_sparse_tp_equals_per_shard_masked_dense(tp_run):
    refs, ranks, _ = tp_run
    model, header, tensors = refs["sparse"]
    ref = ShardMasked(model, header, tensors)
    want = ref.logits(torch.tensor(IDS))
    for r in ranks:
        torch.testing.assert_close(r["sparse"]["logits"], want, atol=1e-5, rtol=1e-5)
    # every rank picks k_r = ceil(K/tp) rows inside its own shard; their union is the reference's
    bc = header["build_config"]
    per = {}
    for rank, r in enumerate(ranks):
        for l, kind, idx in r["sparse"]["trace"]:
            n = (64 if kind == "mlp" else 4) // TP
            k = k_per_rank((bc["mlp_k"] if kind == "mlp" else bc["attn_k"])[l], n * TP, TP)
            assert idx.shape[-1] == k and int(idx.min()) >= 0 and int(idx.max()) < n
            per.setdefault((l, kind), []).append(idx.long() + rank * n)
    want_sel = {(l, kind): idx for l, kind, idx in ref.selections}
    assert per.keys() == want_sel.keys()
    for key, parts in per.items():
        assert torch.equal(torch.cat(parts, -1).sort(-1).values, want_sel[key]), key
    # greedy decode (sparse steps, deferred K/V) equals the masked-dense reference token for token
    assert ranks[0]["sparse"]["tokens"] == ranks[1]["sparse"]["tokens"] == ref.generate(PROMPT, 16)


def test_sampling_agrees_across_ranks(tp_run):
    _, ranks, _ = tp_run
    for name in CASES:
        assert ranks[0][name]["sampled"] == ranks[1][name]["sampled"]


def test_shard_files_verify_and_refuse_single_rank_load(tp_run):
    _, _, folder = tp_run
    path = shard_path(folder / "sparse.engine", 1, TP)
    header, tensors = read_engine(path)
    assert header["build_config"]["tp"]["rank"] == 1 and tensors["layers.0.attn.wq"].shape == (16, 32)
    assert torch.count_nonzero(tensors["layers.0.mlp.b2"]) == 0  # bias only on rank 0
    with pytest.raises(DejavuError, match="tensor-parallel shard 1 of 2"):
        Engine.load(path)


def test_shard_errors_and_names():
    model = tiny_model(seed=1)
    header, tensors = engine_from_dense(model, 0.5, 0.5)
    with pytest.raises(DejavuError, match=r"--tp 3 must divide num_attention_heads \(4\)"):
        shard_engine(header, tensors, 3)
    header66, tensors66 = engine_from_dense(tiny_model(seed=1, ffn_dim=66), 0.5, 0.5)
    with pytest.raises(DejavuError, match=r"ffn_dim \(66\)"):
        shard_engine(header66, tensors66, 4)
    with pytest.raises(DejavuError, match="already a tensor-parallel shard"):
        shard_engine(*shard_engine(header, tensors, 2)[0], 2)
    assert shard_engine(header, tensors, 1)[0][1] is tensors
    assert shard_path("out/m.engine", 1, 4) == os.path.join("out", "m.rank1-of-4.engine")
    assert shard_path("m-{rank}-{size}.bin", 0, 2) == "m-0-2.bin"


def test_torchrun_entry_point(tmp_path):
    """`torchrun -m dejavu.runtime.tp OUT.engine --prompt TEXT`: rank 0 prints the text once,
    and it equals the single-rank engine's completion."""
    import subprocess
    import sys

    from runtime_helpers import tiny_tokenizer_json

    tj = tiny_tokenizer_json(300)
    # density 1.0: the per-shard selection equals the single-rank one only there
    header, tensors = engine_from_dense(tiny_model(seed=2, vocab_size=300), 1.0, 1.0, tokenizer_json=tj)
    write_shards(tmp_path / "m.engine", header, tensors, TP)
    prompt = "The tower is"
    want = prompt + Engine.from_tensors(header, tensors, "cpu").complete([prompt], 8)[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(TP), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "dejavu.runtime.tp",
           str(tmp_path / "m.engine"), "--prompt", prompt, "--max-new-tokens", "8"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == want.strip()



def test_tp_triton_backend_in_interpreter(tp_run):
    """Triton launchers on shard shapes (2 heads, 32 neurons) with the residual unfused, in
    Triton's interpreter: same greedy tokens as the reference backend, every kernel (attention
    included: its launchers take H*hd < D rows on a shard) passing the activation check."""
    _, ranks, _ = tp_run
    if ranks[0]["triton"] is None:
        pytest.skip("triton not installed")
    for r in ranks:
        k = r["triton"]["kernels"]
        assert set(k.values()) == {"triton"}, k
        assert r["triton"]["tokens"] == r["sparse"]["tokens"][:4]

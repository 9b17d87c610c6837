"""Tensor-parallel Llama engines on CPU: `dejavu-compile --tp 2` of a tiny GQA Llama (6 query / 2 KV heads; with
attention_bias and mlp_bias, so the biases' split and their adds after the all-reduce are in it too), the shards run
by 2 gloo processes (mp.spawn) through `TPEngine.load`, against the single-rank engine of the same build."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.tensor_parallel import shard_engine
from dejavu.engine_file import read_engine
from dejavu.errors import DejavuError
from dejavu.runtime import Engine
from llama_helpers import write_tiny_llama
from runtime_helpers import free_port, join_gloo

TP = 2
PROMPTS = [[0, 9, 4, 200, 17], [7, 1, 3]]
IDS = torch.randint(0, 320, (2, 14), generator=torch.Generator().manual_seed(3))
CALIB = dict(calib_tokens=512, calib_window=128, dtype="float32")


def _worker(rank: int, port: int, folder: str) -> None:
    join_gloo(rank, port, TP)
    from dejavu.runtime.tp import TPEngine

    try:
        eng = TPEngine.load(os.path.join(folder, "tp.engine"), "cpu")
        res = {"class": type(eng).__name__, "describe": eng.describe(), "logits": eng.logits(IDS),
               "decode": eng.decode_logits(IDS), "tokens": eng.generate(PROMPTS, 10, stop_at_eos=False),
               "sampled": eng.generate(PROMPTS[:1], 8, temperature=1.0, seed=100 + rank, stop_at_eos=False)[0]}
        try:  # the Triton launchers on the shard's shapes, through the interpreter
            import triton  # noqa: F401
            tri = TPEngine.load(os.path.join(folder, "tp.engine"), "cpu", backend="triton")
            res["triton"] = tri.generate(PROMPTS, 4, stop_at_eos=False)
        except ImportError:
            res["triton"] = None
        torch.save(res, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_tp")
    model = write_tiny_llama(folder / "m", seed=3, attention_bias=True, mlp_bias=True)
    build_engine(model, BuildConfig(density=0.6, **CALIB), folder / "one.engine", progress=False)
    build_engine(model, BuildConfig(density=0.6, tp=TP, **CALIB), folder / "tp.engine", progress=False)
    mp.spawn(_worker, args=(free_port(), str(folder)), nprocs=TP, join=True)
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(TP)]
    return folder, ranks


def test_tp_ranks_compute_the_single_engine(tp_run):
    """Logits token-parallel and through the decode steps, and greedy generation (prefill, then sparse decode
    steps), on every rank equal the single-rank engine's: o's and down's thresholded inputs are each rank's own
    heads' and neurons' (the union is the whole model's), q/k/v's and gate/up's the replicated hidden state."""
    folder, ranks = tp_run
    one = Engine.load(folder / "one.engine")
    want = {"logits": one.logits(IDS), "decode": one.decode_logits(IDS)}
    tokens = one.generate(PROMPTS, 10, stop_at_eos=False)
    for r in ranks:
        assert r["class"] == "LlamaTPEngine" and r["describe"]["heads"] == 3 and r["describe"]["kv_heads"] == 1
        for k in want:
            torch.testing.assert_close(r[k], want[k], atol=1e-4, rtol=1e-4)
        assert r["tokens"] == tokens
    assert ranks[0]["sampled"] == ranks[1]["sampled"]  # rank 0's samples on both ranks (seeds differ)
    if ranks[0]["triton"] is not None:
        assert ranks[0]["triton"] == ranks[1]["triton"] == one.generate(PROMPTS, 4, stop_at_eos=False)


def test_llama_shards_split_heads_and_neurons(tp_run):
    """The shard files: each rank's q/k/v columns are its heads' (q, then k, then v), o's rows its query heads',
    gate/up's columns its neurons' (gate, then up), down's rows its neurons'; the rest replicated. A tp that does
    not divide the KV heads is one error."""
    folder, _ = tp_run
    h, t = read_engine(folder / "one.engine")
    hd, F = 8, 80
    for r in range(TP):
        hr, tr = read_engine(folder / f"tp.rank{r}-of-{TP}.engine")
        assert hr["build_config"]["tp"]["rank"] == r and hr["sparsity"] == h["sparsity"]
        q = slice(r * 3 * hd, (r + 1) * 3 * hd)
        w = t["layers.1.attn.wqkv_t"]
        want = torch.cat([w[:, q], w[:, 48 + r * hd:48 + (r + 1) * hd], w[:, 64 + r * hd:64 + (r + 1) * hd]], 1)
        assert torch.equal(tr["layers.1.attn.wqkv_t"], want)
        assert torch.equal(tr["layers.1.attn.wo_t"], t["layers.1.attn.wo_t"][q])
        f = slice(r * F // 2, (r + 1) * F // 2)
        gu = t["layers.0.mlp.wgu_t"]
        assert torch.equal(tr["layers.0.mlp.wgu_t"], torch.cat([gu[:, :F][:, f], gu[:, F:][:, f]], 1))
        assert torch.equal(tr["layers.0.mlp.wd_t"], t["layers.0.mlp.wd_t"][f])
        assert torch.equal(tr["embed_tokens"], t["embed_tokens"]) and torch.equal(tr["final_norm"], t["final_norm"])
    with pytest.raises(DejavuError, match=r"--tp 4 must divide num_key_value_heads \(2\)"):
        shard_engine(h, t, 4)


def test_a_llama_shard_is_not_a_model(tp_run):
    """A shard file loaded as a single engine is one error, as an OPT shard is (one rank's heads and neurons are
    not the model); `dejavu-run` says so in one line."""
    from dejavu.runtime.cli import main as run_main

    folder, _ = tp_run
    with pytest.raises(DejavuError, match="tensor-parallel shard 1 of 2: run it with dejavu.runtime.tp"):
        Engine.load(folder / f"tp.rank1-of-{TP}.engine")
    with pytest.raises(SystemExit) as e:
        run_main([str(folder / f"tp.rank0-of-{TP}.engine"), "--prompt", "a"])
    assert e.value.code == 2

"""Tensor-parallel end-to-end decode latency: dense TP vs dejavu TP (issue 8). NOT YET RUN ON GPUs.

Skeleton for one multi-GPU host (not yet run on one; docs/tensor_parallel.md):

    source benchmarks/device_env.sh
    export NCCL_NVLS_ENABLE=0          # NVLink multicast off (NCCL's NVLS)
    torchrun --nproc-per-node 8 benchmarks/e2e_tp.py --model opt-175b      # 8 GPUs
    torchrun --nproc-per-node 4 benchmarks/e2e_tp.py --model opt-66b       # 4 GPUs

Each rank builds only its own shard in memory (random weights and random predictors of the
real shapes; the full OPT-175B would not fit one GPU), with the split of
compiler/tensor_parallel.py, and runs `dejavu.runtime.tp.TPEngine` (NCCL, no CUDA graphs).
Rows: dense TP (K = N) and dejavu TP at --densities (default 0.3), batch 1, prompt 128,
--new-tokens decode steps; ms per step measured on every rank, rank 0 writes the JSON
(`$OUT/e2e_tp.json` or --out). Paper anchor: 15.9 ms/token OPT-175B on 8xA100 vs 40.5 for
FasterTransformer. The only run so far is the CPU dry run on a tiny shape:

    DEJAVU_E2E_DEVICE=cpu torchrun --nproc-per-node 2 benchmarks/e2e_tp.py --model tiny --new-tokens 8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import COMMON, TINY, default_ranks, header_for  # noqa: E402

DEV = os.environ.get("DEJAVU_E2E_DEVICE", "cuda")
SHAPES = {  # facebook/opt-66b, opt-175b (the 175B config as in the OPT paper / metaseq)
    "opt-66b": dict(vocab_size=50272, hidden_size=9216, num_hidden_layers=64, num_attention_heads=72,
                    ffn_dim=36864, max_position_embeddings=2048, word_embed_proj_dim=9216),
    "opt-175b": dict(vocab_size=50272, hidden_size=12288, num_hidden_layers=96, num_attention_heads=96,
                     ffn_dim=49152, max_position_embeddings=2048, word_embed_proj_dim=12288),
    "tiny": TINY,
}


def shard_tensors(c: dict, tp: int, rank: int, dtype, device, ranks) -> dict:
    """This rank's kernel-layout shard, random (replicated tensors use the same seed on every rank)."""
    D, F, H, L, V = (c[k] for k in ("hidden_size", "ffn_dim", "num_attention_heads", "num_hidden_layers",
                                    "vocab_size"))
    Dq, Fr, Hr = D // tp, F // tp, H // tp
    g_rep = torch.Generator(device=device).manual_seed(0)
    g_own = torch.Generator(device=device).manual_seed(1000 + rank)

    def w(*shape, std=0.02, g=g_own):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    def rep(*shape, std=0.02):
        return w(*shape, std=std, g=g_rep)

    t = {"embed_tokens": rep(V, D), "embed_positions": rep(c["max_position_embeddings"] + 2, D),
         "final_ln.weight": 1.0 + rep(D, std=0.05), "final_ln.bias": rep(D)}
    for l in range(L):
        p = f"layers.{l}."
        t.update({p + "ln_attn.weight": 1.0 + rep(D, std=0.05), p + "ln_attn.bias": rep(D),
                  p + "ln_mlp.weight": 1.0 + rep(D, std=0.05), p + "ln_mlp.bias": rep(D),
                  p + "attn.wq": w(Dq, D, std=0.02 * (D // H) ** -0.5), p + "attn.bq": w(Dq),
                  p + "attn.wkv": w(2 * Dq, D), p + "attn.bkv": w(2 * Dq), p + "attn.wo_t": w(Dq, D),
                  p + "attn.bo": w(D) if rank == 0 else torch.zeros(D, dtype=dtype, device=device),
                  p + "mlp.w1": w(Fr, D), p + "mlp.b1": w(Fr), p + "mlp.w2_t": w(Fr, D),
                  p + "mlp.b2": w(D) if rank == 0 else torch.zeros(D, dtype=dtype, device=device)})
        for kind, n, r in (("pred_mlp", Fr, ranks[0]), ("pred_attn", Hr, ranks[1])):
            t.update({p + kind + ".a": rep(r, D, std=D ** -0.5), p + kind + ".b": w(n, r, std=r ** -0.5),
                      p + kind + ".bias": w(n, std=0.1)})
    return t


def shard_header(c: dict, density: float | None, dtype_name: str, ranks, tp: int, rank: int) -> dict:
    from dejavu.compiler.tensor_parallel import k_per_rank

    h = header_for(c, density, dtype_name, ranks, "float")  # shard_tensors' predictors are float
    bc, F, H = h["build_config"], c["ffn_dim"], c["num_attention_heads"]
    bc["tp"] = {"size": tp, "rank": rank, "num_heads": H // tp, "ffn_dim": F // tp,
                "k_per_rank": {"mlp": [k_per_rank(k, F, tp) for k in bc["mlp_k"]],
                               "attn": [k_per_rank(k, H, tp) for k in bc["attn_k"]]}}
    h["target"]["device"] = DEV
    return h


def time_tp(eng, c: dict, B: int, P: int, N: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, c["vocab_size"], (B, P), generator=g).tolist()
    eng.generate(prompts, 4, stop_at_eos=False)  # warm-up (kernels compile, NCCL communicators)
    eng.generate(prompts, N, stop_at_eos=False)
    st = eng.stats
    return {"ms_per_step": st.ms_per_token, "prefill_ms": 1e3 * st.prefill_s, "steps": st.decode_steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="opt-175b", choices=sorted(SHAPES))
    p.add_argument("--densities", default="0.3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float16" if DEV == "cuda" else "float32")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e_tp.json"))
    a = p.parse_args(argv)
    from dejavu.fileio import write_json
    from dejavu.runtime.tp import TPEngine, init_distributed

    if DEV == "cuda" and os.environ.get("NCCL_NVLS_ENABLE") != "0":
        raise SystemExit("set NCCL_NVLS_ENABLE=0 (NVLink multicast stays off for this benchmark)")
    init_distributed(DEV)
    rank, tp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if DEV == "cuda" else torch.device("cpu")
    if DEV == "cuda":
        torch.cuda.set_device(device)
    c = SHAPES[a.model]
    ranks, _ = default_ranks(c, predictor_dtype="float")
    dtype = getattr(torch, a.dtype)
    results = []
    for density in [None] + [float(d) for d in a.densities.split(",")]:
        t0 = time.perf_counter()
        tensors = shard_tensors(c, tp, rank, dtype, device, ranks)
        eng = TPEngine(shard_header(c, density, a.dtype, ranks, tp, rank), tensors, device)
        row = {"system": "dense_tp" if density is None else f"dejavu_tp_{density}", "setup_s": time.perf_counter() - t0,
               **time_tp(eng, c, a.batch, a.prompt, a.new_tokens)}
        per_rank = [None] * tp
        dist.all_gather_object(per_rank, row["ms_per_step"])
        row["ms_per_step_ranks"] = per_rank
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del eng, tensors
        if DEV == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        meta = {"model": a.model, "shape": {**COMMON, **c}, "tp": tp, "batch": a.batch, "prompt": a.prompt,
                "device": DEV, "dtype": a.dtype, "predictor_ranks": ranks,
                "gpu": torch.cuda.get_device_name() if DEV == "cuda" else None,
                "note": "random weights and predictors; per-shard top-k (docs/tensor_parallel.md)"}
        write_json(a.out, {"meta": meta, "results": results}, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writing a Llama engine's tensor-parallel shards: one pass for every rank against one rank at a time.

    python benchmarks/write_shards.py --hidden 2048 --ffn 5632 --layers 8 --heads 16 --kv-heads 4 --tp 4 \\
        --out benchmarks/results/write_shards_2026-12-07.json

A random-weight Llama of the given shape (models/llama.py) is laid out as the build lays it out
(`build_llama.llama_parts`: each kernel-layout tensor made from the model's weights when the writer reaches
it) and written as --tp shards twice, into a temporary folder beside --out:

- `one_pass`: `compiler/tensor_parallel.write_shards` (since 462e45b): the ranks' files side by side, each tensor
  laid out once and its slices written to every rank's file;
- `per_rank`: the form before it, kept here as the baseline: each rank's file written in turn, every tensor laid
  out again for each rank.

Both write the same bytes (asserted). Records wall seconds, bytes written and how many times the tensors were
laid out. CPU only; the figures are of this machine's disk and page cache.
"""
from __future__ import annotations

import argparse
import hashlib
import platform
import tempfile
import time
from pathlib import Path

import torch

from dejavu.compiler.build_llama import llama_parts
from dejavu.compiler.tensor_parallel import _split_rule, _whole, write_shards
from dejavu.engine_file import TensorPart, write_engine_parts
from dejavu.fileio import write_json
from dejavu.models.llama import LlamaConfig, LlamaForCausalLM
from dejavu.provenance import tree_commit
from dejavu.shards import shard_path


def per_rank(out, header: dict, parts: dict, tp: int) -> int:
    """The writer before 462e45b: each rank's file in turn, every part read (laid out) once per rank."""
    headers, split = _split_rule(header, tp)
    total = 0
    for r, hr in enumerate(headers):
        rank_parts = {}
        for name, p in parts.items():
            shape = split(name, torch.empty(p.shape, dtype=p.dtype, device="meta"), r).shape
            rank_parts[name] = TensorPart(p.dtype, shape, lambda n=name, p=p, r=r: TensorPart.of(
                n, split(n, _whole(p), r).contiguous()).chunks())
        total += write_engine_parts(shard_path(out, r, tp), hr, rank_parts)
    return total


def counted(parts: dict, count: list) -> dict:
    def wrap(p):
        def chunks():
            count[0] += 1
            return p.chunks()
        return TensorPart(p.dtype, p.shape, chunks)
    return {n: wrap(p) for n, p in parts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="each form's writes, alternating; the best is kept")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    cfg = LlamaConfig.from_hf_dict(dict(
        model_type="llama", hidden_act="silu", hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        vocab_size=a.vocab, max_position_embeddings=2048, rms_norm_eps=1e-5))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    header = {"model_family": "llama", "model_config": cfg.to_hf_dict(), "build_config": {},
              "target": {"device": "cpu", "arch": None, "kernel_settings": {}}}
    n_tensors = len(llama_parts(model, torch.float16))
    forms = {"one_pass": lambda out, parts: write_shards(out, header, parts, a.tp)[0],
             "per_rank": lambda out, parts: per_rank(out, header, parts, a.tp)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows = {k: {"seconds": []} for k in forms}
    files = {}
    with tempfile.TemporaryDirectory(dir=a.out.parent) as tmp:
        for rep in range(a.repeats):
            for name, write in forms.items():
                out = Path(tmp) / name / "m.engine"
                out.parent.mkdir(exist_ok=True)
                count = [0]
                t0 = time.perf_counter()
                size = write(out, counted(llama_parts(model, torch.float16), count))
                rows[name]["seconds"].append(round(time.perf_counter() - t0, 3))
                rows[name].update(bytes=size, layouts=count[0], layouts_per_tensor=count[0] / n_tensors)
                files[name] = [hashlib.sha256(Path(shard_path(out, r, a.tp)).read_bytes()).hexdigest() for r in range(a.tp)]
                print(f"{name:9} {rows[name]['seconds'][-1]:7.2f} s  {size / 1e9:.2f} GB  "
                      f"{count[0] / n_tensors:.0f} layouts a tensor", flush=True)
        assert files["one_pass"] == files["per_rank"], "the two forms wrote different shards"
    for r in rows.values():
        r["best_s"] = min(r["seconds"])
    result = {"meta": {"argv": vars(a) | {"out": str(a.out)}, "commit": tree_commit(), "torch": torch.__version__,
                       "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
                       "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())},
              "tensors": n_tensors, "same_bytes": True, "forms": rows}
    write_json(a.out, result)
    print(f"one pass {rows['one_pass']['best_s']:.2f} s vs per rank {rows['per_rank']['best_s']:.2f} s "
          f"({rows['per_rank']['best_s'] / rows['one_pass']['best_s']:.2f}x); wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak host memory and time of the build's sensitivity pass, in one pass or in passes.

    python benchmarks/sensitivity_memory.py MODEL [--memory-gib G] [--heldout-tokens N] [--out F.json]

MODEL: a checkpoint folder or preset (opt-mini). The layers are streamed from the checkpoint in
fp32 on the CPU as the build streams them (`build._streamed_parts`), with random predictors of the
build's ranks (the pass's memory does not depend on what they predict), on the build's first
held-out set and its candidate K, bfloat16 autocast (the default `--sensitivity-dtype`).
Without --memory-gib: `allocate.measure_sensitivity`, one pass (the call that trees before the
passes made). With it: `allocate.measure_sensitivity_passes` within that many GiB of branch states.
Prints peak resident memory (VmHWM), seconds, passes and a hash of the measured table (equal
tables: equal hashes).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch


def main() -> None:
    from dejavu.compiler import allocate
    from dejavu.compiler.build import _predictor_settings, _streamed_parts
    from dejavu.compiler.config import BuildConfig
    from dejavu.compiler.predictors import Predictors, default_ranks, mlp_ranks
    from dejavu.compiler.stream import rss_peak_bytes
    from dejavu.models.loader import Checkpoint, load_tokenizer
    from dejavu.models.presets import resolve

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--memory-gib", type=float, default=None, help="bound on the branch states (default: one pass)")
    ap.add_argument("--heldout-tokens", type=int, default=BuildConfig.heldout_tokens)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    folder = resolve(args.model)
    ckpt, tok = Checkpoint(folder), load_tokenizer(folder)
    cfg = ckpt.cfg
    config = BuildConfig(density=0.5, heldout_tokens=args.heldout_tokens)
    ps = _predictor_settings(config)
    g = torch.Generator().manual_seed(0)
    D, F, H = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads
    sd = {}
    for l, rm in enumerate(mlp_ranks(cfg, ps)):
        for kind, n, r in (("pred_mlp", F, rm), ("pred_attn", H, default_ranks(cfg, ps)[1])):
            sd.update({f"layers.{l}.{kind}.a": torch.randn(r, D, generator=g) / D ** 0.5,
                       f"layers.{l}.{kind}.b": torch.randn(n, r, generator=g) / r ** 0.5,
                       f"layers.{l}.{kind}.bias": torch.zeros(n)})
    preds = Predictors.from_state_dict(sd, config.predictor_input)
    corpus, skip = allocate.heldout_source(config)
    window = min(config.calib_window, cfg.max_position_embeddings)
    ids, source = allocate.heldout_windows(tok, corpus, skip, config.heldout_tokens, window, cfg.bos_token_id)
    ks = {kind: allocate.candidate_ks(n) for kind, n in (("mlp", F), ("attn", H))}
    streamed = _streamed_parts(ckpt, "cpu")
    calls = []

    def parts():
        calls.append(1)
        return streamed()

    t0, rss0 = time.perf_counter(), rss_peak_bytes()
    if args.memory_gib is None:
        sens = allocate.measure_sensitivity(*parts(), ids, preds, ks, dtype=config.sensitivity_dtype)
    else:
        sens = allocate.measure_sensitivity_passes(parts, ids, preds, ks, int(args.memory_gib * 2 ** 30),
                                                   dtype=config.sensitivity_dtype)
    row = {"model": args.model, "memory_gib": args.memory_gib, "heldout": source,
           "branches": cfg.num_hidden_layers * sum(map(len, ks.values())),
           "state_bytes": int(ids.numel() * D * 4), "passes": len(calls),
           "seconds": round(time.perf_counter() - t0, 1), "peak_host_bytes_before": rss0,
           "peak_host_bytes": rss_peak_bytes(),
           "table_sha256": hashlib.sha256(json.dumps(sens.to_dict(), sort_keys=True).encode()).hexdigest()[:16]}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

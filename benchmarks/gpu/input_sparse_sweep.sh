#!/usr/bin/env bash
# The input-sparse GEMV's settings per projection shape (benchmarks/input_sparse_sweep.py), under 4 minutes:
# Llama-3-8B and one Llama-3-70B TP-8 rank, batch 1, half the inputs kept; select + GEMV + sum of each
# projection kind (q/k/v, o, gate/up, down) as LlamaOps launches them, a CUDA graph over weight copies that
# L2 cannot hold, each configuration checked against PyTorch before it is timed; coordinate descent from the
# defaults (each kind's, input_sparse.projections applied) over block_m x block_k, num_warps, min_split_inputs,
# target_programs, no measurement started after 160 s. JSON to $OUT, the best per shape on stdout.
#   bash benchmarks/gpu/input_sparse_sweep.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
exec timeout 225 python3 benchmarks/input_sparse_sweep.py --budget-s 160 \
    --out "$OUT/input-sparse-sweep-$(date -u +%F).json"

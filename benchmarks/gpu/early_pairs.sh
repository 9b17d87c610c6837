#!/usr/bin/env bash
# The input-sparse GEMV's first pairs loaded beside their count (InputSparseSettings.early_pairs) against after it:
# Llama-3-8B and the 70B TP-8 rank, random weights, batch 1, TEAL 50% skipped: the dense graph, the defaults, early
# pairs, the defaults again (smoke check first, every form). Under 4.5 minutes.
#   bash benchmarks/gpu/early_pairs.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
exec timeout 270 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 0 \
    --kernel-variants '[{"early_pairs": true}, {}]' --out "$OUT/e2e-llama-early-pairs-$(date -u +%F).json"

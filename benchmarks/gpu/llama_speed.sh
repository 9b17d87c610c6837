#!/usr/bin/env bash
# GPU-measurements run 8: Llama-family decode with TEAL input sparsity. Llama-3-8B and one rank of
# Llama-3-70B under 8-way tensor parallelism (random weights, batch 1): our dense CUDA graph and TEAL at
# 50% of every projection input skipped (default blocks), then a sweep of the input-sparse kernel's
# blocks at 50% (benchmarks/e2e_llama.py VARIANTS), and a torch.profiler timeline of one decode layer
# for the dense graph and TEAL 50% (kernels, launches and GPU time per step); a kernels-vs-reference
# and graph-vs-eager smoke check first. HF eager and the 25% / 40% levels were measured on 2026-12-05
# (docs/llama.md) and are left out to stay under 10 minutes.
# Target: >= 1.8x our dense graph at 50% skipped, within 1.3x of the bandwidth floor.
#   bash benchmarks/gpu/llama_speed.sh
#   bash benchmarks/gpu/llama_speed.sh ab    # Llama-3-8B only: the sliced form (default) against the list
#                                            # form (sliced off), both profiled; under 4 minutes
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
if [ "${1:-}" = ab ]; then
    exec timeout 220 python3 benchmarks/e2e_llama.py --models llama-3-8b --skips 0.5 --no-hf --profile-steps 20 \
        --kernel-variants '[{"sliced": false}]' --profile-variants --out "$OUT/e2e-llama-ab-$(date -u +%F).json"
fi
timeout 580 python3 benchmarks/e2e_llama.py --skips 0.5 --no-hf --profile-steps 20 \
    --out "$OUT/e2e-llama-$(date -u +%F).json"

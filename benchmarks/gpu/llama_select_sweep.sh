#!/usr/bin/env bash
# The input-sparse kernels' launch shapes with the fp32 residual stream (the default since 2026-12-06): the selects'
# warps (4 / 16 against 8), the GEMV's programs (792: 6 per SM, against 528) and longer splits (min_split_inputs
# 512 against 256), both Llama shapes at 50% skipped, each profiled, after the smoke check; under 5 minutes.
#   bash benchmarks/gpu/llama_select_sweep.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
exec timeout 330 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants '[{"select_warps": 4}, {"select_warps": 16}, {"target_programs": 792}, {"min_split_inputs": 512}]' \
    --out "$OUT/e2e-llama-select-$(date -u +%F).json"

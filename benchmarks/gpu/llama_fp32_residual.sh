#!/usr/bin/env bash
# o's and down's GEMV adding into an fp32 residual stream with atomics (InputSparseSettings.fp32_residual, the
# default since 2026-12-06: no split-K sum launch for them, 2 launches a layer fewer) against the fp16 stream with
# their sum launches (fp32_residual off, the bit-reproducible form): both Llama shapes at 50% skipped, the dense
# graph, the defaults and the variant, each profiled, after the smoke check (kernels vs reference, graph vs eager,
# greedy vs reference on a tiny fp32 model, both forms); under 3 minutes.
#   bash benchmarks/gpu/llama_fp32_residual.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
exec timeout 200 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants '[{"fp32_residual": false}]' --out "$OUT/e2e-llama-fp32res-$(date -u +%F).json"

#!/usr/bin/env bash
# transformers' static cache with the one-token forward under torch.compile (inductor, reduce-overhead), beside
# Hugging Face eager, our dense CUDA graph and TEAL 50%, on the Llama-3-8B shape (random weights, batch 1).
# Under 9 minutes (the compile takes one to three).
#   bash benchmarks/gpu/llama_hf_compile.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
D=$(date -u +%F)
nvidia-smi --query-gpu=name --format=csv,noheader
exec timeout 540 python3 benchmarks/e2e_llama.py --models llama-3-8b --skips 0.5 --no-smoke --profile-steps 0 \
    --kernel-variants '[]' --hf-compile --out "$OUT/e2e-llama-hf-compile-$D.json"

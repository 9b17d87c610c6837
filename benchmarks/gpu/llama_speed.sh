#!/usr/bin/env bash
# GPU-measurements run 8: Llama-family decode with TEAL input sparsity. Llama-3-8B and one rank of
# Llama-3-70B under 8-way tensor parallelism (random weights, batch 1), 25/40/50% of every projection
# input skipped, against our dense CUDA graph and Hugging Face eager; a kernels-vs-reference smoke
# check first. Target: >= 1.8x our dense graph at 50% skipped, within 1.3x of the bandwidth floor.
#   bash benchmarks/gpu/llama_speed.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
timeout 580 python3 benchmarks/e2e_llama.py --out "$OUT/e2e-llama-$(date -u +%F).json"

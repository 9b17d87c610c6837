#!/usr/bin/env bash
# GPU-measurements run 1: quality through the Triton kernels (CUDA graph, side-stream predictors) against
# the CPU reference on the same engines. opt-mini engines are built on the GPU machine's CPU with
# dejavu-compile's defaults; perplexity over the first 8,192 WikiText-2 test tokens and the shipped
# tasks (first LIMIT examples each), per-example task agreement with the CPU `parallel` run (the CPU
# reference runs first, so a time limit leaves comparable rows).
# Target: perplexity within 0.2% of the CPU figure, task predictions equal on >= 99% of examples.
#   bash benchmarks/gpu/quality.sh [ENGINES] [LIMIT]     (one device command, < 10 min)
#   CPU_PATHS=parallel,generate bash benchmarks/gpu/quality.sh d0.7 100   # also the CPU reference of `generate`
# ENGINES: quality_kernels.py --engines (dN = --density N; M/A = MLP/head densities). Engines already in
# $WORK (default build/quality) are used as they are.
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
ENGINES=${1:-d0.7,d0.5}
LIMIT=${2:-500}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.csv" || true
timeout 570 python3 benchmarks/quality_kernels.py --engines "$ENGINES" --devices cpu,cuda \
    --paths parallel,decode,generate --cpu-paths "${CPU_PATHS:-parallel}" --ppl-tokens 8192 --tasks all --limit "$LIMIT" \
    --work "${WORK:-build/quality}" --out "$OUT/quality-$(date -u +%F).json"

#!/usr/bin/env bash
# The SwiGLU MLP in one launch (input_sparse.fuse_mlp: gate/up over every kept input, the SwiGLU threshold, the kept
# neurons' down rows added into the fp32 stream) against the defaults' three launches (gate/up's partials, down's
# SwiGLU select, down), Llama-3-8B and the Llama-3-70B TP-8 rank at 50% skipped (random weights, batch 1), each
# profiled; neurons a program (mlp_block_i 16 / 32), gate/up's pairs a step (block_k 64 / 128); each variant runs
# only if the engine's load-time check of the fused kernel passes. First the MLP alone (probe_fused_mlp.py: each
# form's error and time in a CUDA graph, and a diagnosis). Under 9 minutes.
#   bash benchmarks/gpu/fused_mlp.sh
set -uo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/probe_fused_mlp.py --out "$OUT/probe-fused-mlp-$(date -u +%F).json" 2>&1 | tail -40
V='[{"fuse_mlp": true}, {"fuse_mlp": true, "mlp_block_i": 16}, {"fuse_mlp": true, "projections": []}]'
timeout 300 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants "$V" --budget-s 220 --out "$OUT/e2e-llama-fused-mlp-$(date -u +%F).json" 2>&1 | tail -30

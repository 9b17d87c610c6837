#!/usr/bin/env bash
# The SwiGLU MLP in one launch (input_sparse.fuse_mlp: gate/up over every kept input, the SwiGLU threshold, the kept
# neurons' down rows added into the fp32 stream) against the defaults' three launches (gate/up's partials, down's
# SwiGLU select, down), Llama-3-8B and the Llama-3-70B TP-8 rank at 50% skipped (random weights, batch 1), each
# profiled; neurons a program (mlp_block_i 16 / 32 / 64), gate/up's pairs a step (block_k 64 / 128), 8 warps,
# down's columns a step (128 / 256). Every variant passes the engine's load-time check of the fused kernel first.
# Under 6 minutes.
#   bash benchmarks/gpu/fused_mlp.sh
set -uo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
V='[{"fuse_mlp": true}, {"fuse_mlp": true, "mlp_block_i": 16}, {"fuse_mlp": true, "mlp_block_i": 64},
    {"fuse_mlp": true, "projections": []}, {"fuse_mlp": true, "projections": [], "mlp_block_i": 64},
    {"fuse_mlp": true, "projections": [["gate_up", "block_k", 64], ["gate_up", "num_warps", 8]]},
    {"fuse_mlp": true, "mlp_block_d": 128}]'
timeout 330 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants "$V" --budget-s 250 --out "$OUT/e2e-llama-fused-mlp-$(date -u +%F).json" 2>&1 | tail -30

#!/usr/bin/env bash
# The Llama figures on an H200: the defaults on both shapes at 50% skipped (dense graph, TEAL, each profiled,
# smoke check first), Llama-3-8B at a 3968-token prompt, and launch_chain.py (the ten-launch layer's bound there).
# On any GPU first: the GPU tests of the Llama build (an offloaded build against an on-device one). Under 6 minutes.
#   bash benchmarks/gpu/llama_h200.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
D=$(date -u +%F)
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:warnings tests/runtime/test_llama_runtime.py \
    -k "offloaded_build or half_checkpoint" 2>&1 | tail -2 || echo "llama_h200: the build tests failed"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "llama_h200: not an H200"; exit 0; }
timeout 150 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf \
    --profile-steps 20 --out "$OUT/e2e-llama-h200-$D.json" | tail -6 || echo "llama_h200: e2e_llama ended early"
timeout 60 python3 benchmarks/e2e_llama.py --models llama-3-8b --skips 0.5 --no-hf --prompt-len 3968 \
    --new-tokens 128 --no-smoke --out "$OUT/e2e-llama-h200-long-$D.json" | tail -3 || echo "llama_h200: long ended early"
exec timeout 60 python3 benchmarks/launch_chain.py --out "$OUT/launch-chain-$D.json" | tail -4

#!/usr/bin/env bash
# runtime/tune.py (dejavu-tune) on both Llama shapes at 50% skipped: the search from the defaults (each trial the
# whole decode step in a CUDA graph against the incumbent), then the tuned engine timed as generate runs it, then
# the defaults again; the dense graph first. On any GPU first: the GPU test of dejavu-tune; last, the Qwen2-7B and
# Qwen3-8B shapes at the defaults (dense graph, TEAL 50%). Under 8 minutes.
#   bash benchmarks/gpu/llama_tune.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
D=$(date -u +%F)
nvidia-smi --query-gpu=name --format=csv,noheader
TRITON_INTERPRET=0 timeout 80 python3 -m pytest -q -p no:warnings tests/runtime/test_tune.py -k gpu 2>&1 | tail -2 \
    || echo "llama_tune: the GPU test failed"
timeout 330 python3 benchmarks/e2e_llama.py --models llama-3-70b-tp8,llama-3-8b \
    --variant-models llama-3-70b-tp8,llama-3-8b --skips 0.5 --no-hf --no-smoke --profile-steps 0 --kernel-variants '[]' \
    --tune --tune-budget-s 120 --out "$OUT/e2e-llama-tune-$D.json" || echo "llama_tune: the tune run exited with $?"
exec timeout 100 python3 benchmarks/e2e_llama.py --models qwen2-7b,qwen3-8b --skips 0.5 --no-hf --no-smoke \
    --profile-steps 0 --kernel-variants '[]' --out "$OUT/e2e-qwen-$D.json"

#!/usr/bin/env bash
# The split-K sum folded into the TEAL GEMV (InputSparseSettings.fold_sum): the A/B at 50% skipped on both
# shapes (the dense graph, the defaults, fold_sum), each profiled, then its real-shape checks on the GPU
# (bit-equal to the sum launch over 20 CUDA-graph replays, float64 bounds); with `long`, then Llama-3-8B at a 3968-token
# prompt (the split attention kernel against SDPA over the whole cache, and fold_sum), under 6 minutes.
#   bash benchmarks/gpu/llama_fold.sh [long]
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
timeout 150 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants '[{"fold_sum": true}]' --out "$OUT/e2e-llama-fold-$(date -u +%F).json" | tail -12 || echo "llama_fold: e2e_llama ended early"
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x tests/plugins/test_plugin_real_shapes.py -k "sliced" 2>&1 | tail -5 || echo "llama_fold: real-shape checks failed"
[ "${1:-}" = long ] || exit 0
exec timeout 90 python3 benchmarks/e2e_llama.py --models llama-3-8b --skips 0.5 --no-hf --prompt-len 3968 \
    --new-tokens 128 --profile-steps 20 --profile-variants --no-smoke \
    --kernel-variants '[{"gqa_attn": {"kernel": false}}, {"fold_sum": true}]' \
    --out "$OUT/e2e-llama-long-$(date -u +%F).json" | tail -8

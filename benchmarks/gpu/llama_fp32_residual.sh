#!/usr/bin/env bash
# o's and down's GEMV adding into an fp32 residual stream with atomics (InputSparseSettings.fp32_residual, the
# default since 2026-12-06: no split-K sum launch for them, 2 launches a layer fewer) against the fp16 stream with
# their sum launches (fp32_residual off, the bit-reproducible form): both Llama shapes at 50% skipped, the dense
# graph, the defaults and the variant, each profiled, after the smoke check (kernels vs reference, graph vs eager,
# greedy vs reference on a tiny fp32 model, both forms); under 3 minutes. With `long`: then the real-shape GPU checks
# of the TEAL GEMV (the fp32 stream's included: graph replays against eager, float64 bounds) and Llama-3-8B at a
# 3968-token prompt (128 new tokens), both forms and SDPA; under 6 minutes in all.
#   bash benchmarks/gpu/llama_fp32_residual.sh [long]
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
timeout 200 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants '[{"fp32_residual": false}]' --out "$OUT/e2e-llama-fp32res-$(date -u +%F).json" | tail -12 \
    || echo "llama_fp32_residual: e2e_llama ended early"
[ "${1:-}" = long ] || exit 0
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x tests/plugins/test_plugin_real_shapes.py -k "sliced" 2>&1 | tail -5 \
    || echo "llama_fp32_residual: real-shape checks failed"
exec timeout 90 python3 benchmarks/e2e_llama.py --models llama-3-8b --skips 0.5 --no-hf --prompt-len 3968 \
    --new-tokens 128 --profile-steps 20 --profile-variants --no-smoke \
    --kernel-variants '[{"fp32_residual": false}, {"gqa_attn": {"kernel": false}}]' \
    --out "$OUT/e2e-llama-long-$(date -u +%F).json" | tail -8

#!/usr/bin/env bash
# The TEAL GEMV's first pairs loaded beside its split's count (input_sparse.early_pairs) against after it: both
# Llama shapes at 50% skipped, the dense graph, both forms profiled, after the smoke check; then the real-shape
# GPU checks of the sliced GEMV. Under 5 minutes.
#   bash benchmarks/gpu/early_pairs.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
timeout 200 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants '[{"early_pairs": false}]' --out "$OUT/e2e-llama-early-$(date -u +%F).json" | tail -9 \
    || echo "early_pairs: e2e_llama ended early"
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x tests/plugins/test_plugin_real_shapes.py -k "sliced" 2>&1 | tail -3

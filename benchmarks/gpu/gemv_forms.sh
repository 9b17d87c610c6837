#!/usr/bin/env bash
# The TEAL select + GEMV in the shipped form against column-panel weights and a select fused into the GEMV
# (benchmarks/gemv_forms.py: every Llama block shape of both models, RMSNorm inputs, half kept; under 4 minutes),
# then the decode step's defaults against the dense graph (llama_fp32_residual.sh; under 3 minutes).
#   bash benchmarks/gpu/gemv_forms.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
(cd benchmarks && timeout 240 python3 gemv_forms.py --out "$OUT/gemv-forms-$(date -u +%F).json") \
    || echo "gemv_forms: ended early"
OUT="$OUT" bash benchmarks/gpu/llama_fp32_residual.sh

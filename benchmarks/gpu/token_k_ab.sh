#!/usr/bin/env bash
# Per-token MLP K on vs off at the same K (benchmarks/token_k_ab.py): one layer's predictor + sparse MLP
# at batch 1 in a CUDA graph, OPT-30B and OPT-66B shapes, MLP densities 0.1 / 0.2 / 0.3 (random weights).
#   bash benchmarks/gpu/token_k_ab.sh
# Target: token_k (top-2K, mean K rows read) no slower than fixed K at every density; fixed_skip0 says
# what fc2 skipping ReLU zeros alone is worth.
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.csv" || true
for shape in opt-30b opt-66b; do
    timeout 240 python3 benchmarks/token_k_ab.py --shape "$shape" --out "$OUT/token_k_ab-$(date -u +%F)-$shape.json"
done

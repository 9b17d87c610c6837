#!/usr/bin/env bash
# Per-token MLP K on vs off at the same K, and where the difference goes:
# 1. benchmarks/token_k_ab.py: one layer's predictor + sparse MLP at batch 1 in a CUDA graph, OPT-30B and
#    OPT-66B shapes, MLP densities 0.1 / 0.2 / 0.3 (random weights): fixed K, and fc2 over h's nonzero rows
#    (compacted) for fixed K, the per-token K (top-2K, mean K rows kept) and the per-token K fitted to rows read
#    (token_k_read: mean kept + nonzero rows = 2K, --token-k-rows read), and each part alone (top-k at K / 2K / 2K
#    with the kept count, the torch form of the rule, fc1 and fc2 over K rows vs stopping at the kept count).
# 2. benchmarks/e2e.py --token-k: the whole decode step (CUDA graph, predictors on the side stream, overlap
#    on and off) of the OPT-30B shape at batch 1, densities 0.3 and 0.1, fixed K beside the per-token K.
#   bash benchmarks/gpu/token_k_ab.sh            (~2 minutes on one H100)
#   E2E_ONLY=1 bash benchmarks/gpu/token_k_ab.sh (part 2 alone)
# Target: token_k_compact no slower than fixed_compact at every density (one layer), and the whole step with the
# per-token K no slower than with fixed K; token_k_read_compact no slower than fixed_compact (what switching the build's default
# --token-k-rows to read needs: fc2's skipped rows save their time). On 2026-12-05 (1abe2c2, the keep flags by torch ops, fc1 / fc2 masking 2K
# rows) token_k was 1.45-1.62x fixed K (benchmarks/results/token-k-ab-2026-12-05-opt30b.json, -opt66b.json).
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.csv" || true
for shape in $([ -n "${E2E_ONLY:-}" ] || echo opt-30b opt-66b); do
    timeout 150 python3 benchmarks/token_k_ab.py --shape "$shape" --out "$OUT/token_k_ab-$(date -u +%F)-$shape.json"
done
timeout 300 python3 benchmarks/e2e.py --models opt-30b --batches 1 --densities 0.3,0.1 --token-k --no-smoke \
    --no-hf --ablations "" --kv-policies deferred --full-kv-densities "" --new-tokens 64 --budget 270 \
    --out "$OUT/e2e-token-k-$(date -u +%F)-opt-30b.json"

#!/usr/bin/env bash
# fc2 over h's nonzero rows (compact_rows + fc2 stopping at their count; DecodeOptions.compact_zeros, the default
# since this ran: H100 80GB HBM3, 2026-12-05, commit 424623d) against fc2 skipping the zero rows' loads
# (docs/kernels.md, "fc2 over the nonzero rows"):
# 1. benchmarks/token_k_ab.py --rows compact: one layer at batch 1 in a CUDA graph, OPT-30B and OPT-66B shapes,
#    MLP 0.1 / 0.2 / 0.3 (random weights, about half of h zero): fc2 over K, skipping zeros, compacted (with and
#    without the compaction launch, and the launch alone); predictor + top-k + fc1 + fc2 of fixed K and of the
#    per-token K fitted to rows read (token_k_read), each with fc2 skipping zeros and compacted.
# 2. benchmarks/e2e.py: the whole OPT-30B decode step at batch 1 (CUDA graph, predictors on the side stream),
#    MLP 0.1 then 0.3: fixed K and the per-token K fitted to rows read, each with fc2 compacted and skipping zeros
#    (--no-compact-zeros: ..._nocompact; at 424623d the flag was --compact-zeros: ..._compact).
#   bash benchmarks/gpu/compact_ab.sh               (under 4 minutes on one H100 / H200; the timeouts bound it)
#   E2E_ONLY=1 bash benchmarks/gpu/compact_ab.sh    (part 2 alone)
# Targets: fc2_K_compact (the launch included) below fc2_K_skip0, nearer fc2 over the nonzero rows' share of
# fc2_K; token_k_read_compact no slower than fixed_skip0 (what `--token-k-rows read` as the default needs);
# the whole step's ..._tokenk row (compacted) no slower than the fixed-K ..._nocompact row.
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.csv" || true
for shape in $([ -n "${E2E_ONLY:-}" ] || echo opt-30b opt-66b); do
    timeout 50 python3 benchmarks/token_k_ab.py --shape "$shape" --rows compact \
        --out "$OUT/compact_ab-$(date -u +%F)-$shape.json" || echo "token_k_ab $shape: exit $?"
done
timeout 130 python3 benchmarks/e2e.py --models opt-30b --batches 1 --densities 0.1,0.3 --token-k --token-k-rows read \
    --no-compact-zeros --overlaps on --no-smoke --no-hf --ablations "" --kv-policies deferred --full-kv-densities "" \
    --new-tokens 64 --cap-s 2 --budget 115 --out "$OUT/e2e-compact-$(date -u +%F)-opt-30b.json" || echo "e2e: exit $?"

#!/usr/bin/env bash
# int8 MLP predictors (the default build: int8 rows with an fp16 scale a row at twice the float rank, in the same
# bytes) against float ones at the float rank, OPT-30B shape (D 7168, F 28672), batch 1, CUDA graphs:
# 1. benchmarks/token_k_ab.py: rows pred_float (rank 512, fp16) and pred_int8 (rank 1024, int8 rows): one MLP
#    predictor's scores + top-K at K = 0.1 F and 0.3 F (the Triton GEMVs read the int8 rows and multiply each
#    output row by its scale once), beside topk_K (the same at the benchmark's rank 1144, fp16).
# 2. benchmarks/e2e.py --predictor-dtype float / int8: the whole decode step at MLP and head density 0.1 (random
#    weights), overlap on and off; the predictors run on the side stream, so the step changes only where they
#    outlast the attention they overlap.
#   bash benchmarks/gpu/int8_predictors.sh     (~4 minutes on one H100 / H200)
# Target: pred_int8 no slower than pred_float (equal bytes, twice the rank's instructions), and the step with
# int8 predictors no slower than with float ones.
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.csv" || true
timeout 70 python3 benchmarks/token_k_ab.py --shape opt-30b --densities 0.1 0.3 --rows predictors \
    --out "$OUT/int8-predictors-ab-$(date -u +%F)-opt-30b.json"
for pd in float int8; do
    timeout 80 python3 benchmarks/e2e.py --models opt-30b --batches 1 --densities 0.1 --no-smoke --no-hf \
        --ablations "" --kv-policies deferred --full-kv-densities "" --batch-policy per_sequence --new-tokens 64 \
        --cap-s 2 --budget 70 --predictor-dtype "$pd" --out "$OUT/e2e-predictors-$pd-$(date -u +%F)-opt-30b.json"
done

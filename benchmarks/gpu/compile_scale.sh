#!/usr/bin/env bash
# GPU-measurements run 5: compile at scale. Writes a random-weight checkpoint of the OPT shape
# (sharded fp16 safetensors, Hugging Face layout), runs `dejavu-compile` on cuda in fp16 with 65,536
# calibration tokens, then decodes from the engine it built. Peak host / GPU memory, per-stage
# seconds, engine and cache bytes in the JSON.
#   bash benchmarks/gpu/compile_scale.sh [SHAPE]      (13b; 30b if the disk holds checkpoint + engine)
# Target: the OPT-30B shape compiled in <= 10 minutes.
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
SHAPE=${1:-13b}
df -h /tmp > "$OUT/disk.txt"
python3 benchmarks/compile_scale.py --shapes "$SHAPE" --device cuda --compute-dtype float16 \
    --calib-tokens 65536 --predictor-epochs 8 --density 0.5 --decode-tokens 16 --timeout 520 \
    --work /tmp/dejavu-cs --out "$OUT/compile-scale-$(date -u +%F)-$SHAPE"

#!/usr/bin/env bash
# GPU-measurements run 6: dejavu-serve on the OPT-30B shape (random weights, fp16), 1-64 streaming
# clients, dense vs sparse engine, and the solo-vs-batched agreement. starlette and uvicorn are not on
# the GPU machine: prepare them on a machine with the packages, as a folder carried with the run:
#   pip install --no-deps --target benchmarks/.serve-deps starlette uvicorn h11 anyio sniffio click
#   bash benchmarks/gpu/serve.sh     (carry benchmarks/.serve-deps)
set -euo pipefail
source benchmarks/device_env.sh
export PYTHONPATH=$PWD/benchmarks/.serve-deps:$PYTHONPATH
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
timeout 580 python3 benchmarks/serve.py --shape opt-30b --density 0.3 --device cuda --max-batch 64 \
    --max-context 512 --clients 1 4 16 64 --requests 4 --prompt-len 128 --max-tokens 128 \
    --agreement 64 --out "$OUT/serve-$(date -u +%F)-h200.json"

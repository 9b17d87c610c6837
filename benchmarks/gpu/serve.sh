#!/usr/bin/env bash
# GPU-measurements run 6: dejavu-serve on the OPT-30B shape (random weights, fp16), 1-64 streaming
# clients, dense vs sparse engine, and the solo-vs-batched agreement. starlette and uvicorn are not on
# the GPU machine: prepare them on a machine with the packages, as a folder carried with the run:
#   pip install --no-deps --target benchmarks/.serve-deps starlette uvicorn h11 anyio sniffio click
#   bash benchmarks/gpu/serve.sh     (carry benchmarks/.serve-deps)
#
# Sized for one 600 s call on an H100 (80 GB). Memory: the weights of either engine are ~62 GB
# (59 GB of layers, the int8 predictors 1.7 GB); the cache is 1.38 MB of K/V a token plus the
# sparse engine's x_hist 0.69 MB, so 32 rows x 128 tokens is 8.5 GB (64 x 512 would be 68 GB: no
# fit). Hence --max-batch 32 (64 clients measure queueing too), prompt 64 + 64 tokens = context 128.
# Time: each server is a process start, random weights drawn on the GPU, two Engine.generate runs
# for direct_ms_per_token, and one CUDA graph per decode bucket (1 2 4 8 16 32); a level is one
# warm-up request plus clients x --requests requests of 64 tokens. Order: sparse then dense at 1 and
# 16 clients, then a second server each for 4 and 64, then the agreement (two more engine builds,
# one per batch policy, 16 prompts). The JSON is rewritten after every level; what has not started
# by --budget-s is listed under "skipped"; the longest single item (agreement) fits between the
# budget and the timeout.
set -euo pipefail
source benchmarks/device_env.sh
export PYTHONPATH=$PWD/benchmarks/.serve-deps:$PYTHONPATH
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
timeout 540 python3 benchmarks/serve.py --shape opt-30b --density 0.3 --device cuda --max-batch 32 \
    --max-context 128 --engines sparse dense --clients 1 16 --more-clients 4 64 --requests 2 \
    --prompt-len 64 --max-tokens 64 --agreement 16 --budget-s 400 --out "$OUT/serve-$(date -u +%F).json"

#!/usr/bin/env bash
# The q/k/v sum folded into the attention kernel (gqa_attn.fuse_qkv, the default) against the sum kernel launched
# before it: first the Llama GPU tests (tiny engines' Triton decode and generate against the CPU reference, the
# fused path included); then Llama-3-8B and the 70B TP-8 rank (random weights, batch 1): the dense graph, TEAL 50%
# fused and unfused (smoke check first, the unfused form included), then the dense graph unfused. Under 7 minutes.
#   bash benchmarks/gpu/llama_fuse_qkv.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
D=$(date -u +%F)
nvidia-smi --query-gpu=name --format=csv,noheader
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:warnings tests/runtime/test_llama_variants.py \
    tests/runtime/test_llama_runtime.py -k gpu 2>&1 | tail -2 || echo "llama_fuse_qkv: a GPU test failed"
UNFUSED='[{"gqa_attn": {"fuse_qkv": false}}]'
timeout 200 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 --variant-models llama-3-8b,llama-3-70b-tp8 \
    --skips 0.5 --no-hf --profile-steps 0 --kernel-variants "$UNFUSED" --out "$OUT/e2e-llama-fuse-qkv-$D.json" \
    || echo "llama_fuse_qkv: the sparse run exited with $?"
exec timeout 120 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips '' --variant-skip 0 --no-hf --no-smoke --profile-steps 0 \
    --kernel-variants "$UNFUSED" --out "$OUT/e2e-llama-fuse-qkv-dense-$D.json"

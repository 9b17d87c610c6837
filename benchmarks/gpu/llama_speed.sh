#!/usr/bin/env bash
# Llama-family decode with TEAL input sparsity, under 5 minutes. One rank of Llama-3-70B under 8-way tensor
# parallelism, then Llama-3-8B (random weights, batch 1): our dense CUDA graph and TEAL at 50% of every projection
# input skipped (default settings), each profiled (torch.profiler over 20 graph replays: kernels, launches and GPU
# time per step); then on 8B the A/B around the defaults at 50% (benchmarks/e2e_llama.py VARIANTS), each variant
# started only inside the first 230 s (later ones recorded as skipped); a kernels-vs-reference and graph-vs-eager
# smoke check first. HF eager and the 25% / 40% levels were measured on 2026-12-05 (docs/llama.md) and are left out.
# Target: >= 1.8x our dense graph at 50% skipped, within 1.3x of the bandwidth floor.
#   bash benchmarks/gpu/llama_speed.sh
#   bash benchmarks/gpu/llama_speed.sh ab    # both shapes, Llama-3-8B first: the dense graph, the defaults and
#       # every VARIANTS entry, each profiled; no variant started after 240 s (the rest recorded as skipped: the
#       # 70B rank's last ones first), under 330 s. The A/B around the defaults (the split attention kernel,
#       # gate/up's block_k 64; on an H100 on 2026-12-05, 7e44501: 1.76x / 1.79x the dense graph): the attention
#       # by PyTorch's masked SDPA, tiles of 64 slots, at most 4 splits, twice the programs, gate/up at the table's
#       # block_k 128, block_m 32, 1056 programs
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
if [ "${1:-}" = ab ]; then
    exec timeout 330 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
        --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
        --budget-s 240 --out "$OUT/e2e-llama-ab-$(date -u +%F).json"
fi
exec timeout 290 python3 benchmarks/e2e_llama.py --models llama-3-70b-tp8,llama-3-8b --variant-models llama-3-8b \
    --skips 0.5 --no-hf --profile-steps 20 --budget-s 230 --out "$OUT/e2e-llama-$(date -u +%F).json"

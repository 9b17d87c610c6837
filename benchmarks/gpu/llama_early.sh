#!/usr/bin/env bash
# Reads issued before the PDL wait in the Llama decode step: the GQA attention's first K/V tile of each split
# loaded before its wait (slot pos patched in after it, later tiles a loop step ahead; GQAAttnSettings.early_tile)
# against loading every tile after it; both Llama shapes at 50% skipped, the dense graph, the defaults and the
# variant, each profiled, after the smoke check (kernels vs reference, graph vs eager, greedy vs reference on a tiny
# fp32 model: the attention kernel reading slot pos right after the kernel that wrote it); then Llama-3-8B at a
# 3968-token prompt (splits of many tiles) both ways; the real-shape GPU checks of the TEAL GEMV; then
# launch_chain.py (the ten-launch layer's bound on this GPU). Under 8 minutes.
#   bash benchmarks/gpu/llama_early.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
D=$(date -u +%F)
timeout 230 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --kernel-variants '[{"gqa_attn": {"early_tile": false}}]' --out "$OUT/e2e-llama-early-$D.json" | tail -8 \
    || echo "llama_early: e2e_llama ended early"
timeout 120 python3 benchmarks/e2e_llama.py --models llama-3-8b --skips 0.5 --no-hf --prompt-len 3968 \
    --new-tokens 128 --profile-steps 20 --profile-variants --no-smoke \
    --kernel-variants '[{"gqa_attn": {"early_tile": false}}]' --out "$OUT/e2e-llama-early-long-$D.json" | tail -4 \
    || echo "llama_early: the long run ended early"
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x tests/plugins/test_plugin_real_shapes.py -k sliced \
    2>&1 | tail -3 || echo "llama_early: real-shape checks failed"
exec timeout 60 python3 benchmarks/launch_chain.py --out "$OUT/launch-chain-$D.json" | tail -4

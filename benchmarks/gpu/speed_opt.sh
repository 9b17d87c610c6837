#!/usr/bin/env bash
# GPU-measurements runs 2 and 3: decode latency of the engines users build. The per-layer K of
# `dejavu-compile opt-mini --density B` for B in BUDGETS (sensitivity allocation, built on the GPU
# machine's CPU) mapped onto the OPT shape, beside the even split 0.3 and the dense CUDA graph, at
# batches 1 and 8, with the copy bandwidth measured in the same run; Hugging Face eager repeated and
# static-cache torch.compile when HF=1.
#   bash benchmarks/gpu/speed_opt.sh --save-k 0.3,0.4,0.5 [ENGINE_DIR]   # here: K of the engines as JSON
#   bash benchmarks/gpu/speed_opt.sh [MODEL] [BUDGETS] [HF] [LAYERS]   e.g. opt-30b 0.3,0.4,0.5 1
#   bash benchmarks/gpu/speed_opt.sh opt-66b 0.3,0.4,0.5 0 32   # 32 of OPT-66B's 64 layers (64 need ~130 GB in fp16)
# Targets (OPT-30B, batch 1): even split 0.3 <= 5.5 ms/token, >= 2.7x the dense graph, <= 1.25x floor.
set -euo pipefail
if [ "${1:-}" = "--save-k" ]; then  # here, before the run: the headers of `dejavu-compile opt-mini --density B`
    mkdir -p benchmarks/gpu/k
    for b in ${2//,/ }; do
        e=${3:-/tmp/dejavu-k}/opt-mini-d$b.engine
        [ -f "$e" ] || dejavu-compile opt-mini --density "$b" -o "$e" -q
        python3 -c "import json, sys; from dejavu.engine_file import read_header; h = read_header(sys.argv[1]); json.dump({'build_config': {k: h['build_config'][k] for k in ('density', 'mlp_k', 'attn_k')}, 'model_config': {k: h['model_config'][k] for k in ('ffn_dim', 'num_attention_heads')}}, open(sys.argv[2], 'w'))" "$e" benchmarks/gpu/k/opt-mini-d$b.json
    done
    exit 0
fi
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
MODEL=${1:-opt-30b}
BUDGETS=${2:-0.3,0.4,0.5}
HF=${3:-0}
LAYERS=${4:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.csv" || true
ENGINES=()
for b in ${BUDGETS//,/ }; do  # the engine's header saved in benchmarks/gpu/k/ (written by --save-k), else a build here
    e=benchmarks/gpu/k/opt-mini-d$b.json
    [ -f "$e" ] || { e=/tmp/dejavu-k/opt-mini-d$b.engine; [ -f "$e" ] || python3 -m dejavu.compiler.cli opt-mini --density "$b" -o "$e" -q; }
    ENGINES+=("$e")
done
KFROM=$(IFS=,; echo "${ENGINES[*]}")
HFARGS=(--no-hf)
[ "$HF" = 1 ] && HFARGS=(--hf-repeats 5 --hf-compile)
timeout 580 python3 benchmarks/e2e.py --models "$MODEL" --batches 1,8 --densities 0.3 --k-from "$KFROM" \
    --ablations same --ablate-batches 1 --ablate-densities 0.3 --full-kv-densities "" \
    "${HFARGS[@]}" ${LAYERS:+--num-layers "$LAYERS"} --budget 500 --out "$OUT/e2e-$(date -u +%F)-$MODEL.json"

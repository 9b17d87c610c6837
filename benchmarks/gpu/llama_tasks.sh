#!/usr/bin/env bash
# A SmolLM2-135M engine built with eight-window distillation, then its zero-shot tasks on both scoring paths,
# on the GPU in fp32: `--path generate` (each example's context prefilled as LlamaDecoder.prefill does, the
# continuation decoded) on the first 500 examples of each task, then `--path parallel` on every example of
# the shipped files (lambada_openai 5,153, piqa 1,838, winogrande 1,267, openbookqa 500, rte 277, copa 100).
# With `dense` (and DENSITY -, no engine: the three take ~130 s each on an H100), the dense model's
# full-file tasks and perplexity in fp32 (the reference the engines are compared against on this machine),
# bf16 and fp16: how far a change that leaves perplexity where it is moves each task. Each result is written
# to $OUT as it ends; a step that would pass the 580-second mark is cut short (its file then holds nothing).
# One device command.
#   bash benchmarks/gpu/llama_tasks.sh GGUF CALIB DENSITY|- [dense]
#   e.g. bash benchmarks/gpu/llama_tasks.sh SmolLM2-135M-Instruct.Q4_1.gguf wikitext-2/train.txt 0.8
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
GGUF=$1 CALIB=$2 D=$3
day=$(date -u +%F)
left() { local s=$(( 580 - SECONDS < $1 ? 580 - SECONDS : $1 )); echo $(( s > 1 ? s : 1 )); }  # at most $1 s
EVAL="python3 -m dejavu.runtime.evaluation.evaluate"
if [ "${4:-}" = dense ]; then
    for dt in float32 bfloat16 float16; do
        timeout "$(left 200)" $EVAL "$GGUF" --tasks all --ppl-tokens 8192 --window 512 --device cuda --dtype $dt \
            --json -q > "$OUT/llama_eval_smollm2_dense_${dt}_tasksall_cuda-$day.json" || echo "llama_tasks: dense $dt ended early"
    done
fi
[ "$D" != - ] || exit 0
E=/tmp/smollm2_d${D}_b8.engine
t0=$SECONDS
python3 -m dejavu.compiler.cli "$GGUF" --density "$D" --distill-steps 1000 --distill-batch 8 --calib "$CALIB" \
    --calib-tokens 8192 --device cuda -o "$E" > "$OUT/llama_build_d${D}_b8-$day.log" 2>&1
echo "llama_tasks: built $E in $((SECONDS - t0)) s"; tail -n 3 "$OUT/llama_build_d${D}_b8-$day.log"
timeout "$(left 240)" $EVAL "$E" --tasks all --limit 500 --path generate --device cuda --dtype float32 --json -q \
    > "$OUT/llama_eval_smollm2_d${D}_b8_generate_tasks500-$day.json" || echo "llama_tasks: generate-path tasks ended early"
timeout "$(left 240)" $EVAL "$E" --tasks all --device cuda --dtype float32 --json -q \
    > "$OUT/llama_eval_smollm2_d${D}_b8_tasksall_cuda-$day.json" || echo "llama_tasks: full-file tasks ended early"
echo "llama_tasks: done at $SECONDS s"

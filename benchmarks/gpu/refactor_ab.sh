#!/usr/bin/env bash
# GPU-measurements run 4: no speed lost to the shipped-path refactor. The same e2e measurement from
# two trees on one GPU in one run, interleaved (before, after, before, after) so clock drift shows as spread:
# BEFORE = the tree before the refactor (default 9826d98, which still holds the removed modes),
# AFTER = this checkout. The device run gets no git history, so pack the old tree here first:
#   bash benchmarks/gpu/refactor_ab.sh --pack [COMMIT]   # here: writes benchmarks/gpu/before.tar.gz (untracked, ~0.3 MB)
#   bash benchmarks/gpu/refactor_ab.sh [ROUNDS]          # on the GPU machine (default 2 rounds, < 10 min);
#       both files are git-ignored: carry benchmarks/gpu/before.tar.gz and benchmarks/gpu/before.commit with the run
# Target: <= 2% slower anywhere, or explained.
set -euo pipefail
HERE=benchmarks/gpu
if [ "${1:-}" = "--pack" ]; then
    C=${2:-9826d98}
    git archive --prefix=before/ "$C" plugins runtime compiler models dejavu benchmarks \
        ':(exclude)models/opt-mini' ':(exclude)dejavu/data' ':(exclude)benchmarks/results' | gzip > $HERE/before.tar.gz
    echo "$C" > $HERE/before.commit
    exit 0
fi
[ -f $HERE/before.tar.gz ] || { echo "refactor_ab: run '$0 --pack' on a machine with the git history first" >&2; exit 2; }
ROUNDS=${1:-2}
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
AFTER=$PWD
rm -rf /tmp/ab && mkdir -p /tmp/ab && tar xzf $HERE/before.tar.gz -C /tmp/ab
BEFORE=/tmp/ab/before
ln -sfn "$AFTER/models/opt-mini" "$BEFORE/models/opt-mini"; ln -sfn "$AFTER/dejavu/data" "$BEFORE/dejavu/data"
for p in models compiler runtime plugins; do ln -sfn "../$p" "$BEFORE/dejavu/$p"; done
ARGS=(--models opt-30b --batches 1 --densities 0.3,0.1 --ablations same --ablate-batches 0 --full-kv-densities ""
      --no-hf --no-smoke --budget 110)
for r in $(seq 1 "$ROUNDS"); do
    for side in before after; do
        tree=$AFTER; [ $side = before ] && tree=$BEFORE
        (cd "$tree" && PYTHONPATH=$tree timeout 130 python3 benchmarks/e2e.py "${ARGS[@]}" \
            --out "$OUT/ab-$side-$r.json") || echo "refactor_ab: $side round $r failed" >&2
    done
done
echo "before: $(cat $HERE/before.commit)" > "$OUT/ab-trees.txt"

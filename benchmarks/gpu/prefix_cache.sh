#!/usr/bin/env bash
# dejavu-serve's prefix caching on a GPU: the CUDA cases of its test (the first logits bit for bit, the tokens and
# logprobs those of a server that prefills everything, CUDA graphs per decode bucket), then time to first token with
# a shared 1,024-token prefix, the cache on and off, on the OPT-1.3B shape (random weights, fp16).
# The server's packages are not on the GPU machine: prepare them on a machine with the packages, as a folder carried
# with the run:
#   pip install --no-deps --target benchmarks/.serve-deps starlette uvicorn h11 anyio sniffio click httpx httpcore \
#       certifi idna typing_extensions
#   bash benchmarks/gpu/prefix_cache.sh          # (carry benchmarks/.serve-deps) raw JSON under $OUT
set -uo pipefail
source benchmarks/device_env.sh
export PYTHONPATH=$PWD/benchmarks/.serve-deps:$PYTHONPATH
python3 -c "import starlette, uvicorn, httpx" || { echo "prefix_cache: carry benchmarks/.serve-deps (above)"; exit 1; }
TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_prefix_cache.py -k cuda 2>&1 | tail -15
for flag in "" "--no-prefix-caching"; do
  python3 benchmarks/serve.py --shape opt-1.3b --density 0.3 --device cuda --engines sparse --max-batch 4 \
      --max-context 1280 --clients 1 4 --requests 4 --shared-prefix 1024 --prompt-len 32 --max-tokens 16 \
      --budget-s 200 $flag --out "$OUT/serve-prefix${flag:+-off}.json" 2>&1 | grep -v '^\s*$' | tail -25
done

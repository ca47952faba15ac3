#!/usr/bin/env bash
# (Re)creates .bench_tokenizer/ (git-ignored) at the repo root: the SmolLM2-135M-Instruct tokenizer
# (49,152 tokens) that bench/workload_bench.py's json variant builds its LLM with ($BENCH_TOKENIZER names
# another folder). Its source is tokenmill's cache of the built-in smollm2-135m-instruct (bfloat16),
# made the first time that model is loaded here. The GPU machine has neither network nor that cache:
# carry .bench_tokenizer there with the working tree (the run tool's carry).
set -euo pipefail
cd "$(dirname "$0")/.."
src=${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}/models/smollm2-135m-instruct-bfloat16
for f in tokenizer.json tokenizer_config.json; do
  if [ ! -f "$src/$f" ]; then
    echo "prepare_bench_tokenizer.sh: $src/$f is missing: load tokenmill's built-in smollm2-135m-instruct once" \
         "(python3 -c \"import tokenmill; tokenmill.LLM('smollm2-135m-instruct')\") or set TOKENMILL_CACHE" >&2
    exit 1
  fi
done
rm -rf .bench_tokenizer
mkdir .bench_tokenizer
cp "$src/tokenizer.json" "$src/tokenizer_config.json" .bench_tokenizer/
if [ -f "$src/special_tokens_map.json" ]; then cp "$src/special_tokens_map.json" .bench_tokenizer/; fi
echo "prepare_bench_tokenizer.sh: .bench_tokenizer/ from $src: $(ls .bench_tokenizer | tr '\n' ' ')"

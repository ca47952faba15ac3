#!/usr/bin/env bash
# Everything we run on the GPU machine, in one call: the GPU tests, the kernel micro-benchmark and
# the throughput protocols P1-P3 (bench/peer_bench.py). Writes to $OUT (or ./gpu-out):
#   gpu_tests.log, kernels.jsonl, throughput.jsonl (rows tagged with commit, date and GPU), suite.log
# Usage on the device:  bash bench/gpu_suite.sh [tests|engine-tests] [kernels] [throughput] [throughput-fp8] [gemm] [sampler]
#                        [chat] [chat-8b] [chat-vllm] [profile] [profile-gpu] [timeline] [vllm]
#   (default: tests kernels throughput)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=${*:-tests kernels throughput}
# Pass COMMIT=<sha> from your checkout: the device's copy of .git can lag the working tree it runs.
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "commit $commit, $(date -u +%FT%TZ), $gpu, torch $(python3 -c 'import torch,triton;print(torch.__version__, "triton", triton.__version__)')" | tee "$OUT/suite.log"

tag() {  # append rows of $1 to $2 with commit/date/gpu
  python3 - "$1" "$2" "$commit" "$gpu" <<'PY'
import json, sys, datetime
src, dst, commit, gpu = sys.argv[1:]
with open(src) as f, open(dst, "a") as out:
    for line in f:
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            row.update(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), gpu=gpu)
            out.write(json.dumps(row) + "\n")
PY
}

for part in $parts; do
  start=$(date +%s)
  case $part in
    tests|engine-tests)
      [ "$part" = tests ] && sel=tests/gpu || sel="tests/gpu/test_engine_gpu.py tests/gpu/test_pooling_gpu.py tests/gpu/test_sampler_kernel_gpu.py"
      timeout 330 python3 -m pytest $sel -q --maxfail=8 -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    kernels)
      timeout 120 python3 bench/kernels_bench.py > "$OUT/kernels.raw" 2>>"$OUT/suite.log"; tag "$OUT/kernels.raw" "$OUT/kernels.jsonl"; cat "$OUT/kernels.jsonl" ;;
    throughput)
      for run in "qwen3-0.6b nano uniform" "llama3-8b nano"; do
        RESULTS="$OUT/throughput.raw" timeout 170 python3 bench/peer_bench.py tokenmill $run 2>&1 | grep -v "^\s*$" | tail -5
      done
      tag "$OUT/throughput.raw" "$OUT/throughput.jsonl" ;;
    throughput-fp8)  # kv_cache_dtype="fp8": not the protocols' bf16, recorded as its own engine
      for run in "qwen3-0.6b nano" "llama3-8b nano"; do
        RESULTS="$OUT/throughput_fp8.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 150 python3 bench/peer_bench.py tokenmill_fp8kv $run 2>&1 | grep -v "^\s*$" | tail -3
      done
      tag "$OUT/throughput_fp8.raw" "$OUT/throughput.jsonl" ;;
    gemm)  # cuBLAS against a Triton tile sweep on the decode GEMM shapes (a prototype question)
      timeout 150 python3 bench/gemm_bench.py > "$OUT/gemm.raw" 2>>"$OUT/suite.log"; tag "$OUT/gemm.raw" "$OUT/gemm.jsonl"; cat "$OUT/gemm.jsonl" ;;
    sampler)  # the sampling kernels alone: temperature, filters, penalties at 64 / 256 / 1,024 rows
      timeout 150 python3 bench/sampler_bench.py --json > "$OUT/sampler.raw" 2>>"$OUT/suite.log"
      grep -v '^{' "$OUT/sampler.raw"; tag "$OUT/sampler.raw" "$OUT/sampler.jsonl" ;;
    chat|chat-8b)  # the chat workload: temperature only, + top_p 0.9, + top_k 50, + repetition_penalty 1.1, all
      [ "$part" = chat ] && shape=qwen3-0.6b || shape=llama3-8b
      RESULTS="$OUT/chat.raw" timeout 400 python3 bench/workload_bench.py tokenmill $shape 2>&1 | grep '^{'
      tag "$OUT/chat.raw" "$OUT/throughput.jsonl" ;;
    chat-vllm)
      cat .vllmchunk/vllm026-slim-site.tar.xz.part* | xz -d | tar -C /tmp -xf - --one-top-level=vllm-site 2>/dev/null \
        || { mkdir -p /tmp/vllm-site; cat .vllmchunk/*.part* | xz -d | tar -C /tmp/vllm-site -xf -; }
      PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 RESULTS="$OUT/chat_vllm.raw" timeout 500 \
        python3 bench/workload_bench.py vllm qwen3-0.6b 2>&1 | grep '^{'
      tag "$OUT/chat_vllm.raw" "$OUT/throughput.jsonl" ;;
    profile)
      timeout 150 python3 bench/profile_step.py qwen3-0.6b nano > "$OUT/profile_p1.txt" 2>&1; head -45 "$OUT/profile_p1.txt" ;;
    timeline)
      for shape in qwen3-0.6b llama3-8b; do
        timeout 120 python3 bench/profile_step.py $shape nano --timeline > "$OUT/timeline_$shape.txt" 2>&1; tail -9 "$OUT/timeline_$shape.txt"
      done ;;
    profile-gpu)
      for shape in qwen3-0.6b llama3-8b; do
        timeout 150 python3 bench/profile_step.py $shape nano --gpu > "$OUT/profile_gpu_$shape.txt" 2>&1; head -32 "$OUT/profile_gpu_$shape.txt"
      done ;;
    vllm)
      cat .vllmchunk/vllm026-slim-site.tar.xz.part* | xz -d | tar -C /tmp -xf - --one-top-level=vllm-site 2>/dev/null \
        || { mkdir -p /tmp/vllm-site; cat .vllmchunk/*.part* | xz -d | tar -C /tmp/vllm-site -xf -; }
      for run in "qwen3-0.6b nano uniform" "llama3-8b nano"; do
        PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 RESULTS="$OUT/vllm.raw" timeout 250 \
          python3 bench/peer_bench.py vllm $run 2>&1 | tail -3
      done
      tag "$OUT/vllm.raw" "$OUT/throughput.jsonl" ;;
  esac
  echo "[$part took $(( $(date +%s) - start )) s]" | tee -a "$OUT/suite.log"
done

#!/usr/bin/env bash
# Everything we run on the GPU machine, in one call: the GPU tests, the kernel micro-benchmark and
# the throughput protocols P1-P3 (bench/peer_bench.py). Writes to $OUT (or ./gpu-out):
#   gpu_tests.log, kernels.jsonl, throughput.jsonl (rows tagged with commit, date and GPU), suite.log
# Usage on the device:  bash bench/gpu_suite.sh [tests|tests-1|tests-2|tests-3|engine-tests|quant-tests] [kernels] [throughput] [p1p5] [p4] [p5] [p6] [p6-calls] [p6-calls-ab-old] [throughput-fp8]
#   [gemm] [gemm-sweep] [quant-gemm] [fp8-tiles] [quant-throughput] [quant-decode96] [controls-tests] [offload] [moe] [moe-sweep] [moe-ab] [moe-ab-old] [moe-engine] [memory-plan] [lora] [lora-ab-old]
#   [sampler] [sampler-ab-old] [sampler-rounds] [grammar-host] [chat] [chat-8b] [chat-ab-old] [protocol-ab-old] [job] [job-short] [job-score] [job-embed] [job-embed-ab-old] [refill] [beam] [profile-chat] [profile] [profile-gpu] [profile-gpu-fp8] [profile-moe] [timeline-moe] [profile-refill] [launch-gap] [timeline] [first-call] [timeline-fp8kv] [profile-p5] [p6-host] [varlen-sweep] [vllm-unpack]
#   [vllm] [vllm-p1p5] [vllm-p4p5] [vllm-p6] [vllm-chat] [vllm-refill] [vllm-beam] [vllm-fp8] [vllm-fp8kv] [vllm-moe] [vllm-lora] [ray]
#   [deterministic] [throughput-det] [vllm-det]
#   [tp2] [vllm-tp2]   (two GPUs, nvidia-h200-x2: tensor parallelism over NCCL)
#   [kernels-p5] [prefill-ab-old] [ws-probe] [kernels-coresident] [sm-partition] [side-decodes] [p1-overlap] [p5-overlap] [p3-overlap] [batch-sweep] [order-sweep] [queue-sweep] [queue-throughput] [queue-throughput-fp8kv] [gc-throughput] [ncu-w4a16] [ncu-fp8]
#   (default: tests kernels throughput). P4-P6: ../shared/bench/protocols.md; bench/peer_bench.py and
#   bench/embed_bench.py are unchanged copies of the shared scripts. vllm*: the bundle's parts must be in
#   .vllmchunk/ or already unpacked in /tmp/vllm-site (vllm-unpack joins and unpacks them). chat*: the chat
#   workload with tutorial sampling settings (bench/workload_bench.py; CHAT_VARIANTS picks variants, default all but json). ray: P1 through tokenmill.ray against
#   plain generate; needs .raybundle/ (bench/build_ray_bundle.sh) carried. Tests that load GGUF or quantized
#   checkpoints need .whl/ (bench/build_wheels.sh) carried and installed (that script says how).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off in every part (device README: a program using it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# tests/conftest.py pins torch to one thread unless OMP_NUM_THREADS is set (right for 2 busy CI cores); the GPU
# machine has 16, so the test parts below set 8. The benchmarks keep torch's default.
export TESTS_OMP=${OMP_NUM_THREADS:-8}
parts=${*:-tests kernels throughput}
# Pass COMMIT=<sha> from your checkout: the device's copy of .git can lag the working tree it runs.
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "commit $commit, $(date -u +%FT%TZ), $gpu, torch $(python3 -c 'import torch,triton;print(torch.__version__, "triton", triton.__version__)')" | tee "$OUT/suite.log"

tag() {  # append rows of $1 to $2 with commit/date/gpu (nothing when a part's runs wrote no $1)
  [ -f "$1" ] || return 0
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

mark_tree() {  # the ab-old parts: tokenmill rows of $2 not yet marked get "tree": $1 (old or new)
  sed -i "/\"tree\"/!s/\"engine\": \"tokenmill\",/\"engine\": \"tokenmill\", \"tree\": \"$1\",/" "$2"
}

install_wheels() {  # the carried wheels (.whl/, bench/build_wheels.sh) onto PYTHONPATH, once a machine
  if compgen -G ".whl/*.whl" > /dev/null && [ ! -d /tmp/tokenmill-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tokenmill-wheels .whl/*.whl 2>&1 | tail -2
  fi
  [ -d /tmp/tokenmill-wheels ] && export PYTHONPATH="$PYTHONPATH:/tmp/tokenmill-wheels"
  return 0
}

for part in $parts; do
  start=$(date +%s)
  case $part in
    tests|engine-tests|tests-1|tests-2|tests-3)
      # The whole of tests/gpu (~700 tests) in three calls: tests-1, the files before
      # test_pooling_gpu.py, tests-2 the rest (a new file falls on one side by its name), tests-3
      # the MoE, LoRA (peft from .whl) and logprobs_mode files. On an H100 of lease BH (5b74e17) the
      # split was at test_quant_kernels_gpu.py: tests-1 491 s, tests-2 206 s, tests-3 117 s, so tests-1
      # alone came near a call's 600 s; the pooling, qkv-prologue and quant-engine files (the last one's five
      # slowest tests alone ~60 s there) now run in tests-2. On the H200 at 403bb60 (AU) the three took 209,
      # 123 and 56 s. test_block_fp8_gpu.py (block-wise fp8, not yet timed) joins tests-2, which has room.
      # TESTS_IGNORE drops files (the quant tests need compressed-tensors from .whl, installed here when
      # carried); the Ray tests skip without the Ray bundle and have their own part.
      case $part in
        tests) sel=tests/gpu ;;
        engine-tests) sel="tests/gpu/test_engine_gpu.py tests/gpu/test_pooling_gpu.py tests/gpu/test_sampler_kernel_gpu.py tests/gpu/test_logprob_token_ids_gpu.py tests/gpu/test_logits_processor_gpu.py" ;;
        *) sel=""; for f in tests/gpu/test_*.py; do
             [ "$(basename "$f")" = test_ray_gpu.py ] && continue
             name=$(basename "$f")
             if [[ $name == test_moe* || $name == test_lora* || $name == test_logprobs_mode* ]]; then half=tests-3
             elif [[ $name < test_pooling_gpu.py && $name != test_block_fp8* ]]; then half=tests-1; else half=tests-2; fi
             [ "$half" = "$part" ] && sel="$sel $f"
           done ;;
      esac
      ignores=""; for f in tests/gpu/test_ray_gpu.py ${TESTS_IGNORE:-}; do ignores="$ignores --ignore=$f"; done
      # The carried wheels (compressed-tensors, gguf, peft, xgrammar: .whl/, bench/build_wheels.sh) the
      # checkpoint, LoRA and structured-output tests need: without them 9 tests fail and a file skips (AU).
      install_wheels
      log="$OUT/gpu_tests.log"; [[ $part = tests-? ]] && log="$OUT/gpu_$part.log"
      OMP_NUM_THREADS=$TESTS_OMP timeout ${TESTS_TIMEOUT:-540} python3 -m pytest $sel $ignores -q --maxfail=25 -p no:cacheprovider -rs \
        --durations=15 2>&1 | tee "$log" | tail -40 ;;
    kernels)
      timeout 180 python3 bench/kernels_bench.py > "$OUT/kernels.raw" 2>>"$OUT/suite.log"
      timeout 120 python3 bench/varlen_bench.py >> "$OUT/kernels.raw" 2>>"$OUT/suite.log"; tag "$OUT/kernels.raw" "$OUT/kernels.jsonl"; cat "$OUT/kernels.jsonl" ;;
    throughput)
      for run in "qwen3-0.6b nano uniform" "llama3-8b nano"; do
        RESULTS="$OUT/throughput.raw" timeout 170 python3 bench/peer_bench.py tokenmill $run 2>&1 | grep -v "^\s*$" | tail -5
      done
      tag "$OUT/throughput.raw" "$OUT/throughput.jsonl"; : > "$OUT/throughput.raw" ;;
    throughput-fp8)  # kv_cache_dtype="fp8": not the protocols' bf16, recorded as its own engine (P1, P5, P3; then P3
                     # with fp8 weights too, engine tokenmill_fp8_fp8kv)
      for run in "tokenmill_fp8kv qwen3-0.6b nano prefill" "tokenmill_fp8kv llama3-8b nano" "tokenmill_fp8_fp8kv llama3-8b nano"; do
        RESULTS="$OUT/throughput_fp8.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 150 python3 bench/peer_bench.py $run 2>&1 | grep -v "^\s*$" | tail -3
      done
      tag "$OUT/throughput_fp8.raw" "$OUT/throughput.jsonl"; : > "$OUT/throughput_fp8.raw" ;;
    throughput-det)  # deterministic=True (issue 21): P1-P3 in deterministic mode, rows tagged tokenmill_deterministic
      for run in "qwen3-0.6b nano uniform" "llama3-8b nano"; do
        RESULTS="$OUT/throughput_det.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 240 python3 bench/peer_bench.py tokenmill_deterministic $run 2>&1 | grep -v "^\s*$" | tail -3
      done
      tag "$OUT/throughput_det.raw" "$OUT/throughput.jsonl"; : > "$OUT/throughput_det.raw" ;;
    deterministic)  # deterministic mode's GPU tests, then its kernels against the default ones
      timeout 300 python3 -m pytest tests/gpu/test_deterministic_gpu.py "tests/gpu/test_engine_gpu.py::test_no_kernel_is_compiled_during_a_run" \
        -q --maxfail=8 -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests_det.log" | tail -12
      timeout 240 python3 bench/deterministic_bench.py --quick > "$OUT/det.raw" 2>>"$OUT/suite.log"; tag "$OUT/det.raw" "$OUT/kernels.jsonl"; cat "$OUT/det.raw" ;;
    quant-tests)  # issue 18's GPU tests alone (also part of "tests")
      install_wheels  # compressed-tensors, gguf
      OMP_NUM_THREADS=$TESTS_OMP timeout 420 python3 -m pytest tests/gpu/test_quant_kernels_gpu.py tests/gpu/test_quant_engine_gpu.py tests/gpu/test_block_fp8_gpu.py -q --maxfail=8 -p no:cacheprovider -rs 2>&1 | tee "$OUT/quant_tests.log" | tail -15 ;;
    quant-gemm)  # W4A16 and fp8 GEMMs against bf16 cuBLAS on the 8B projections (rows: bench/results/gpu_quant_gemm.jsonl);
                 # QUANT_GEMM_KINDS="w4a16" (or fp8, fused, block) runs only those
      timeout 450 python3 bench/quant_gemm_bench.py ${QUANT_GEMM_KINDS:-} > "$OUT/quant_gemm.raw" 2>>"$OUT/suite.log"; tag "$OUT/quant_gemm.raw" "$OUT/quant_gemm.jsonl"; : > "$OUT/quant_gemm.raw"; cat "$OUT/quant_gemm.jsonl" ;;
    fp8-tiles)  # the swapped fp8 GEMM past 64 tokens on larger tiles beside _scaled_mm, and tile rules scored (docs/perf.md 81)
      timeout 300 python3 bench/fp8_tile_sweep.py > "$OUT/fp8_tiles.raw" 2>>"$OUT/suite.log"; tag "$OUT/fp8_tiles.raw" "$OUT/quant_gemm.jsonl"; : > "$OUT/fp8_tiles.raw"; tail -2 "$OUT/quant_gemm.jsonl" ;;
    quant-throughput)  # P3 with quantization="fp8" beside bf16 P3, and 8B 32-sequence decode bf16 / W4A16 / fp8
      RESULTS="$OUT/quant_throughput.raw" timeout 170 python3 bench/peer_bench.py tokenmill llama3-8b nano 2>&1 | grep -v "^\s*$" | tail -2
      RESULTS="$OUT/quant_throughput.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 170 python3 bench/peer_bench.py tokenmill_fp8 llama3-8b nano 2>&1 | grep -v "^\s*$" | tail -2
      for variant in bf16 w4a16 fp8; do
        RESULTS="$OUT/quant_throughput.raw" timeout 150 python3 bench/quant_decode_bench.py $variant 2>&1 | grep -v "^\s*$" | tail -2
      done
      tag "$OUT/quant_throughput.raw" "$OUT/throughput.jsonl"; : > "$OUT/quant_throughput.raw" ;;
    quant-decode96)  # 96 sequences (the decode graphs' 96-row bucket, two 64-row W4A16 tiles): bf16 against W4A16
      for variant in bf16 w4a16; do
        RESULTS="$OUT/quant_throughput.raw" timeout 150 python3 bench/quant_decode_bench.py $variant 96 2>&1 | grep -v "^\s*$" | tail -2
      done
      tag "$OUT/quant_throughput.raw" "$OUT/throughput.jsonl"; : > "$OUT/quant_throughput.raw" ;;
    controls-tests)  # issue 17's GPU tests alone (also part of "tests"): sleep memory, wake/reload/update, cpu_offload, profiler
      timeout 300 python3 -m pytest tests/gpu/test_engine_controls_gpu.py -q --maxfail=8 -p no:cacheprovider -rs 2>&1 | tee "$OUT/controls_tests.log" | tail -15 ;;
    offload)  # what cpu_offload_gb costs: 64x128 greedy decode with none / half of the weights streamed from pinned CPU memory
              # (OFFLOAD_SHAPES picks the shapes; both by default)
      for shape in ${OFFLOAD_SHAPES:-qwen3-0.6b llama3-8b}; do for fraction in 0 0.5; do run="$shape $fraction"
        RESULTS="$OUT/offload.raw" timeout 200 python3 bench/offload_bench.py $run 2>&1 | grep -v "^\s*$" | tail -2
      done; done
      tag "$OUT/offload.raw" "$OUT/throughput.jsonl"; : > "$OUT/offload.raw" ;;
    moe)  # the fused MoE layer: its GPU tests (also part of "tests"), then fused_experts against a per-expert torch loop
          # on Qwen3-30B-A3B's and Mixtral-8x7B's experts at T 1-8192, both tile classes timed (MOE_MODELS picks models)
      OMP_NUM_THREADS=$TESTS_OMP timeout 300 python3 -m pytest tests/gpu/test_moe_gpu.py -q --maxfail=8 -p no:cacheprovider -rs \
        --durations=5 2>&1 | tee "$OUT/moe_tests.log" | tail -12
      timeout 450 python3 bench/moe_bench.py ${MOE_MODELS:-} > "$OUT/moe.raw" 2>>"$OUT/suite.log"; tag "$OUT/moe.raw" "$OUT/moe.jsonl"; : > "$OUT/moe.raw"; cat "$OUT/moe.jsonl" ;;
    moe-sweep)  # tiles of the fused MoE GEMMs swept on three expert shapes, and the best rule of a tile per bucket of pairs
                # an expert (bench/moe_tile_sweep.py; MOE_SWEEP_ARGS: shapes, --vllm for vLLM's fused_experts beside);
                # the rule row is kept in /tmp/moe_rule.json for moe-ab on the same machine
      timeout ${MOE_SWEEP_TIMEOUT:-420} python3 bench/moe_tile_sweep.py ${MOE_SWEEP_ARGS:-} > "$OUT/moe_sweep.raw" 2>>"$OUT/suite.log"
      grep '"moe_tile_rule"' "$OUT/moe_sweep.raw" | tail -1 > /tmp/moe_rule.json.new && [ -s /tmp/moe_rule.json.new ] && mv /tmp/moe_rule.json.new /tmp/moe_rule.json
      tag "$OUT/moe_sweep.raw" "$OUT/moe.jsonl"; : > "$OUT/moe_sweep.raw"; tail -1 "$OUT/moe.jsonl" ;;
    moe-ab)  # Qwen3-30B-A3B's shape end to end (MOE_WORKLOADS, default nano uniform): the engine's MoE tiles, then
             # moe-sweep's rule (/tmp/moe_rule.json) through bench/tokenmill_moe_tiles.py
      for engine in tokenmill tokenmill_moe_tiles; do
        [ $engine = tokenmill_moe_tiles ] && [ ! -s /tmp/moe_rule.json ] && { echo "moe-ab: no rule"; continue; }
        TOKENMILL_MOE_TILES=/tmp/moe_rule.json RESULTS="$OUT/moe_engine.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" \
          timeout ${MOE_AB_TIMEOUT:-280} python3 bench/moe_peer_bench.py $engine qwen3-30b-a3b ${MOE_WORKLOADS:-nano uniform} 2>&1 \
          | grep -v "^\s*$" | tail -3
      done
      tag "$OUT/moe_engine.raw" "$OUT/throughput.jsonl"; : > "$OUT/moe_engine.raw" ;;
    moe-ab-old)  # Qwen3-30B-A3B's shape end to end (MOE_WORKLOADS, default nano uniform): an older engine in .old/ (made here
                 # with `git worktree add --detach .old <sha>`, carried) beside this tree, old first, in one call (rows' "tree")
      [ -d .old/tokenmill ] || { echo "moe-ab-old: no .old/ tree carried"; continue; }
      for tree in old new; do
        dir=$PWD; [ $tree = old ] && dir=$PWD/.old
        (cd "$dir" && RESULTS="$OUT/moe_ab.raw" PYTHONPATH="$dir" timeout ${MOE_AB_TIMEOUT:-280} \
          python3 bench/moe_peer_bench.py tokenmill qwen3-30b-a3b ${MOE_WORKLOADS:-nano uniform} 2>&1 | grep -v "^\s*$" | tail -2)
        mark_tree "$tree" "$OUT/moe_ab.raw"
      done
      tag "$OUT/moe_ab.raw" "$OUT/throughput.jsonl"; : > "$OUT/moe_ab.raw" ;;
    memory-plan)  # the GPU memory plan (docs/perf.md 88-89): its GPU test (the real peak inside the plan), then the plan's
                  # line and the run's time for Qwen3-30B-A3B's P1 requests and Qwen3-0.6B's P2 (profile_step --timeline)
      OMP_NUM_THREADS=$TESTS_OMP timeout 200 python3 -m pytest tests/gpu/test_memory_plan_gpu.py -q -p no:cacheprovider -rs 2>&1 \
        | tee "$OUT/memory_plan_tests.log" | tail -3
      for run in "qwen3-30b-a3b nano" "qwen3-0.6b uniform"; do
        timeout 160 python3 bench/profile_step.py $run --timeline > "$OUT/plan_${run// /_}.txt" 2>&1
        grep -E "GPU memory|generate:" "$OUT/plan_${run// /_}.txt"
      done ;;
    timeline-moe)  # Qwen3-30B-A3B's P1 and P2 requests by step kind and batch size, with the run's preemptions (the
                   # re-prefills of preempted sequences are prompt steps too: entry 90's note on uniform's 0.95x)
      for workload in ${MOE_WORKLOADS:-nano uniform}; do
        timeout 200 python3 bench/profile_step.py qwen3-30b-a3b $workload --timeline > "$OUT/timeline_moe_$workload.txt" 2>&1
        grep -E "GPU memory|generate:|prompt tokens" "$OUT/timeline_moe_$workload.txt"
      done ;;
    moe-engine)  # MoE decoders end to end (tests/gpu/test_moe_engine_gpu.py), then P1's and P2's requests on
                 # Qwen3-30B-A3B's shape, and P1's with quantization="fp8" (bench/moe_peer_bench.py; beside vllm-moe)
      OMP_NUM_THREADS=$TESTS_OMP timeout 240 python3 -m pytest tests/gpu/test_moe_engine_gpu.py -q --maxfail=4 -p no:cacheprovider -rs \
        2>&1 | tee "$OUT/moe_engine_tests.log" | tail -8
      RESULTS="$OUT/moe_engine.raw" timeout 330 python3 bench/moe_peer_bench.py tokenmill qwen3-30b-a3b nano uniform 2>&1 | grep -v "^\s*$" | tail -3
      RESULTS="$OUT/moe_engine.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 200 \
        python3 bench/moe_peer_bench.py tokenmill_fp8 qwen3-30b-a3b nano 2>&1 | grep -v "^\s*$" | tail -2
      tag "$OUT/moe_engine.raw" "$OUT/throughput.jsonl"; : > "$OUT/moe_engine.raw" ;;
    lora)  # LoRA adapters: P1's and P2's requests on Qwen3-0.6B's shape with enable_lora off (base), on without
           # adapters (lora-none, max_loras=4), one adapter (lora-1) and four (lora-4), rank 16 on every projection
           # (bench/lora_bench.py; beside vllm-lora; LORA_MODES picks modes, LORA_WORKLOADS the workloads: refill-short ...)
      for mode in ${LORA_MODES:-base lora-none lora-1 lora-4}; do
        RESULTS="$OUT/lora.raw" timeout 150 python3 bench/lora_bench.py tokenmill qwen3-0.6b $mode ${LORA_WORKLOADS:-nano uniform} 2>&1 | grep -v "^\s*$" | tail -2
      done
      tag "$OUT/lora.raw" "$OUT/throughput.jsonl"; : > "$OUT/lora.raw" ;;
    lora-ab-old)  # the lora part on an older engine in .old/ (carried) and on this tree, old then new, AB_ROUNDS times,
                  # the order swapped each round (LORA_MODES default lora-4, LORA_WORKLOADS default nano); rows carry "tree"
      [ -d .old/tokenmill ] || { echo "lora-ab-old: no .old/ tree carried"; continue; }
      for round in $(seq "${AB_ROUNDS:-2}"); do
        trees="old new"; [ $((round % 2)) = 0 ] && trees="new old"
        for tree in $trees; do
          path=$PWD; [ $tree = old ] && path=$PWD/.old
          for mode in ${LORA_MODES:-lora-4}; do
            RESULTS="$OUT/lora.raw" PYTHONPATH="$path:$PYTHONPATH" timeout 150 python3 bench/lora_bench.py tokenmill \
              qwen3-0.6b $mode ${LORA_WORKLOADS:-nano} 2>&1 | grep -v "^\s*$" | tail -2
            mark_tree "$tree" "$OUT/lora.raw"
          done
        done
      done
      tag "$OUT/lora.raw" "$OUT/throughput.jsonl"; : > "$OUT/lora.raw" ;;
    gemm)  # cuBLAS against a Triton tile sweep on the decode GEMM shapes (a prototype question)
      timeout 150 python3 bench/gemm_bench.py > "$OUT/gemm.raw" 2>>"$OUT/suite.log"; tag "$OUT/gemm.raw" "$OUT/gemm.jsonl"; cat "$OUT/gemm.jsonl" ;;
    gemm-sweep)  # M 1-256: cuBLAS, cuBLASLt, W^T stored, the swapped split-K kernel on bf16 (rows: gpu_gemm.jsonl)
      timeout 240 python3 bench/gemm_bench.py --decode-sweep > "$OUT/gemm_sweep.raw" 2>>"$OUT/suite.log"; tag "$OUT/gemm_sweep.raw" "$OUT/gemm_sweep.jsonl"; cat "$OUT/gemm_sweep.jsonl" ;;
    sampler)  # the sampling kernels alone: temperature, filters, penalties at 64 / 256 / 1,024 rows
      timeout 300 python3 bench/sampler_bench.py --json > "$OUT/sampler.raw" 2>>"$OUT/suite.log"
      grep -v '^{' "$OUT/sampler.raw"; tag "$OUT/sampler.raw" "$OUT/sampler.jsonl"; : > "$OUT/sampler.raw" ;;
    sampler-ab-old)  # the sampler bench on an older engine in .old/ (carried) and on this tree, old then new, AB_ROUNDS
                     # times (default 2); rows carry "tree" (docs/perf.md 102: the draw's noise by lg2.approx)
      [ -d .old/tokenmill ] || { echo "sampler-ab-old: no .old/ tree carried"; continue; }
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for tree in old new; do
          path=$PWD; [ $tree = old ] && path=$PWD/.old
          # Each tree's own copy of the bench: it puts its tree's root first on sys.path.
          timeout 300 python3 "$path/bench/sampler_bench.py" --json > "$OUT/sampler.raw" 2>>"$OUT/suite.log"
          grep -v '^{' "$OUT/sampler.raw" | sed "s/^/$tree: /"
          sed -i "/^{/s/^{/{\"tree\": \"$tree\", /" "$OUT/sampler.raw"
          tag "$OUT/sampler.raw" "$OUT/sampler.jsonl"; : > "$OUT/sampler.raw"
        done
      done ;;
    sampler-rounds)  # top-p alone (0.5 / 0.9 / 0.95) with 0-3 argmax rounds: 0 is the exact path alone (perf.md 51)
      timeout 500 python3 bench/sampler_bench.py --json --cases "top_p 0.5" "top_p 0.9" "top_p 0.95" --rounds 0 1 2 3 \
        > "$OUT/sampler.raw" 2>>"$OUT/suite.log"
      grep -v '^{' "$OUT/sampler.raw"; tag "$OUT/sampler.raw" "$OUT/sampler.jsonl"; : > "$OUT/sampler.raw" ;;
    grammar-host)  # structured outputs' host work a step (xgrammar's masks and token steps) by thread count; needs
                   # .bench_tokenizer/ and xgrammar (.whl) carried
      RESULTS="$OUT/grammar_host.raw" timeout 150 python3 bench/grammar_host_bench.py --rows 128 512 --threads 1 2 4 8 \
        2>>"$OUT/suite.log"; tag "$OUT/grammar_host.raw" "$OUT/grammar_host.jsonl"; : > "$OUT/grammar_host.raw" ;;
    chat|chat-8b)  # the chat workload: temperature only, + top_p 0.9, + top_k 50, + top_k 100 & top_p 0.95, + repetition_penalty 1.1, all, logit bias, logprobs 1 / 2, min_tokens (a stop id banned every step)
                   # (the default); json, only when named (CHAT_VARIANTS="temperature json"): a JSON schema through structured
                   # outputs; needs .bench_tokenizer/ carried (bench/prepare_bench_tokenizer.sh) and xgrammar, which the image
                   # lacks: from .whl (bench/build_wheels.sh) when carried and installed, else linked from the vLLM bundle
                   # (unpacked by vllm-unpack; its xgrammar 0.2.7, the one vLLM runs). CHAT_FLAGS=--matched-vocab: the
                   # model's vocabulary cut to the tokenizer's (json beside vLLM without this bench's padding ids)
      [ "$part" = chat ] && shape=qwen3-0.6b || shape=llama3-8b
      xgr=""
      if [[ " ${CHAT_VARIANTS:-} " == *" json "* ]] && ! python3 -c "import xgrammar" 2>/dev/null; then
        [ -d /tmp/vllm-site/vllm ] || bash "$0" vllm-unpack
        mkdir -p /tmp/xgr-site
        for p in /tmp/vllm-site/{xgrammar,tvm_ffi,apache_tvm_ffi,pydantic,annotated_types,typing_inspection,typing_extensions}*; do
          ln -sfn "$p" /tmp/xgr-site/
        done
        xgr=/tmp/xgr-site:
      fi
      PYTHONPATH="$xgr$PYTHONPATH" RESULTS="$OUT/chat.raw" timeout 450 python3 bench/workload_bench.py tokenmill $shape ${CHAT_VARIANTS:-} ${CHAT_FLAGS:-} 2>&1 | grep -E '^(\{|WARNING)'
      tag "$OUT/chat.raw" "$OUT/throughput.jsonl"; : > "$OUT/chat.raw" ;;
    chat-ab-old)  # the chat workload (CHAT_VARIANTS, default temperature min_tokens) on an older engine in .old/ (carried, as for
                  # moe-ab-old) and on this tree, both through this tree's workload_bench.py, old first; rows carry "tree"
      [ -d .old/tokenmill ] || { echo "chat-ab-old: no .old/ tree carried"; continue; }
      for tree in old new; do
        path=$PWD; [ $tree = old ] && path=$PWD/.old
        RESULTS="$OUT/chat_ab.raw" PYTHONPATH="$path:$PYTHONPATH" timeout 280 python3 bench/workload_bench.py tokenmill qwen3-0.6b \
          ${CHAT_VARIANTS:-temperature min_tokens} 2>&1 | grep -E '^(\{|WARNING)'
        mark_tree "$tree" "$OUT/chat_ab.raw"
      done
      tag "$OUT/chat_ab.raw" "$OUT/throughput.jsonl"; : > "$OUT/chat_ab.raw" ;;
    protocol-ab-old)  # P1 and P5 (peer_bench.py, each in its own process, so each is a process's first call as in the
                      # protocols) on an older engine in .old/ (carried, as for moe-ab-old) and on this tree, old then new,
                      # AB_ROUNDS times (default 2); rows carry "tree"
      [ -d .old/tokenmill ] || { echo "protocol-ab-old: no .old/ tree carried"; continue; }
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for tree in old new; do
          path=$PWD; [ $tree = old ] && path=$PWD/.old
          for workload in nano prefill; do
            RESULTS="$OUT/protocol_ab.raw" PYTHONPATH="$path:$PYTHONPATH" timeout 170 python3 bench/peer_bench.py tokenmill \
              qwen3-0.6b $workload 2>&1 | grep -E '^\{'
            mark_tree "$tree" "$OUT/protocol_ab.raw"
          done
        done
      done
      tag "$OUT/protocol_ab.raw" "$OUT/throughput.jsonl"; : > "$OUT/protocol_ab.raw" ;;
    refill)  # many more requests than run at once (bench/refill_bench.py: short 8,192 x 16 tokens, long 4,096 of
             # P1's lengths): prompts admitted beside running decodes every step, which P1-P5 never reach; then
             # where each one's time goes, steps with prompt tokens apart from decode-only ones (profile_step.py --timeline)
      RESULTS="$OUT/refill.raw" timeout 300 python3 bench/refill_bench.py tokenmill qwen3-0.6b ${REFILL_WORKLOADS:-short long} 2>&1 | grep -E '^\{'
      tag "$OUT/refill.raw" "$OUT/throughput.jsonl"; : > "$OUT/refill.raw"
      for workload in ${REFILL_WORKLOADS:-short long}; do
        timeout 200 python3 bench/profile_step.py qwen3-0.6b refill:$workload --timeline > "$OUT/timeline_refill_$workload.txt" 2>&1
        tail -12 "$OUT/timeline_refill_$workload.txt"
      done ;;
    beam)  # LLM.beam_search (bench/beam_bench.py: 256 prompts, 64 tokens a beam; BEAM_WIDTHS, default 4)
      RESULTS="$OUT/beam.raw" timeout 300 python3 bench/beam_bench.py tokenmill qwen3-0.6b ${BEAM_WIDTHS:-4} 2>&1 | grep -E '^\{'
      tag "$OUT/beam.raw" "$OUT/throughput.jsonl"; : > "$OUT/beam.raw" ;;
    job)  # the batch job (tokenmill run's loop) beside LLM.generate on P1's and P2's requests, one process, alternating (perf.md 69)
      RESULTS="$OUT/job.raw" timeout 400 python3 bench/job_bench.py qwen3-0.6b nano uniform 2>&1 | grep -E '^\{'
      tag "$OUT/job.raw" "$OUT/throughput.jsonl"; : > "$OUT/job.raw" ;;
    job-short)  # short requests (8,192 text / chat prompts, 16 tokens out) through the batch job beside generate / chat (perf.md 70);
                # needs .bench_tokenizer/; the tokenizer's threads on, as a user's process has them
      env -u TOKENIZERS_PARALLELISM RESULTS="$OUT/job.raw" timeout 400 python3 bench/job_bench.py qwen3-0.6b short-text short-chat \
        ${JOB_ROUNDS:+--rounds $JOB_ROUNDS} 2>&1 | grep -E '^\{'
      tag "$OUT/job.raw" "$OUT/throughput.jsonl"; : > "$OUT/job.raw" ;;
    job-score)  # a scoring job (8,192 texts of 64-512 words, prompt_logprobs=0, one token out, text decoded) through
                # the batch job beside generate; needs .bench_tokenizer/
      env -u TOKENIZERS_PARALLELISM RESULTS="$OUT/job.raw" timeout 400 python3 bench/job_bench.py qwen3-0.6b score-text \
        ${JOB_ROUNDS:+--rounds $JOB_ROUNDS} 2>&1 | grep -E '^\{'
      tag "$OUT/job.raw" "$OUT/throughput.jsonl"; : > "$OUT/job.raw" ;;
    job-embed)  # P6's inputs through an embedding job (tokenmill run --task embed's loop) beside LLM.embed, alternating (perf.md 106)
      # Rows and any error line: a run that died at once printed nothing here before (perf.md 107).
      RESULTS="$OUT/job.raw" timeout 500 python3 bench/embed_job_bench.py ${JOB_EMBED_SHAPES:-} ${JOB_ROUNDS:+--rounds $JOB_ROUNDS} 2>&1 \
        | grep -E '^\{|rror'
      tag "$OUT/job.raw" "$OUT/throughput.jsonl"; : > "$OUT/job.raw" ;;
    job-embed-ab-old)  # job-embed on an older engine in .old/ (carried: .old/tokenmill is enough) and on this tree, old
                       # then new, AB_ROUNDS times (default 1; each run alternates job and embed JOB_ROUNDS times); rows carry "tree"
      [ -d .old/tokenmill ] || { echo "job-embed-ab-old: no .old/ tree carried"; continue; }
      for round in $(seq "${AB_ROUNDS:-1}"); do
        for tree in old new; do
          path=$PWD; [ $tree = old ] && path=$PWD/.old
          RESULTS="$OUT/job.raw" PYTHONPATH="$path:$PYTHONPATH" timeout 300 python3 bench/embed_job_bench.py ${JOB_EMBED_SHAPES:-} \
            ${JOB_ROUNDS:+--rounds $JOB_ROUNDS} 2>&1 | grep -E '^\{|rror'
          [ -f "$OUT/job.raw" ] && mark_tree "$tree" "$OUT/job.raw"
        done
      done
      tag "$OUT/job.raw" "$OUT/throughput.jsonl"; : > "$OUT/job.raw" ;;
    profile)
      timeout 150 python3 bench/profile_step.py qwen3-0.6b nano > "$OUT/profile_p1.txt" 2>&1; head -45 "$OUT/profile_p1.txt" ;;
    timeline)
      for shape in qwen3-0.6b llama3-8b; do
        timeout 120 python3 bench/profile_step.py $shape nano --timeline > "$OUT/timeline_$shape.txt" 2>&1; tail -9 "$OUT/timeline_$shape.txt"
      done ;;
    first-call)  # what a process's first big generate call pays that its second does not (asked in perf.md 96, answered in
                 # 99: the eager logits GEMM at new row counts, now warmed in LLM()): P1's requests
                 # twice in one process, the second over moved token ids (profile_step.py --timeline --calls=2), then
                 # three runs that each take one suspect away before call 1: every CUDA graph launched once after
                 # start-up (graphs: the driver uploads a graph at its first launch), the GPU kept busy for 1 s
                 # (gpu: clocks coming up from the start-up's idle), every CUDA kernel loaded at start-up
                 # (eager: CUDA_MODULE_LOADING=EAGER against lazy loading); then P5's requests. Beside each run the
                 # GPU's clocks and performance state every 100 ms (first_call_*_clocks.csv; each call's line in the
                 # timeline gives its start in the same time format).
      for run in "nano" "nano graphs" "nano gpu" "nano eager" "prefill"; do
        read -r workload suspect <<< "$run"; name=first_call_$workload${suspect:+_$suspect}
        flags=""; envs=""
        case $suspect in graphs|gpu) flags=--prime=$suspect ;; eager) envs=CUDA_MODULE_LOADING=EAGER ;; esac
        nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader \
          -lms 100 > "$OUT/${name}_clocks.csv" 2>&1 & clocks=$!
        env $envs timeout 200 python3 bench/profile_step.py qwen3-0.6b $workload --timeline --calls=2 $flags \
          > "$OUT/$name.txt" 2>&1
        kill $clocks 2>/dev/null; wait $clocks 2>/dev/null
        echo "== $name"; grep -E "^(replayed|kept|generate|-- call|steps with prompt|decode steps with (1-16|193-256|257))" "$OUT/$name.txt"
      done ;;
    timeline-fp8kv)  # P1 and P3 over an fp8 cache, by batch size (perf.md 28: 1.29x / 1.12x where the attention kernel
                     # alone gave ~1.4x / ~1.2x; at ea5083c P1's 193-256-sequence steps waited only 0.58 of 6.64 ms for the
                     # GPU: is the host now the limit?)
      for shape in qwen3-0.6b llama3-8b; do
        timeout 120 python3 bench/profile_step.py $shape nano --timeline --fp8-cache > "$OUT/timeline_${shape}_fp8kv.txt" 2>&1
        tail -9 "$OUT/timeline_${shape}_fp8kv.txt"
      done ;;
    ncu-w4a16|ncu-fp8)  # Nsight Compute over a decode GEMM: occupancy, scheduler and stall reasons (raw page).
                        # w4a16 (docs/perf.md 35, 38): the engine's K split and a larger one on gate_up, down, qkv.
                        # fp8 (perf.md 37, 39): the swapped kernel on several row tiles at 4 stages against 6
                        # (O's 71 µs on down at M = 128 did not reproduce: 32.0 against 27.9); its fixed cost at M = 1.
      if [ "$part" = ncu-w4a16 ]; then
        kernel=_w4a16_kernel; cases=("gate_up 16" "gate_up 16 split_k=4" "down 4" "down 4 split_k=16" "qkv 1" "qkv 1 split_k=16")
      else
        kernel=_fp8_swapped_kernel; cases=("down 128 num_stages=4" "down 128" "o 128 num_stages=4" "o 128" "gate_up 128 num_stages=4" "o 1")
      fi
      for case in "${cases[@]}"; do
        echo "== $case" >> "$OUT/$part.txt"
        timeout 90 /usr/local/cuda/bin/ncu --kernel-name regex:$kernel --launch-skip 3 --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats \
          --section MemoryWorkloadAnalysis --page raw python3 bench/decode_gemm_launches.py ${part#ncu-} $case >> "$OUT/$part.txt" 2>&1
      done
      grep -E "^== |config|gpu__time_duration.sum|sm__warps_active.avg.pct_of_peak|smsp__issue_active.avg.pct|stalled.*per_issue_active|dram__throughput.avg.pct|lts__t_sector_hit_rate.pct|launch__occupancy_limit|sm__ctas_launched" \
        "$OUT/$part.txt" | grep -v "  0$" | head -200 ;;
    profile-gpu)
      for shape in qwen3-0.6b llama3-8b; do
        timeout 150 python3 bench/profile_step.py $shape nano --gpu > "$OUT/profile_gpu_$shape.txt" 2>&1; head -32 "$OUT/profile_gpu_$shape.txt"
      done ;;
    profile-moe)  # Qwen3-30B-A3B's P1 requests under torch.profiler's step windows: the MoE layer's kernels at prompt and decode sizes
      timeout 240 python3 bench/profile_step.py qwen3-30b-a3b nano --gpu > "$OUT/profile_gpu_moe.txt" 2>&1; grep "^==" "$OUT/profile_gpu_moe.txt" ;;
    profile-refill)  # refill_bench.py's long workload: the host under cProfile, then torch.profiler's windows (device and host time by op)
      timeout 200 python3 bench/profile_step.py qwen3-0.6b refill:long > "$OUT/profile_refill_host.txt" 2>&1; head -60 "$OUT/profile_refill_host.txt"
      timeout 200 python3 bench/profile_step.py qwen3-0.6b refill:long --gpu > "$OUT/profile_refill_gpu.txt" 2>&1; grep "^==" "$OUT/profile_refill_gpu.txt" ;;
    profile-chat)  # the chat workload on the 0.6B, temperature only against repetition_penalty 1.1: wall time by batch size
                   # with the host's wait for the GPU, then GPU time by kernel (issue 15 part 1; perf.md 53)
      for variant in temperature repetition; do
        timeout 100 python3 bench/profile_step.py qwen3-0.6b chat:$variant --timeline > "$OUT/timeline_chat_$variant.txt" 2>&1
        timeout 150 python3 bench/profile_step.py qwen3-0.6b chat:$variant --gpu > "$OUT/profile_gpu_chat_$variant.txt" 2>&1
        tail -12 "$OUT/timeline_chat_$variant.txt"; head -40 "$OUT/profile_gpu_chat_$variant.txt"
      done ;;
    launch-gap)  # what a kernel boundary costs in a CUDA graph, with and without programmatic dependent launch (perf.md 40)
      timeout 120 python3 bench/launch_gap_bench.py > "$OUT/launch_gap.raw" 2>>"$OUT/suite.log"; tag "$OUT/launch_gap.raw" "$OUT/kernels.jsonl"; cat "$OUT/launch_gap.raw" ;;
    profile-gpu-fp8)  # P3's GPU time by kernel on fp8 weights beside bf16 (issue 18: what the last ~4% to 1.3x would come from)
      for variant in "" --fp8-weights; do
        timeout 200 python3 bench/profile_step.py llama3-8b nano --gpu $variant > "$OUT/profile_gpu_llama3-8b${variant:+_fp8}.txt" 2>&1
        head -40 "$OUT/profile_gpu_llama3-8b${variant:+_fp8}.txt"
      done ;;
    p4)  # sampling: top_p/top_k/penalties, shared prefix, both shapes
      for run in "qwen3-0.6b sampling" "llama3-8b sampling"; do
        RESULTS="$OUT/throughput.raw" timeout 240 python3 bench/peer_bench.py tokenmill $run 2>&1 | grep -v "^\s*$" | tail -3
      done
      tag "$OUT/throughput.raw" "$OUT/throughput.jsonl"; : > "$OUT/throughput.raw" ;;
    p5)  # long prompts, short outputs
      RESULTS="$OUT/throughput.raw" timeout 150 python3 bench/peer_bench.py tokenmill qwen3-0.6b prefill 2>&1 | grep -v "^\s*$" | tail -3
      tag "$OUT/throughput.raw" "$OUT/throughput.jsonl"; : > "$OUT/throughput.raw" ;;
    p1p5)  # P1 and P5 alone, each in its own process (each a process's first call, as the protocols run them)
      for workload in nano prefill; do
        RESULTS="$OUT/throughput.raw" timeout 170 python3 bench/peer_bench.py tokenmill qwen3-0.6b $workload 2>&1 | grep -E '^\{'
      done
      tag "$OUT/throughput.raw" "$OUT/throughput.jsonl"; : > "$OUT/throughput.raw" ;;
    p6-calls)  # P6's embed call twice in one process (bench/embed_calls.py), the second over moved ids: what a pooling
               # engine's first call pays that its second does not (docs/perf.md 99-100)
      for shape in qwen3-embed-0.6b bert-minilm; do
        RESULTS="$OUT/embed_calls.raw" timeout 200 python3 bench/embed_calls.py tokenmill $shape 2 2>&1 | grep -E '^\{'
      done
      tag "$OUT/embed_calls.raw" "$OUT/throughput.jsonl"; : > "$OUT/embed_calls.raw" ;;
    p6-calls-ab-old)  # p6-calls on an older engine in .old/ (carried) and on this tree, old then new, AB_ROUNDS times
                      # (default 2); rows carry "tree"
      [ -d .old/tokenmill ] || { echo "p6-calls-ab-old: no .old/ tree carried"; continue; }
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for tree in old new; do
          path=$PWD; [ $tree = old ] && path=$PWD/.old
          for shape in qwen3-embed-0.6b bert-minilm; do
            RESULTS="$OUT/embed_calls.raw" PYTHONPATH="$path:$PYTHONPATH" timeout 200 python3 bench/embed_calls.py tokenmill \
              $shape 2 2>&1 | grep -E '^\{'
            mark_tree "$tree" "$OUT/embed_calls.raw"
          done
        done
      done
      tag "$OUT/embed_calls.raw" "$OUT/throughput.jsonl"; : > "$OUT/embed_calls.raw" ;;
    p6)  # embeddings, input tokens/s
      for shape in qwen3-embed-0.6b bert-minilm; do
        RESULTS="$OUT/embed.raw" timeout 150 python3 bench/embed_bench.py tokenmill $shape 2>&1 | grep -v "^\s*$" | tail -3
      done
      tag "$OUT/embed.raw" "$OUT/throughput.jsonl"; : > "$OUT/embed.raw" ;;
    batch-sweep)  # decode attention at P1's batch sizes (graph buckets 16-256, ragged contexts) , P2's 1,024, P5's long contexts, bf16 and fp8 caches: K splits, tiles (~100 s a head layout; --heads 32 for Llama-3-8B's)
      timeout 400 python3 bench/kernels_bench.py --batch-sweep > "$OUT/batch_sweep.raw" 2>>"$OUT/suite.log"; tag "$OUT/batch_sweep.raw" "$OUT/kernels.jsonl"
      grep -c us_median "$OUT/batch_sweep.raw"; : > "$OUT/batch_sweep.raw" ;;
    order-sweep)  # the same decode steps with their rows request-ordered, longest first, shortest first, uniform (dispatch-order tails)
      timeout 300 python3 bench/kernels_bench.py --order-sweep > "$OUT/order_sweep.raw" 2>>"$OUT/suite.log"; tag "$OUT/order_sweep.raw" "$OUT/kernels.jsonl"
      grep -c us_median "$OUT/order_sweep.raw"; : > "$OUT/order_sweep.raw" ;;
    queue-sweep)  # the item-queue decode kernel against the default launch, bucket by bucket (docs/perf.md 44)
      timeout 400 python3 bench/kernels_bench.py --queue-sweep > "$OUT/queue_sweep.raw" 2>>"$OUT/suite.log"; tag "$OUT/queue_sweep.raw" "$OUT/kernels.jsonl"
      grep -c us_median "$OUT/queue_sweep.raw"; : > "$OUT/queue_sweep.raw" ;;
    gc-throughput)  # P1, P5, P2 without and with the full garbage collection at the end of LLM(), alternating (docs/perf.md 49)
      for engine in tokenmill_nocollect tokenmill tokenmill_nocollect tokenmill; do
        RESULTS="$OUT/gc.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 170 python3 bench/peer_bench.py $engine qwen3-0.6b nano prefill uniform 2>&1 | grep -v "^\s*$" | tail -3
      done
      tag "$OUT/gc.raw" "$OUT/throughput.jsonl"; : > "$OUT/gc.raw" ;;
    queue-throughput|queue-throughput-fp8kv)  # P1, P5, P3 (over an fp8 cache: P1, P3) with the item queue off and on, alternating (docs/perf.md 44, 46)
      if [ "$part" = queue-throughput ]; then off=tokenmill_noqueue on=tokenmill runs=("qwen3-0.6b nano prefill" "llama3-8b nano")
      else off=tokenmill_fp8kv_noqueue on=tokenmill_fp8kv runs=("qwen3-0.6b nano" "llama3-8b nano"); fi
      for run in "${runs[@]}"; do
        for engine in $off $on $off $on; do
          RESULTS="$OUT/queue.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 170 python3 bench/peer_bench.py $engine $run 2>&1 | grep -v "^\s*$" | tail -2
        done
      done
      tag "$OUT/queue.raw" "$OUT/throughput.jsonl"; : > "$OUT/queue.raw" ;;
    kernels-coresident)  # a mixed P5 step's queued decodes beside its prefill launch on two streams (docs/perf.md 80)
      timeout 150 python3 bench/prefill_step_bench.py --coresident > "$OUT/kernels_coresident.raw" 2>>"$OUT/suite.log"; tag "$OUT/kernels_coresident.raw" "$OUT/kernels.jsonl"
      cat "$OUT/kernels_coresident.raw"; : > "$OUT/kernels_coresident.raw" ;;
    sm-partition)  # a P5-like mixed step's decodes and prompt chunks side by side on disjoint SM partitions (green contexts), by split (perf.md 113)
      for shape in "8192 256" "4096 256"; do set -- $shape
        timeout 150 python3 bench/sm_partition_probe.py --prompt-tokens $1 --decodes $2 >> "$OUT/sm_partition.raw" 2>>"$OUT/suite.log"
      done
      tag "$OUT/sm_partition.raw" "$OUT/kernels.jsonl"; cat "$OUT/sm_partition.raw"; : > "$OUT/sm_partition.raw" ;;
    side-decodes)  # P5 with the mixed steps' decodes on a side stream (SIDE_DECODES programs an SM, default 2: the best kernel row of perf.md 80) against the default, alternating
      for engine in tokenmill tokenmill_side_decodes tokenmill tokenmill_side_decodes; do
        RESULTS="$OUT/side.raw" TOKENMILL_SIDE_DECODES=${SIDE_DECODES:-2} PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 170 python3 bench/peer_bench.py $engine qwen3-0.6b prefill 2>&1 | grep -v "^\s*$" | tail -2
      done
      tag "$OUT/side.raw" "$OUT/throughput.jsonl"; : > "$OUT/side.raw" ;;
    kernels-p5)  # P5's prefill and mixed attention steps: one launch vs decodes split off, prefill tile sweep; bf16, then fp8 cache
      timeout 240 python3 bench/prefill_step_bench.py --sweep > "$OUT/kernels_p5.raw" 2>>"$OUT/suite.log"
      timeout 240 python3 bench/prefill_step_bench.py --sweep --fp8-cache >> "$OUT/kernels_p5.raw" 2>>"$OUT/suite.log"; tag "$OUT/kernels_p5.raw" "$OUT/kernels.jsonl"
      cat "$OUT/kernels_p5.raw"; : > "$OUT/kernels_p5.raw" ;;
    p1-overlap|p3-overlap|p5-overlap)  # two micro-batches on two streams (TOKENMILL_OVERLAP): the run without, then with
      case $part in
        p1-overlap) run="qwen3-0.6b nano" places=decode ;;
        p3-overlap) run="llama3-8b nano" places=decode ;;
        *) run="qwen3-0.6b prefill" places=mixed ;;
      esac
      RESULTS="$OUT/overlap.raw" timeout 200 python3 bench/peer_bench.py tokenmill $run 2>&1 | grep -v "^\s*$" | tail -2
      RESULTS="$OUT/overlap.raw" TOKENMILL_OVERLAP=$places PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 200 \
        python3 bench/peer_bench.py tokenmill_overlap $run 2>&1 | grep -v "^\s*$" | tail -2
      tag "$OUT/overlap.raw" "$OUT/throughput.jsonl"; : > "$OUT/overlap.raw" ;;
    p6-host)  # the pooling engine's host µs per request on this machine's CPU (forward stubbed), both P6 input shapes
      for shape in bert qwen3; do
        timeout 120 python3 bench/pooling_host_bench.py $shape >> "$OUT/pooling_host.raw" 2>>"$OUT/suite.log"
      done
      tag "$OUT/pooling_host.raw" "$OUT/kernels.jsonl"; cat "$OUT/pooling_host.raw"; : > "$OUT/pooling_host.raw" ;;
    ws-probe)  # causal prefill attention with Triton 3.6's Hopper warp specialisation (a probe kernel over contiguous K/V)
      # beside the same kernel without it, the engine's paged prefill and torch's SDPA back ends (docs/perf.md 109)
      # Each warp-specialised probe in its own process under a short timeout: on an H100 (BQ) none of them returned.
      for probe in 0 1 2; do
        timeout 40 python3 bench/ws_attention_probe.py --shapes 8x2048 --probes $probe --no-others >> "$OUT/ws_probe.raw" 2>&1 \
          || echo "warp-specialised probe $probe: no result within 40 s"
      done
      timeout 200 python3 bench/ws_attention_probe.py --probes 345 >> "$OUT/ws_probe.raw" 2>&1
      grep -E '^\{' "$OUT/ws_probe.raw" | python3 -c "import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['case'], r['seqs'], r['seq_len'], r.get('us'), r.get('tflops'), r.get('error', ''))"
      tag "$OUT/ws_probe.raw" "$OUT/kernels.jsonl" ;;
    prefill-ab-old)  # P5's attention steps (prefill_step_bench.py, bf16 then fp8 cache) and the probe's engine and SDPA rows on
                     # an older engine in .old/ (carried whole: its bench/ and tests/ run its kernels) and on this tree, old then
                     # new, AB_ROUNDS times (default 2); rows carry "tree" (docs/perf.md 110)
      [ -d .old/bench ] || { echo "prefill-ab-old: no .old/ tree carried with its bench/"; continue; }
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for tree in old new; do
          root=$PWD; [ $tree = old ] && root=$PWD/.old
          for cache in "" --fp8-cache; do
            PYTHONPATH="$root:$PYTHONPATH" timeout 150 python3 "$root/bench/prefill_step_bench.py" $cache 2>>"$OUT/suite.log" \
              | sed "s/^{/{\"tree\": \"$tree\", /" >> "$OUT/prefill_ab.raw"
          done
          PYTHONPATH="$root:$PYTHONPATH" timeout 150 python3 "$root/bench/ws_attention_probe.py" --probes "" 2>>"$OUT/suite.log" \
            | sed "s/^{/{\"tree\": \"$tree\", /" >> "$OUT/prefill_ab.raw"
        done
      done
      grep -E '^\{' "$OUT/prefill_ab.raw" | python3 -c "import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['tree'], r['case'], r.get('cache_dtype', ''), r.get('seqs', ''), r.get('seq_len', ''), r.get('us', r.get('us_median')), r.get('tflops', r.get('prefill_tflops', '')), r.get('error', ''))"
      tag "$OUT/prefill_ab.raw" "$OUT/kernels.jsonl"; : > "$OUT/prefill_ab.raw" ;;
    varlen-sweep)  # varlen attention tile variants on both P6 steps (the default launch rows come with kernels)
      timeout 240 python3 bench/varlen_bench.py --sweep > "$OUT/varlen.raw" 2>>"$OUT/suite.log"
      tag "$OUT/varlen.raw" "$OUT/kernels.jsonl"; cat "$OUT/varlen.raw" ;;
    profile-p5)
      timeout 150 python3 bench/profile_step.py qwen3-0.6b prefill --timeline > "$OUT/timeline_p5.txt" 2>&1; tail -12 "$OUT/timeline_p5.txt"
      timeout 150 python3 bench/profile_step.py qwen3-0.6b prefill --gpu > "$OUT/profile_gpu_p5.txt" 2>&1; head -32 "$OUT/profile_gpu_p5.txt" ;;
    ray)  # P1 through tokenmill.ray (1 replica, then 2 sharing the GPU) against plain LLM.generate in the same
          # lease, and tests/gpu/test_ray_gpu.py; ray comes from the carried .raybundle/
      mkdir -p /tmp/ray-site && tar -C /tmp/ray-site -xJf .raybundle/ray260-py312-slim.tar.xz
      RESULTS="$OUT/ray.raw" timeout 170 python3 bench/peer_bench.py tokenmill qwen3-0.6b nano 2>&1 | grep '^{'
      for n in 1 2; do
        PYTHONPATH="/tmp/ray-site:$PYTHONPATH" RESULTS="$OUT/ray.raw" timeout 240 python3 bench/ray_bench.py --replicas $n qwen3-0.6b nano 2>&1 | grep '^{'
      done
      tag "$OUT/ray.raw" "$OUT/throughput.jsonl"; : > "$OUT/ray.raw"
      PYTHONPATH="/tmp/ray-site:$PYTHONPATH" timeout 200 python3 -m pytest tests/gpu/test_ray_gpu.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/ray_tests.log" | tail -4 ;;
    tp2)  # two GPUs: the tensor-parallel GPU tests (NCCL all-reduces in decode graphs), then P3 at TP=2 beside P3 at TP=1
      OMP_NUM_THREADS=$TESTS_OMP timeout 330 python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_nccl_graphs_gpu.py \
        -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/tp2_tests.log" | tail -8
      RESULTS="$OUT/tp2.raw" timeout 170 python3 bench/peer_bench.py tokenmill llama3-8b nano 2>&1 | grep '^{'
      RESULTS="$OUT/tp2.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 200 python3 bench/peer_bench.py tokenmill_tp2 llama3-8b nano 2>&1 | grep -v "^\s*$" | tail -3
      tag "$OUT/tp2.raw" "$OUT/throughput.jsonl"; : > "$OUT/tp2.raw" ;;
    vllm-unpack)  # join the bundle's parts (carried in .vllmchunk/ over several calls, each moved to /tmp/vllmchunk by the
      # call that carried it) into /tmp/vllm-site. A call carries at most 64 MiB with the working tree, and the tree's
      # 4.8 MB of tracked files no longer fit beside one of build_vllm_bundle.sh's two 59 MiB parts: re-split them in
      # three (cat part0 part1 | split -n 3 -d -a 1 - <name>.part), carried in three calls < 30 s apart.
      if [ ! -d /tmp/vllm-site/vllm ]; then
        mkdir -p /tmp/vllm-site
        # Only the parts that exist: under pipefail a glob that matched nothing failed the pipeline after a good unpack.
        chunks=""; for f in /tmp/vllmchunk/*.part* .vllmchunk/*.part*; do [ -f "$f" ] && chunks="$chunks $f"; done
        cat $chunks | xz -d | tar -C /tmp/vllm-site -xf - || echo "vllm bundle: unpack failed"
      fi ;;
    vllm-det)  # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) on P1-P3, rows tagged "engine": "vllm" with "mode"
      [ -d /tmp/vllm-site/vllm ] || bash "$0" vllm-unpack
      for run in "llama3-8b nano" "qwen3-0.6b nano uniform"; do  # P3 first: the costliest case
        PYTHONPATH=/tmp/vllm-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_BATCH_INVARIANT=1 RESULTS="$OUT/vllm_det.raw" \
          timeout 300 python3 bench/peer_bench.py vllm $run 2>&1 | tail -3
      done
      sed -i 's/"engine": "vllm"/"engine": "vllm", "mode": "batch_invariant"/' "$OUT/vllm_det.raw" 2>/dev/null
      tag "$OUT/vllm_det.raw" "$OUT/throughput.jsonl"; : > "$OUT/vllm_det.raw" ;;
    vllm|vllm-p1p5|vllm-p4p5|vllm-p6|vllm-chat|vllm-refill|vllm-beam|vllm-tp2|vllm-fp8|vllm-fp8kv|vllm-moe|vllm-lora)
      [ -d /tmp/vllm-site/vllm ] || bash "$0" vllm-unpack
      export PYTHONPATH=/tmp/vllm-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
      case $part in
        vllm-tp2)  # P3 at TP=2 (two GPUs); its all-reduce without symmetric memory (multicast stays off)
              VLLM_ALLREDUCE_USE_SYMM_MEM=0 RESULTS="$OUT/vllm.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 400 \
                python3 bench/peer_bench.py vllm_tp2 llama3-8b nano 2>&1 | tail -3 ;;
        vllm-fp8kv)  # P1, P5 and P3 with kv_cache_dtype="fp8" (the comparison for throughput-fp8's tokenmill_fp8kv)
              for run in "qwen3-0.6b nano prefill" "llama3-8b nano"; do
                RESULTS="$OUT/vllm.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 280 python3 bench/peer_bench.py vllm_fp8kv $run 2>&1 | tail -3
              done ;;
        vllm-fp8)  # P3 with quantization="fp8" (issue 18's comparison for tokenmill_fp8)
              RESULTS="$OUT/vllm.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 300 \
                python3 bench/peer_bench.py vllm_fp8 llama3-8b nano 2>&1 | tail -3 ;;
        vllm) for run in "qwen3-0.6b nano uniform" "llama3-8b nano"; do
                RESULTS="$OUT/vllm.raw" timeout 250 python3 bench/peer_bench.py vllm $run 2>&1 | tail -3; done ;;
        vllm-p1p5) RESULTS="$OUT/vllm.raw" timeout 300 python3 bench/peer_bench.py vllm qwen3-0.6b nano prefill 2>&1 | tail -3 ;;
        vllm-p4p5) for run in "qwen3-0.6b sampling prefill" "llama3-8b sampling"; do
                RESULTS="$OUT/vllm.raw" timeout 300 python3 bench/peer_bench.py vllm $run 2>&1 | tail -3; done ;;
        vllm-p6) for shape in qwen3-embed-0.6b bert-minilm; do
                RESULTS="$OUT/vllm.raw" timeout 200 python3 bench/embed_bench.py vllm $shape 2>&1 | tail -3; done ;;
        vllm-chat) # the whole log kept: vLLM's engine core died in the json variant twice (AE, AL), its reason filtered out
          RESULTS="$OUT/vllm.raw" timeout 500 python3 bench/workload_bench.py vllm qwen3-0.6b ${CHAT_VARIANTS:-} ${CHAT_FLAGS:-} 2>&1 \
            | tee "$OUT/vllm_chat.log" | grep -E '^(\{|WARNING)' ;;
        vllm-refill) RESULTS="$OUT/vllm.raw" timeout 400 python3 bench/refill_bench.py vllm qwen3-0.6b ${REFILL_WORKLOADS:-short long} 2>&1 | tail -3 ;;
        vllm-beam) RESULTS="$OUT/vllm.raw" timeout 400 python3 bench/beam_bench.py vllm qwen3-0.6b ${BEAM_WIDTHS:-4} 2>&1 | tail -3 ;;
        vllm-lora) for mode in ${LORA_MODES:-base lora-none lora-1 lora-4}; do
                RESULTS="$OUT/vllm.raw" timeout 200 python3 bench/lora_bench.py vllm qwen3-0.6b $mode ${LORA_WORKLOADS:-nano uniform} 2>&1 | tail -2
              done ;;
        vllm-moe) # the log kept: vLLM's KV cache size beside the plan's (memory-plan, entry 88)
              RESULTS="$OUT/vllm.raw" timeout 330 python3 bench/moe_peer_bench.py vllm qwen3-30b-a3b ${MOE_WORKLOADS:-nano uniform} 2>&1 \
                | tee "$OUT/vllm_moe.log" | grep -E "KV cache|^\{" | tail -6
              [ "${MOE_FP8:-1}" = 1 ] && RESULTS="$OUT/vllm.raw" PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout 250 \
                python3 bench/moe_peer_bench.py vllm_fp8 qwen3-30b-a3b nano 2>&1 | tail -3 ;;
      esac
      tag "$OUT/vllm.raw" "$OUT/throughput.jsonl"; : > "$OUT/vllm.raw" ;;
  esac
  echo "[$part took $(( $(date +%s) - start )) s]" | tee -a "$OUT/suite.log"
done
# The device tool brings back at most 8 files from $OUT: leave no empty scratch files behind.
find "$OUT" -maxdepth 1 -type f -empty -delete

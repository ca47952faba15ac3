"""P1 through the Ray Data processor (tokenmill.ray) on one GPU, to compare with plain LLM.generate.

Usage: python bench/ray_bench.py [--replicas N] [SHAPE] [WORKLOAD]     (default: 1 qwen3-0.6b nano)

The same model folder, random weights (load_format="dummy"), token-id prompts and sampling values
as bench/peer_bench.py, whose `tokenmill` run gives the plain figure in the same lease. The rows go
through `build_llm_processor` on a local Ray cluster: one replica holding the GPU, or N replicas
sharing it (num_gpus 1/N each, a fixed KV cache each so they do not size against each other).

Figures (one JSON row, appended to $RESULTS when set):
  out_tok_s          output tokens / seconds from the first row reaching an engine to the last
                     result back in the driver (engine start-up left out, as peer_bench leaves out LLM())
  out_tok_s_startup  output tokens / seconds of the whole dataset run, replicas' start-up included
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_usage import check_usage  # noqa: E402
from peer_bench import model_dir, workload  # noqa: E402
from result_row import emit  # noqa: E402


def main() -> None:
    check_usage(__doc__, 0)
    args = sys.argv[1:]
    replicas = 1
    if args[:1] == ["--replicas"]:
        replicas, args = int(args[1]), args[2:]
    shape = args[0] if args else "qwen3-0.6b"
    name = args[1] if len(args) > 1 else "nano"

    import ray

    from tokenmill.ray import TokenmillProcessorConfig, build_llm_processor

    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    prompts, outs, sampling = workload(name)  # the protocol's shared settings (a dict)
    items = [{"prompt_token_ids": p, "sampling_params": {**sampling, "ignore_eos": True, "max_tokens": o,
                                                          "detokenize": False}} for p, o in zip(prompts, outs)]
    engine = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
    if replicas == 1:
        engine["gpu_memory_utilization"] = 0.9
    else:  # replicas share the GPU: a fixed cache each (P1 needs < 32 GiB of Qwen3-0.6B KV in all)
        engine["kv_cache_memory_bytes"] = int(100 * 2**30 / replicas)
    batches = 8 * replicas
    config = TokenmillProcessorConfig(model_source=model_dir(shape, False), engine_kwargs=engine, concurrency=replicas,
                                      batch_size=-(-len(items) // batches), max_concurrent_batches=8,
                                      num_gpus=1 / replicas, num_cpus=1)
    processor = build_llm_processor(config)
    started = time.monotonic()
    rows = processor(ray.data.from_items(items, override_num_blocks=batches)).take_all()
    ended = time.monotonic()
    errors = [r["__inference_error__"] for r in rows if r["__inference_error__"]]
    assert not errors, errors[:3]
    first = min(r["metrics"]["arrival_time"] for r in rows)  # the actors' time.monotonic(): one host, one clock
    got = sum(r["num_generated_tokens"] for r in rows)
    row = dict(engine="tokenmill-ray", replicas=replicas, shape=shape, workload=name, seqs=len(rows),
               in_tokens=sum(map(len, prompts)), out_tokens=sum(outs), got_tokens=got,
               seconds=round(ended - first, 2), out_tok_s=round(sum(outs) / (ended - first), 1),
               out_tok_s_startup=round(sum(outs) / (ended - started), 1), startup_s=round(first - started, 1))
    emit(row)
    ray.shutdown()


if __name__ == "__main__":
    main()

"""The Ray Data processor on one GPU: two replicas sharing it give, row for row, the greedy tokens of
one LLM on the same GPU (in fp32, where batching changes only rounding); and
`tokenmill run --replicas 2` gives each replica its own GPU (refused, clearly, on a one-GPU host). Skipped without CUDA or without ray
(bench/gpu_suite.sh ray puts the carried ray bundle on PYTHONPATH)."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 * 2**20, enforce_eager=True)
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def test_two_replicas_sharing_the_gpu_match_one_llm(gpu_ray, tiny_llama_dir):
    from tokenmill.ray import TokenmillProcessorConfig, build_llm_processor

    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(5 + i % 23)] for i in range(64)]
    llm = LLM(str(tiny_llama_dir), device="cuda", **ENGINE)
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                             SamplingParams(**GREEDY), use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    config = TokenmillProcessorConfig(model_source=str(tiny_llama_dir), engine_kwargs=ENGINE, concurrency=2,
                                      num_gpus=0.5, batch_size=8)
    processor = build_llm_processor(config, preprocess=lambda row: dict(sampling_params=GREEDY))
    items = [{"i": i, "prompt_token_ids": p} for i, p in enumerate(prompts)]
    rows = processor(gpu_ray.data.from_items(items, override_num_blocks=8)).take_all()
    assert sorted(r["i"] for r in rows) == list(range(64))
    assert [list(r["generated_tokens"]) for r in sorted(rows, key=lambda r: r["i"])] == expected


def test_run_replicas_on_the_gpus(tmp_path, tiny_llama_dir):
    """Two replicas need two GPUs: with one, a clear refusal; with more, the single-process text."""
    from tokenmill.batch.job import JobConfig, run_job

    rows = [{"id": i, "prompt_token_ids": [(5 * i + j) % 250 + 3 for j in range(4 + i % 9)]} for i in range(24)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = dict(input=str(tmp_path / "in.jsonl"), model=str(tiny_llama_dir), sampling=GREEDY, progress=False,
                  engine={**ENGINE, "device": "cuda"})
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="--replicas 2 with tensor_parallel_size 1 needs 2 GPUs, but 1 are visible"):
            run_job(JobConfig(output=str(tmp_path / "replica.jsonl"), replicas=2, **common))
        return
    assert run_job(JobConfig(output=str(tmp_path / "single.jsonl"), **common)).exit_code == 0
    assert run_job(JobConfig(output=str(tmp_path / "replica.jsonl"), replicas=2, **common)).exit_code == 0
    texts = [{r["row"]: r["text"] for r in map(json.loads, open(tmp_path / name))} for name in ("single.jsonl", "replica.jsonl")]
    assert texts[0] == texts[1]

"""NCCL all-reduces captured in CUDA graphs, on ONE GPU: a one-rank NCCL process group built the way
tensor parallelism builds its group (tokenmill.distributed.process_group), so the capture machinery
of the TP > 1 decode graphs runs on the single-GPU machine too. Replays must equal eager execution.

With one rank a SUM all-reduce is the identity; PREMUL_SUM (NCCL multiplies by a factor) is not, so
a replay that skipped the collective, or baked in the capture's values, gives the wrong numbers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def one_rank_nccl_group():
    import torch.distributed as dist

    from tokenmill.distributed.process_group import create_group, create_store

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    store = create_store(1)
    group = create_group(store, 0, 1, torch.device("cuda", 0))
    yield group
    with contextlib.suppress(Exception):
        group.shutdown()


@pytest.mark.parametrize("op", ["sum", "premul_sum"])
def test_all_reduce_inside_a_captured_graph_equals_eager(one_rank_nccl_group, op):
    import torch.distributed as dist

    factor = 3.0 if op == "premul_sum" else 1.0
    reduce_op = dist._make_nccl_premul_sum(factor) if op == "premul_sum" else dist.ReduceOp.SUM
    x = torch.randn(4096, device="cuda")

    def step() -> torch.Tensor:
        y = x * 2.0
        dist.all_reduce(y, op=reduce_op, group=one_rank_nccl_group)
        return y + 1.0

    torch.testing.assert_close(step(), x * 2.0 * factor + 1.0)  # eager; also starts the communicator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x * 2.0 * factor + 1.0)


def test_decode_graphs_with_nccl_all_reduces_equal_eager(tiny_llama_dir, one_rank_nccl_group):
    """The tiny Llama with an all-reduce over the one-rank NCCL group after every row-parallel layer
    and the embedding (where TP > 1 reduces), captured into the runner's decode graphs: greedy
    tokens must equal the eager run's, and decode steps must come from graph replays."""
    import torch.distributed as dist

    from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from tokenmill.models.layers.linear import RowParallelLinear

    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=16,
              kv_cache_memory_bytes=2**26, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 289, (n,), generator=gen).tolist()} for n in (3, 17, 41, 9, 60, 5, 22)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    runner = llm.llm_engine.executor.runner
    reduces = []

    def all_reduce_output(module, args, output):
        reduces.append(module)
        dist.all_reduce(output, group=one_rank_nccl_group)
        return output

    for module in runner.model.modules():
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)) and not isinstance(module, ParallelLMHead):
            module.register_forward_hook(all_reduce_output)
    runner.capture_decode_graphs(max_num_seqs=16, max_model_len=256)
    assert len(reduces) >= 2 * len(runner.graphs.buckets) * 5  # 2 layers x (o_proj, down_proj) + embedding, warm-up and capture
    replays = []
    real_run = runner.graphs.run
    runner.graphs.run = lambda *args: (replays.append(args[0].shape[0]), real_run(*args))[1]
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphed == eager
    assert len(replays) >= params.max_tokens - 1

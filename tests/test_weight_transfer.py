"""update_weights refuses a bad update whole, before any tensor is replaced, for every model family
and however the tensors come (in this process, or over the trainer's group); over the group a
refused update is still received to its end, so the trainer's send returns and the next update
works, on one rank and on two. The happy paths: tests/test_engine_controls.py; pooling models refuse by
name: tests/test_vllm_entrypoint.py."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from reference import hf_greedy, hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.weight_transfer import WeightSender

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=8 * 2**20, max_num_seqs=8, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 70, 91, 13, 8], [200, 4]]
GENERATIVE_FAMILIES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_mistral_dir", "tiny_granite_dir",
                       "tiny_smollm3_dir", "tiny_phi3_dir", "tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_mixtral_dir"]
NOTHING = "nothing was replaced"


def _checkpoint(path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(str(path / "model.safetensors")).items())


def _params(engine: LLM) -> list[dict[str, torch.Tensor]]:
    """Every rank's parameters, copied."""
    return engine.collective_rpc(lambda worker: {n: p.detach().clone() for n, p in worker.model.named_parameters()})


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x) for x, y in zip(a, b))


def _tokens(engine: LLM) -> list[list[int]]:
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _hf_tokens(path) -> list[list[int]]:
    model = hf_model(str(path))
    return [hf_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS]


def _in_hand(pairs: list[tuple[str, torch.Tensor]]) -> dict:
    return {"update_info": {"names": [n for n, _ in pairs], "tensors": [t for _, t in pairs]}}


def _bad_updates(pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[list[tuple[str, torch.Tensor]], str]]:
    """The good ``pairs`` with one bad tensor last (so a loader going tensor by tensor would have
    replaced the others first), and the error each must give."""
    last, tensor = pairs[-1]
    projection = next((n, t) for n, t in pairs if n.endswith(("k_proj.weight", "qkv_proj.weight", "experts.1.w2.weight")))
    wider = (projection[0], torch.zeros(projection[1].shape[0], projection[1].shape[1] + 1))
    return [
        ([*pairs, ("model.no_such.weight", torch.zeros(3))], rf"has no tensors \(1\) model.no_such.weight.*{NOTHING}"),
        ([*pairs[:-1], (last, tensor.long())], rf"tensor '{last}' has dtype torch.int64: must be a floating-point dtype "
                                               rf"\(the model's is torch.float32\); {NOTHING}"),
        ([*pairs[:-1], (last, torch.zeros(tensor.numel() + 1))],
         rf"tensor '{last}' does not fit .*shape mismatch: checkpoint tensor has shape \({tensor.numel() + 1},\), "
         rf"expected \({tensor.numel()},\); {NOTHING}"),
        ([p for p in pairs if p[0] != projection[0]] + [wider],  # named as sent (Mixtral's block, Phi-3's fused qkv_proj)
         rf"tensor '{projection[0]}'.*shape mismatch: checkpoint tensor has shape \({wider[1].shape[0]}, {wider[1].shape[1]}\).*; {NOTHING}"),
    ]


# ---- tensors from this process, every generative family -----------------------------------------------
@pytest.mark.parametrize("family", GENERATIVE_FAMILIES)
def test_a_bad_tensor_is_refused_before_any_is_replaced(family, request):
    """Unknown names, integer tensors and wrong shapes, each last in an update of every other tensor,
    are refused by name with nothing replaced; the same update without it then replaces them all."""
    path = request.getfixturevalue(family)
    engine = LLM(str(path), **OPTIONS)
    before = _params(engine)
    pairs = [(name, tensor * 0.5 + 0.25) for name, tensor in _checkpoint(path)]  # every value changes
    for update, error in _bad_updates(pairs):
        with pytest.raises(ValueError) as refused:
            engine.update_weights(_in_hand(update))
        assert _same(_params(engine), before), f"replaced before refusing: {refused.value}"
        assert re.search(error, str(refused.value)), (error, str(refused.value))
    engine.update_weights(_in_hand(pairs))
    after = _params(engine)[0]
    assert torch.equal(after["model.norm.weight"], dict(pairs)["model.norm.weight"])
    assert not any(torch.equal(after[name], before[0][name]) for name in after)


def test_a_fused_phi3_tensor_with_rows_left_over_is_refused(tiny_phi3_dir):
    """Phi-3's qkv_proj is cut into q, k and v by rows: extra rows would be left over unseen."""
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model

    model = load_model(resolve_model(str(tiny_phi3_dir)), torch.float32, torch.device("cpu"))
    name, qkv = next((n, t) for n, t in _checkpoint(tiny_phi3_dir) if n.endswith("qkv_proj.weight"))
    longer = torch.cat([qkv, qkv[:16]])
    rows = qkv.shape[0]
    shape_error = rf"'{name}': shape mismatch: checkpoint tensor has shape \({rows + 16}, 64\), expected \({rows}, 64\)"
    with pytest.raises(ValueError, match=shape_error):
        model.load_weights([(name, longer)], partial=True)
    engine = LLM(str(tiny_phi3_dir), **OPTIONS)
    before = _params(engine)
    with pytest.raises(ValueError, match=rf"{shape_error} .*; {NOTHING}"):
        engine.update_weights(_in_hand([(name, longer)]))
    assert _same(_params(engine), before)


# ---- over the trainer's group ------------------------------------------------------------------------
def _together(engine_side, trainer_side, timeout: float = 60.0) -> tuple[BaseException | None, BaseException | None]:
    """Run the engine's call and the trainer's at once, each in a thread; both must return within
    ``timeout`` (a hang fails the test instead of hanging it). Their exceptions, or None."""
    errors: list[BaseException | None] = [None, None]

    def run(i: int, side) -> None:
        try:
            side()
        except BaseException as exc:  # noqa: BLE001  (returned to the test)
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, side), daemon=True) for i, side in enumerate((engine_side, trainer_side))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not threads[0].is_alive(), "the engine's side did not return"
    assert not threads[1].is_alive(), "the trainer's send did not return: the engine stopped receiving"
    return errors[0], errors[1]


def _connected(engine: LLM) -> WeightSender:
    sender = WeightSender("127.0.0.1", 0, world_size=1 + engine.get_world_size())
    engine_error, trainer_error = _together(lambda: engine.init_weight_transfer_engine({"init_info": sender.init_info()}),
                                            sender.connect)
    assert engine_error is None and trainer_error is None
    return sender


def _send(engine: LLM, sender: WeightSender, pairs, update_info: dict | None = None) -> BaseException | None:
    """One update over the group; the trainer's send must succeed whatever the engine says."""
    info = WeightSender.update_info(pairs) if update_info is None else update_info
    engine_error, trainer_error = _together(lambda: engine.update_weights({"update_info": info}), lambda: sender.send(pairs))
    assert trainer_error is None
    return engine_error


def _refused_then_accepted(engine: LLM, other_llama_dir) -> None:
    """Bad updates over the group (a bad tensor first, last, an unknown name, fewer names than
    tensors, sleeping weights), each refused on every rank with nothing replaced and the trainer's
    send returned; then the good one gives the other model's tokens."""
    sender = _connected(engine)
    before, tokens = _params(engine), _tokens(engine)
    pairs = _checkpoint(other_llama_dir)
    first, tensor = pairs[0]
    bad = _bad_updates(pairs)
    bad.append(([(first, torch.zeros(tensor.shape[0] + 1, tensor.shape[1])), *pairs[1:]], rf"'{first}' does not fit"))
    for update, error in bad:
        engine_error = _send(engine, sender, update)
        assert _same(_params(engine), before), f"replaced before refusing: {engine_error}"
        assert isinstance(engine_error, ValueError), engine_error
        assert re.search(error, str(engine_error)), (error, str(engine_error))
        assert f"the {len(update)} tensors the trainer sent were received and dropped" in str(engine_error)
        assert _tokens(engine) == tokens
    short = WeightSender.update_info(pairs)
    short["names"] = short["names"][:-1]
    assert re.search(rf"has {len(pairs) - 1} names and {len(pairs)} tensors .*{NOTHING}", str(_send(engine, sender, pairs, short)))
    engine.sleep(level=1)
    asleep = _send(engine, sender, pairs)
    assert isinstance(asleep, RuntimeError) and re.search(rf"while the weights sleep.*{NOTHING}.*received and dropped", str(asleep))
    engine.wake_up()
    assert _same(_params(engine), before) and _tokens(engine) == tokens
    assert _send(engine, sender, pairs) is None
    assert _tokens(engine) == _hf_tokens(other_llama_dir)
    assert engine.get_weight_version() == 1


@pytest.fixture(scope="module")
def other_llama_dir(tiny_models_root, tiny_llama_dir):
    """The tiny Llama with other weights: the 'trained' model."""
    from transformers import AutoConfig

    from support.tiny_models import save_tiny_model

    return save_tiny_model(tiny_models_root, "llama_other_weights", AutoConfig.from_pretrained(tiny_llama_dir), seed=12)


def test_a_refused_update_over_the_group_is_received_to_its_end(tiny_llama_dir, other_llama_dir):
    _refused_then_accepted(LLM(str(tiny_llama_dir), **OPTIONS), other_llama_dir)


def test_an_update_failing_part_way_over_the_group_says_how_far_and_keeps_the_group_in_step(tiny_llama_dir, other_llama_dir):
    """A failure the up-front check cannot see (here a loader that fails on the real parameter: a lost
    device) stops the update part-way: the error says which tensors were replaced, the rest of the
    update is received and dropped, and the next update works."""
    from tokenmill.models.layers.linear import default_weight_loader

    def lost_device(param, loaded, shard_id=None):
        if not param.is_meta:  # the up-front check's meta twin passes
            raise RuntimeError("device lost")
        default_weight_loader(param, loaded, shard_id)

    def norm(worker):
        return worker.model.model.layers[1].input_layernorm.weight

    engine = LLM(str(tiny_llama_dir), **OPTIONS)
    sender = _connected(engine)
    pairs = _checkpoint(other_llama_dir)
    at = [n for n, _ in pairs].index("model.layers.1.input_layernorm.weight")
    engine.collective_rpc(lambda worker: setattr(norm(worker), "weight_loader", lost_device))
    failed = _send(engine, sender, pairs)
    assert isinstance(failed, RuntimeError) and re.search(
        rf"failed after {at + 1} of {len(pairs)} tensors were taken in \(the last 'model.layers.1.input_layernorm.weight'\): "
        r"those before the failing one were replaced, the rest were not: device lost", str(failed)), failed
    engine.collective_rpc(lambda worker: setattr(norm(worker), "weight_loader", default_weight_loader))
    assert _send(engine, sender, pairs) is None
    assert _tokens(engine) == _hf_tokens(other_llama_dir)


@pytest.mark.slow
def test_both_ranks_refuse_alike_and_stay_in_step(tiny_llama_dir, other_llama_dir):
    _refused_then_accepted(LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS), other_llama_dir)


def test_quantized_weights_refuse_an_update_over_the_group_after_receiving_it(tiny_llama_dir):
    """The refusal of quantized weights is each rank's (it used to come before the ranks were asked,
    with the trainer already broadcasting)."""
    engine = LLM(str(tiny_llama_dir), quantization="fp8", **OPTIONS)
    sender = _connected(engine)
    pairs = _checkpoint(tiny_llama_dir)
    refused = _send(engine, sender, pairs)
    assert isinstance(refused, ValueError) and re.search(
        rf"update_weights on quantized weights \(.*fp8.*\) is not supported; {NOTHING} \(the {len(pairs)} tensors the "
        r"trainer sent were received and dropped", str(refused)), refused
    assert _send(engine, sender, pairs[:1]) is not None  # the group is in step: the next send returns too


def test_an_announcement_that_cannot_be_received_is_refused_by_its_field(tiny_llama_dir):
    """Without valid dtype_names and shapes nothing can be received: refused before anything is,
    by field; no trainer sends here (its send could not be matched)."""
    engine = LLM(str(tiny_llama_dir), **OPTIONS)
    _connected(engine)
    cases = [({"names": ["a"], "dtype_names": ["float32"], "shapes": [[2, -1]]}, r"update_info\['shapes'\]\[0\]=\[2, -1\] is invalid"),
             ({"names": ["a"], "dtype_names": ["float99"], "shapes": [[2]]}, r"dtype name 'float99' is not a torch dtype"),
             ({"names": ["a"], "dtype_names": ["float32"]}, r"needs 'tensors', or 'dtype_names' and 'shapes'")]
    for info, error in cases:
        with pytest.raises(ValueError, match=error + r".*nothing was received or replaced"):
            engine.update_weights({"update_info": info})

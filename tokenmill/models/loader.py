"""Build a model for a resolved source and fill its weights (safetensors, PyTorch .bin, GGUF or dummy).

The model is constructed directly on the target device in the target dtype (no fp32 copy on
the host first), then each weight is streamed from the checkpoint into its parameter, where
the parameter's ``weight_loader`` keeps only this rank's tensor-parallel slice. Models that set
``supports_lazy_weights`` get safetensors weights as CheckpointTensors, so a rank reads from
disk only the slice it keeps.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.models.checkpoint_tensor import CheckpointTensor
from tokenmill.models.registry import architecture_of, get_model_class

if TYPE_CHECKING:
    from tokenmill.models.source import ModelSource
    from tokenmill.quantization.config import QuantizationConfig

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # torch has no per-call default dtype for nn.Parameter(torch.empty(...)); set it only while
    # the model is being built and always restore it.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    source: "ModelSource",
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Any = None,
    seed: int = 0,
    architecture: str | None = None,
    quantization: "QuantizationConfig | None" = None,
    place: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """The model of ``source`` in eval mode with gradients off, on ``device`` in ``dtype``.

    ``architecture`` overrides the config's (a causal LM run as an embedder loads as its base model).
    ``quantization`` (tokenmill.quantization.config) gives its linear layers quantized weights;
    ``dtype`` is then the dtype of activations, embeddings, norms and the LM head.
    ``place``: the model is built on the CPU (its tensors allocated, not touched) and ``place(model)``
    moves each tensor where it is to live before the weights are read (cpu_offload_gb keeps some
    layers in pinned CPU memory this way, without ever holding the whole model on the GPU).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; allowed: {list(LOAD_FORMATS)}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating-point dtype")
    fmt = weights_format(source, load_format)
    if fmt != "dummy" and fmt != source.weights_format:
        raise ValueError(
            f"load_format={load_format!r} but model {source.name!r} holds {source.weights_format} weights"
        )
    if fmt != "dummy" and source.weights_path is None:
        raise ValueError(f"model {source.name!r} has no weight files: {_describe_missing(source)}")
    model_cls = get_model_class(architecture or architecture_of(source.hf_config))
    extra: dict[str, Any] = {}
    if quantization is not None:
        if "quant_config" not in inspect.signature(model_cls.__init__).parameters:
            raise ValueError(f"quantization={quantization.describe()} is not supported for {model_cls.__name__}; "
                             "quantized weights load into the Llama-family decoders (Llama, Mistral, Qwen2, Qwen3)")
        extra["quant_config"] = quantization
    if place is not None and quantization is not None:
        raise ValueError(f"quantization={quantization.describe()} with cpu_offload_gb is not supported; "
                         "use one or the other")
    device = torch.device(device)
    with torch.no_grad(), _default_dtype(dtype), torch.device("cpu") if place is not None else device:
        model = model_cls(source.hf_config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, **extra)
    if place is not None:
        place(model)
    with torch.no_grad():
        fill_weights(model, source, fmt, seed)
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
    model.eval()
    model.requires_grad_(False)
    return model


def fill_weights(model: nn.Module, source: "ModelSource", fmt: str, seed: int) -> None:
    """Read the checkpoint's tensors into the model's parameters (``fmt``: "safetensors", "pt", "gguf"
    or "dummy"); also `Worker.reload_weights` after a level-2 sleep."""
    if fmt == "dummy":
        init_dummy_weights(model, seed)
    elif fmt == "safetensors":
        assert source.weights_path is not None
        lazy = bool(getattr(model, "supports_lazy_weights", False))
        model.load_weights(iter_safetensors(source.weights_path, _wanted_names(model), lazy=lazy))
    elif fmt == "pt":
        assert source.weights_path is not None
        model.load_weights(iter_pytorch_checkpoint(source.weights_path))
    else:
        from tokenmill.models.gguf_weights import iter_gguf_weights

        assert source.weights_path is not None
        model.load_weights(iter_gguf_weights(source.weights_path, source.gguf_reader))


def weights_format(source: "ModelSource", load_format: str) -> str:
    """The format ``load_format`` reads ``source`` in ("auto": the source's own)."""
    return source.weights_format if load_format == "auto" else load_format


def _wanted_names(model: nn.Module) -> set[str] | None:
    expected = getattr(model, "expected_weight_names", None)
    return expected() if callable(expected) else None


def _describe_missing(source: "ModelSource") -> str:
    folder = source.config_dir
    if folder is None:
        return "no weights path"
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf", ".safetensors"))
    hint = f"found {found}" if found else "found no weight files"
    return (
        f"{folder} has none of {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, pytorch_model.bin or "
        f"pytorch_model.bin.index.json ({hint}); give the folder of a Hugging Face checkpoint, or use load_format='dummy'"
    )


def checkpoint_files(weights_path: Path) -> list[Path]:
    """The shard files of a checkpoint given its single file or its ``.index.json`` (safetensors or
    PyTorch: both indexes map tensor names to shard files)."""
    weights_path = Path(weights_path)
    if not weights_path.is_file():
        raise ValueError(f"weight file {weights_path} does not exist")
    if weights_path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(weights_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"checkpoint index {weights_path} is not valid: {exc}") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
            raise ValueError(f"checkpoint index {weights_path} is not valid: its weight_map must map tensor names to "
                             f"shard file names, got {str(weight_map)[:200]}")
        files = [weights_path.parent / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"checkpoint index {weights_path} names shard files that do not exist: {missing}")
        return files
    return [weights_path]


def iter_safetensors(
    weights_path: Path, wanted: set[str] | None = None, lazy: bool = False
) -> Iterator[tuple[str, "torch.Tensor | CheckpointTensor"]]:
    """Yield (name, tensor) one tensor at a time from memory-mapped files.

    Tensors not in ``wanted`` are still yielded (so the model can report them as unexpected),
    but only their names are read, never their data. With ``lazy`` the tensors are
    CheckpointTensors, read only as far as they are sliced, and valid until the next one is yielded.
    """
    from safetensors import safe_open

    for path in checkpoint_files(weights_path):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError, OSError: truncated or not a safetensors file
            raise ValueError(f"cannot read safetensors file {path}: {exc}") from exc
        with handle as f:
            for name in f.keys():
                if wanted is not None and name not in wanted:
                    yield name, torch.empty(0)
                    continue
                try:
                    tensor = CheckpointTensor(f.get_slice(name), name) if lazy else f.get_tensor(name)
                except Exception as exc:
                    raise ValueError(f"cannot read tensor {name!r} from {path}: {exc}") from exc
                yield name, tensor


def iter_pytorch_checkpoint(weights_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from PyTorch checkpoint shards (``pytorch_model*.bin``), one shard at a
    time. Read with ``weights_only`` (tensors only: a file holding code is refused, never run) and
    memory-mapped where the file's format allows, so a rank reads only the slices it keeps."""
    for path in checkpoint_files(weights_path):
        try:
            try:
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (pre-zipfile) format cannot be memory-mapped
                state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # UnpicklingError (not only tensors), EOFError (truncated), ...
            raise ValueError(f"cannot read PyTorch checkpoint {path} as tensors only ({exc}); convert it to "
                             "safetensors") from exc
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError(f"PyTorch checkpoint {path} is not a dict of tensors (a state_dict)")
        yield from state.items()
        del state


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights from the config alone, for benchmarks and tests without a checkpoint.

    Each parameter gets its own generator seeded from (seed, name), so a replicated parameter
    is identical on every tensor-parallel rank and results do not depend on creation order.
    Norm weights are 1 and other weights N(0, 0.02), which keeps activations and logits finite;
    quantized layers' parameters bring their own ``dummy_init`` (random codes, scales to match).
    """
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        custom = getattr(param, "dummy_init", None)
        if custom is not None:
            custom(param.data, generator)
            continue
        values = torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
        param.data.copy_(values * 0.02)

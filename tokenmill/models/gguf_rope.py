"""A GGUF file's rope scaling, as the Hugging Face ``rope_parameters`` of the model it came from.

transformers' GGUF config reading ignores rope scaling for the architectures we load, so a scaled
model would run with plain RoPE. llama.cpp's converter (convert_hf_to_gguf.py) writes it three ways,
and we read each back into the HF parameters it was written from:

- "linear" and "yarn" as metadata: ``{arch}.rope.scaling.type``, ``.factor``,
  ``.original_context_length`` and YaRN's ``.yarn_attn_factor`` (HF's ``attention_factor``),
  ``.yarn_beta_fast``, ``.yarn_beta_slow``. A file without a type but with a factor is linear,
  llama.cpp's default.
- "llama3" (Llama 3.1 / 3.2 / 3.3) as the ``rope_freqs`` tensor: per rotary pair i a divisor f_i of
  its frequency, 1 for short wavelengths, ``factor`` for long ones and a blend in the band between
  (wavelengths L/high_freq_factor .. L/low_freq_factor, L the pretraining length):
  1/f = (1 - s)/factor + s, s = (L/wavelength - low)/(high - low). We fit the parameters to the
  factors and keep them only if they give back every factor within fp32 rounding.
- Phi-3's LongRoPE as ``rope_factors_long`` / ``rope_factors_short`` tensors, with the pretraining
  length in ``.original_context_length`` and the attention factor in ``.attn_factor``.

The converted folder then holds a plain HF config (rope tensors are not weights: gguf_weights skips
them). Anything we cannot express exactly is refused, naming the key or tensor, its value and what
is supported.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.models.gguf_weights import ROPE_TENSORS, field

SUPPORTED_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# A factor recomputed from the fitted llama3 parameters may differ from the file's by fp32 rounding
# (the converter computes in fp32: measured up to 1.3e-7 relative on Llama 3.1/3.2 shapes).
_FACTOR_RTOL = 1e-6


def fp32_value(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (0.22, not
    0.2199999988079071): the number the converter was given, whenever it had one."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="0"))


def rope_scaling_from_gguf(reader: Any, path: Path, theta: float, rotary_dim: int,
                           context_length: int) -> dict[str, Any]:
    """The HF rope parameters beyond ``rope_theta`` (``rope_type`` and its fields) that the file's
    scaling keys and rope tensors describe; {} for plain RoPE. ``rotary_dim``: the rotating dims of
    a head; ``context_length``: the file's ``{arch}.context_length``."""
    arch = field(reader, "general.architecture")

    def key(name: str) -> Any:
        return field(reader, f"{arch}.rope.scaling.{name}")

    tensors = {t.name: t for t in reader.tensors if t.name in ROPE_TENSORS}
    kind = key("type")
    factor = key("factor")
    if factor is None:
        factor = field(reader, f"{arch}.rope.scale_linear")  # the key older converters wrote
    _refuse_keys_we_cannot_honour(arch, key, path)
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        if kind not in (None, "longrope"):
            raise ValueError(f"GGUF file {path}: {arch}.rope.scaling.type={kind!r} with LongRoPE factor tensors "
                             "(rope_factors_long/short): the two scalings cannot both apply")
        return _longrope(reader, tensors, key, path, rotary_dim, context_length)
    attn = key("attn_factor")
    if attn is not None and float(attn) != 1.0:  # llama.cpp multiplies cos and sin by it; only LongRoPE's is HF's
        raise ValueError(f"GGUF file {path}: {arch}.rope.scaling.attn_factor={fp32_value(attn)} cannot be honoured "
                         "without LongRoPE factor tensors; supported: the key absent or 1.0")
    if kind == "longrope":
        raise ValueError(f"GGUF file {path} has {arch}.rope.scaling.type='longrope' but no rope_factors_long.weight / "
                         "rope_factors_short.weight tensors: its LongRoPE factors are unknown")
    if "rope_freqs.weight" in tensors:
        if kind not in (None, "none") or (factor is not None and float(factor) != 1.0 and kind is None):
            raise ValueError(f"GGUF file {path} has both a rope_freqs.weight tensor (llama3 rope scaling) and "
                             f"{arch}.rope.scaling.type={kind!r} / factor={factor}: only one rope scaling can apply")
        factors = np.array(_tensor_values(tensors["rope_freqs.weight"]), dtype=np.float64)
        return llama3_from_factors(factors, theta, rotary_dim, f"GGUF file {path}, tensor rope_freqs.weight")
    if kind is None:
        kind = "linear" if factor is not None else "none"  # llama.cpp's default type when only a factor is given
    if kind not in SUPPORTED_SCALING_TYPES:
        raise ValueError(f"GGUF file {path}: {arch}.rope.scaling.type={kind!r} is not supported; supported: "
                         f"{list(SUPPORTED_SCALING_TYPES)}")
    if kind == "none" or (kind == "linear" and factor is not None and float(factor) == 1.0):
        return {}  # llama.cpp never scales with type "none", whatever the factor says
    if factor is None or not float(factor) > 0:
        raise ValueError(f"GGUF file {path}: {arch}.rope.scaling.type={kind!r} needs {arch}.rope.scaling.factor > 0, "
                         f"got {factor}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": fp32_value(factor)}
    return _yarn(key, fp32_value(factor), context_length)


def _refuse_keys_we_cannot_honour(arch: str, key: Any, path: Path) -> None:
    """Keys of other models' scalings (DeepSeek's YaRN log multiplier, Hunyuan's NTK alpha, a YaRN
    with a partial extrapolation mix) that HF's rope types for our families cannot express."""
    checks = (("yarn_log_multiplier", 0.0, "DeepSeek's YaRN mscale, which these architectures do not have"),
              ("yarn_ext_factor", 1.0, "HF's YaRN always mixes fully (1.0)"),
              ("alpha", None, "NTK-alpha scaling is not supported"))
    for name, neutral, why in checks:
        value = key(name)
        if value is not None and (neutral is None or float(value) != neutral):
            raise ValueError(f"GGUF file {path}: {arch}.rope.scaling.{name}={value} cannot be honoured ({why}); "
                             f"supported: the key absent{'' if neutral is None else f' or {neutral}'}")


def _yarn(key: Any, factor: float, context_length: int) -> dict[str, Any]:
    """HF's YaRN parameters from the converter's keys (llama.cpp falls back on the context length
    when the pretraining length is absent)."""
    params: dict[str, Any] = {"rope_type": "yarn", "factor": factor,
                              "original_max_position_embeddings": int(key("original_context_length") or context_length)}
    for gguf_name, hf_name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                               ("yarn_beta_slow", "beta_slow")):
        if key(gguf_name) is not None:
            params[hf_name] = fp32_value(key(gguf_name))
    return params


def _longrope(reader: Any, tensors: dict[str, Any], key: Any, path: Path, rotary_dim: int,
              context_length: int) -> dict[str, Any]:
    """Phi-3's LongRoPE: both factor lists, the pretraining length and, when the file's attention
    factor is not the one HF derives from the two lengths, that factor."""
    arch = field(reader, "general.architecture")
    lists = {}
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name not in tensors:
            raise ValueError(f"GGUF file {path} has a LongRoPE factor tensor but no {name}: both are needed")
        values = [fp32_value(v) for v in _tensor_values(tensors[name])]
        if len(values) != rotary_dim // 2:
            raise ValueError(f"GGUF file {path}: tensor {name} has {len(values)} values; the rotary width "
                             f"({rotary_dim} dims) needs {rotary_dim // 2}")
        lists[name] = values
    original = key("original_context_length")
    if not original:
        raise ValueError(f"GGUF file {path} has LongRoPE factor tensors but no {arch}.rope.scaling.original_context_length")
    params: dict[str, Any] = {"rope_type": "longrope", "long_factor": lists["rope_factors_long.weight"],
                              "short_factor": lists["rope_factors_short.weight"],
                              "original_max_position_embeddings": int(original)}
    attn = key("attn_factor")
    scale = context_length / int(original)
    derived = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
    if attn is not None and abs(float(attn) - derived) > 1e-6 * derived:  # HF derives the same factor from the lengths
        params["attention_factor"] = fp32_value(attn)
    return params


def _tensor_values(tensor: Any) -> list[float]:
    import gguf

    return [float(v) for v in np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)]


def _base_inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """Each pair's unscaled inverse frequency, in fp32 as transformers computes it."""
    import torch

    return (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))).double().numpy()


def llama3_factors(params: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """The per-pair divisors a "llama3" scaling with these parameters gives (llama.cpp's rope_freqs)."""
    wavelen = 2 * math.pi / _base_inverse_frequencies(theta, dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    length = params["original_max_position_embeddings"]
    smooth = (length / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < length / high, 1.0, np.where(wavelen > length / low, factor, blended))


def llama3_from_factors(factors: np.ndarray, theta: float, dim: int, where: str) -> dict[str, Any]:
    """HF "llama3" rope parameters that give these per-pair divisors (``where`` names the source in
    errors). Only two combinations of the four are determined by the factors of the blend band
    (s = a/wavelength - b with a = L/(high-low), b = low/(high-low)); we take L an integer and low as
    close to 1 as that allows (exactly 1 for Llama's own values). With fewer than two pairs in the
    band the line is chosen to reproduce the factors with the band's edges away from every pair.
    An all-ones tensor is plain RoPE ({}), one that divides every pair alike a linear scaling."""
    if factors.shape != (dim // 2,):
        raise ValueError(f"{where} has {factors.size} values; the rotary width ({dim} dims) needs {dim // 2}")
    if not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise ValueError(f"{where}: rope frequency divisors must be finite and > 0, got min {factors.min()}")
    factor = float(factors.max())
    near = lambda values, target: np.abs(values - target) <= _FACTOR_RTOL * target  # noqa: E731
    kept, scaled = near(factors, 1.0), near(factors, factor)
    if kept.all():
        return {}
    if scaled.all():
        return {"rope_type": "linear", "factor": fp32_value(factor)}
    band = ~kept & ~scaled
    # Wavelengths grow with the pair index: kept pairs first, then the band, then the scaled ones.
    order = np.where(kept, 0, np.where(band, 1, 2))
    if np.any(np.diff(order) < 0) or factors.min() < 1.0 - _FACTOR_RTOL:
        raise ValueError(f"{where}: the divisors {factors.tolist()} are not a llama3 scaling (1 for the shortest "
                         "wavelengths, then rising to the largest for the longest)")
    x = _base_inverse_frequencies(theta, dim) / (2 * math.pi)  # 1 / wavelength
    y = (1 / factors - 1 / factor) / (1 - 1 / factor)  # the blend s of each pair
    a, b = _band_line(x, y, kept, band, scaled)
    if not (a > 0 and b > 0):
        raise ValueError(f"{where}: the divisors {factors.tolist()} are not a llama3 scaling (its blend band "
                         f"would need low_freq_factor <= 0)")
    length = max(1, round(a / b))
    low = length * b / a
    high = low + length / a
    raw = {"factor": fp32_value(factor), "low_freq_factor": low, "high_freq_factor": high,
           "original_max_position_embeddings": length}
    tidy = {**raw, "low_freq_factor": float(f"{low:.6g}"), "high_freq_factor": float(f"{high:.6g}")}
    for candidate in (tidy, raw):
        if np.all(np.abs(llama3_factors(candidate, theta, dim) - factors) <= _FACTOR_RTOL * factors):
            return {"rope_type": "llama3", **candidate}
    got = llama3_factors(raw, theta, dim)
    worst = int(np.argmax(np.abs(got - factors) / factors))
    raise ValueError(f"{where}: no llama3 rope scaling reproduces the tensor within fp32 rounding; the closest "
                     f"(factor={raw['factor']}, low_freq_factor={low:.6g}, high_freq_factor={high:.6g}, "
                     f"original_max_position_embeddings={length}) gives {got[worst]:.7g} for pair {worst}, "
                     f"the tensor has {factors[worst]:.7g}")


def _band_line(x: np.ndarray, y: np.ndarray, kept: np.ndarray, band: np.ndarray,
               scaled: np.ndarray) -> tuple[float, float]:
    """(a, b) of the blend s = a x - b: fitted through the band's pairs when it has two or more; with
    one, the line through it twice as steep as the nearest kept or scaled pair allows; with none,
    the band put in the geometric middle of the gap between the last kept and first scaled pair."""
    if band.sum() >= 2:
        slope, intercept = np.polyfit(x[band], y[band], 1)
        return float(slope), float(-intercept)
    first_scaled = float(x[scaled].max())  # the scaled pair of shortest wavelength
    if band.sum() == 1:
        x1, y1 = float(x[band][0]), float(y[band][0])
        steepest = y1 / (x1 - first_scaled)  # s must reach 0 before the first scaled pair
        if kept.any():
            steepest = max(steepest, (1 - y1) / (float(x[kept].min()) - x1))  # and 1 after the last kept one
        slope = 2 * steepest
        return slope, slope * x1 - y1
    last_kept = float(x[kept].min())  # kept pairs exist: an all-scaled tensor was handled as linear
    ratio = last_kept / first_scaled  # > 1: the gap's width as a wavelength ratio
    x_high, x_low = last_kept / ratio**0.25, last_kept / ratio**0.75  # where s = 1 and s = 0
    slope = 1 / (x_high - x_low)
    return slope, slope * x_low

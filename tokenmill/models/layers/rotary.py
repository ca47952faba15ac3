"""Rotary position embedding (RoPE), applied per token by its explicit position.

The batch is flat (tokens of many sequences at different positions side by side), so the
angle of each token is looked up by ``positions`` in a cos/sin table precomputed once for
every position up to ``max_position_embeddings``. The layout is the "neox" one Hugging Face
Llama uses: the head is split in halves (x1, x2) rather than interleaved pairs.

Frequencies follow transformers' ``modeling_rope_utils`` for the supported ``rope_type``s
("default", "linear", "llama3", "longrope", "yarn"), computed in fp32 the same way so results match
bit for bit; YaRN's cos and sin carry its attention factor, as transformers applies it. LongRoPE (Phi-3.5, Phi-3's 128K variants) switches to its long-context factors once a
forward reaches past ``original_max_position_embeddings``, which in a batch of many sequences
would make one sequence's rotation depend on the others; tokenmill keeps the short factors and
the engine stops at that length (`longrope_limit`), where both agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RopeParams:
    rope_type: str
    theta: float
    extra: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ...


def rope_params_from_config(config: "PretrainedConfig") -> RopeParams:
    """Read rope settings from either config layout.

    transformers >= 5 keeps everything in ``config.rope_parameters`` (``rope_theta`` included,
    ``rope_scaling`` is an alias of it); older configs have ``rope_theta`` at top level and an
    optional ``rope_scaling`` dict whose type key may be ``type`` or ``rope_type``.
    """
    params = dict(_raw_rope(config))
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported: {sorted(params)}")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = 10000.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    partial = params.pop("partial_rotary_factor", None) or getattr(config, "partial_rotary_factor", None) or 1.0
    if not 0.0 < float(partial) <= 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is invalid: must be in (0, 1]")
    if partial != 1.0:
        params["partial_rotary_factor"] = float(partial)
    if rope_type in ("llama3", "yarn", "longrope"):
        # The pretraining length, by transformers' priority: the config's own field (where Phi-3 keeps
        # it), then the rope dict's, then max_position_embeddings (LongRoPE must state it).
        original = getattr(config, "original_max_position_embeddings", None) or params.get("original_max_position_embeddings")
        if not original and rope_type == "longrope":
            raise ValueError("rope_type='longrope' needs original_max_position_embeddings in the config")
        params["original_max_position_embeddings"] = int(original or config.max_position_embeddings)
    if rope_type == "yarn":
        _yarn_defaults(params, config)
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        # transformers' rule: the scale of cos and sin, from the context extension factor.
        factor = params.get("factor") or config.max_position_embeddings / original
        if params.get("attention_factor") is None:
            params["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeParams(rope_type=rope_type, theta=float(theta), extra=params)


def _yarn_defaults(params: dict[str, Any], config: "PretrainedConfig") -> None:
    """YaRN's settings as transformers completes them: the factor (from the two lengths when absent,
    DeepSeek's way) and the attention factor."""
    original = params["original_max_position_embeddings"]
    factor = float(params.get("factor") or config.max_position_embeddings / original)
    params["factor"] = factor
    if params.get("attention_factor") is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            params["attention_factor"] = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            params["attention_factor"] = _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _raw_rope(config: Any) -> dict[str, Any]:
    """The config's rope dict as written, from either layout (see `rope_params_from_config`); {} if none."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return params if isinstance(params, dict) else {}


def _raw_rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type") or params.get("type") or "default"


def longrope_limit(config: "PretrainedConfig") -> int | None:
    """The longest sequence a LongRoPE model runs exactly here (its original_max_position_embeddings);
    None for other models (whose rope settings, supported or not, the model's own build reads)."""
    if _raw_rope_type(_raw_rope(config)) != "longrope":
        return None
    return rope_params_from_config(config).extra["original_max_position_embeddings"]


def rope_scaled_len(config: Any, positions: int) -> int:
    """``positions`` as a rope scaling stretches them, by vLLM's rule (the length its users get): a
    linear (or dynamic) factor multiplies max_position_embeddings, YaRN's multiplies the pretraining
    length (Qwen2.5's 32K with factor 4: 128K); LongRoPE and llama3 configs state their length."""
    params = _raw_rope(config)
    if any(isinstance(v, dict) for v in params.values()):
        return positions  # per-layer-type parameters (refused when the model is built)
    rope_type, factor = _raw_rope_type(params), params.get("factor")
    if rope_type in ("default", "longrope", "su", "llama3") or not isinstance(factor, (int, float)) or factor <= 0:
        return positions
    if rope_type == "yarn":
        positions = (getattr(config, "original_max_position_embeddings", None)
                     or params.get("original_max_position_embeddings") or positions)
    return int(positions * factor)


def rotary_dim(head_dim: int, rope: RopeParams) -> int:
    """How many of a head's dims rotate (transformers: ``int(head_dim * partial_rotary_factor)``)."""
    dim = int(head_dim * rope.extra.get("partial_rotary_factor", 1.0))
    if dim % 2 or (head_dim - dim) % 2:
        raise ValueError(f"partial rotary over {dim} of {head_dim} dims is not supported: both parts must be even")
    return dim


def partial_rotary_permutation(head_dim: int, rope: RopeParams) -> torch.Tensor | None:
    """For partial rotary: the order of a head's q/k dims that lets a full-head rotation do it.

    transformers rotates the first ``r`` dims as pairs (i, i + r/2) and passes the rest through.
    The kernels rotate pairs (i, i + head_dim/2). With q and k rows reordered the same way (their
    dot product does not change) as [rotating first halves, pass-through A, rotating second
    halves, pass-through B], the pairs line up, and the pass-through pairs get angle 0 (cos 1,
    sin 0) in the table. ``new[j] = old[perm[j]]``; None for full rotary."""
    dim = rotary_dim(head_dim, rope)
    if dim == head_dim:
        return None
    half, rest = dim // 2, (head_dim - dim) // 2
    return torch.cat([torch.arange(half), torch.arange(dim, dim + rest),
                      torch.arange(half, dim), torch.arange(dim + rest, head_dim)])


def inverse_frequencies(head_dim: int, rope: RopeParams) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, scaled as ``rope.rope_type`` prescribes; with partial
    rotary the pass-through pairs (see `partial_rotary_permutation`) get frequency 0."""
    dim = rotary_dim(head_dim, rope)
    inv_freq = _inverse_frequencies(dim, rope)
    return torch.cat([inv_freq, torch.zeros((head_dim - dim) // 2, dtype=inv_freq.dtype)])


def _inverse_frequencies(head_dim: int, rope: RopeParams) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    bases = rope.theta**exponents  # each pair's wavelength / 2 pi, unscaled
    inv_freq = 1.0 / bases
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "longrope":  # the short factors: see the module docstring
        ext_factors = torch.tensor(_require(rope, "short_factor"), dtype=torch.float32)
        if ext_factors.shape != inv_freq.shape:
            raise ValueError(f"rope short_factor has {ext_factors.numel()} values; head_dim {head_dim} needs {inv_freq.numel()}")
        return 1.0 / (ext_factors * bases)
    factor = float(_require(rope, "factor"))
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, rope, factor, bases)
    if rope.rope_type == "linear":
        # Position interpolation: positions are effectively divided by `factor`.
        return inv_freq / factor
    # llama3 (Llama 3.1): long wavelengths are stretched by `factor`, short ones kept, and the
    # band in between blends the two smoothly.
    low_freq_factor = float(_require(rope, "low_freq_factor"))
    high_freq_factor = float(_require(rope, "high_freq_factor"))
    old_context_len = float(_require(rope, "original_max_position_embeddings"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inverse_frequencies(dim: int, rope: RopeParams, factor: float, bases: torch.Tensor) -> torch.Tensor:
    """YaRN (NTK-by-parts): the dims that turn fewer than ``beta_slow`` times over the pretraining
    length are interpolated (frequency / factor), those turning more than ``beta_fast`` times kept,
    and a linear ramp blends the band between."""
    original = float(rope.extra["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times over ``original``
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.extra.get("beta_fast") or 32), correction_dim(rope.extra.get("beta_slow") or 1)
    if rope.extra.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return (1.0 / (factor * bases)) * (1 - kept) + (1.0 / bases) * kept


def _require(rope: RopeParams, key: str) -> Any:
    if key not in rope.extra:
        raise ValueError(f"rope_type={rope.rope_type!r} needs {key!r} in the config's rope parameters")
    return rope.extra[key]


class RotaryEmbedding(nn.Module):
    """Rotates q and k of every token by the angle of its position."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeParams):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope = rope
        self.build_buffers()

    def build_buffers(self) -> None:
        """The cos/sin table, computed on the default device (the one the model is built on, or the
        one a model built elsewhere will run on: cpu_offload_gb calls this again there, so the table's
        values are the device's own)."""
        inv_freq = inverse_frequencies(self.head_dim, self.rope)
        # fp32 outer product, as HF does (it multiplies inside an fp32 matmul with autocast off).
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq.to(torch.float32))
        # [max_position, head_dim]: cos of the half angles, then sin. Kept fp32 and cast at use,
        # which is what HF does with its freshly computed fp32 cos/sin.
        cos, sin = freqs.cos(), freqs.sin()
        scaling = self.rope.extra.get("attention_factor")  # LongRoPE and YaRN scale cos and sin (in fp32, as HF)
        if scaling is not None and scaling != 1.0:
            rotating = rotary_dim(self.head_dim, self.rope) // 2  # pass-through pairs stay (1, 0)
            cos[:, :rotating] *= scaling
            sin[:, :rotating] *= scaling
        table = torch.cat([cos, sin], dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    @classmethod
    def from_config(cls, config: "PretrainedConfig", head_dim: int) -> "RotaryEmbedding":
        # The table covers every position max_model_len allows: a rope scaling stretches the model's.
        return cls(head_dim, max(config.max_position_embeddings, rope_scaled_len(config, config.max_position_embeddings)),
                   rope_params_from_config(config))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, step_cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq * D] and k [T, Hk * D] (or already [T, H, D]) -> same shapes.
        ``step_cache``: a dict that lives for one forward (the attention metadata's), where the
        positions' cos and sin are kept for the other layers (see ``rotate``)."""
        if q.is_cuda and q.is_contiguous() and k.is_contiguous():
            from tokenmill.kernels.triton.rotary import rotary_embedding_

            tokens = q.shape[0]
            # In place, one kernel for q and k together (see RMSNorm.forward).
            rotary_embedding_(positions, q.view(tokens, -1, self.head_dim), k.view(tokens, -1, self.head_dim), self.cos_sin_cache)
            return q, k
        return self.rotate(positions, q, step_cache), self.rotate(positions, k, step_cache)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, step_cache: dict | None = None) -> torch.Tensor:
        """x [T, H * D] (any row stride; q and k side by side are one x) -> a new contiguous tensor, rotated.

        The positions' cos and sin, gathered from the table and cast to x's dtype, are the same
        for every layer of a forward: with ``step_cache`` they are made once, not once a layer (on
        the CPU each is a few small ops, which the whole of a decode step is made of)."""
        key = f"rotary {id(self)} {x.dtype}"
        cos_sin = step_cache.get(key) if step_cache is not None else None
        if cos_sin is None:
            cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D / 2] each
            cos_sin = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
            if step_cache is not None:
                step_cache[key] = cos_sin
        cos, sin = cos_sin
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        # Same products in the same order as HF's q * cos + rotate_half(q) * sin.
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(shape)

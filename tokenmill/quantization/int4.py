"""4-bit weights in plain torch: the three checkpoint layouts, and the one layout our kernel reads.

Every format stores unsigned 4-bit codes ``u`` in [0, 15] packed eight to an int32, the element
of lowest index in the lowest bits, and dequantizes as ``w = (u - z) * s`` with a scale ``s`` and
a zero point ``z`` per group of input features (``z = 8`` when symmetric). They differ in which
axis is packed and in small conventions:
- compressed-tensors ``pack-quantized``: ``weight_packed`` [N, K/8] (packed along the input
  features), ``weight_scale`` [N, K/g], ``weight_zero_point`` [N/8, K/g] (packed along the
  outputs); its codes are the signed values plus 8, so ``z`` = signed zero point + 8.
- GPTQ: ``qweight`` [K/8, N], ``qzeros`` [K/g, N/8], ``scales`` [K/g, N]; the original ("v1")
  format stores ``z - 1``.
- AWQ (GEMM): ``qweight`` [K, N/8], ``qzeros`` [K/g, N/8], ``scales`` [K/g, N], the eight
  outputs of a word in the order 0, 2, 4, 6, 1, 3, 5, 7.
Ours (``Int4Weights``): codes [ceil(K/8), N] packed along K like GPTQ (a kernel tile of K x N
loads whole words, contiguous along N), scales [G, N], zero points [G, N] as uint8 or None for 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds output 8 * word + AWQ_ORDER[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """int32 words packed along ``dim`` -> uint8 codes, ``count`` of them along ``dim``."""
    moved = packed.movedim(dim, -1).to(torch.int32)
    codes = (moved.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # arithmetic shift, then mask: sign-safe
    codes = codes.flatten(-2)[..., :count].to(torch.uint8)
    return codes.movedim(-1, dim).contiguous()


def pack_int4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes in [0, 15] -> int32 words packed along ``dim`` (the last word zero-padded)."""
    moved = codes.movedim(dim, -1).to(torch.int64)
    pad = -moved.shape[-1] % 8
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    words = (moved.unflatten(-1, (-1, 8)) << _SHIFTS.to(codes.device, torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the int32 with the same bits
    return words.to(torch.int32).movedim(-1, dim).contiguous()


@dataclass
class Int4Weights:
    """One layer's 4-bit weight in our layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 [ceil(K/8), N]
    scales: torch.Tensor  # [G, N], float
    zeros: torch.Tensor | None  # uint8 [G, N], or None: every zero point is 8
    in_features: int  # K
    group_size: int  # features per group; K (or more) for one group per output channel

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight ``(u - z) * s`` in ``dtype`` (computed in fp32, so exactly the stored values)."""
        k = self.in_features
        codes = unpack_int4(self.qweight, 0, k).float()  # [K, N]
        group = torch.arange(k, device=codes.device) // self.group_size
        zeros = 8.0 if self.zeros is None else self.zeros.float()[group]
        return ((codes - zeros) * self.scales.float()[group]).t().to(dtype).contiguous()


def from_compressed_tensors(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                            in_features: int, group_size: int) -> Int4Weights:
    """weight_packed [N, K/8], weight_scale [N, G], weight_zero_point [N/8, G] or None."""
    n = packed.shape[0]
    zeros = None if zero_point is None else unpack_int4(zero_point, 0, n).t().contiguous()
    return _int4(packed.t(), scale.t(), zeros, in_features, group_size)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, in_features: int,
              group_size: int, zeros_minus_one: bool) -> Int4Weights:
    """qweight [K/8, N], qzeros [G, N/8], scales [G, N]."""
    n = qweight.shape[1]
    # v1 adds one to the stored nibble, as its kernels do, so a stored 15 means 16 (u - 16 is still exact).
    zeros = unpack_int4(qzeros, 1, n) + int(zeros_minus_one)
    return _int4(qweight, scales, zeros, in_features, group_size)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, in_features: int,
             group_size: int) -> Int4Weights:
    """qweight [K, N/8], qzeros [G, N/8], scales [G, N]; outputs within a word in AWQ_ORDER."""
    n = scales.shape[1]
    codes = _awq_unpack(qweight, n)  # [K, N]
    return _int4(pack_int4(codes, 0), scales, _awq_unpack(qzeros, n), in_features, group_size)


def _awq_unpack(words: torch.Tensor, count: int) -> torch.Tensor:
    nibbles = unpack_int4(words, 1, words.shape[1] * 8)  # nibble order within each word
    inverse = torch.tensor(AWQ_ORDER).argsort().to(words.device)  # output c sits in nibble inverse[c]
    return nibbles.unflatten(1, (-1, 8))[..., inverse].flatten(1)[:, :count].contiguous()


def _int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, in_features: int,
          group_size: int) -> Int4Weights:
    if zeros is not None and bool((zeros == 8).all()):
        zeros = None  # symmetric in fact: the kernel then skips loading zero points
    group_size = in_features if group_size == -1 else group_size
    return Int4Weights(qweight.contiguous(), scales.contiguous(), zeros, in_features, group_size)

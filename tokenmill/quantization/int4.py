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

Activation-order checkpoints add ``g_idx`` [K], the group of each feature (GPTQ ``desc_act``,
compressed-tensors ``actorder: "group"``), where the others' group is ``feature // group_size``.
The kernel reads groups as runs of features, so ``group_contiguous`` reorders such a weight's
features group by group and says where each reordered feature comes from: the layer gathers its
input's columns in that order before the product (``x[:, index] @ W[:, index]^T = x @ W^T``).
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
    g_idx: torch.Tensor | None = None  # int64 [K]: each feature's group (act-order); None: feature // group_size

    def groups(self) -> torch.Tensor:
        """Each feature's group, int64 [K]."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight ``(u - z) * s`` in ``dtype`` (computed in fp32, so exactly the stored values)."""
        k = self.in_features
        codes = unpack_int4(self.qweight, 0, k).float()  # [K, N]
        group = self.groups()
        zeros = 8.0 if self.zeros is None else self.zeros.float()[group]
        return ((codes - zeros) * self.scales.float()[group]).t().to(dtype).contiguous()


def from_compressed_tensors(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                            in_features: int, group_size: int, g_idx: torch.Tensor | None = None) -> Int4Weights:
    """weight_packed [N, K/8], weight_scale [N, G], weight_zero_point [N/8, G] or None; weight_g_idx [K]
    for actorder "group"."""
    n = packed.shape[0]
    zeros = None if zero_point is None else unpack_int4(zero_point, 0, n).t().contiguous()
    return _int4(packed.t(), scale.t(), zeros, in_features, group_size, g_idx)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, in_features: int,
              group_size: int, zeros_minus_one: bool, g_idx: torch.Tensor | None = None) -> Int4Weights:
    """qweight [K/8, N], qzeros [G, N/8], scales [G, N]; g_idx [K] for desc_act."""
    n = qweight.shape[1]
    # v1 adds one to the stored nibble, as its kernels do, so a stored 15 means 16 (u - 16 is still exact).
    zeros = unpack_int4(qzeros, 1, n) + int(zeros_minus_one)
    return _int4(qweight, scales, zeros, in_features, group_size, g_idx)


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
          group_size: int, g_idx: torch.Tensor | None = None) -> Int4Weights:
    if zeros is not None and bool((zeros == 8).all()):
        zeros = None  # symmetric in fact: the kernel then skips loading zero points
    group_size = in_features if group_size == -1 else group_size
    g_idx = None if g_idx is None else g_idx.to(torch.int64)
    return Int4Weights(qweight.contiguous(), scales.contiguous(), zeros, in_features, group_size, g_idx)


def group_contiguous(weights: Int4Weights, slice_features: int = 16) -> tuple[Int4Weights, torch.Tensor | None]:
    """An act-order weight with its features reordered so that groups lie in runs of features, and the
    gather index ``index`` such that reordered feature ``i`` is input feature ``index[i]`` (None: no
    reordering needed, ``weights`` returned as they are).

    When every group holds ``group_size`` features (the last one maybe fewer: what act-order
    quantization writes, whose g_idx is a permuted plain order), the result keeps ``group_size``, its
    groups those present in g_idx in increasing order. Otherwise (a tensor-parallel rank's slice of a
    row-parallel layer holds some features of many groups) each group's run is padded to whole
    ``slice_features``-feature slices, each slice a group of its own; a padding feature gathers
    input feature ``K``, which the caller makes a zero column (``index`` has entries up to K)."""
    if weights.g_idx is None:
        return weights, None
    k, n = weights.in_features, weights.qweight.shape[1]
    g_idx = weights.g_idx
    order = torch.argsort(g_idx, stable=True)
    present, counts = torch.unique_consecutive(g_idx[order], return_counts=True)
    even = bool((counts[:-1] == weights.group_size).all()) and int(counts[-1]) <= weights.group_size
    if even:
        zeros = None if weights.zeros is None else weights.zeros[present].contiguous()
        if torch.equal(order, torch.arange(k, device=order.device)):  # already in order (static groups)
            return Int4Weights(weights.qweight, weights.scales[present].contiguous(), zeros, k, weights.group_size), None
        index, group_of_run, group_size = order, present, weights.group_size
    else:
        # Slot s of group j's padded run holds its s-th feature, or padding past its count.
        slices = (counts + slice_features - 1) // slice_features
        group_of_run = present.repeat_interleave(slices)  # one group a slice
        starts = torch.cumsum(counts, 0) - counts  # where each group's features begin in ``order``
        slot = torch.arange(int(slices.sum()) * slice_features, device=order.device)
        run = slot // slice_features
        first_slice = torch.cumsum(slices, 0) - slices
        owner = torch.repeat_interleave(torch.arange(len(present), device=order.device), slices)[run]
        within = slot - first_slice[owner] * slice_features
        real = within < counts[owner]
        index = torch.where(real, order[(starts[owner] + within).clamp(max=k - 1)], torch.full_like(slot, k))
        group_size = slice_features
    codes = torch.cat([unpack_int4(weights.qweight[:, c : c + 4096], 0, k) for c in range(0, n, 4096)], 1)  # [K, N]
    codes = torch.cat([codes, torch.zeros_like(codes[:1])])[index]  # padding rows: code 0 (their input is 0)
    qweight = torch.cat([pack_int4(codes[:, c : c + 4096], 0) for c in range(0, n, 4096)], 1)
    zeros = None if weights.zeros is None else weights.zeros[group_of_run].contiguous()
    reordered = Int4Weights(qweight, weights.scales[group_of_run].contiguous(), zeros, len(index), group_size)
    return reordered, index

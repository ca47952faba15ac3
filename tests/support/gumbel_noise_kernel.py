"""The sampler's Gumbel noise (``sampling_rows._gumbel_noise``) on its own, for the tests that hold it
to its float64 twin (``reference.gumbel_from_bits_ref``): one launch over given 32-bit values."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.sampling_rows import _gumbel_noise

# 32-bit values (as unsigned) at the ends of w's range, each with its mirror of the other sign
# (one's complement: the same magnitude k): k = 0 and 1 (w = 2^-32, the largest noise), k around
# 2^24 (w around 2^-7, where the series hands over to the log), k = 2^31 - 2^24 (w about 1 - 2^-7),
# and the largest k (w clamped just below 1, the smallest noise) with its neighbours.
_MAGNITUDES = [0, 1, 2**24 - 1, 2**24, 2**24 + 1, 2**31 - 2**24, 2**31 - 64, 2**31 - 1]
EDGE_BITS = [bits for k in _MAGNITUDES for bits in (k, 2**32 - 1 - k)]


@triton.jit
def _noise_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n
    bits = tl.load(bits_ptr + offsets, mask=valid, other=0)
    tl.store(out_ptr + offsets, _gumbel_noise(bits, FAST_LOG), mask=valid)


# Largest |kernel - twin| of the noise: the interpreter's (and the GPU's libdevice) float32 logs,
# where 1 - w rounds to 2^-24 steps above the series' range (<= 2^-25 / 2^-7 relative in E); with
# FAST_LOG, lg2.approx's 2^-22.6 in log2 on top (<= 1.4e-5 in g, where E >= 2^-7).
EXACT_LOG_TOLERANCE = 5e-6
FAST_LOG_TOLERANCE = 3e-5
NOISE_MAX = 22.2  # -ln(2^-32): the noise of the smallest w, the midpoint 2^-32
NOISE_MIN = -2.82  # -ln(-ln(2^-24)): the noise of the largest w, just below 1


def gumbel_noise(bits: torch.Tensor, fast_log: bool, device: str | torch.device = "cpu") -> torch.Tensor:
    """The kernels' noise (on ``device``, returned on the CPU) for ``bits``, values in [0, 2^32)."""
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).to(device)
    out = torch.empty(bits.shape, dtype=torch.float32, device=device)
    block = 1024
    _noise_kernel[(triton.cdiv(bits.numel(), block),)](bits, out, bits.numel(), BLOCK=block, FAST_LOG=fast_log,
                                                       enable_fp_fusion=False)
    return out.cpu()


def noise_inputs(count: int, seed: int) -> torch.Tensor:
    """int64 values in [0, 2^32): EDGE_BITS, ``count`` uniform ones, and the same count with small
    magnitudes (the race's winners: w below 2^-7, where the series takes over)."""
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.randint(0, 2**32, (count,), generator=gen, dtype=torch.int64)
    small = torch.randint(0, 2**24, (count,), generator=gen, dtype=torch.int64)
    small = torch.where(torch.rand(count, generator=gen) < 0.5, small, 2**32 - 1 - small)  # both signs
    return torch.cat([torch.tensor(EDGE_BITS, dtype=torch.int64), uniform, small])

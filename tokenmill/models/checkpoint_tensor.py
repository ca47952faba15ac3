"""A tensor of a safetensors checkpoint that is read only as far as it is sliced.

Under tensor parallelism each rank keeps 1/N of most weights. Handing the weight loaders the
whole tensor would make every rank read (and page in) the whole checkpoint; a CheckpointTensor
instead reads just the rows or columns a loader asks for through ``narrow``. It offers the two
tensor operations the weight loaders use, ``shape`` and ``narrow``, plus ``[...]`` for a whole
read, so a loader accepts either a CheckpointTensor or a plain ``torch.Tensor``. ``rows_of`` cuts a
fused tensor into its parts the same lazy way.
"""

from __future__ import annotations

from typing import Any

import torch


# safetensors' dtype names -> torch's (those a checkpoint of ours may hold; the rest are None).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class CheckpointTensor:
    """One named tensor of an open ``safe_open`` file; valid only while that file is open."""

    def __init__(self, file_slice: Any, name: str):
        self._slice = file_slice  # safetensors' PySafeSlice: indexing reads only the indexed part
        self.name = name
        self.shape = torch.Size(file_slice.get_shape())
        # The file's dtype ("F32", "I8", ...), so a loader can refuse integers for a float weight
        # without reading the data; None for a name torch has no dtype for.
        self.dtype: torch.dtype | None = _SAFETENSORS_DTYPES.get(file_slice.get_dtype())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``tensor.narrow(dim, start, length)``, reading only those elements from the file."""
        if not 0 <= dim < self.ndim or start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"cannot narrow {self.name!r} of shape {tuple(self.shape)} to dim {dim}, [{start}, {start + length})")
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._slice[index]

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, shape={tuple(self.shape)})"


class RowSlice:
    """Rows ``[start, start + length)`` of a checkpoint tensor, read only as far as a loader narrows
    them: a fused checkpoint tensor (Phi-3's qkv_proj) handed out as its separate parts."""

    def __init__(self, tensor: "CheckpointTensor", start: int, length: int):
        self._tensor, self._start = tensor, start
        self.shape = torch.Size((length, *tensor.shape[1:]))
        self.dtype = tensor.dtype
        self.name = f"{tensor.name}[{start}:{start + length}]"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._tensor.narrow(0, self._start + start, length)
        return self[...].narrow(dim, start, length)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._tensor.narrow(0, self._start, self.shape[0])[index]


def rows_of(tensor: "torch.Tensor | CheckpointTensor", start: int, length: int) -> "torch.Tensor | RowSlice":
    """Rows of a tensor, lazily for a checkpoint tensor."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(0, start, length)
    return RowSlice(tensor, start, length)


class HeadPermuted:
    """A q or k projection's rows (weight or bias) with each head's rows in ``perm`` order, read
    as lazily as the tensor underneath: a loader narrows whole heads (tensor-parallel slices are
    whole heads). Partial rotary uses it (``rotary.partial_rotary_permutation``)."""

    def __init__(self, tensor: Any, head_dim: int, perm: torch.Tensor):
        if tensor.shape[0] % head_dim:
            raise ValueError(f"{tensor!r} has {tensor.shape[0]} rows, not whole heads of {head_dim}")
        self._tensor, self._head_dim, self._perm = tensor, head_dim, perm
        self.shape = tensor.shape
        self.dtype = getattr(tensor, "dtype", None)
        self.name = getattr(tensor, "name", "tensor")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self[...].narrow(dim, start, length)
        if start % self._head_dim or length % self._head_dim:
            raise ValueError(f"rows [{start}, {start + length}) of {self.name!r} are not whole heads of {self._head_dim}")
        rows = self._tensor.narrow(0, start, length)
        heads = rows.reshape(length // self._head_dim, self._head_dim, *rows.shape[1:])
        return heads[:, self._perm].reshape(rows.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])[index]

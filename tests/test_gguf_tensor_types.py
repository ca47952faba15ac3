"""Every GGML tensor type a GGUF may hold: each one tokenmill loads gives exactly what the gguf
package's own dequantizer (``gguf.quants.dequantize``, the reference) gives for the stored blocks,
in torch's shape, for 2-D tensors with an odd row count and 3-D ones (merged experts); the types
it cannot dequantize are refused naming the tensor and its type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill.models.gguf_weights import iter_gguf_weights

# Types the gguf package cannot dequantize (integers, F64, the activation-only Q8_1 / Q8_K).
REFUSED = ("Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64", "Q1_0")


def _all_types() -> list[str]:
    import gguf

    return [q.name for q in gguf.GGMLQuantizationType]


def _write(path: Path, qtype_name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A llama file holding one tensor "x.weight" of ``shape`` (numpy order) stored as the type;
    returns its stored bytes (or values, for the plain float and integer types)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}
    if qtype_name in plain:
        data = (rng.standard_normal(shape) * 50).astype(plain[qtype_name])
        writer.add_tensor("x.weight", data)
    else:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        try:
            data = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        except NotImplementedError:  # no quantizer in the package: random blocks
            data = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * block_bytes), dtype=np.uint8)
            # Bit 6 of every byte clear: no fp16 (or fp8) scale, wherever a type keeps it, is NaN or
            # infinite (their exponents' top bit), so every value is a number to compare.
            data &= 0xBF
        writer.add_tensor("x.weight", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return data


@pytest.mark.parametrize("qtype", [q for q in _all_types() if q not in REFUSED])
@pytest.mark.parametrize("rows", [(3,), (2, 5)])
def test_each_loadable_type_matches_the_gguf_dequantizer(qtype: str, rows: tuple[int, ...], tmp_path: Path) -> None:
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    shape = (*rows, block * 3 if block > 1 else 7)
    data = _write(tmp_path / "x.gguf", qtype, shape, seed=len(qtype) + len(rows))
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]), np.float32))
    got = dict(iter_gguf_weights(tmp_path / "x.gguf"))["x.weight"]
    assert got.shape == shape and got.dtype == torch.float32
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want.reshape(shape), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [q for q in REFUSED if q in _all_types()])
def test_types_the_dequantizer_lacks_are_refused_by_name(qtype: str, tmp_path: Path) -> None:
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    _write(tmp_path / "x.gguf", qtype, (2, block * 2 if block > 1 else 4), seed=1)
    with pytest.raises(ValueError, match=rf"cannot dequantize tensor 'x\.weight' \({qtype}\) in .*x\.gguf"):
        dict(iter_gguf_weights(tmp_path / "x.gguf"))

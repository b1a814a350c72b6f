"""The tensors of a GGUF file, without parsing its metadata values.

Why: ``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, and
a model's tokenizer is ~100k strings: for SmolLM2-135M's GGUF that took 3-4 s, on every
engine start that reads the quantised blocks (:mod:`flexpage.model.gguf_linear`). This walks
past the metadata (reading only ``general.alignment``) to the tensor table, ~0.1 s, and
maps each tensor's bytes from the file. Types and block sizes come from the ``gguf`` package.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["GGUFTensor", "gguf_tensors"]

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
#: bytes of each scalar metadata value type (GGUF's GGUFValueType ids)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType name: "F32", "Q4_1", "Q8_0", ...
    shape: tuple[int, ...]  # rows first (numpy order: the last GGUF dimension first)
    data: np.ndarray  # the stored bytes (uint8, read-only, mapped from the file)


def gguf_tensors(path: str | os.PathLike[str]) -> Iterator[GGUFTensor]:
    """Every tensor of the GGUF file at ``path``, in file order."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    magic, _version, num_tensors, num_values = struct.unpack_from("<4sIQQ", buffer, 0)
    if magic != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r})")
    position, alignment = 24, 32
    for _ in range(num_values):
        key, position = _string(buffer, position)
        (value_type,) = struct.unpack_from("<I", buffer, position)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buffer, position + 4)
        position = _skip_value(buffer, value_type, position + 4)
    table = []
    for _ in range(num_tensors):
        name, position = _string(buffer, position)
        (dims,) = struct.unpack_from("<I", buffer, position)
        shape = struct.unpack_from(f"<{dims}Q", buffer, position + 4)
        type_id, offset = struct.unpack_from("<IQ", buffer, position + 4 + 8 * dims)
        position += 4 + 8 * dims + 12
        table.append((name, GGMLQuantizationType(type_id), tuple(reversed(shape)), offset))
    data_start = -(-position // alignment) * alignment
    for name, ggml_type, shape, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        size = int(np.prod(shape)) // block * block_bytes
        start = data_start + offset
        yield GGUFTensor(name, ggml_type.name, shape, buffer[start:start + size])


def _string(buffer: np.ndarray, position: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, position)
    start = position + 8
    return bytes(buffer[start:start + length]).decode("utf-8"), start + length


def _skip_value(buffer: np.ndarray, value_type: int, position: int) -> int:
    """The position after a metadata value of ``value_type`` that starts at ``position``."""
    if value_type == _STRING:
        (length,) = struct.unpack_from("<Q", buffer, position)
        return position + 8 + length
    if value_type == _ARRAY:
        element_type, count = struct.unpack_from("<IQ", buffer, position)
        position += 12
        if element_type in _SCALAR_BYTES:
            return position + count * _SCALAR_BYTES[element_type]
        for _ in range(count):
            position = _skip_value(buffer, element_type, position)
        return position
    return position + _SCALAR_BYTES[value_type]

"""A GGUF file's header in one pass: its metadata and its tensor table, each tensor's data a view
of one read-only memory map of the file.

gguf's own GGUFReader makes a numpy view of every element of every metadata array (two per
string): for the default model's 49k-token vocabulary and 48k merges, about a second on this
machine, paid once by the tokenizer and once by the weights. Here an array of strings is one
loop over the bytes and an array of numbers one `np.frombuffer`. Little-endian files only (what
llama.cpp writes on every common platform); anything malformed is a ValueError.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from forge_service.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_U64 = struct.Struct("<Q")
_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
# Tensor types whose data is read as numbers; every other type is blocks of bytes.
_ELEMENTS: dict[GGMLQuantizationType, type] = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class Field:
    """One metadata value: `types` as gguf gives them ([type], or [ARRAY, element type, ...])."""

    types: list[GGUFValueType]
    value: Any  # str, int, float, bool, or a list of them (nested lists for arrays of arrays)

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims in GGUF order (the innermost first), uint64
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # read-only: numbers shaped as the tensor, or [rows, bytes per row] of blocks


class GGUFFile:
    """`fields` (name -> Field, in file order) and `tensors` (in file order) of a GGUF file."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the views keep it open
        self._offset = 0
        if self._bytes(4) != MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._scalar("I")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            why = "big-endian GGUF files are not supported" if swapped in VERSIONS else f"version {version}"
            raise ValueError(f"unsupported GGUF: {why}")
        tensor_count, kv_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Field] = {}
        for _ in range(kv_count):
            name = self._string()
            if name in self.fields:
                raise ValueError(f"duplicate metadata key {name}")
            self.fields[name] = self._field()
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            field = self.fields["general.alignment"]
            alignment = field.value
            if field.types != [GGUFValueType.UINT32] or alignment <= 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment must be a power of two (uint32), not {alignment!r}")
        self.data_offset = -(-self._offset // alignment) * alignment
        self.tensors: list[Tensor] = []
        names: set[str] = set()
        for name, dims, ggml_type, offset in infos:
            if name in names:
                raise ValueError(f"duplicate tensor {name}")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, ggml_type, self.data_offset + offset))

    # ---- the header, read in order from self._offset ----

    def _bytes(self, n: int) -> bytes:
        start, end = self._offset, self._offset + n
        if n < 0 or end > len(self._map):
            raise ValueError(f"truncated: the file has {len(self._map)} bytes, the header runs to byte {end}")
        self._offset = end
        return self._map[start:end]

    def _scalar(self, code: str) -> Any:
        unpack = struct.Struct("<" + code)
        return unpack.unpack(self._bytes(unpack.size))[0]

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row: one loop over the bytes (a vocabulary is ~100k of them)."""
        data, at, size, out = self._map, self._offset, len(self._map), []
        for _ in range(count):
            if at + 8 > size:
                raise ValueError(f"truncated: the file has {size} bytes, a string's length runs past it")
            end = at + 8 + _U64.unpack_from(data, at)[0]
            if end > size:
                raise ValueError(f"truncated: the file has {size} bytes, a string runs to byte {end}")
            out.append(data[at + 8:end].decode("utf-8"))
            at = end
        self._offset = at
        return out

    def _field(self) -> Field:
        kind = GGUFValueType(self._scalar("I"))
        if kind == GGUFValueType.ARRAY:
            types, value = self._array()
            return Field([kind, *types], value)
        return Field([kind], self._value(kind))

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        raise ValueError(f"unknown metadata value type {kind!r}")

    def _array(self) -> tuple[list[GGUFValueType], list[Any]]:
        """An array's element types (its own, then its elements' for arrays of arrays) and values."""
        kind, count = GGUFValueType(self._scalar("I")), self._scalar("Q")
        if kind in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[kind])
            raw = self._bytes(count * dtype.itemsize)
            return [kind], np.frombuffer(raw, dtype=dtype).tolist()
        left = len(self._map) - self._offset
        if count > left // 8:  # a string or an array takes at least 8 bytes: a bad count ends here
            raise ValueError(f"truncated: an array of {count} elements in the last {left} bytes")
        if kind == GGUFValueType.STRING:
            return [kind], self._strings(count)
        if kind == GGUFValueType.ARRAY:
            values, inner = [], []
            for _ in range(count):
                inner, value = self._array()
                values.append(value)
            return [kind, *inner], values
        raise ValueError(f"unknown metadata array type {kind!r}")

    def _tensor_info(self) -> tuple[str, list[int], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = [self._scalar("Q") for _ in range(n_dims)]
        return name, dims, GGMLQuantizationType(self._scalar("I")), self._scalar("Q")

    def _tensor(self, name: str, dims: list[int], ggml_type: GGMLQuantizationType, start: int) -> Tensor:
        n_elements = int(np.prod(dims, dtype=np.uint64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if n_elements % block:
            raise ValueError(f"tensor {name}: {n_elements} elements are not whole blocks of {block}")
        n_bytes = n_elements * type_size // block
        if start + n_bytes > len(self._map):
            raise ValueError(f"truncated: tensor {name} runs to byte {start + n_bytes} of {len(self._map)}")
        shape = tuple(reversed(dims))
        element = _ELEMENTS.get(ggml_type)
        if element is None:
            data = np.frombuffer(self._map, np.uint8, n_bytes, start).reshape(quant_shape_to_byte_shape(shape, ggml_type))
        else:
            data = np.frombuffer(self._map, element, n_elements, start).reshape(shape)
        return Tensor(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes, start, data)


def read_gguf(path: str) -> GGUFFile:
    """`path` parsed; a file that is missing, not GGUF or malformed is a ModelLoadError."""
    try:
        return GGUFFile(path)
    except (ValueError, KeyError, OverflowError, OSError, struct.error) as e:
        # UnicodeDecodeError is a ValueError; bad magic, versions and enum values are too.
        raise ModelLoadError(path, f"not a readable GGUF file: {e}") from e

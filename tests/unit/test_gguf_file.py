"""GGUFFile, Forge's one-pass GGUF header reader, against gguf's own GGUFReader: the same metadata
(values and types) and the same tensors (types, shapes, offsets, bytes), and clear errors."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from forge_service.errors import ModelLoadError
from forge_service.loaders.gguf_file import GGUFFile, read_gguf

SCALARS = [(V.UINT8, 200), (V.INT8, -100), (V.UINT16, 60000), (V.INT16, -30000), (V.UINT32, 4_000_000_000),
           (V.INT32, -2_000_000_000), (V.UINT64, 2**63 + 5), (V.INT64, -(2**62)), (V.FLOAT32, 1e-5),
           (V.FLOAT64, 1 / 3), (V.BOOL, True), (V.STRING, "héllo ✓")]


def write(path: Path, alignment: int | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for kind, value in SCALARS:
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, -2.25])
    writer.add_array("test.strings", ["a", "", "ünïcode", "x" * 300])
    writer.add_array("test.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8)  # 4 rows of 64 Q8_0 values: 2 blocks of 34 bytes
    writer.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    q41 = rng.integers(0, 256, (2, 20), dtype=np.uint8)  # 2 rows of 32 Q4_1 values: 1 block of 20 bytes
    writer.add_tensor("q4_1", q41, raw_dtype=Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_reads_as_gguf_reads_it(tmp_path: Path, alignment: int | None) -> None:
    path = write(tmp_path / "t.gguf", alignment)
    want, got = gguf.GGUFReader(path), GGUFFile(str(path))
    names = [n for n in want.fields if not n.startswith("GGUF.")]  # gguf lists the header's counts too
    assert list(got.fields) == names
    for name in names:
        assert got.fields[name].contents() == want.fields[name].contents(), name
        # gguf gives an empty array no element type; otherwise the same types
        assert got.fields[name].types[:len(want.fields[name].types)] == want.fields[name].types, name
    assert got.fields["test.float32"].types == [V.FLOAT32] and got.fields["test.strings"].types == [V.ARRAY, V.STRING]
    assert got.data_offset == want.data_offset and got.data_offset % (alignment or 32) == 0
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for a, b in zip(want.tensors, got.tensors):
        assert (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset) == \
            (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset), a.name
        assert b.shape.tolist() == a.shape.tolist() and b.data.shape == a.data.shape and b.data.dtype == a.data.dtype
        assert np.array_equal(np.asarray(a.data), b.data), a.name
        assert not b.data.flags.writeable  # views of the read-only map


def _string_array_count_offset(data: bytes, key: bytes) -> int:
    at = data.index(key) + len(key)
    assert struct.unpack_from("<II", data, at) == (V.ARRAY, V.STRING)
    return at + 8


@pytest.mark.timeout(10)
def test_a_corrupt_string_count_fails_at_once(tmp_path: Path) -> None:
    path = write(tmp_path / "t.gguf")
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, _string_array_count_offset(bytes(data), b"test.strings"), 2**60)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="truncated"):
        read_gguf(str(path))


@pytest.mark.parametrize("damage, fragment", [
    (lambda d: d[:3], "truncated"),
    (lambda d: b"GGUX" + d[4:], "magic"),
    (lambda d: d[:4] + struct.pack(">I", 3) + d[8:], "big-endian"),
    (lambda d: d[:4] + struct.pack("<I", 9) + d[8:], "version 9"),
    (lambda d: d.replace(b"\xc3\xa9", b"\xff\xfe", 1), "utf-8"),
])
def test_a_malformed_file_is_a_model_load_error(tmp_path: Path, damage, fragment: str) -> None:
    path = write(tmp_path / "t.gguf")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ModelLoadError, match=fragment) as info:
        read_gguf(str(path))
    assert "t.gguf" in str(info.value)


def test_a_tensor_cut_short_is_a_model_load_error(tmp_path: Path) -> None:
    path = write(tmp_path / "t.gguf")
    last = GGUFFile(str(path)).tensors[-1]
    path.write_bytes(path.read_bytes()[:last.data_offset + last.n_bytes - 1])
    with pytest.raises(ModelLoadError, match=f"tensor {last.name} runs to byte"):
        read_gguf(str(path))


def test_a_missing_file_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        read_gguf(str(tmp_path / "absent.gguf"))

"""The 4-bit GGUF encodings (Q4_0, Q4_1, Q4_K) read as codes, not values.

Each becomes an `Int4Weight`: codes 0..15 with a scale and a zero per group of 32 inputs, so that
w = (code - 8) * scale + zero reproduces llama.cpp's dequantisation exactly in fp32. Decode steps
then multiply by the checkpoint's own 4-bit weights instead of a dequantised copy 4x the size.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from forge_service.backends.base import INT4_GROUP, Int4Weight


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # qs: [..., 16] bytes of a 32-value group -> [..., 32] codes: low nibbles first, then high.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1, block_bytes)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _q4_0(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # block: d (f16), qs[16]; w = (q - 8) * d
    b = _blocks(raw, rows, 18)
    d = _f16(b, 0)
    return _nibbles(b[..., 2:]), d, np.zeros_like(d)


def _q4_1(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # block: d (f16), m (f16), qs[16]; w = q * d + m = (q - 8) * d + (m + 8 d)
    b = _blocks(raw, rows, 20)
    d, m = _f16(b, 0), _f16(b, 2)
    return _nibbles(b[..., 4:]), d, m + 8 * d


def _q4_k(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # super-block of 256: d (f16), dmin (f16), scales[12] (eight 6-bit scales and mins), qs[128].
    # Sub-block j: w = d * sc_j * q - dmin * m_j. Each 32 bytes of qs hold two sub-blocks: the
    # low nibbles are sub-block 2i, the high nibbles sub-block 2i + 1.
    b = _blocks(raw, rows, 144)
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[..., 4:16].astype(np.int32)  # [R, S, 12]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(rows, -1, 4, 32)  # [R, S, 4, 32]
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 8, 32)  # [R, S, 8 sub-blocks, 32]
    scale = d[..., None] * sc  # [R, S, 8]
    zero = 8 * scale - dmin[..., None] * mn
    return codes, scale, zero


_CODECS: dict[QType, Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q4_K: _q4_k,
}
INT4_TYPES = frozenset(_CODECS)


def int4_weight(raw: np.ndarray, tensor_type: QType, rows: int, cols: int) -> Int4Weight:
    """A 4-bit tensor's codes, scales and zeros, in HF shape [rows, cols]."""
    codes, scale, zero = _CODECS[tensor_type](raw, rows)
    groups = cols // INT4_GROUP
    return Int4Weight(
        codes=torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
        scale=torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, groups))),
        zero=torch.from_numpy(np.ascontiguousarray(zero.reshape(rows, groups))),
    )

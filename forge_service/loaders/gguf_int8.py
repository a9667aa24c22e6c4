"""The GGUF encodings other than the affine 4-bit ones read as int8 codes with a scale per 32 inputs.

Q8_0 is that form already (w = q * d per block of 32; q int8, d fp16), so its codes are kept
exactly. The others (Q6_K, Q5_K, Q5_0, Q5_1, Q3_K, Q2_K, and the non-linear IQ4_NL and IQ4_XS)
hold 2- to 6-bit codes under their own scales; they are dequantised and re-quantised to int8 per
group of 32 with an fp16 scale (Int8Weight.quantize): at most half a step, 1/254 of the group's
largest weight, from the file's values. llama.cpp writes Q5_0, Q5_1 and IQ4_NL where a tensor's
rows are no multiple of 256 (a Q4_K_M Qwen2.5-0.5B's 896), and Q3_K / Q2_K in its 2- and 3-bit files.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from forge_service.backends.base import INT4_GROUP, Int8Weight

INT8_TYPES = frozenset({QType.Q8_0, QType.Q6_K, QType.Q5_K, QType.Q5_0, QType.Q5_1, QType.Q3_K, QType.Q2_K,
                        QType.IQ4_NL, QType.IQ4_XS})


def int8_weight(raw: np.ndarray, tensor_type: QType, rows: int, cols: int) -> Int8Weight:
    """One of INT8_TYPES's int8 codes and scales, in HF shape [rows, cols]."""
    if tensor_type == QType.Q8_0:  # block: d (f16), qs[32] int8
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // INT4_GROUP, 34)
        scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return Int8Weight(codes=torch.from_numpy(codes.copy()), scale=torch.from_numpy(scale))
    values = gguf.quants.dequantize(raw, tensor_type).reshape(rows, cols).astype(np.float32)
    return Int8Weight.quantize(torch.from_numpy(values))

"""GGUF tensor types -> the engine's weights: float types as torch tensors, the block types it
computes as `kernels.quant.QuantWeight` with the same values the file's own dequantization gives
(Q4_1, Q4_K, Q5_K, Q6_K and Q8_0 exactly; Q4_0's d * (q - 8) as d * q - 8d, within a rounding).

Block layouts (llama.cpp's ggml-common.h), per row of K elements:
- Q8_0: 32 elements per 34 bytes: float16 d, 32 int8 codes. w = d * q.
- Q4_0: 32 per 18 bytes: float16 d, 16 bytes of nibbles (element j low, j + 16 high). w = d * (q - 8).
- Q4_1: 32 per 20 bytes: float16 d, float16 m, 16 bytes of nibbles. w = d * q + m.
- Q4_K: 256 per 144 bytes: float16 d, float16 dmin, 12 bytes of eight 6-bit (scale, min) pairs,
  128 bytes of nibbles (4 chunks of 32 bytes: sub-block 2i low, 2i + 1 high). w = d*sc * q - dmin*m.
- Q5_K: 256 per 176 bytes: as Q4_K plus 32 bytes of fifth bits (bit i of byte j: sub-block i).
- Q6_K: 256 per 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, float16 d.
  w = d * sc[16-element group] * (q - 32)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import dequantize

from engine.errors import ConfigError
from kernels.quant import QuantWeight, pack_nibbles

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
QUANT_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES


def to_float(data: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of any type gguf can dequantize (its raw bytes, uint8 [rows, bytes per row]), as
    float32 (F16 kept as float16)."""
    if ggml_type == GGMLType.F16:
        return torch.from_numpy(np.array(data).view(np.float16)).reshape(shape)
    # A copy: the reader's arrays are read-only views of the memory-mapped file.
    return torch.from_numpy(np.array(dequantize(data, ggml_type), dtype=np.float32)).reshape(shape)


def to_quant(data: np.ndarray, ggml_type: GGMLType, n: int, k: int) -> QuantWeight:
    """A 2-D quantized tensor [n, k] (its raw blocks, uint8 [n, bytes per row]) as a QuantWeight."""
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    return _CONVERTERS[ggml_type](raw, n, k)


def _split(raw: np.ndarray, n: int, block_bytes: int, *widths: int) -> list[np.ndarray]:
    """Each block's fields: [n, blocks, width] arrays, in order."""
    blocks = raw.reshape(n, -1, block_bytes)
    out, at = [], 0
    for w in widths:
        out.append(blocks[:, :, at:at + w])
        at += w
    return out


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a))  # a copy: the reader's arrays map the file read-only


def _q8_0(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    d, qs = _split(raw, n, 34, 2, 32)
    return QuantWeight(_t(qs.view(np.int8).reshape(n, k)), _t(_f16(d)), None, 8, 32)


def _q4_0(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    d, qs = _split(raw, n, 18, 2, 16)
    d = _f16(d)
    return QuantWeight(_t(qs.reshape(n, k // 2)), _t(d), _t(d * np.float16(-8)), 4, 32)


def _q4_1(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    d, m, qs = _split(raw, n, 20, 2, 2, 16)
    return QuantWeight(_t(qs.reshape(n, k // 2)), _t(_f16(d)), _t(_f16(m)), 4, 32)


def _k_scales(d: np.ndarray, dmin: np.ndarray, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-element sub-block, float32 scale d*sc and bias -dmin*m."""
    b = packed.astype(np.uint8)
    lo, hi, mix = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    d32, dmin32 = _f16(d).astype(np.float32)[..., None], _f16(dmin).astype(np.float32)[..., None]
    return d32 * sc.astype(np.float32), -(dmin32 * mn.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """Q4_K/Q5_K's 128 nibble bytes per block -> 4-bit codes [n, blocks, 256] in element order."""
    chunks = qs.reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return (chunks & 0x0F).reshape(n, -1, 256)


def _q4_k(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    d, dmin, packed, qs = _split(raw, n, 144, 2, 2, 12, 128)
    scale, bias = _k_scales(d, dmin, packed)
    codes = torch.from_numpy(_k_low_nibbles(qs, n).reshape(n, k))
    return QuantWeight(pack_nibbles(codes), _t(scale.reshape(n, -1)), _t(bias.reshape(n, -1)), 4, 32)


def _q5_k(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    d, dmin, packed, qh, qs = _split(raw, n, 176, 2, 2, 12, 32, 128)
    scale, bias = _k_scales(d, dmin, packed)
    high = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    codes = _k_low_nibbles(qs, n) | (high.reshape(n, -1, 256) << 4)
    return QuantWeight(_t(codes.astype(np.int8).reshape(n, k)), _t(scale.reshape(n, -1)),
                       _t(bias.reshape(n, -1)), 8, 32)


def _q6_k(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    ql, qh, sc, d = _split(raw, n, 210, 128, 64, 16, 2)
    low = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    codes = (low.reshape(n, -1, 256) | (high.reshape(n, -1, 256) << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(d).astype(np.float32)[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)
    return QuantWeight(_t(codes.reshape(n, k)), _t(scale.reshape(n, -1)), None, 8, 16)


_CONVERTERS = {GGMLType.Q8_0: _q8_0, GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1,
               GGMLType.Q4_K: _q4_k, GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k}


def check_type(name: str, ggml_type: GGMLType) -> None:
    """ConfigError naming the tensor and its type if the engine cannot compute that type."""
    if ggml_type not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ConfigError(f"GGUF tensor {name!r} has type {ggml_type.name}, which this engine does not "
                          f"compute (supported: {names})")

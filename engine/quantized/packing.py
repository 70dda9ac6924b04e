"""Shared pieces of the GPTQ and AWQ loaders: unpacking int32 words of `bits`-bit codes, and the
one step that maps integer codes, a scale and a zero point per group onto `QuantWeight` (or onto
float32 where the engine's format cannot hold the groups)."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from kernels.quant import QuantWeight, pack_nibbles


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 // bits codes per word, code j of word r at bits j*bits.. of row
    r * (32 // bits) + j (GPTQ's qweight, packed along K) -> int32 codes [R * 32 // bits, C]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, per, 1)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then mask
    return codes.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with code j of word c at bits j*bits.. of column c * (32 // bits) + j (GPTQ's
    qzeros; AWQ's words before its column interleave is undone) -> int32 codes [R, C * 32 // bits]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, 1, per)
    codes = (packed.unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], packed.shape[1] * per)


def check_packed(name: str, t: torch.Tensor | None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """`t` (the checkpoint tensor `name`): present, int32 where it holds packed codes, of `shape`."""
    if t is None:
        raise ConfigError(f"quantized checkpoint: {name!r} is missing")
    if shape is not None and tuple(t.shape) != shape:
        raise ConfigError(f"quantized checkpoint: {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def fits_quant_weight(bits: int, k: int, group_size: int) -> bool:
    """Whether groups of `group_size` along K map onto QuantWeight (2- and 4-bit codes go into its
    4-bit nibbles; 8-bit codes into its int8 ones)."""
    if bits in (2, 4):
        return k % 32 == 0 and group_size % 32 == 0 and k % group_size == 0
    return bits == 8 and k % 32 == 0 and group_size % 16 == 0 and k % group_size == 0


def to_quant_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                    group_size: int, perm: torch.Tensor | None = None) -> QuantWeight:
    """Codes [N, K] (0 .. 2**bits - 1), scales and integer zero points [N, K // group_size] of a
    weight whose value is scale * (q - zero) -> the same weight as a QuantWeight (with `perm`:
    codes whose columns are the input columns in that order, `QuantWeight.perm`): value =
    scale * q + bias with bias = -scale * zero computed in float32. The scales keep their float16
    (exact); scale * zero of a float16 scale and a zero below 2**9 is exact in float32 and so is the
    sum, so `dequantize()` equals the float32 scale * (q - zero) here, and a kernel's own summation
    order stays within a float rounding of it. 8-bit codes are stored shifted by -128 (int8) with
    bias = scale * (128 - zero)."""
    codes = codes.contiguous()  # the checkpoints' codes arrive transposed; the kernels want rows
    scale_t = scales if scales.dtype == torch.float16 else scales.float()
    s = scale_t.float()
    if bits == 8:
        qweight = (codes - 128).to(torch.int8)
        biases = s * (128 - zeros).float()
    else:
        qweight = pack_nibbles(codes)
        biases = -(s * zeros.float())
    return QuantWeight(qweight, scale_t.contiguous(), biases.contiguous(), 8 if bits == 8 else 4, group_size, perm)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_of: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: scale[n, g(k)] * (q[n, k] - zero[n, g(k)]) with g = `group_of` [K] (any
    group index per input column, e.g. GPTQ's act-order g_idx). q - zero is a small integer and
    the product with a float16 scale is exact in float32."""
    idx = group_of.long()
    return (codes - zeros[:, idx]).float() * scales.float()[:, idx]

"""AWQ checkpoints (AutoAWQ / llm-awq exports; `quant_method: "awq"`, `version: "gemm"`).

Per quantized projection `<prefix>` (in_features K, out_features N, 4-bit codes, group size G):
- `qweight` int32 [K, N / 8]: packed along N, interleaved: word c of row k holds, in its 4-bit
  slot i (bits 4i .. 4i + 3), the code of column c * 8 + AWQ_ORDER[i] with
  AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (AutoAWQ's WQLinear_GEMM.from_linear); unpacking takes the
  slots in order and gathers columns with the inverse [0, 4, 1, 5, 2, 6, 3, 7].
- `qzeros` int32 [K / G, N / 8], the same packing; the zero point is stored as is.
- `scales` float16 [K / G, N].
- value[n, k] = scales[k // G, n] * (q[k, n] - zero[k // G, n]) (AutoAWQ's dequantize_gemm,
  transformers' and vLLM's AWQ loaders).
Only the GEMM packing with zero points and 4-bit codes is read; GEMV / Marlin / ExLlama / IPEX
versions and `zero_point: false` are refused."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.quantized.packing import (
    check_packed,
    dequantize_groups,
    fits_quant_weight,
    to_quant_weight,
    unpack_cols,
)
from kernels.quant import QuantWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def convert_awq(weights: dict[str, torch.Tensor], qc: dict, keep: bool) -> dict[str, torch.Tensor | QuantWeight]:
    """Every `<prefix>.qweight/qzeros/scales` group of `weights` -> `<prefix>.weight`: with `keep`,
    a QuantWeight holding exactly the reference's values (see `to_quant_weight`) where the group
    size is a multiple of 32, else float32 (the exact scale * (q - zero); the reference kernels
    compute it in float16, so within one float16 rounding of theirs)."""
    bits = int(qc.get("bits") or qc.get("w_bit") or 4)
    if bits != 4:
        raise ConfigError(f"AWQ checkpoint: bits={bits} is not supported (supported: 4)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"AWQ checkpoint: version {version!r} is not supported (supported: 'gemm')")
    if not qc.get("zero_point", True):
        raise ConfigError("AWQ checkpoint: zero_point=false is not supported")
    group_size = int(qc.get("group_size") or qc.get("q_group_size") or 128)
    if group_size != -1 and group_size <= 0:
        raise ConfigError(f"AWQ checkpoint: group_size={group_size} is not supported")
    prefixes = [name[: -len(".qweight")] for name in weights if name.endswith(".qweight")]
    if not prefixes:
        raise ConfigError("AWQ checkpoint: config.json has a quantization_config but no *.qweight tensors")
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for prefix in prefixes:
        out[prefix + ".weight"] = _projection(weights, prefix, group_size, keep)
    out.update(weights)
    return out


def _inverse_order(n: int) -> torch.Tensor:
    """Column gather index [n]: logical column c * 8 + AWQ_ORDER[i] sits in unpacked slot c * 8 + i."""
    inv = torch.empty(8, dtype=torch.long)
    inv[torch.tensor(AWQ_ORDER)] = torch.arange(8)
    return (torch.arange(0, n, 8).unsqueeze(1) + inv.unsqueeze(0)).reshape(n)


def _projection(weights: dict[str, torch.Tensor], prefix: str, group_size: int, keep: bool) -> torch.Tensor | QuantWeight:
    qweight = check_packed(prefix + ".qweight", weights.pop(prefix + ".qweight"))
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = k if group_size == -1 else group_size
    if k % g:
        raise ConfigError(f"AWQ checkpoint: {prefix!r} has K={k}, not a multiple of group_size {g}")
    qzeros = check_packed(prefix + ".qzeros", weights.pop(prefix + ".qzeros", None), (k // g, n // 8))
    scales = check_packed(prefix + ".scales", weights.pop(prefix + ".scales", None), (k // g, n))
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ConfigError(f"AWQ checkpoint: {prefix!r} packs its codes in {qweight.dtype}, not int32")
    order = _inverse_order(n)
    codes = unpack_cols(qweight, 4)[:, order].t()  # [N, K]
    zeros = unpack_cols(qzeros, 4)[:, order].t()  # [N, K // G]
    scales_nk = scales.t()
    if keep and fits_quant_weight(4, k, g):
        return to_quant_weight(codes, scales_nk, zeros, 4, g)
    return dequantize_groups(codes, scales_nk, zeros, torch.arange(k) // g)

"""Quantized safetensors checkpoints (config.json's `quantization_config.quant_method`): GPTQ,
AWQ and FP8 weights turned into `kernels.quant.QuantWeight`s or float tensors at load. The
layouts each reads are in `gptq.py`, `awq.py` and `fp8.py`."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.quantized.awq import convert_awq
from engine.quantized.fp8 import convert_compressed_tensors, convert_fp8
from engine.quantized.gptq import convert_gptq
from kernels.quant import QuantWeight

QUANT_METHODS = ("awq", "compressed-tensors", "fp8", "gptq")


def convert_checkpoint(weights: dict[str, torch.Tensor], quant_config: dict,
                       keep: bool) -> dict[str, torch.Tensor | QuantWeight]:
    """The checkpoint's tensors with each quantized projection (its packed tensors: e.g.
    `*.qweight`, `*.qzeros`, `*.scales`) replaced by one `<prefix>.weight`: a QuantWeight when
    `keep` (quantization=auto) and the format maps onto it exactly (GPTQ 2/4/8-bit, act-order
    included through a column permutation, and AWQ 4-bit, group size a multiple of 32), else
    dequantized float32 (always for FP8, and for everything when not `keep`). Other tensors pass
    through. `weights` is consumed. ConfigError names an unsupported method or setting."""
    method = str(quant_config.get("quant_method", "")).lower()
    if method == "gptq":
        return convert_gptq(weights, quant_config, keep)
    if method == "awq":
        return convert_awq(weights, quant_config, keep)
    if method == "fp8":
        return convert_fp8(weights, quant_config)
    if method == "compressed-tensors":
        return convert_compressed_tensors(weights, quant_config)
    raise ConfigError(f"quant_method {quant_config.get('quant_method')!r} is not supported "
                      f"(supported: {', '.join(QUANT_METHODS)})")

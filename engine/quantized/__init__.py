"""Quantized safetensors checkpoints (config.json's `quantization_config.quant_method`): GPTQ,
AWQ and FP8 weights turned into `kernels.quant.QuantWeight`s or float tensors at load."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from kernels.quant import QuantWeight


def convert_checkpoint(weights: dict[str, torch.Tensor], quant_config: dict,
                       keep: bool) -> dict[str, torch.Tensor | QuantWeight]:
    """The checkpoint's tensors with each quantized projection (its packed tensors: e.g.
    `*.qweight`, `*.qzeros`, `*.scales`) replaced by one `<prefix>.weight`: a QuantWeight when
    `keep` (quantization=auto), else dequantized float32."""
    raise ConfigError(f"quant_method {quant_config.get('quant_method')!r} is not supported yet")

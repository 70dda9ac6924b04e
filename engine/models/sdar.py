"""SDAR (block diffusion): Qwen3's layers and weights under block-causal attention, with logits at
every position asked for and no shift (position i's logits are position i's token distribution)."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.models.base import register_model
from engine.models.layers import MoESplit
from engine.models.llama import LlamaForCausalLM
from kernels.cpu_linear import LinearKind


@register_model("SDARForCausalLM")
class SDARForCausalLM(LlamaForCausalLM):
    """Position i attends to position j iff j // block_size <= i // block_size, in every forward.
    `block_size` is config.json's (`ModelConfig.dllm_block_size`), which must give it and
    `mask_token_id`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        mlp_shard: tuple[int, int] = (0, 1),
        linear: LinearKind = "torch",
        moe_split: MoESplit = "experts",
    ) -> None:
        if not cfg.is_dllm:
            raise ConfigError(
                "SDARForCausalLM needs integer block_size and mask_token_id in config.json"
            )
        # Qwen3's per-head q/k norms also under model_type "sdar" (ModelConfig sets them for "qwen3").
        super().__init__(
            msgspec.structs.replace(cfg, qk_norm=True),
            weights,
            dtype,
            device,
            max_positions,
            mlp_shard,
            linear,
            moe_split,
        )
        self.block_size = cfg.dllm_block_size

    def forward(self, fb: ForwardBatch, attn) -> torch.Tensor:
        fb.attn_metadata = attn.block_causal_metadata(fb, self.block_size)
        return super().forward(fb, attn)

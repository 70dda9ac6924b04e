"""What a block-diffusion model's config.json adds to its architecture's: the mask token and the
block size."""

from __future__ import annotations

import json
import os

import msgspec

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.model_path import resolve_model_path


class DllmConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`mask_token_id`: the id of a position still to be denoised; `block_size` (B): positions per
    block, blocks aligned to absolute position 0 (attention is block-causal over them)."""

    mask_token_id: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id must be >= 0, got {self.mask_token_id}")

    @classmethod
    def from_hf(cls, hf: dict) -> DllmConfig:
        """From an HF config dict that carries `mask_token_id` and `block_size`."""
        missing = [k for k in ("mask_token_id", "block_size") if not isinstance(hf.get(k), int)]
        if missing:
            raise ConfigError(
                f"a block-diffusion model's config.json needs integer {' and '.join(missing)}"
            )
        return cls(mask_token_id=hf["mask_token_id"], block_size=hf["block_size"])

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> DllmConfig:
        """From the parsed config.json (`ModelConfig.dllm_block_size`, `dllm_mask_token_id`)."""
        if not cfg.is_dllm:
            raise ConfigError(
                f"{cfg.architecture} is not a block-diffusion model (no block_size and mask_token_id)"
            )
        return cls(mask_token_id=cfg.dllm_mask_token_id, block_size=cfg.dllm_block_size)

    @classmethod
    def from_dir(cls, model_path: str) -> DllmConfig:
        """From a model folder's config.json, or a built-in model's name."""
        path = os.path.join(resolve_model_path(model_path), "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no config.json at {path!r}")
        with open(path) as f:
            return cls.from_hf(json.load(f))

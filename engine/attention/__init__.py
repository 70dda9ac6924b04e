"""Attention backends over the token-level KV pool, created by name from a registry.

Importing this package registers the built-in backends: "torch", "triton", "flash_attn". The
optional packages behind the last two (triton, vllm_flash_attn) are imported only when such a
backend is created."""

from engine.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    create_attention_backend,
    graph_safe_backends,
    register_backend,
)
from engine.attention.flash_attn import FlashAttnBackend, FlashAttnMetadata
from engine.attention.torch import TorchAttnBackend, TorchAttnMetadata
from engine.attention.triton import TritonAttnBackend, TritonAttnMetadata

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "FlashAttnBackend",
    "FlashAttnMetadata",
    "TorchAttnBackend",
    "TorchAttnMetadata",
    "TritonAttnBackend",
    "TritonAttnMetadata",
    "create_attention_backend",
    "graph_safe_backends",
    "register_backend",
]

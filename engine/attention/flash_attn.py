"""Attention backend "flash_attn": FlashAttention's varlen kernel (vllm_flash_attn or flash_attn),
when an installed build imports with the running torch. vllm-flash-attn pins torch==2.4.0, so it
is never a dependency of radixray: install it into an environment built around that torch.
Otherwise the engine refuses this backend with the reason. The package is imported when the
backend is created, never at engine import."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register_backend
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.memory import KVCache, ReqToTokenPool


def _import_flash() -> Callable[..., torch.Tensor]:
    errors = []
    for name in ("vllm_flash_attn", "flash_attn"):
        try:
            return importlib.import_module(name).flash_attn_varlen_func
        except Exception as e:  # ImportError, or an ABI error against this torch
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise ConfigError(
        "attention_backend='flash_attn' is unavailable: no FlashAttention build imports with torch "
        f"{torch.__version__} (vllm-flash-attn pins torch==2.4.0; install a build matching your torch, or use "
        f"attention_backend='triton' or 'torch'). Tried: " + "; ".join(errors))


@dataclass(frozen=True, slots=True)
class FlashAttnMetadata:
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64: every request's KV slots, one request after another
    cu_seqlens_q: torch.Tensor  # [bs + 1] int32: offsets of each request's new tokens
    cu_seqlens_k: torch.Tensor  # [bs + 1] int32: offsets of each request's keys in kv_slots
    max_seqlen_q: int
    max_seqlen_k: int


@register_backend("flash_attn")
class FlashAttnBackend(AttentionBackend):
    """Each layer gathers the batch's K/V out of the pool through req_to_token into one packed
    tensor and calls flash_attn_varlen_func, causal (aligned to the end of each sequence, so the
    new tokens see the whole cached prefix). The pool has pages of one token, which FlashAttention's
    paged path (block_table) does not take: it needs pages of 16 (vllm_flash_attn) or 256 tokens."""

    # The packed K/V has sum(seq_lens) rows, a host value that changes every step.
    graph_safe = False

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, scale: float,
                 device: torch.device) -> None:
        super().__init__(req_to_token_pool, kv_cache, scale, device)
        self.varlen = _import_flash()
        k0 = kv_cache.k[0]
        if k0.device.type != "cuda":
            raise ConfigError("attention_backend='flash_attn' needs a CUDA device")
        if k0.dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"attention_backend='flash_attn' needs dtype float16 or bfloat16, not {k0.dtype}")
        if k0.shape[-1] % 8 or k0.shape[-1] > 256:
            raise ConfigError(f"attention_backend='flash_attn' needs a head dim that is a multiple of 8 and "
                              f"at most 256, not {k0.shape[-1]}")

    def init_forward_metadata(self, fb: ForwardBatch) -> FlashAttnMetadata:
        dev, bs = self.req_to_token.device, fb.batch_size
        if fb.num_tokens == 0:
            zero = torch.zeros(1, dtype=torch.int32, device=dev)
            return FlashAttnMetadata(torch.empty(0, dtype=torch.int64, device=dev), zero, zero, 0, 0)
        seq_lens = fb.seq_lens.to(torch.int64)
        total_k, max_k = sum(fb.seq_lens_cpu), max(fb.seq_lens_cpu)
        cu_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
        if fb.forward_mode.is_decode():
            cu_q, max_q = torch.arange(bs + 1, dtype=torch.int32, device=dev), 1
        else:
            cu_q = F.pad(torch.cumsum(fb.extend_seq_lens, 0, dtype=torch.int32), (1, 0))
            max_q = max(fb.extend_seq_lens_cpu)
        # Key j of request b is req_to_token[row_b, j]. output_size comes from the host, so
        # building the index does not wait for the device.
        owner = torch.repeat_interleave(torch.arange(bs, device=dev), seq_lens, output_size=total_k)
        pos = torch.arange(total_k, device=dev) - cu_k[:-1].to(torch.int64)[owner]
        slots = self.req_to_token[fb.req_pool_indices.to(torch.int64)[owner], pos].to(torch.int64)
        return FlashAttnMetadata(slots, cu_q, cu_k, max_q, max_k)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return q
        md: FlashAttnMetadata = self.metadata(fb)
        self.kv.set_kv(layer, fb.out_cache_loc, k, v)
        keys = self.kv.k[layer].index_select(0, md.kv_slots)  # [sum(seq_lens), Hkv, D]
        vals = self.kv.v[layer].index_select(0, md.kv_slots)
        # Keywords only: vllm_flash_attn and flash_attn order the positional arguments differently.
        return self.varlen(q=q, k=keys, v=vals, cu_seqlens_q=md.cu_seqlens_q, cu_seqlens_k=md.cu_seqlens_k,
                           max_seqlen_q=md.max_seqlen_q, max_seqlen_k=md.max_seqlen_k,
                           softmax_scale=self.scale, causal=True)

"""Attention backend "triton": the kernels of kernels/triton_attention.py behind the engine's
AttentionBackend interface. Needs CUDA, or TRITON_INTERPRET=1 (Triton's CPU interpreter, slow:
for tests)."""

from __future__ import annotations

import os

import torch

from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.memory import KVCache, ReqToTokenPool


class TritonAttnBackend:
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, scale: float) -> None:
        device = kv_cache.k[0].device
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 to test "
                              "the kernels on the CPU)")
        try:
            from kernels import triton_attention
        except ImportError as e:
            raise ConfigError(f"attention_backend='triton' needs the triton package: {e}") from None
        self.ops = triton_attention
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv = kv_cache
        self.scale = scale
        self._max_extend = 0

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_extend():
            self._max_extend = max(fb.extend_seq_lens_cpu, default=0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return q
        k_buf, v_buf = self.kv.k[layer], self.kv.v[layer]
        self.ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode():
            return self.ops.decode_attention(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                             self.scale)
        return self.ops.extend_attention(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                         fb.extend_seq_lens, fb.extend_start_loc, self._max_extend, self.scale)

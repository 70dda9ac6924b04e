"""Attention backend "triton": the kernels of kernels/triton_attention.py. Needs CUDA, or
TRITON_INTERPRET=1 (Triton's CPU interpreter, slow: for tests). The kernels are imported when
the backend is created, so the engine imports without the triton package."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, register_backend
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.memory import KVCache, ReqToTokenPool


@dataclass(frozen=True, slots=True)
class TritonAttnMetadata:
    # The kernels read rows and lengths straight from the ForwardBatch's tensors; only the
    # extend kernel's grid needs a host value: the longest extend of the batch.
    max_extend: int = 0
    # Block-causal extends (block_size > 0) run as one decode row per token: its request's row and
    # the keys it sees (up to the end of its block, within the request's seq_len).
    block_size: int = 0
    token_rows: torch.Tensor | None = None
    token_kv_lens: torch.Tensor | None = None


@register_backend("triton")
class TritonAttnBackend(AttentionBackend):
    # Decode reads req_to_token in the kernel, its grid is (bs, heads): nothing depends on values.
    graph_safe = True
    block_causal = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, scale: float,
                 device: torch.device) -> None:
        super().__init__(req_to_token_pool, kv_cache, scale, device)
        if kv_cache.k[0].device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 to test "
                              "the kernels on the CPU)")
        try:
            from kernels import triton_attention
        except ImportError as e:
            raise ConfigError(f"attention_backend='triton' needs the triton package: {e}") from None
        self.ops = triton_attention

    def init_forward_metadata(self, fb: ForwardBatch, block_size: int = 0) -> TritonAttnMetadata:
        if fb.forward_mode.is_extend():
            max_extend = max(fb.extend_seq_lens_cpu, default=0)
            if not block_size:
                return TritonAttnMetadata(max_extend=max_extend)
            # A query at position i sees the first min((i // B + 1) * B, seq_len) keys of its
            # request: the decode kernel over that many keys, once every token's K/V is stored.
            ext = fb.extend_seq_lens.to(fb.seq_lens.device)
            rows = fb.req_pool_indices.repeat_interleave(ext, output_size=fb.num_tokens)
            seq = fb.seq_lens.repeat_interleave(ext, output_size=fb.num_tokens)
            block_end = (fb.positions.to(seq.device) // block_size + 1) * block_size
            return TritonAttnMetadata(max_extend=max_extend, block_size=block_size, token_rows=rows,
                                      token_kv_lens=torch.minimum(block_end, seq))
        return TritonAttnMetadata()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return q
        md: TritonAttnMetadata = self.metadata(fb)
        k_buf, v_buf = self.kv.k[layer], self.kv.v[layer]
        self.ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v)
        if md.token_rows is not None:
            return self.ops.decode_attention(q, k_buf, v_buf, self.req_to_token, md.token_rows, md.token_kv_lens,
                                             self.scale)
        if fb.forward_mode.is_decode():
            return self.ops.decode_attention(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                             self.scale)
        return self.ops.extend_attention(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                         fb.extend_seq_lens, fb.extend_start_loc, md.max_extend, self.scale)

    # === CUDA graphs: the kernels read the runner's static rows and lengths directly, so there
    # is no extra state to allocate; a verify graph's extend grid is fixed by its width. A
    # DLLM_EXTEND graph (`block_size` > 0, every request one block) reads its per-token rows and
    # key counts from the metadata built at capture, which replay_metadata recomputes in place. ===
    def init_cuda_graph_state(self, max_bs: int) -> None:
        pass

    def capture_metadata(self, fb: ForwardBatch, block_size: int = 0) -> TritonAttnMetadata:
        mode = fb.forward_mode
        if block_size and mode.is_dllm_extend():
            return self.init_forward_metadata(fb, block_size=block_size)
        if not (mode.is_decode() or mode.is_target_verify()):
            raise ValueError(f"CUDA graphs capture DECODE, TARGET_VERIFY and block-causal DLLM_EXTEND "
                             f"batches only, got {mode.name}")
        return self.init_forward_metadata(fb)

    def replay_metadata(self, fb: ForwardBatch) -> None:
        md: TritonAttnMetadata = fb.attn_metadata
        if md is not None and md.token_rows is not None:  # device ops on the static tensors: no host sync
            fresh = self.init_forward_metadata(fb, block_size=md.block_size)
            md.token_rows.copy_(fresh.token_rows)
            md.token_kv_lens.copy_(fresh.token_kv_lens)

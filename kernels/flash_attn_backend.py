"""Attention backend "flash_attn": FlashAttention's paged KV-cache kernels (vllm_flash_attn or
flash_attn), when an installed build imports with the running torch. vllm-flash-attn pins
torch==2.4.0, so it is never a dependency of radixray: install it into an environment built
around that torch. Otherwise the engine refuses this backend with the reason."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.memory import KVCache, ReqToTokenPool


def _import_flash():
    errors = []
    for name in ("vllm_flash_attn", "flash_attn"):
        try:
            module = __import__(name)
            return module.flash_attn_with_kvcache, module.flash_attn_varlen_func
        except Exception as e:  # ImportError, or an ABI error against this torch
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise ConfigError(
        "attention_backend='flash_attn' is unavailable: no FlashAttention build imports with torch "
        f"{torch.__version__} (vllm-flash-attn pins torch==2.4.0; install a build matching your torch, or use "
        f"attention_backend='triton' or 'torch'). Tried: " + "; ".join(errors))


class FlashAttnBackend:
    """Decode: flash_attn_with_kvcache over the pool viewed as pages of one token, with
    req_to_token rows as block tables. Extend: the same call with the new tokens as queries
    (causal from the end of each sequence)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, scale: float) -> None:
        self.with_kvcache, _ = _import_flash()
        if kv_cache.k[0].device.type != "cuda":
            raise ConfigError("attention_backend='flash_attn' needs a CUDA device")
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv = kv_cache
        self.scale = scale

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._tables = self.req_to_token[fb.req_pool_indices, :max(fb.seq_lens_cpu or [1])]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return q
        k_buf, v_buf = self.kv.k[layer], self.kv.v[layer]
        k_buf[fb.out_cache_loc] = k
        v_buf[fb.out_cache_loc] = v
        pages_k, pages_v = k_buf.unsqueeze(1), v_buf.unsqueeze(1)  # [slots, page=1, heads, dim]
        if fb.forward_mode.is_decode():
            out = self.with_kvcache(q.unsqueeze(1), pages_k, pages_v, cache_seqlens=fb.seq_lens.int(),
                                    block_table=self._tables, softmax_scale=self.scale, causal=True)
            return out.squeeze(1)
        outs = []
        for i, (start, n) in enumerate(zip(fb.extend_start_loc.tolist(), fb.extend_seq_lens_cpu)):
            o = self.with_kvcache(q[start:start + n].unsqueeze(0), pages_k, pages_v,
                                  cache_seqlens=fb.seq_lens[i:i + 1].int(), block_table=self._tables[i:i + 1],
                                  softmax_scale=self.scale, causal=True)
            outs.append(o.squeeze(0))
        return torch.cat(outs)

"""Attention backends over the token-level KV pool. Each owns the metadata of one forward."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.memory import KVCache, ReqToTokenPool


class AttentionBackend(Protocol):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build what every layer of this forward shares (called once per forward)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of the new tokens; store k/v, return [T, H, D]."""


class TorchAttnBackend:
    """Plain torch: gathers K/V through req_to_token and calls SDPA. Works on CPU and CUDA."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, scale: float) -> None:
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv = kv_cache
        self.scale = scale
        # On CPU/float32, decode reads K/V in place with a small C++ kernel (see kernels/).
        self.cpu_decode = None
        if kv_cache.k[0].device.type == "cpu" and kv_cache.k[0].dtype == torch.float32:
            from kernels import cpu_attention

            if cpu_attention.load() is not None:
                self.cpu_decode = cpu_attention.decode_attention
        self._decode_slots: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._extend: list[tuple[int, int, int, torch.Tensor]] = []

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            if self.cpu_decode is not None:
                return
            max_len = max(fb.seq_lens_cpu)
            rows = self.req_to_token[fb.req_pool_indices, :max_len].to(torch.int64)
            self._decode_slots = rows.view(-1)
            ar = torch.arange(max_len, device=rows.device)
            self._decode_mask = (ar.unsqueeze(0) < fb.seq_lens.unsqueeze(1)).view(fb.batch_size, 1, 1, max_len)
        elif fb.forward_mode.is_extend():
            self._extend, start = [], 0
            rows = fb.req_pool_indices.tolist()
            for row, n, seq in zip(rows, fb.extend_seq_lens_cpu, fb.seq_lens_cpu):
                self._extend.append((start, n, seq, self.req_to_token[row, :seq].to(torch.int64)))
                start += n

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return q
        self.kv.set_kv(layer, fb.out_cache_loc, k, v)
        k_buf, v_buf = self.kv.k[layer], self.kv.v[layer]
        if fb.forward_mode.is_decode():
            if self.cpu_decode is not None:
                return self.cpu_decode(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices,
                                       fb.seq_lens, self.scale)
            # index_select, not advanced indexing: several times faster for row gathers.
            shape = (fb.batch_size, -1, *k_buf.shape[1:])
            keys = k_buf.index_select(0, self._decode_slots).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
            vals = v_buf.index_select(0, self._decode_slots).view(shape).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, vals, attn_mask=self._decode_mask, scale=self.scale,
                enable_gqa=True)
            return out.squeeze(2)
        out = torch.empty_like(q)
        for start, n, seq, slots in self._extend:
            qs = q[start:start + n].transpose(0, 1)  # [H, n, D]
            keys = k_buf.index_select(0, slots).transpose(0, 1)  # [Hkv, seq, D]
            vals = v_buf.index_select(0, slots).transpose(0, 1)
            prefix = seq - n
            if prefix == 0:
                o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                # Causal over the new tokens, full over the cached prefix.
                mask = torch.ones(n, seq, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
                o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
        return out


def create_attention_backend(name: str, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache,
                             scale: float, device: torch.device) -> AttentionBackend:
    if name == "torch":
        return TorchAttnBackend(req_to_token_pool, kv_cache, scale)
    if name == "triton":
        from kernels.triton_backend import TritonAttnBackend

        return TritonAttnBackend(req_to_token_pool, kv_cache, scale)
    if name == "flash_attn":
        from kernels.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(req_to_token_pool, kv_cache, scale)
    raise ValueError(f"unknown attention backend {name!r}")

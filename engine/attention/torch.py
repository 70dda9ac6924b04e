"""Attention backend "torch": gathers K/V through req_to_token and calls SDPA. Works on CPU and CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register_backend
from engine.forward_batch import ForwardBatch
from engine.memory import KVCache, ReqToTokenPool
from kernels import cpu_kernels


@dataclass(frozen=True, slots=True)
class TorchAttnMetadata:
    # Decode: the KV slots of every row padded to the longest sequence [bs * max_len], and the
    # mask of the real ones [bs, 1, 1, max_len]. None when the C++ CPU kernel reads the pool itself.
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    # Extend: per request (first new token in the flat token dim, new tokens, seq_len, KV slots,
    # the [new tokens, seq_len] mask of block-causal attention or None: causal).
    extend: tuple[tuple[int, int, int, torch.Tensor, torch.Tensor | None], ...] = ()
    block_size: int = 0  # > 0: the extends are block-causal with blocks of this many positions


@register_backend("torch")
class TorchAttnBackend(AttentionBackend):
    # The decode gather's width comes from host sequence lengths and extend loops on the host.
    graph_safe = False
    block_causal = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, scale: float,
                 device: torch.device) -> None:
        super().__init__(req_to_token_pool, kv_cache, scale, device)
        # On the CPU, decode reads K/V in place with a C++ kernel (kernels/cpu_kernels.py), which
        # also applies RoPE and stores the new K/V (float32, bfloat16): no host sync, no
        # value-dependent shape, so the CPU decode graphs can hold it.
        self.cpu_decode = None
        buf = kv_cache.k[0]
        if buf.device.type == "cpu" and buf.dtype in (torch.float32, torch.bfloat16):
            if cpu_kernels.load() is not None:
                self.fused_rope_decode = self.cpu_graph_safe = True
                if buf.dtype == torch.float32:
                    self.cpu_decode = cpu_kernels.decode_attention

    def init_forward_metadata(self, fb: ForwardBatch, block_size: int = 0) -> TorchAttnMetadata:
        if fb.forward_mode.is_decode():
            if self.cpu_decode is not None or self.fused_rope_decode or fb.batch_size == 0:
                return TorchAttnMetadata()
            max_len = max(fb.seq_lens_cpu)
            rows = self.req_to_token[fb.req_pool_indices, :max_len].to(torch.int64)
            ar = torch.arange(max_len, device=rows.device)
            mask = (ar.unsqueeze(0) < fb.seq_lens.unsqueeze(1)).view(fb.batch_size, 1, 1, max_len)
            return TorchAttnMetadata(decode_slots=rows.view(-1), decode_mask=mask)
        if fb.forward_mode.is_extend():
            extend, start = [], 0
            rows = fb.req_pool_indices.tolist()
            for row, n, seq in zip(rows, fb.extend_seq_lens_cpu, fb.seq_lens_cpu):
                mask = None
                if block_size:  # the query at position i sees key j (position j) iff j // B <= i // B
                    q_block = torch.arange(seq - n, seq, device=self.device) // block_size
                    k_block = torch.arange(seq, device=self.device) // block_size
                    mask = k_block.unsqueeze(0) <= q_block.unsqueeze(1)
                extend.append((start, n, seq, self.req_to_token[row, :seq].to(torch.int64), mask))
                start += n
            return TorchAttnMetadata(extend=tuple(extend), block_size=block_size)
        return TorchAttnMetadata()  # IDLE: no tokens

    def forward_decode_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, layer: int,
                            fb: ForwardBatch) -> torch.Tensor:
        heads = qkv.shape[1] - 2 * self.kv.k[layer].shape[1]
        return cpu_kernels.decode_attention_rope(
            qkv, cos, sin_signed, fb.positions, self.kv.k[layer], self.kv.v[layer], fb.out_cache_loc,
            self.req_to_token, fb.req_pool_indices, fb.seq_lens, heads, self.scale)

    # === graph hooks (CPU decode graphs): the kernel reads the batch's own tensors, nothing else ===
    def init_cuda_graph_state(self, max_bs: int) -> None:
        if not self.cpu_graph_safe:
            super().init_cuda_graph_state(max_bs)

    def capture_metadata(self, fb: ForwardBatch) -> TorchAttnMetadata:
        if not self.cpu_graph_safe:
            super().capture_metadata(fb)
        return TorchAttnMetadata()

    def replay_metadata(self, fb: ForwardBatch) -> None:
        if not self.cpu_graph_safe:
            super().replay_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return q
        md: TorchAttnMetadata = self.metadata(fb)
        self.kv.set_kv(layer, fb.out_cache_loc, k, v)
        k_buf, v_buf = self.kv.k[layer], self.kv.v[layer]
        if fb.forward_mode.is_decode():
            if self.cpu_decode is not None:
                return self.cpu_decode(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices,
                                       fb.seq_lens, self.scale)
            # index_select, not advanced indexing: several times faster for row gathers.
            shape = (fb.batch_size, -1, *k_buf.shape[1:])
            keys = k_buf.index_select(0, md.decode_slots).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
            vals = v_buf.index_select(0, md.decode_slots).view(shape).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, vals, attn_mask=md.decode_mask, scale=self.scale,
                enable_gqa=True)
            return out.squeeze(2)
        out = torch.empty_like(q)
        for start, n, seq, slots, block_mask in md.extend:
            qs = q[start:start + n].transpose(0, 1)  # [H, n, D]
            keys = k_buf.index_select(0, slots).transpose(0, 1)  # [Hkv, seq, D]
            vals = v_buf.index_select(0, slots).transpose(0, 1)
            prefix = seq - n
            if block_mask is not None:
                o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=block_mask, scale=self.scale,
                                                   enable_gqa=True)
            elif prefix == 0:
                o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                # Causal over the new tokens, full over the cached prefix.
                mask = torch.ones(n, seq, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
                o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
        return out

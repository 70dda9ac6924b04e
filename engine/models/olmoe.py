"""OLMoE: Llama attention with one RMSNorm over all heads of q and one over all of k (not per
head), q/k/v optionally clamped to +-clip_qkv, and an MoE MLP in every layer (router `mlp.gate`,
experts `mlp.experts.{e}.{gate,up,down}_proj`, renormalised iff norm_topk_prob)."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.models.base import Weights, register_model
from engine.models.layers import Attention, rms_norm
from engine.models.moe import SparseMoeCausalLM
from kernels.cpu_linear import Linear, LinearKind
from kernels.lora import LoRABatchInfo


class OlmoeAttention(Attention):
    def __init__(self, qkv: Linear, o: Linear, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 q_norm: torch.Tensor, k_norm: torch.Tensor, clip: float | None) -> None:
        super().__init__(qkv, o, num_heads, num_kv_heads, head_dim, eps, q_norm, k_norm)
        self.clip = clip

    def unroped_qkv(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """`lora` is never given: LoRA adapters are refused for OLMoE at start."""
        q_dim, k_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        flat = self.qkv_proj(x)
        qkv = torch.cat([rms_norm(flat[:, :q_dim], self.q_norm, self.eps),
                         rms_norm(flat[:, q_dim:q_dim + k_dim], self.k_norm, self.eps),
                         flat[:, q_dim + k_dim:]], dim=1)
        if self.clip is not None:
            qkv.clamp_(-self.clip, self.clip)
        return qkv.view(x.shape[0], self.qkv_heads, self.head_dim)


@register_model("OlmoeForCausalLM")
class OlmoeForCausalLM(SparseMoeCausalLM):
    def make_attention(self, w: Weights, p: str, linear: LinearKind) -> Attention:
        cfg = self.cfg
        if cfg.attention_bias:  # it would bias o_proj too, which Attention does not
            raise ConfigError("OLMoE with attention_bias is not supported")
        a = p + "self_attn."
        qkv = Linear(torch.cat([w(f"{a}{x}_proj.weight") for x in "qkv"]), kind=linear)
        return OlmoeAttention(qkv, Linear(w(a + "o_proj.weight"), kind=linear), cfg.num_attention_heads,
                              cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, w(a + "q_norm.weight"),
                              w(a + "k_norm.weight"), cfg.clip_qkv)

"""Qwen3-MoE and Qwen2-MoE: Qwen3 (per-head q/k RMSNorm) or Qwen2 (q/k/v bias) attention, and
MoE MLPs with the router at `mlp.gate` and experts at `mlp.experts.{e}.{gate,up,down}_proj`;
routing weights renormalised iff `norm_topk_prob`; dense MLPs on `mlp_only_layers` and off
`decoder_sparse_step`. Qwen2-MoE adds a sigmoid-gated shared expert (`mlp.shared_expert`).
The attention flavour and the shared expert follow from ModelConfig."""

from __future__ import annotations

from engine.models.base import register_model
from engine.models.moe import SparseMoeCausalLM


@register_model("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
class Qwen3MoeForCausalLM(SparseMoeCausalLM):
    pass

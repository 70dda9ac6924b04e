"""Mixtral: Mistral attention and an MoE MLP in every layer, the router at `block_sparse_moe.gate`
and expert e as `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down). The top-k
weights are always renormalised: softmax over the top-k logits, as transformers computes it
(softmax over all experts, top-k, divided by their sum)."""

from __future__ import annotations

from engine.models.base import register_model
from engine.models.moe import SparseMoeCausalLM


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(SparseMoeCausalLM):
    moe_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")

    def renormalize(self) -> bool:
        return True

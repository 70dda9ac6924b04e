"""The base of the sparse mixture-of-experts models: a Llama-style decoder whose MLP slots are
`MoEMLP`s on the layers `ModelConfig.is_sparse_layer` picks (dense `GatedMLP`s elsewhere). The
model files subclass it, register their HF names and name their checkpoint tensors."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.models.base import Weights
from engine.models.layers import MLP, GatedMLP, MoEMLP
from engine.models.llama import LlamaForCausalLM


class SparseMoeCausalLM(LlamaForCausalLM):
    """Router at `{layer}{moe_prefix}gate.weight`, expert e's projections at
    `{layer}{moe_prefix}experts.{e}.{name}.weight` with `expert_names` = (gate, up, down): the
    per-expert layout of the published checkpoints (transformers writes it too)."""

    moe_prefix = "mlp."
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, mlp_shard: tuple[int, int] = (0, 1),
                 onednn: bool = False) -> None:
        if cfg.num_experts < 1:
            raise ConfigError(f"{cfg.architecture} needs num_experts >= 1 in config.json")
        # Before the layers are built (LlamaForCausalLM.__init__ calls make_mlp): they share it.
        self.expert_tokens = torch.zeros(cfg.num_experts, dtype=torch.int64, device=device)
        super().__init__(cfg, weights, dtype, device, max_positions, mlp_shard, onednn)

    def renormalize(self) -> bool:
        """Whether the top-k routing weights are divided by their sum."""
        return self.cfg.norm_topk_prob

    def make_mlp(self, w: Weights, p: str, mlp_shard: tuple[int, int], onednn: bool) -> MLP:
        layer = int(p.rstrip(".").rsplit(".", 1)[1])  # p = "model.layers.{i}."
        if not self.cfg.is_sparse_layer(layer):
            return super().make_mlp(w, p, mlp_shard, onednn)
        m = p + self.moe_prefix
        gate, up, down = self.load_experts(w, m + "experts.")
        shared = shared_gate = None
        if self.cfg.shared_expert_intermediate_size:
            s = m + "shared_expert."
            shared = GatedMLP(w(s + "gate_proj.weight"), w(s + "up_proj.weight"), w(s + "down_proj.weight"),
                              mlp_shard, onednn)
            shared_gate = w(m + "shared_expert_gate.weight")
        return MoEMLP(w(m + "gate.weight"), gate, up, down, self.cfg.num_experts_per_tok, self.renormalize(),
                      mlp_shard, onednn, self.expert_tokens, shared, shared_gate)

    def load_experts(self, w: Weights, x: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate [E, I, H], up [E, I, H], down [E, H, I] from the checkpoint's expert tensors under `x`."""
        return tuple(torch.stack([w(f"{x}{e}.{name}.weight") for e in range(self.cfg.num_experts)])
                     for name in self.expert_names)

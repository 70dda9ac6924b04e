"""The base of the sparse mixture-of-experts models: a Llama-style decoder whose MLP slots are
`MoEMLP`s on the layers `ModelConfig.is_sparse_layer` picks (dense `GatedMLP`s elsewhere). The
model files subclass it, register their HF names and name their checkpoint tensors."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.models.base import Weights
from engine.models.layers import MLP, ExpertWeights, GatedMLP, MoEMLP, MoESplit, shard_range
from engine.models.llama import LlamaForCausalLM
from engine.tp.comm import TPGroup
from kernels.cpu_linear import LinearKind


class SparseMoeCausalLM(LlamaForCausalLM):
    """Router at `{layer}{moe_prefix}gate.weight`, expert e's projections at
    `{layer}{moe_prefix}experts.{e}.{name}.weight` with `expert_names` = (gate, up, down): the
    per-expert layout of the published checkpoints (transformers writes it too). Under tensor
    parallelism each rank holds a slice of every expert's (and the shared expert's)
    intermediate dim (`engine.tp.sharding`): the experts are built from those slices as from
    whole weights, and the layer's one all-reduce sums routed and shared parts at once."""

    cpu_graph_safe = False  # expert grouping reads routing counts on the host
    moe_prefix = "mlp."
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @property
    def cuda_graph_safe(self) -> bool:
        """Only with every MoE layer in the fused kernel: the grouped path (quantized experts)
        reads routing counts on the host."""
        return all(layer.mlp.fused for layer in self.layers if isinstance(layer.mlp, MoEMLP))

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, mlp_shard: tuple[int, int] = (0, 1),
                 linear: LinearKind = "torch", moe_split: MoESplit = "experts", tp: TPGroup | None = None) -> None:
        if cfg.num_experts < 1:
            raise ConfigError(f"{cfg.architecture} needs num_experts >= 1 in config.json")
        # Before the layers are built (LlamaForCausalLM.__init__ calls make_mlp): they share it.
        self.expert_tokens = torch.zeros(cfg.num_experts, dtype=torch.int64, device=device)
        super().__init__(cfg, weights, dtype, device, max_positions, mlp_shard, linear, moe_split, tp)

    def renormalize(self) -> bool:
        """Whether the top-k routing weights are divided by their sum."""
        return self.cfg.norm_topk_prob

    def make_mlp(self, w: Weights, p: str, mlp_shard: tuple[int, int], linear: LinearKind) -> MLP:
        layer = int(p.rstrip(".").rsplit(".", 1)[1])  # p = "model.layers.{i}."
        # Expert parallelism keeps the dense MLPs (dense layers, shared experts) whole on every
        # member: they run data-parallel on its own rows, like attention, with no collectives.
        dense_shard = (0, 1) if self.moe_split == "experts" else mlp_shard
        if not self.cfg.is_sparse_layer(layer):
            return super().make_mlp(w, p, dense_shard, linear)
        m = p + self.moe_prefix
        held = range(self.cfg.num_experts)
        if self.moe_split == "experts":  # only this member's experts are read
            held = range(*shard_range(self.cfg.num_experts, mlp_shard, "num_experts"))
        gate, up, down = self.load_experts(w, m + "experts.", held)
        shared = shared_gate = None
        if self.cfg.shared_expert_intermediate_size:
            s = m + "shared_expert."
            shared = GatedMLP(w(s + "gate_proj.weight"), w(s + "up_proj.weight"), w(s + "down_proj.weight"),
                              dense_shard, linear)
            shared_gate = w(m + "shared_expert_gate.weight")
        return MoEMLP(w(m + "gate.weight"), gate, up, down, self.cfg.num_experts_per_tok, self.renormalize(),
                      mlp_shard, linear, self.expert_tokens, shared, shared_gate, split=self.moe_split)

    def load_experts(self, w: Weights, x: str, experts: range) -> tuple[ExpertWeights, ExpertWeights, ExpertWeights]:
        """gate, up and down of `experts` from the checkpoint's expert tensors under `x`: stacked
        float tensors (gate [E', I, H], up [E', I, H], down [E', H, I]) or, when the checkpoint
        holds every one of them quantized, one QuantWeight per expert (kept in its block format)."""
        names = [[f"{x}{e}.{name}.weight" for e in experts] for name in self.expert_names]
        if all(w.is_quantized(n) for per_name in names for n in per_name):
            return tuple([w.linear(n) for n in per_name] for per_name in names)
        return tuple(torch.stack([w(n) for n in per_name]) for per_name in names)

"""What one tensor-parallel rank holds, computed once from the ModelConfig and (tp_rank, tp_size):
its query and KV heads, its slice of every MLP's intermediate dim, its rows of the padded
vocabulary, its KV bytes per token and its weight count. Pure arithmetic: no tensors."""

from __future__ import annotations

import msgspec
import torch

from engine.config import ModelConfig
from engine.errors import ConfigError


def divide(size: int, tp_size: int, what: str) -> int:
    """size / tp_size, or a ConfigError naming `what` when it does not divide."""
    if size % tp_size:
        raise ConfigError(f"{what} {size} is not divisible by tp_size {tp_size}")
    return size // tp_size


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    return any(not cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))


class TPLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Rank `tp_rank` of `tp_size`'s share of a model (SGLang/vLLM's split):

    - query heads [head_start, head_start + num_heads): column-parallel q;
    - KV heads [kv_head_start, kv_head_start + num_kv_heads): split like q when the model has at
      least tp_size of them, else one head per rank, replicated on `kv_head_replicas` ranks (the
      head its query heads read, as SGLang's QKVParallelLinear does);
    - a 1/tp_size slice of the dense MLP's, each expert's and the shared expert's intermediate
      dim (column-parallel gate/up, row-parallel down);
    - vocabulary rows [vocab_start, vocab_end) of the vocabulary padded to `padded_vocab_size`
      (VocabParallelEmbedding / ParallelLMHead); rows at or past `vocab_size` are padding.
    Sizes are per rank unless named `total_`."""

    tp_rank: int
    tp_size: int
    head_dim: int
    total_num_heads: int
    total_num_kv_heads: int
    num_heads: int
    num_kv_heads: int
    head_start: int
    kv_head_start: int
    kv_head_replicas: int  # ranks holding each of this rank's KV heads (1: split, not replicated)
    intermediate_size: int  # dense MLP's, this rank's slice (0: the model has no dense MLP)
    moe_intermediate_size: int  # each expert's, this rank's slice (0: a dense model)
    shared_expert_intermediate_size: int
    vocab_size: int  # the model's (unpadded)
    padded_vocab_size: int
    vocab_start: int
    vocab_end: int  # exclusive; every rank holds vocab_end - vocab_start rows, padding included

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, tp_rank: int, tp_size: int, vocab_pad_multiple: int = 1
    ) -> TPLayout:
        """The layout of rank `tp_rank`; a ConfigError when the model cannot be split `tp_size`
        ways (query heads, KV heads, an intermediate dim). The vocabulary is padded to a multiple
        of tp_size * `vocab_pad_multiple` (vLLM pads to 64 per rank on GPUs for aligned GEMMs)."""
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
        heads = divide(cfg.num_attention_heads, tp_size, "num_attention_heads")
        kv = cfg.num_key_value_heads
        if kv >= tp_size:
            kv_heads, replicas = divide(kv, tp_size, "num_key_value_heads"), 1
            kv_start = tp_rank * kv_heads
        else:
            # Fewer KV heads than ranks: each rank holds the one head its query heads use.
            if tp_size % kv:
                raise ConfigError(
                    f"num_key_value_heads {kv} is fewer than tp_size {tp_size} and does not "
                    "divide it (each rank must read exactly one KV head)"
                )
            kv_heads, replicas = 1, tp_size // kv
            kv_start = tp_rank // replicas
        inter = (
            divide(cfg.intermediate_size, tp_size, "intermediate_size")
            if _has_dense_mlp(cfg)
            else 0
        )
        moe = (
            divide(cfg.moe_intermediate_size, tp_size, "moe_intermediate_size")
            if cfg.num_experts
            else 0
        )
        shared = divide(
            cfg.shared_expert_intermediate_size, tp_size, "shared_expert_intermediate_size"
        )
        step = tp_size * max(1, vocab_pad_multiple)
        padded = -(-cfg.vocab_size // step) * step
        per_rank = padded // tp_size
        return cls(
            tp_rank=tp_rank,
            tp_size=tp_size,
            head_dim=cfg.head_dim,
            total_num_heads=cfg.num_attention_heads,
            total_num_kv_heads=kv,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_start=tp_rank * heads,
            kv_head_start=kv_start,
            kv_head_replicas=replicas,
            intermediate_size=inter,
            moe_intermediate_size=moe,
            shared_expert_intermediate_size=shared,
            vocab_size=cfg.vocab_size,
            padded_vocab_size=padded,
            vocab_start=tp_rank * per_rank,
            vocab_end=(tp_rank + 1) * per_rank,
        )

    @property
    def q_size(self) -> int:
        """This rank's q width (num_heads * head_dim): the o-projection's input slice."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_per_rank(self) -> int:
        return self.vocab_end - self.vocab_start

    @property
    def org_vocab_end(self) -> int:
        """End of this rank's real (unpadded) rows; rows [org_vocab_end, vocab_end) are padding."""
        return max(self.vocab_start, min(self.vocab_end, self.vocab_size))

    @property
    def num_padding(self) -> int:
        return self.vocab_end - self.org_vocab_end

    def kv_bytes_per_token(self, num_layers: int, dtype: torch.dtype) -> int:
        """This rank's KV pool bytes per token: K and V of its heads in every layer (the pool is
        sized per rank, so replicated KV heads cost every rank that holds them)."""
        return (
            2
            * num_layers
            * self.num_kv_heads
            * self.head_dim
            * torch.empty(0, dtype=dtype).element_size()
        )


def rank_weight_numel(cfg: ModelConfig, layout: TPLayout, tied: bool | None = None) -> int:
    """Parameters rank `layout.tp_rank` holds after `engine.tp.sharding.shard_weights` (float
    elements; padding rows and replicated tensors included): what the memory planner can budget
    before a weight is read. `tied` defaults to cfg.tie_word_embeddings."""
    tied = cfg.tie_word_embeddings if tied is None else tied
    h, hd = cfg.hidden_size, layout.head_dim
    n = layout.vocab_per_rank * h * (1 if tied else 2) + h  # embedding (+ LM head), final norm
    attn = (
        h * (layout.q_size + 2 * layout.kv_size) + layout.q_size * h + 2 * h
    )  # qkv, o, both layer norms
    if cfg.attention_bias:
        attn += layout.q_size + 2 * layout.kv_size
    if cfg.qk_norm:
        attn += 2 * hd  # per-head norms, replicated
    for i in range(cfg.num_hidden_layers):
        n += attn
        if not cfg.is_sparse_layer(i):
            n += 3 * h * layout.intermediate_size
            continue
        n += cfg.num_experts * (
            h + 3 * h * layout.moe_intermediate_size
        )  # router row + expert slice
        if layout.shared_expert_intermediate_size:
            n += 3 * h * layout.shared_expert_intermediate_size + h  # shared expert slice, its gate
    return n


def rank_weight_bytes(
    cfg: ModelConfig, layout: TPLayout, dtype: torch.dtype, tied: bool | None = None
) -> int:
    """`rank_weight_numel` in `dtype` (float weights; a quantized model holds fewer bytes)."""
    return rank_weight_numel(cfg, layout, tied) * torch.empty(0, dtype=dtype).element_size()


def replicated_numel(cfg: ModelConfig) -> int:
    """Parameters every rank holds whole: norms, per-head q/k norms, MoE routers and the shared
    expert's gate (replicated KV heads are counted by the layout's KV sizes instead)."""
    h = cfg.hidden_size
    n = h + cfg.num_hidden_layers * (2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0))
    sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    return n + sparse * (cfg.num_experts * h + (h if cfg.shared_expert_intermediate_size else 0))

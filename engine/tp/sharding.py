"""Tensor-parallel shards of a checkpoint: pure functions from the full weights (HF names, as
`engine.models.load_weights` returns them: q/k/v and gate/up as separate tensors, experts as
`...experts.{e}.{gate_proj,up_proj,down_proj}` or Mixtral's `w1, w3, w2`) to one rank's, under
the same names, so a model builds from the shards as it builds from the checkpoint.

The split is SGLang's / vLLM's:
- ColumnParallelLinear (output rows): q by query heads, k/v by KV heads (replicated when there
  are fewer KV heads than ranks: each rank keeps the head its query heads read), gate/up by the
  intermediate dim; their biases (Qwen2's q/k/v) likewise. Outputs stay local to the rank.
- RowParallelLinear (input columns): o_proj over the rank's heads, down_proj over its
  intermediate slice; each rank's output is a partial sum, all-reduced once per projection. A
  bias is kept on rank 0 only (zeros elsewhere), so it is added exactly once by the sum.
- VocabParallelEmbedding / ParallelLMHead: rows [vocab_start, vocab_end) of the vocabulary
  padded to a multiple of tp_size; padding rows are zero (their logits are masked to -inf,
  `engine.tp.ops.vocab_parallel_logits`). A tied LM head is the embedding's shard itself.
- Replicated: RMSNorm weights, Qwen3's per-head q/k norms (one head_dim vector applied to every
  head), MoE routers, Qwen2-MoE's shared-expert gate (a per-token scalar: scaling each rank's
  partial output scales their sum).
- MoE: tensor parallelism inside every expert (each rank holds 1/tp_size of every expert's
  intermediate dim), not expert parallelism. Under TP every rank sees every token anyway, so
  both need one all-reduce per MoE layer; the intermediate split keeps the ranks' work equal
  whatever the routing (a TP step waits for its slowest rank each layer, and a decode step of a
  few tokens may route every token to experts of one rank), needs no num_experts % tp_size, and
  splits the dense and shared-expert MLPs the same way. It is SGLang's default (ep_size 1).

Quantized weights (`kernels.quant.QuantWeight`) split the same way: rows (`select_rows`) for
column-parallel and vocabulary shards, columns (`select_cols`) for row-parallel ones, which
must fall on the format's group boundaries (a ConfigError otherwise).

LoRA adapters split like the projection they attach to (`TPLoRAShards`): a column-parallel
projection's B by the same output rows (A whole: every rank needs x A), a row-parallel one's A by
the same input columns (B whole: the ranks' (x_r A_r) B add up to (x A) B in the all-reduce the
base projection has anyway).

Slices are copied (`clone`), so the full checkpoint tensors can be freed once sharded."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.lora.adapter import LoRAModule, target_shapes, target_weight_name
from engine.tp.layout import TPLayout, divide
from kernels.quant import QuantWeight

Weight = torch.Tensor | QuantWeight

# How a checkpoint tensor is split across the TP group.
ShardKind = Literal["q", "kv", "column", "row", "row_bias", "vocab", "replicated"]

# First match wins: q/k norms before the generic norms, the expert/MLP projections by suffix.
_RULES: list[tuple[re.Pattern[str], ShardKind]] = [
    (re.compile(p), kind)
    for p, kind in [
        (r"(^|\.)embed_tokens\.weight$", "vocab"),
        (r"(^|\.)lm_head\.weight$", "vocab"),
        (r"\.self_attn\.q_proj\.(weight|bias)$", "q"),
        (r"\.self_attn\.[kv]_proj\.(weight|bias)$", "kv"),
        (r"\.self_attn\.o_proj\.weight$", "row"),
        (r"\.self_attn\.o_proj\.bias$", "row_bias"),
        (r"\.self_attn\.[qk]_norm\.weight$", "replicated"),  # per head; checked in shard_spec
        (r"\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$", "column"),
        (r"\.(down_proj|w2)\.weight$", "row"),
        (r"\.(down_proj|w2)\.bias$", "row_bias"),
        (r"(^|\.)(\w*norm)\.weight$", "replicated"),  # input/post-attention layernorms, model.norm
        (r"\.(mlp|block_sparse_moe)\.gate\.weight$", "replicated"),  # the MoE router
        (r"\.shared_expert_gate\.weight$", "replicated"),
        (r"\.rotary_emb\.inv_freq$", "replicated"),
    ]
]


def shard_kind(name: str) -> ShardKind:
    """How the checkpoint tensor `name` is split; a ConfigError for a name with no rule (a
    weight replicated by mistake would make every rank's partial sums wrong, silently)."""
    for pattern, kind in _RULES:
        if pattern.search(name):
            return kind
    raise ConfigError(f"no tensor-parallel rule for weight {name!r}")


def _own(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` in storage of its own: a view would keep the whole checkpoint tensor alive."""
    if t is None or t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _own_quant(w: QuantWeight) -> QuantWeight:
    return QuantWeight(
        _own(w.qweight), _own(w.scales), _own(w.biases), w.bits, w.group_size, _own(w.perm)
    )


def _rows(w: Weight, lo: int, hi: int) -> Weight:
    if isinstance(w, QuantWeight):
        return _own_quant(w.select_rows(slice(lo, hi)))
    return _own(w[lo:hi])


def _cols(w: Weight, lo: int, hi: int, name: str) -> Weight:
    if isinstance(w, QuantWeight) and w.perm is not None:
        # act-order's groups are spread over every rank's slice of the input: this rank's slice
        # as float (the model's dtype once loaded)
        return _own(w.dequantize()[:, lo:hi])
    if isinstance(w, QuantWeight):
        try:
            return _own_quant(w.select_cols(lo, hi))
        except ValueError as e:
            if ".experts." in name:  # an expert is small: its slice as float, as unquantized experts load
                return _own(w.dequantize()[:, lo:hi])
            raise ConfigError(
                f"{name}: the row-parallel split [{lo}, {hi}) of its {w.in_features} input "
                f"columns falls inside a quantization group of {w.group_size} (a tp_size "
                f"whose slice is a multiple of the group size is needed): {e}"
            ) from None
    return _own(w[:, lo:hi])


def pad_rows(w: Weight, rows: int) -> Weight:
    """`w` with zero rows appended up to `rows` (a quantized zero row: codes, scales, biases 0)."""
    extra = rows - w.shape[0]
    if extra == 0:
        return w
    if isinstance(w, QuantWeight):

        def pad(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

        return QuantWeight(
            pad(w.qweight), pad(w.scales), pad(w.biases), w.bits, w.group_size, w.perm
        )
    return torch.cat([w, w.new_zeros(extra, *w.shape[1:])])


def column_shard(w: Weight, tp_rank: int, tp_size: int, name: str = "weight") -> Weight:
    """ColumnParallelLinear: output rows [rank * N / tp, (rank + 1) * N / tp) (a 1-D bias too)."""
    per = divide(w.shape[0], tp_size, f"{name} output size")
    return _rows(w, tp_rank * per, (tp_rank + 1) * per)


def row_shard(w: Weight, tp_rank: int, tp_size: int, name: str = "weight") -> Weight:
    """RowParallelLinear: input columns [rank * K / tp, (rank + 1) * K / tp)."""
    per = divide(w.shape[1], tp_size, f"{name} input size")
    return _cols(w, tp_rank * per, (tp_rank + 1) * per, name)


def row_bias_shard(b: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """A RowParallelLinear's bias: whole on rank 0, zeros elsewhere (added once by the all-reduce)."""
    return b.clone() if tp_rank == 0 else torch.zeros_like(b)


class ShardSpec(NamedTuple):
    """What a rank reads of one checkpoint tensor: `[lo, hi)` along `dim` (0: rows, 1: columns;
    None: the whole tensor), then zero rows appended up to `pad_rows` (vocabulary padding), or
    zeros of the tensor's shape (`zeros`: a row-parallel bias off rank 0). A loader can read just
    that slice from the file (`engine.tp.loader`)."""

    kind: ShardKind
    dim: int | None
    lo: int = 0
    hi: int = 0
    pad_rows: int = 0
    zeros: bool = False


def shard_spec(name: str, shape: Sequence[int], layout: TPLayout) -> ShardSpec:
    """Rank `layout.tp_rank`'s slice of checkpoint tensor `name` of `shape` (see the module
    docstring); a ConfigError when the tensor cannot be split so."""
    kind = shard_kind(name)
    rank, tp = layout.tp_rank, layout.tp_size
    if kind == "vocab":
        if shape[0] != layout.vocab_size:
            raise ConfigError(
                f"{name} has {shape[0]} rows, config.json says vocab_size {layout.vocab_size}"
            )
        if tp == 1 and layout.num_padding == 0:
            return ShardSpec(kind, None)
        return ShardSpec(
            kind, 0, layout.vocab_start, layout.org_vocab_end, pad_rows=layout.vocab_per_rank
        )
    if kind == "replicated":
        if re.search(r"\.[qk]_norm\.weight$", name) and shape[-1] != layout.head_dim and tp > 1:
            # OLMoE normalises q (and k) over all heads at once: the RMS would need every
            # rank's heads (an all-reduce of the squares) before the norm.
            raise ConfigError(
                f"{name}: a q/k norm over all heads (OLMoE) is not supported with tp_size > 1"
            )
        return ShardSpec(kind, None)
    if tp == 1:
        return ShardSpec(kind, None)
    if kind in ("q", "kv"):  # this rank's query heads, or its KV heads (replicated if too few)
        hd = layout.head_dim
        if kind == "q":
            start, count, total = layout.head_start, layout.num_heads, layout.total_num_heads
        else:
            start, count, total = (
                layout.kv_head_start,
                layout.num_kv_heads,
                layout.total_num_kv_heads,
            )
        if shape[0] != total * hd:
            raise ConfigError(f"{name} has {shape[0]} rows, expected {total} heads x head_dim {hd}")
        return ShardSpec(kind, 0, start * hd, (start + count) * hd)
    if kind == "column":
        per = divide(shape[0], tp, f"{name} output size")
        return ShardSpec(kind, 0, rank * per, (rank + 1) * per)
    if kind == "row":  # o_proj: the columns of this rank's query heads (heads split evenly)
        per = divide(shape[1], tp, f"{name} input size")
        return ShardSpec(kind, 1, rank * per, (rank + 1) * per)
    return ShardSpec(kind, None, zeros=rank > 0)  # row_bias


def apply_shard_spec(w: Weight, spec: ShardSpec, name: str = "weight") -> Weight:
    """The part of full tensor `w` that `spec` names (a copy, unless the whole tensor)."""
    if spec.zeros:
        if isinstance(w, QuantWeight):
            raise ConfigError(f"{name}: a quantized bias is not supported")
        return torch.zeros_like(w)
    if spec.dim == 0:
        w = _rows(w, spec.lo, spec.hi)
    elif spec.dim == 1:
        w = _cols(w, spec.lo, spec.hi, name)
    return pad_rows(w, spec.pad_rows) if spec.pad_rows else w


def shard_tensor(name: str, w: Weight, layout: TPLayout) -> Weight:
    """Rank `layout.tp_rank`'s part of checkpoint tensor `name` (see the module docstring)."""
    return apply_shard_spec(w, shard_spec(name, w.shape, layout), name)


def shard_weights(
    weights: Mapping[str, Weight],
    cfg: ModelConfig,
    tp_rank: int,
    tp_size: int,
    vocab_pad_multiple: int = 1,
) -> dict[str, Weight]:
    """Rank `tp_rank` of `tp_size`'s shards of every checkpoint tensor, under the same names.
    Replicated tensors are the input's own objects (not copies)."""
    layout = TPLayout.from_config(cfg, tp_rank, tp_size, vocab_pad_multiple)
    return {name: shard_tensor(name, w, layout) for name, w in weights.items()}


def weight_nbytes(w: Weight) -> int:
    """Bytes one tensor (or quantized weight) holds."""
    if isinstance(w, QuantWeight):
        return w.nbytes()
    return w.numel() * w.element_size()


def shard_bytes(weights: Mapping[str, Weight]) -> int:
    """Bytes of a (sharded) weight dict: what one rank holds."""
    return sum(weight_nbytes(w) for w in weights.values())


class TPLoRAShards:
    """Rank `layout.tp_rank`'s part of each LoRA adapter (engine.lora.LoRAShards): the slice
    `shard_spec` gives the base weight it adapts (PEFT's lora_B [out, rank] is sliced where the
    weight [out, in] is sliced by rows, lora_A [rank, in] where it is sliced by columns), so q, k
    and v follow this rank's query and KV heads (a replicated KV head included) and gate/up and
    down its intermediate slice."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout) -> None:
        self.cfg, self.layout = cfg, layout
        self._shapes = target_shapes(cfg)  # (in, out), whole

    def _spec(self, layer: int, target: str) -> ShardSpec:
        d_in, d_out = self._shapes[target]
        return shard_spec(target_weight_name(layer, target), (d_out, d_in), self.layout)

    def target_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each target on this rank (the slices of `shard`)."""
        h, lay = self.cfg.hidden_size, self.layout
        return {
            "q_proj": (h, lay.q_size),
            "k_proj": (h, lay.kv_size),
            "v_proj": (h, lay.kv_size),
            "o_proj": (lay.q_size, h),
            "gate_proj": (h, lay.intermediate_size),
            "up_proj": (h, lay.intermediate_size),
            "down_proj": (lay.intermediate_size, h),
        }

    def shard(self, layer: int, target: str, module: LoRAModule) -> LoRAModule:
        """This rank's A and B of `target` in `layer` (copies: the whole adapter can be freed)."""
        spec = self._spec(layer, target)
        a, b = module.lora_a, module.lora_b
        if spec.dim == 0:
            b = b[spec.lo : spec.hi].clone()
        elif spec.dim == 1:
            a = a[:, spec.lo : spec.hi].clone()
        return LoRAModule(a, b, module.scaling)

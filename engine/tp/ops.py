"""The tensor-parallel steps a model's forward adds around its sharded weights: the
vocabulary-parallel embedding (look up the rank's rows, zero the rest, all-reduce), the
row-parallel reduction, and the vocabulary-parallel LM head's logits (all-gather the shards,
padding masked)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.tp.comm import TPGroup
from engine.tp.layout import TPLayout
from kernels.quant import QuantWeight


def vocab_parallel_embedding(
    ids: torch.Tensor,
    table: torch.Tensor | QuantWeight,
    layout: TPLayout,
    group: TPGroup,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """VocabParallelEmbedding: rows `ids` [T] of the whole table from each rank's shard
    [vocab_per_rank, H]: ids outside the rank's range look up row 0 and are zeroed, then the
    ranks' rows are summed (exactly one rank holds each id, so the sum is that row, bit for bit)."""
    if layout.tp_size == 1:
        local, outside = ids, None
    else:
        outside = (ids < layout.vocab_start) | (ids >= layout.org_vocab_end)
        local = (ids - layout.vocab_start).masked_fill_(outside, 0)
    if isinstance(table, QuantWeight):
        out = table.dequantize_rows(local, dtype or torch.float32)
    else:
        out = F.embedding(local, table)
        if dtype is not None:
            out = out.to(dtype)
    if outside is not None:
        out.masked_fill_(outside.unsqueeze(-1), 0)
    return group.all_reduce(out)


def row_parallel_reduce(partial: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """RowParallelLinear's output: the ranks' partial sums added, in place."""
    return group.all_reduce(partial)


def mask_vocab_padding(local_logits: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """This rank's logits [T, vocab_per_rank] with its padding columns at -inf (in place), so
    they never win an argmax nor take probability mass."""
    if layout.num_padding:
        local_logits[..., layout.org_vocab_end - layout.vocab_start :] = float("-inf")
    return local_logits


def vocab_parallel_logits(
    local_logits: torch.Tensor, layout: TPLayout, group: TPGroup
) -> torch.Tensor:
    """ParallelLMHead: every rank's logits shard [T, vocab_per_rank] -> the logits over the real
    vocabulary [T, vocab_size] on every rank (padding masked, then cut off)."""
    full = group.all_gather(mask_vocab_padding(local_logits, layout), dim=-1)
    return full if full.shape[-1] == layout.vocab_size else full[..., : layout.vocab_size]

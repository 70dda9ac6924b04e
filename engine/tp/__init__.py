"""Tensor parallelism: one engine's model split over `tp_size` ranks (SGLang's / vLLM's
ColumnParallel / RowParallel linears, VocabParallelEmbedding and ParallelLMHead).

- `layout.TPLayout`: a rank's heads, KV heads, intermediate slices and vocabulary rows;
  `rank_weight_numel` / `rank_weight_bytes` its weights; `kv_bytes_per_token` its KV pool's cost.
- `sharding.shard_weights`: a rank's shards of the full checkpoint, under the HF names
  (`shard_spec`: the slice of one tensor); `loader.read_rank_weights`: the same shards read
  slice by slice from a float safetensors checkpoint; `sharding.TPLoRAShards`: a rank's part
  of a LoRA adapter.
- `comm.TPGroup`: the group's collectives on private process groups; `graph_ops`: the same as
  opaque operators inside a CPU decode graph, bound to a group by an integer handle.
- `ops`: the embedding, reduction and logits steps of a sharded forward."""

from engine.tp.comm import TPGroup, make_store, serve_store
from engine.tp.layout import TPLayout, rank_weight_bytes, rank_weight_numel, replicated_numel
from engine.tp.ops import (
    mask_vocab_padding,
    row_parallel_reduce,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)
from engine.tp.sharding import (
    ShardSpec,
    TPLoRAShards,
    shard_bytes,
    shard_kind,
    shard_spec,
    shard_tensor,
    shard_weights,
)

__all__ = [
    "TPGroup",
    "TPLayout",
    "make_store",
    "serve_store",
    "mask_vocab_padding",
    "rank_weight_bytes",
    "rank_weight_numel",
    "replicated_numel",
    "row_parallel_reduce",
    "shard_bytes",
    "shard_kind",
    "shard_spec",
    "ShardSpec",
    "TPLoRAShards",
    "shard_tensor",
    "shard_weights",
    "vocab_parallel_embedding",
    "vocab_parallel_logits",
]

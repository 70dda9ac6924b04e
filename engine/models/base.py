"""The model contract (`CausalLM`), the architecture registry and the checkpoint view models load from."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.models.layers import MoESplit
from engine.tp.comm import TPGroup
from engine.tp.layout import TPLayout
from kernels.cpu_linear import LinearKind
from kernels.quant import QuantWeight

# HF `architectures` name -> model class; filled by @register_model when a model file is imported.
MODEL_REGISTRY: dict[str, type[CausalLM]] = {}


def register_model(*arch_names: str) -> Callable[[type[CausalLM]], type[CausalLM]]:
    """Class decorator: serve checkpoints whose config.json names any of `arch_names`."""

    def register(cls: type[CausalLM]) -> type[CausalLM]:
        taken = [f"{n!r} ({MODEL_REGISTRY[n].__name__})" for n in arch_names if MODEL_REGISTRY.get(n, cls) is not cls]
        if taken:
            raise ValueError(f"architecture already registered: {', '.join(taken)}")
        MODEL_REGISTRY.update(dict.fromkeys(arch_names, cls))
        return cls

    return register


class CausalLM:
    """What ModelRunner, attention-DP (engine/dp.py), CUDA graphs and the benches rely on.

    - `cls(cfg, weights, dtype, device, max_positions, mlp_shard, linear, moe_split=...)`: `weights` maps HF
      checkpoint names to CPU tensors (`engine.models.load_weights`). The model copies what it
      needs to `device` in `dtype` and keeps no reference to the dict; a missing weight raises
      ConfigError naming it (`Weights`). The weight names live in the model's file, with it.
      `max_positions` bounds the positions forward() sees; `mlp_shard` = (rank, world) is this
      attention-DP member's share of every MLP; `linear` the kind of every projection
      (`kernels.cpu_linear.LinearKind`: F.linear, oneDNN's or the project's packed CPU GEMM); `moe_split`
      how an MoE model's MLPs are shared: "experts" (E/world whole experts per member; dense MLPs
      and shared experts whole) or "intermediate" (a slice of every MLP's intermediate dim).
    - `forward(fb, attn) -> logits [bs, vocab]` at `fb.last_token_indices`. Layer i's attention
      is `attn.forward(q, k, v, i, fb)` (q [T, heads, head_dim], k and v [T, kv_heads, head_dim])
      -> [T, heads, head_dim]. T may be 0 (an IDLE batch). On CUDA it must be graph-capturable
      (no host syncs), since decode batches replay it as a CUDA graph. With a backend whose
      `fused_rope_decode` is set, a DECODE (or IDLE) batch must go through
      `attn.forward_decode_rope(qkv, cos, sin_signed, i, fb)` instead, with q/k/v before RoPE.
    - `forward_split_prefill(fb, attn, end) -> logits | None`: layers [fb.split_index, end) of an
      extend batch (ForwardMode.SPLIT_PREFILL): the embedding before layer 0, the hidden state
      carried in `fb.hidden_states` between calls, `fb.split_index` advanced to `end`; the logits
      (as `forward` returns them) after the last layer, else None. The same arithmetic as
      `forward`, layer for layer, so a split prefill computes the same tokens. A model without it
      leaves `supports_split_prefill` False (its prefills are never split).
    - `tp`: the engine's tensor-parallel group (`engine.tp.TPGroup`; a single-rank group when the
      engine is one rank) and `layout` this rank's `engine.tp.TPLayout`. Under tensor
      parallelism `weights` are this rank's shards (`engine.tp.shard_weights`): the model runs
      its layout's heads, all-reduces after each row-parallel part (the o-projection, the whole
      MLP) and all-gathers the vocabulary-parallel logits, so every rank returns the same logits.
    - `scale`: the softmax scale the attention backend applies.
    - `mlp_comm`: None, or set by attention-DP after construction. Every layer then runs its MLP
      through `MLP.split_forward(x, mlp_comm, lora, group_lora)`: a split MLP passes its input
      through `mlp_comm.gather` (all members' rows; with adapters, `group_lora` their slots from
      `mlp_comm.gather_lora`) and its partial output through `mlp_comm.reduce_scatter` (summed,
      back to this member's rows); one held whole runs alone.
    - `num_parameters()`: parameters this member holds (its MLP shard only).
    - `expert_tokens`: None for a dense model; for an MoE model an int64 [num_experts] tensor on
      the device: the (token, expert) routings of every forward, summed over layers (a token
      counts once per expert it is sent to). Read it with `.tolist()` off the hot path (a sync).
      It counts what this member's experts computed: under attention-DP with the intermediate
      split every member counts the whole group's rows for every expert; with expert parallelism
      only the pairs its own experts ran (the group's counts sum to the routing). Padded rows of a
      replayed CUDA graph count too.
    """

    expert_tokens: torch.Tensor | None = None
    supports_split_prefill: bool = False  # it implements forward_split_prefill
    # Its DECODE forward has no host sync and no value-dependent shape, so the CPU decode graphs
    # (engine/cpu_graph.py, torch.compile with fullgraph) can hold it.
    cpu_graph_safe: bool = False

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether a forward may be captured in a CUDA graph (nothing in it waits on the device)."""
        return True

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, mlp_shard: tuple[int, int] = (0, 1),
                 linear: LinearKind = "torch", moe_split: MoESplit = "experts", tp: TPGroup | None = None) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.moe_split = moe_split
        self.tp = tp if tp is not None else TPGroup(0, 1)
        self.layout = TPLayout.from_config(cfg, self.tp.tp_rank, self.tp.tp_size)
        # The group the row-parallel outputs are reduced over; None on one rank (no call at all,
        # so a single rank's forward, CPU decode graphs included, is unchanged).
        self.tp_reduce = self.tp if self.tp.tp_size > 1 else None
        self.scale = cfg.head_dim ** -0.5
        self.mlp_comm = None
        # Adapter slots given to a split MLP (attach_lora under attention-DP): it adapts the
        # group's gathered rows.
        self.lora_split_mlp = False

    def forward(self, fb: ForwardBatch, attn) -> torch.Tensor:
        raise NotImplementedError

    def forward_split_prefill(self, fb: ForwardBatch, attn, end: int) -> torch.Tensor | None:
        raise NotImplementedError

    def num_parameters(self) -> int:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of every tensor the model holds (weights as stored: quantized blocks, packed
        panels, the RoPE tables), each storage counted once."""
        return _tensor_bytes(self, set(), set())


def _tensor_bytes(obj: object, seen: set[int], visited: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:  # a oneDNN-packed weight has no data_ptr to share
            return obj.numel() * obj.element_size()
        ptr = obj.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    # (a TPGroup's buffers are communication, not weights)
    if id(obj) in visited or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.device, torch.dtype,
                                              TPGroup)):
        return 0
    visited.add(id(obj))
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        children += [getattr(obj, n) for c in type(obj).__mro__ for n in getattr(c, "__slots__", ()) if hasattr(obj, n)]
    return sum(_tensor_bytes(c, seen, visited) for c in children)


class Weights:
    """A checkpoint's tensors by HF name; `w(name)` is that tensor on the model's device and dtype
    (dequantized if the checkpoint holds it quantized); `w.linear(name)` keeps a quantized one
    quantized (a `kernels.quant.QuantWeight` on the device), for `make_linear`."""

    def __init__(self, tensors: Mapping[str, torch.Tensor | QuantWeight], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.tensors, self.dtype, self.device = tensors, dtype, device

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _get(self, name: str) -> torch.Tensor | QuantWeight:
        if name not in self.tensors:
            raise ConfigError(f"checkpoint is missing weight {name!r}")
        return self.tensors[name]

    def __call__(self, name: str) -> torch.Tensor:
        w = self._get(name)
        if isinstance(w, QuantWeight):
            return w.dequantize(self.dtype).to(self.device)
        return w.to(device=self.device, dtype=self.dtype)

    def is_quantized(self, name: str) -> bool:
        return isinstance(self._get(name), QuantWeight)

    def linear(self, name: str) -> torch.Tensor | QuantWeight:
        w = self._get(name)
        return w.to(self.device) if isinstance(w, QuantWeight) else w.to(device=self.device, dtype=self.dtype)

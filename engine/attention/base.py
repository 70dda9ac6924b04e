"""The attention-backend contract and the registry that creates a backend by name."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn, TypeVar

import torch

from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.memory import KVCache, ReqToTokenPool


class AttentionBackend(abc.ABC):
    """Attention over the token-level KV pool, shared by every layer of the model.

    Contract:
    - `graph_safe` (class attribute): whether `forward` may run inside a CUDA graph: no host
      sync (no `.item()`, `.tolist()`, boolean-mask indexing, ...) and no tensor shape that
      depends on tensor values. The CUDA graph runner refuses a backend that is not.
    - `init_forward_metadata(fb)` is called once per forward, before the model runs. It builds
      what every layer shares (gathered indices, masks, kernel launch sizes) and *returns* it;
      the caller stores it in `fb.attn_metadata`. The backend keeps nothing per forward on
      itself, so several ForwardBatches (overlap scheduling, graph capture) never clash.
    - `forward(q, k, v, layer, fb)`: q [T, H, D] and k/v [T, Hkv, D] of the batch's new tokens.
      Stores k/v at `fb.out_cache_loc` in layer `layer` of the pool, attends each new token
      over its request's `req_to_token[row, :seq_len]` (causal over the new tokens, full over
      the cached prefix) and returns [T, H, D]. Reads its metadata from `fb.attn_metadata`
      (`self.metadata(fb)`). A batch with no tokens (IDLE) returns q unchanged.
    - Block-causal attention (`block_causal`, class attribute: whether the backend has it), for
      block-diffusion models (engine/models/sdar.py): `init_forward_metadata(fb, block_size=B)`
      with B > 0 builds metadata under which every extend token at position i attends to the
      positions j < seq_len of its request with j // B <= i // B (bidirectional inside a block of
      B positions aligned to position 0, causal across blocks) instead of j <= i. A DECODE row
      is the last position of its request, so it reads the same keys either way. The metadata
      records `block_size` (0: causal); `block_causal_metadata(fb, B)` is what a model calls.
    - `fused_rope_decode` (instance attribute): whether `forward_decode_rope` exists here. It
      takes a decode batch's q/k/v before RoPE, straight from the projection ([T, H + 2 Hkv, D]),
      and applies RoPE, stores k/v and attends in one call (the CPU kernel does; the model then
      skips its own RoPE). Such a backend may also be graph-safe on its own device alone (the
      CPU decode graphs of engine/cpu_graph.py need exactly this: `cpu_graph_safe`).
    - Graph hooks, used by engine/cuda_graph.py (and engine/cpu_graph.py) for DECODE batches
      padded to a captured size (padded rows: request row 0, seq_len 1, KV slot 0), and on CUDA
      for TARGET_VERIFY and (a block-diffusion model) DLLM_EXTEND batches of a fixed width w
      (padded rows: row 0, seq_len w, slot 0). Graph-safe
      backends override all three; the base refuses them for a backend that is not graph-safe.
        `init_cuda_graph_state(max_bs)`: once, before any capture; allocate the persistent
            buffers the graphs will read metadata from.
        `capture_metadata(fb, block_size=0)`: metadata for capturing `fb`, whose tensors are the
            graph runner's static inputs sliced to the captured size (`block_size`: a DLLM_EXTEND
            batch's block-causal blocks). Whatever tensor it returns is
            baked into the graph, so it must live in the persistent state, not be rebuilt.
        `replay_metadata(fb)`: before a replay of the graph captured with `fb`; the runner has
            copied the padded batch into fb's static tensors (and set `fb.seq_lens_cpu`).
            Update in place whatever the captured metadata derives from them.
    """

    name: ClassVar[str] = ""  # set by register_backend
    graph_safe: ClassVar[bool] = False
    block_causal: ClassVar[bool] = False
    fused_rope_decode: bool = False
    cpu_graph_safe: bool = False

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, scale: float,
                 device: torch.device) -> None:
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv = kv_cache
        self.scale = scale
        self.device = device

    @abc.abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch, block_size: int = 0) -> Any:
        """What every layer of this forward shares; the caller puts it in `fb.attn_metadata`.
        `block_size` > 0 (only where `block_causal` is set): block-causal extends."""

    def block_causal_metadata(self, fb: ForwardBatch, block_size: int) -> Any:
        """fb's metadata for block-causal attention with blocks of `block_size`: the one already
        in `fb.attn_metadata` if it was built for that size, else built now (the model runner
        builds causal metadata before every forward; a DECODE or IDLE batch's serves both)."""
        if not self.block_causal:
            raise ConfigError(f"attention backend {self.name!r} has no block-causal attention, which this "
                              f"model needs (backends that have it: {', '.join(block_causal_backends())})")
        md = fb.attn_metadata
        if md is None or (fb.forward_mode.is_extend() and getattr(md, "block_size", 0) != block_size):
            md = self.init_forward_metadata(fb, block_size=block_size)
        return md

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of the new tokens; store k/v, return [T, H, D]."""

    def forward_decode_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, layer: int,
                            fb: ForwardBatch) -> torch.Tensor:
        """DECODE: qkv [T, H + 2 Hkv, D] before RoPE; cos, sin_signed [positions, D] tables
        (`engine.models.layers.RoPE`). RoPE, KV store and attention; returns [T, H, D]."""
        raise NotImplementedError(f"attention backend {self.name!r} has no fused RoPE decode")

    @staticmethod
    def metadata(fb: ForwardBatch) -> Any:
        md = fb.attn_metadata
        if md is None:
            raise RuntimeError("fb.attn_metadata is not set: the caller must run "
                               "fb.attn_metadata = backend.init_forward_metadata(fb) before the model forward")
        return md

    # === CUDA graphs ===
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self._graph_hook_missing("init_cuda_graph_state")

    def capture_metadata(self, fb: ForwardBatch, block_size: int = 0) -> Any:
        self._graph_hook_missing("capture_metadata")

    def replay_metadata(self, fb: ForwardBatch) -> None:
        self._graph_hook_missing("replay_metadata")

    def _graph_hook_missing(self, hook: str) -> NoReturn:
        if not (self.graph_safe or self.cpu_graph_safe):
            raise ConfigError(f"attention backend {self.name!r} is not graph-safe, so it cannot run in "
                              f"CUDA graphs (graph-safe backends: {', '.join(graph_safe_backends()) or 'none'})")
        raise NotImplementedError(f"{type(self).__name__} is marked graph_safe but does not implement {hook}")


# The one module-level mutable object: name -> backend class, filled by @register_backend.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}

B = TypeVar("B", bound=type[AttentionBackend])


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: make the backend creatable as `create_attention_backend(name, ...)`."""

    def deco(cls: B) -> B:
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"{cls!r} is not an AttentionBackend subclass")
        if ATTENTION_BACKENDS.get(name, cls) is not cls:
            raise ValueError(f"attention backend {name!r} is already registered "
                             f"({ATTENTION_BACKENDS[name].__qualname__})")
        cls.name = name
        ATTENTION_BACKENDS[name] = cls
        return cls

    return deco


def graph_safe_backends() -> list[str]:
    return sorted(n for n, cls in ATTENTION_BACKENDS.items() if cls.graph_safe)


def block_causal_backends() -> list[str]:
    return sorted(n for n, cls in ATTENTION_BACKENDS.items() if cls.block_causal)


def create_attention_backend(name: str, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache,
                             scale: float, device: torch.device) -> AttentionBackend:
    cls = ATTENTION_BACKENDS.get(name)
    if cls is None:
        raise ConfigError(f"unknown attention backend {name!r}; registered: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return cls(req_to_token_pool, kv_cache, scale, device)

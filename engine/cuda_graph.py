"""CUDA graphs for DECODE and IDLE batches (section 8.4: decode shapes are fixed, prefill's are not).

A ladder of batch sizes is captured once, largest first, sharing one memory pool. A decode
batch is padded to the next captured size: padded rows use request row 0 (all slot 0), a
sequence length of 1 and KV slot 0 (reserved, never handed out), so they attend to and write
nothing that matters; their logits are sliced off. Prefill, MIXED and batches larger than the
ladder run eagerly. The attention backend must be graph-safe (`graph_safe`: no host sync, no
shape that depends on values); its hooks own the attention metadata the graphs read
(`init_cuda_graph_state` once, `capture_metadata` per captured size, `replay_metadata` before
each replay), so this runner knows no backend by name.

The ladder and the padding are plain functions, tested on the CPU; capture and replay need CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import graph_safe_backends
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch, ForwardMode


def capture_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (and max_bs itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def padded_size(bs: int, ladder: list[int]) -> int | None:
    """The captured size a batch of bs runs at, or None if it is larger than the ladder."""
    for size in ladder:
        if size >= bs:
            return size
    return None


@dataclass
class PaddedDecode:
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor


def pad_decode(fb: ForwardBatch, size: int) -> PaddedDecode:
    """The decode (or IDLE) batch's tensors padded to `size` rows: row 0, seq_len 1, slot 0."""
    bs = fb.batch_size
    pad = size - bs
    dev = fb.input_ids.device

    def fill(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t.to(torch.int64), torch.full((pad,), value, dtype=torch.int64, device=dev)])

    return PaddedDecode(input_ids=fill(fb.input_ids, 0), req_pool_indices=fill(fb.req_pool_indices, 0),
                        seq_lens=fill(fb.seq_lens, 1), out_cache_loc=fill(fb.out_cache_loc, 0),
                        positions=fill(fb.positions, 0))


class CudaGraphRunner:
    def __init__(self, model_runner, max_bs: int) -> None:
        if model_runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        attn = model_runner.attn_backend
        if not attn.graph_safe:
            raise ConfigError(f"attention backend {attn.name!r} is not graph-safe; CUDA graphs need one of "
                              f"{', '.join(graph_safe_backends())} (or disable_cuda_graph=True)")
        self.runner = model_runner
        self.ladder = capture_ladder(max_bs)
        dev = model_runner.device
        n = self.ladder[-1]
        # Static inputs the graphs read; replay copies a batch into their first rows.
        self.static = PaddedDecode(*(torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(5)))
        self.static.seq_lens.fill_(1)
        attn.init_cuda_graph_state(n)
        # The batch each graph was captured with: static tensors and the backend's metadata.
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _fb(self, size: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=size, input_ids=s.input_ids[:size],
                            seq_lens=s.seq_lens[:size], out_cache_loc=s.out_cache_loc[:size],
                            req_pool_indices=s.req_pool_indices[:size], positions=s.positions[:size],
                            seq_lens_cpu=[1] * size, last_token_indices=torch.arange(size, device=s.input_ids.device))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, attn = self.runner.model, self.runner.attn_backend
        stream = torch.cuda.Stream()
        for size in reversed(self.ladder):  # largest first: the shared pool fits every smaller graph
            fb = self._fb(size)
            fb.attn_metadata = attn.capture_metadata(fb)
            self.batches[size] = fb
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (Triton autotune, allocator) outside the capture
                    model.forward(fb, attn)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[size] = model.forward(fb, attn)
            self.pool = graph.pool()
            self.graphs[size] = graph

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode in (ForwardMode.DECODE, ForwardMode.IDLE) and fb.batch_size <= self.ladder[-1]

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        size = padded_size(max(fb.batch_size, 1), self.ladder)
        padded = pad_decode(fb, size)
        for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
            getattr(self.static, name)[:size].copy_(getattr(padded, name), non_blocking=True)
        captured = self.batches[size]
        captured.seq_lens_cpu = (list(fb.seq_lens_cpu) + [1] * (size - fb.batch_size)
                                 if fb.seq_lens_cpu is not None else None)
        self.runner.attn_backend.replay_metadata(captured)
        self.graphs[size].replay()
        return self.outputs[size][:fb.batch_size]

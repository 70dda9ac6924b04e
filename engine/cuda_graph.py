"""CUDA graphs for DECODE and IDLE batches (section 8.4: decode shapes are fixed, prefill's are not),
for TARGET_VERIFY batches whose requests all have the same width (1 + k positions: the
scheduler pads their drafts, see `ModelRunner.verify_graph_width`), and, for a block-diffusion
model, for DLLM_EXTEND batches whose requests each run exactly one block (B positions over their
committed prefix: every step of a block but its first, whose extend also holds the prompt or
the committed block before it).

A ladder of batch sizes is captured once, largest first, sharing one memory pool. A decode
batch is padded to the next captured size: padded rows use request row 0 (all slot 0), a
sequence length of 1 and KV slot 0 (reserved, never handed out), so they attend to and write
nothing that matters; their logits are sliced off. A padded verify row is the same with
`width` positions (0..width-1) and all of them written to slot 0; a padded DLLM_EXTEND row is
one too (width B: its block-causal keys are row 0's first B, slot 0). Prefill, MIXED and batches
larger than the ladder run eagerly. The attention backend must be graph-safe (`graph_safe`: no host sync, no
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


def token_ladder(ladder: list[int], width: int) -> list[int]:
    """The sizes of `ladder` whose batches of `width` positions per request hold at most as many
    tokens as its largest decode batch (their logits, a row per position, stay as large as the
    decode graphs'); at least [1]."""
    return [s for s in ladder if s * width <= ladder[-1]] or [1]


def fits_width(fb: ForwardBatch, width: int) -> bool:
    """Every request of the extend batch runs exactly `width` positions."""
    lens = fb.extend_seq_lens_cpu
    return lens is not None and len(lens) == fb.batch_size and all(n == width for n in lens)


def pad_decode(fb: ForwardBatch, size: int) -> PaddedDecode:
    """The decode (or IDLE) batch's tensors padded to `size` rows: row 0, seq_len 1, slot 0."""
    return pad_verify(fb, size, 1)


def pad_verify(fb: ForwardBatch, size: int, width: int) -> PaddedDecode:
    """A batch of `width` positions per request (1: decode) padded to `size` requests: padded
    rows use row 0, positions 0..width-1, a sequence length of `width` and slot 0."""
    pad = size - fb.batch_size
    dev = fb.input_ids.device

    def fill(t: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.to(torch.int64), tail])

    zeros = torch.zeros(pad * width, dtype=torch.int64, device=dev)
    return PaddedDecode(input_ids=fill(fb.input_ids, zeros), req_pool_indices=fill(fb.req_pool_indices, zeros[:pad]),
                        seq_lens=fill(fb.seq_lens, torch.full((pad,), width, dtype=torch.int64, device=dev)),
                        out_cache_loc=fill(fb.out_cache_loc, zeros),
                        positions=fill(fb.positions, torch.arange(width, device=dev).repeat(pad)))


class CudaGraphRunner:
    def __init__(self, model_runner, max_bs: int, verify_width: int = 0, dllm_width: int = 0) -> None:
        if model_runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        attn = model_runner.attn_backend
        if not attn.graph_safe:
            raise ConfigError(f"attention backend {attn.name!r} is not graph-safe; CUDA graphs need one of "
                              f"{', '.join(graph_safe_backends())} (or disable_cuda_graph=True)")
        self.runner = model_runner
        self.ladder = capture_ladder(max_bs)
        self.verify_width = verify_width  # positions per request of a captured verify batch (0: none)
        self.dllm_width = dllm_width  # a block-diffusion model's block size B (0: no DLLM_EXTEND graphs)
        dev = model_runner.device
        n = self.ladder[-1]
        # Verify and DLLM_EXTEND graphs up to as many tokens as the largest decode batch (speculation
        # pays off at small batches; a block's logits are a row per position).
        self.verify_ladder = token_ladder(self.ladder, verify_width) if verify_width else []
        self.dllm_ladder = token_ladder(self.ladder, dllm_width) if dllm_width else []
        # A block-diffusion model runs DLLM_EXTEND batches only: no decode graphs for it.
        self.decode_ladder = [] if dllm_width else self.ladder
        tokens = max([n] + [s * verify_width for s in self.verify_ladder]
                     + [s * dllm_width for s in self.dllm_ladder])
        # Static inputs the graphs read (decode and verify graphs share them: one replays at a
        # time); replay copies a batch into their first rows.
        z = torch.zeros
        self.static = PaddedDecode(input_ids=z(tokens, dtype=torch.int64, device=dev),
                                   req_pool_indices=z(n, dtype=torch.int64, device=dev),
                                   seq_lens=torch.ones(n, dtype=torch.int64, device=dev),
                                   out_cache_loc=z(tokens, dtype=torch.int64, device=dev),
                                   positions=z(tokens, dtype=torch.int64, device=dev))
        attn.init_cuda_graph_state(n)
        # Per (mode, size): the batch its graph was captured with (static tensors and the
        # backend's metadata), the graph, and its logits.
        self.batches: dict[tuple[ForwardMode, int], ForwardBatch] = {}
        self.graphs: dict[tuple[ForwardMode, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[ForwardMode, int], torch.Tensor] = {}
        self.replays: dict[ForwardMode, int] = dict.fromkeys(
            (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DLLM_EXTEND), 0)
        self.pool = None
        # One capture stream: the caching allocator reuses a freed block only on its own stream,
        # so graphs captured on one stream share the pool's working memory.
        self.stream = torch.cuda.Stream()
        for size in reversed(self.decode_ladder):  # largest first: the shared pool fits every smaller graph
            self._capture(ForwardMode.DECODE, size)
        for size in reversed(self.verify_ladder):
            self._capture(ForwardMode.TARGET_VERIFY, size)
        for size in reversed(self.dllm_ladder):
            self._capture(ForwardMode.DLLM_EXTEND, size)

    def _width(self, mode: ForwardMode) -> int:
        return {ForwardMode.TARGET_VERIFY: self.verify_width, ForwardMode.DLLM_EXTEND: self.dllm_width}.get(mode, 1)

    def _ladder(self, mode: ForwardMode) -> list[int]:
        return {ForwardMode.TARGET_VERIFY: self.verify_ladder,
                ForwardMode.DLLM_EXTEND: self.dllm_ladder}.get(mode, self.decode_ladder)

    def _fb(self, mode: ForwardMode, size: int) -> ForwardBatch:
        s, dev = self.static, self.static.input_ids.device
        width = self._width(mode)
        t = size * width
        fb = ForwardBatch(forward_mode=mode, batch_size=size, input_ids=s.input_ids[:t], seq_lens=s.seq_lens[:size],
                          out_cache_loc=s.out_cache_loc[:t], req_pool_indices=s.req_pool_indices[:size],
                          positions=s.positions[:t], seq_lens_cpu=[width] * size,
                          last_token_indices=torch.arange(t, device=dev))
        if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DLLM_EXTEND):  # every request `width` new tokens, at i * width
            fb.extend_seq_lens_cpu = [width] * size
            fb.extend_seq_lens = torch.full((size,), width, dtype=torch.int64, device=dev)
            fb.extend_start_loc = torch.arange(0, t, width, dtype=torch.int64, device=dev)
        return fb

    @torch.inference_mode()
    def _capture(self, mode: ForwardMode, size: int) -> None:
        model, attn, stream = self.runner.model, self.runner.attn_backend, self.stream
        fb = self._fb(mode, size)
        nothing = ForwardBatch(mode, 0, *(torch.empty(0, dtype=torch.int64) for _ in range(5)))
        self._load(pad_verify(nothing, size, self._width(mode)))  # all rows inert: the warm-up reads only slot 0
        if mode == ForwardMode.DLLM_EXTEND:  # block-causal metadata, refreshed by replay_metadata
            fb.attn_metadata = attn.capture_metadata(fb, block_size=self.dllm_width)
        else:
            fb.attn_metadata = attn.capture_metadata(fb)
        self.batches[mode, size] = fb
        stream.wait_stream(torch.cuda.current_stream())  # the inert rows' copies
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (Triton autotune, allocator) outside the capture
                model.forward(fb, attn)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.outputs[mode, size] = model.forward(fb, attn)
        self.pool = graph.pool()
        self.graphs[mode, size] = graph

    def _load(self, padded: PaddedDecode) -> None:
        for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
            src = getattr(padded, name)
            getattr(self.static, name)[:src.shape[0]].copy_(src, non_blocking=True)

    def verify_graph_width(self, bs: int) -> int | None:
        """The width a verify batch of bs requests must have to replay a graph (None: eager)."""
        return self.verify_width if self.verify_ladder and bs <= self.verify_ladder[-1] else None

    def can_run(self, fb: ForwardBatch) -> bool:
        mode = fb.forward_mode
        if mode == ForwardMode.TARGET_VERIFY:
            return (self.verify_graph_width(fb.batch_size) is not None
                    and fb.num_tokens == fb.batch_size * self.verify_width)
        if mode == ForwardMode.DLLM_EXTEND:
            return (bool(self.dllm_ladder) and 0 < fb.batch_size <= self.dllm_ladder[-1]
                    and fits_width(fb, self.dllm_width))
        return (mode in (ForwardMode.DECODE, ForwardMode.IDLE) and bool(self.decode_ladder)
                and fb.batch_size <= self.decode_ladder[-1])

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        mode = fb.forward_mode
        if mode not in (ForwardMode.TARGET_VERIFY, ForwardMode.DLLM_EXTEND):
            mode = ForwardMode.DECODE  # (IDLE: the decode graphs on padding rows)
        width = self._width(mode)
        size = padded_size(max(fb.batch_size, 1), self._ladder(mode))
        self._load(pad_verify(fb, size, width))
        captured = self.batches[mode, size]
        captured.seq_lens_cpu = (list(fb.seq_lens_cpu) + [width] * (size - fb.batch_size)
                                 if fb.seq_lens_cpu is not None else None)
        self.runner.attn_backend.replay_metadata(captured)
        self.graphs[mode, size].replay()
        self.replays[mode] += 1
        logits = self.outputs[mode, size][:fb.batch_size * width]
        # A block's logits are taken at its masked positions only (the graph computed every row's).
        return logits[fb.last_token_indices] if mode == ForwardMode.DLLM_EXTEND else logits

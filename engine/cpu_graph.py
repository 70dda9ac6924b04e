"""Decode graphs on the CPU: the twin of CUDA graphs (engine/cuda_graph.py), built with torch.compile.

A DECODE (or IDLE) batch, or a TARGET_VERIFY or DLLM_EXTEND batch run as decode rows
(`ForwardBatch.as_decode_rows`), is padded to the next size of the
CUDA graphs' ladder, up to cpu_graph_max_bs (padded rows: request row 0, seq_len 1, KV slot 0:
inert), copied into static input buffers and run by that size's compiled forward: the model's decode forward
(`forward_decode`, through the attention backend's fused RoPE + KV store + attention) compiled
by torch.compile with inductor's C++ backend: every size at start-up, as CUDA graphs are
captured (a compile in the middle of serving would stall every running stream for its duration),
or, with enable_lazy_cpu_graph, the first time the size runs. The CPU kernels stay inside as
opaque operators (`torch.ops.radixray.*`: the GEMM, the fused attention, the fused norms);
inductor fuses what lies between them (embedding, SiLU-and-multiply, q/k norms) and the step runs
without per-op Python.

Each size is its own compiled region with no guards (`isolate_recompiles`,
`torch.compiler.skip_all_guards_unsafe`): a region only ever sees the same static buffers,
weights and KV pool, so there is nothing to re-check per call, and no region is shared between
engines. Inductor's FX graph cache (on disk, `TORCHINDUCTOR_CACHE_DIR`) makes a later compile of
the same graph, in this process or another, take a fraction of the first. A size whose compile
fails runs eagerly from then on (logged once).

Under tensor parallelism every rank compiles its own graphs, with the collectives inside as
opaque operators (engine/tp/graph_ops.py: the Python operators run the engine's TPGroup, called
from the C++ wrapper through the dispatcher). Every rank must then run the same shapes at the
same step: rank 0 decides each batch's size (`size_for`) and sends it with the batch, and the
other ranks replay that size (`replay(fb, size)`); a rank whose compile of that size failed runs
the same padded batch eagerly, which makes the same collectives. A compile runs the graph once
with its collectives dry (no rank waits inside one for a peer still compiling), then the ranks
meet (`TPGroup.rendezvous`, with a compile's patience) before any real run."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from engine.cuda_graph import PaddedDecode, capture_ladder, padded_size
from engine.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.tp.graph_ops import GraphCollectives

log = logging.getLogger("radixray.engine")

# The wrapper that calls the kernels in C++ (cpp_wrapper), not in Python: a Python call per
# kernel costs more than the eager path saves. No size asserts: the inputs are the static buffers.
COMPILE_OPTIONS = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "cpp_wrapper": True,
                   "size_asserts": False}
# Padding values of the static inputs (cuda_graph.pad_decode's): row 0, seq_len 1, slot 0.
_PAD = {"input_ids": 0, "req_pool_indices": 0, "seq_lens": 1, "out_cache_loc": 0, "positions": 0}
# How long a tensor-parallel rank waits for its peers to finish compiling (their compiles share
# the cores and need not take as long as its own).
COMPILE_WAIT_S = 1800.0


class CpuGraphRunner:
    """The compiled decode forwards of one ModelRunner. `collectives`: the runner's TPGroup bound
    to the graph operators (tensor parallelism), None on one rank."""

    def __init__(self, model_runner: ModelRunner, max_bs: int, collectives: GraphCollectives | None = None) -> None:
        if model_runner.device.type != "cpu":
            raise RuntimeError("CPU decode graphs run on the CPU")
        self.runner = model_runner
        self.collectives = collectives
        self.ladder = capture_ladder(max_bs)
        n = self.ladder[-1]
        self.static = PaddedDecode(*(torch.zeros(n, dtype=torch.int64) for _ in range(5)))
        self.static.seq_lens.fill_(1)
        model_runner.attn_backend.init_cuda_graph_state(n)
        self.batches: dict[int, ForwardBatch] = {}
        self.compiled: dict[int, Callable[[], torch.Tensor]] = {}
        self.compile_seconds: dict[int, float] = {}  # by size: compile (and first run) wall time
        self.failed: dict[int, str] = {}  # sizes that run eagerly, and why
        self.replays = 0  # batches run by a compiled graph
        self.replays_by_size: dict[int, int] = {}
        # Under TP: batches of a size rank 0 replays that failed to compile here, run padded eagerly.
        self.padded_eager = 0
        # The same by the mode a batch stands for (`ForwardBatch.rows_of`: decode rows of a verify
        # or block-diffusion batch count as that mode).
        self.replays_by_mode: dict[ForwardMode, int] = dict.fromkeys(
            (ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY, ForwardMode.DLLM_EXTEND), 0)

    @torch.inference_mode()
    def compile_all(self) -> float:
        """Compile every size of the ladder now, on padding rows only (not counted as replays);
        returns the seconds taken."""
        t0 = time.perf_counter()
        for name, pad in _PAD.items():
            getattr(self.static, name).fill_(pad)
        for size in self.ladder:
            if size not in self.compiled and size not in self.failed:
                self._compile(size)
        if self.collectives is not None:  # no rank's first step waits on a peer's compiles
            self.collectives.group.rendezvous(COMPILE_WAIT_S)
        return time.perf_counter() - t0

    def verify_graph_width(self, bs: int) -> None:
        """No padded verify shape on the CPU: a verify batch runs as decode rows
        (`ForwardBatch.as_decode_rows`), which replay the decode graphs where they fit."""
        return None

    def size_for(self, mode: ForwardMode, bs: int) -> int:
        """The padded size whose graph runs a batch of `bs` rows in `mode`; 0: it runs eagerly."""
        if mode not in (ForwardMode.DECODE, ForwardMode.IDLE) or bs > self.ladder[-1]:
            return 0
        size = padded_size(max(bs, 1), self.ladder)
        return 0 if size in self.failed else size

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.size_for(fb.forward_mode, fb.batch_size) > 0

    def _fb(self, size: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=size, input_ids=s.input_ids[:size],
                            seq_lens=s.seq_lens[:size], out_cache_loc=s.out_cache_loc[:size],
                            req_pool_indices=s.req_pool_indices[:size], positions=s.positions[:size],
                            seq_lens_cpu=[1] * size, last_token_indices=torch.arange(size))

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch, size: int | None = None) -> torch.Tensor | None:
        """Logits [bs, vocab] of the batch, run padded to `size` (the model runner's choice,
        rank 0's under tensor parallelism; default: its ladder size), or None if that size failed
        to compile (the caller then runs it eagerly). Under tensor parallelism a size that failed
        here runs padded eagerly instead, as the other ranks' graphs run it."""
        bs = fb.batch_size
        size = size or padded_size(max(bs, 1), self.ladder)
        if size < bs or size not in self.ladder:
            raise ValueError(f"a batch of {bs} rows cannot replay the graph of size {size}")
        for name, pad in _PAD.items():  # in place: no tensor is allocated per step
            buf = getattr(self.static, name)
            if bs:
                buf[:bs].copy_(getattr(fb, name))
            if size > bs:
                buf[bs:size].fill_(pad)
        mode = fb.rows_of or fb.forward_mode
        if size not in self.compiled and size not in self.failed:  # enable_lazy_cpu_graph
            logits = self._compile(size)  # one rank: run on this batch's inputs, so it is the result
            if self.collectives is None:
                if logits is None:
                    return None
                self._count(mode, size)
                return logits[:bs]
            # Several ranks: that run was dry; meet the peers, then run the batch for real (it
            # writes the same KV slots again, from the summed activations).
            self.collectives.group.rendezvous(COMPILE_WAIT_S)
        captured = self.batches[size]
        captured.seq_lens_cpu = (list(fb.seq_lens_cpu) + [1] * (size - bs)
                                 if fb.seq_lens_cpu is not None else None)
        self.runner.attn_backend.replay_metadata(captured)
        fn = self.compiled.get(size)
        if fn is None:
            if self.collectives is None:
                return None
            self.padded_eager += 1
            return self.runner.model.forward(captured, self.runner.attn_backend)[:bs]
        self._count(mode, size)
        return fn()[:bs]

    def _count(self, mode: ForwardMode, size: int) -> None:
        self.replays += 1
        self.replays_by_mode[mode] = self.replays_by_mode.get(mode, 0) + 1
        self.replays_by_size[size] = self.replays_by_size.get(size, 0) + 1

    def _compile(self, size: int) -> torch.Tensor | None:
        """Compile `size`'s forward, which torch.compile does by running it once on the static
        inputs (under tensor parallelism with its collectives dry); that run's logits, or None
        when the compile failed (the size runs eagerly from then on; not counted as a replay)."""
        model, attn = self.runner.model, self.runner.attn_backend
        fb = self._fb(size)
        fb.attn_metadata = attn.capture_metadata(fb)
        self.batches[size] = fb  # (a size that fails runs padded eagerly under TP, on these)

        def decode_step() -> torch.Tensor:
            return model.forward(fb, attn)

        fn = torch.compile(decode_step, fullgraph=True, dynamic=False, isolate_recompiles=True,
                           options=dict(COMPILE_OPTIONS))
        t0 = time.perf_counter()
        try:
            with self.collectives.dry_run() if self.collectives is not None else nullcontext():
                logits = fn()  # compiles, then runs on the static inputs
        except Exception as e:  # this size runs eagerly; the others may still compile
            self.failed[size] = f"{type(e).__name__}: {e}"
            log.warning("CPU decode graph for batch size %d failed to compile; it runs eagerly: %s",
                        size, self.failed[size].splitlines()[0])
            return None
        self.compile_seconds[size] = time.perf_counter() - t0
        log.info("CPU decode graph for batch size %d compiled in %.1f s", size, self.compile_seconds[size])
        self.compiled[size] = fn
        return logits

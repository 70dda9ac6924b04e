"""ScheduleBatch: the scheduler's container of Reqs; turns them into tensors (KV through the
CacheManager)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cache_manager import CacheManager
from engine.forward_batch import ForwardMode
from engine.req import Req

if TYPE_CHECKING:
    from engine.lora import LoRAManager


class ScheduleBatch:
    def __init__(self, reqs: list[Req], cache: CacheManager, device: torch.device,
                 lora_manager: LoRAManager | None = None) -> None:
        self.reqs = reqs
        self.cache = cache
        self.device = device
        # The engine's adapters (None: LoRA off): ForwardBatch.init_new assigns the requests'
        # adapters to slots through it.
        self.lora_manager = lora_manager
        self.forward_mode = ForwardMode.DECODE
        self.input_ids = self.seq_lens = self.out_cache_loc = self.req_pool_indices = None
        self.seq_lens_cpu: list[int] = []
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        # Under overlap, decode inputs not sampled yet are read from this buffer on the
        # forward side, indexed by req_pool_indices (None: input_ids are final).
        self.input_ids_from_future = False
        self.decoding_reqs: set[int] = set()  # ids of running requests folded into a MIXED batch
        self.drafts: list[list[int]] = []  # TARGET_VERIFY: each request's draft tokens
        # DLLM_EXTEND: per request, the offsets in its extend of the positions still masked
        # (where logits are taken).
        self.dllm_logit_rows: list[list[int]] = []

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    def _to_device(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        # On CUDA: pinned host memory and a non-blocking copy, so scheduling never waits on the GPU.
        t = torch.tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _stage(self, data: list[int]) -> torch.Tensor:
        """Forward inputs stay in (pinned) host memory; ForwardBatch.resolve_forward_inputs copies
        them to the device on the forward stream. On the CPU this is the tensor itself."""
        t = torch.tensor(data, dtype=torch.int64)
        return t.pin_memory() if self.device.type == "cuda" else t

    # ---- prefill ---------------------------------------------------------------------------
    def prepare_for_extend(self, mode: ForwardMode = ForwardMode.EXTEND) -> None:
        """Tensors of an extend: only tokens after each request's prefix are computed."""
        self.forward_mode = mode
        input_ids: list[int] = []
        self.prefix_lens = [len(r.prefix_indices) for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            input_ids.extend(r.fill_ids[p:p + n])
        self.seq_lens_cpu = [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]
        self.out_cache_loc = self.cache.alloc_extend(self.reqs, self.prefix_lens, self.extend_lens)
        self.req_pool_indices = self._to_device([r.req_pool_idx for r in self.reqs], torch.int64)
        self.input_ids = self._stage(input_ids)
        self.seq_lens = self._stage(self.seq_lens_cpu)

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Fold the running decode requests in as one-token extends (a MIXED batch)."""
        for r in running.reqs:
            r.prefix_indices = self.cache.kv_indices(r)
            r.extend_input_len = 1
        self.decoding_reqs = {id(r) for r in running.reqs}
        self.reqs = self.reqs + running.reqs
        self.prepare_for_extend(ForwardMode.MIXED)

    # ---- block diffusion -------------------------------------------------------------------
    def prepare_for_dllm_extend(self) -> None:
        """DLLM_EXTEND: per request an extend from its block's `prefix_len` to the block's end
        (the prompt after its cached prefix, or the committed block whose KV is recomputed with
        its final tokens, then the block, masks included); KV slots for the positions that have
        none yet (a new request's row and prompt, a block just begun); logits at the masked
        positions (`dllm_logit_rows`)."""
        self.forward_mode = ForwardMode.DLLM_EXTEND
        blocks = [r.dllm_block for r in self.reqs]
        grow = [(r, b.prefix_len if r.req_pool_idx is None else r.kv_len, b.end)
                for r, b in zip(self.reqs, blocks) if r.req_pool_idx is None or r.kv_len < b.end]
        if grow:
            self.cache.alloc_extend([g[0] for g in grow], [g[1] for g in grow], [e - p for _, p, e in grow])
        self.prefix_lens = [b.prefix_len for b in blocks]
        self.extend_lens = [b.end - b.prefix_len for b in blocks]
        self.seq_lens_cpu = [b.end for b in blocks]
        input_ids = [t for r, b in zip(self.reqs, blocks) for t in r.fill_ids[b.prefix_len:b.start] + b.tokens]
        req_to_token = self.cache.req_to_token
        self.out_cache_loc = torch.cat([req_to_token[r.req_pool_idx, b.prefix_len:b.end]
                                        for r, b in zip(self.reqs, blocks)]).to(torch.int64)
        self.req_pool_indices = self._to_device([r.req_pool_idx for r in self.reqs], torch.int64)
        self.input_ids = self._stage(input_ids)
        self.seq_lens = self._stage(self.seq_lens_cpu)
        self.dllm_logit_rows = [[b.start - b.prefix_len + i for i in b.masked()] for b in blocks]

    # ---- decode ----------------------------------------------------------------------------
    def prepare_for_decode(self, from_future: bool = False) -> None:
        """One new slot per sequence, written at its old length; seq_lens advance by one.
        from_future: the previous batch is still running, so the input ids are resolved on
        the forward side (ModelRunner.forward_and_sample)."""
        self.forward_mode = ForwardMode.DECODE
        bs = len(self.reqs)
        old_lens = [r.kv_len for r in self.reqs]
        self.req_pool_indices = self._to_device([r.req_pool_idx for r in self.reqs], torch.int64)
        self.out_cache_loc = self.cache.alloc_decode(self.reqs, self.req_pool_indices,
                                                     self._to_device(old_lens, torch.int64))
        self.prefix_lens, self.extend_lens = old_lens, [1] * bs
        self.seq_lens_cpu = [n + 1 for n in old_lens]
        self.seq_lens = self._stage(self.seq_lens_cpu)
        self.input_ids_from_future = from_future
        self.input_ids = self._stage([0 if from_future else r.output_ids[-1] for r in self.reqs])

    def prepare_for_verify(self, drafts: list[list[int]], width: int | None = None) -> None:
        """TARGET_VERIFY: per request its last token plus its drafts, as an extend over its KV
        (causal over the drafts, full over the prefix); every position's logits are kept. With
        `width`, every request gets exactly that many positions (a CUDA graph's shape): filler
        tokens after its drafts, whose KV slots are freed with the rejected drafts'."""
        self.drafts = drafts
        self.prefix_lens = [r.kv_len for r in self.reqs]
        self.extend_lens = [width or 1 + len(d) for d in drafts]
        assert all(n >= 1 + len(d) for n, d in zip(self.extend_lens, drafts)), "drafts wider than the verify width"
        input_ids = [t for r, d, n in zip(self.reqs, drafts, self.extend_lens)
                     for t in (r.output_ids[-1], *d, *[0] * (n - 1 - len(d)))]
        self.forward_mode = ForwardMode.TARGET_VERIFY
        self.seq_lens_cpu = [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]
        self.out_cache_loc = self.cache.alloc_extend(self.reqs, self.prefix_lens, self.extend_lens)
        self.req_pool_indices = self._to_device([r.req_pool_idx for r in self.reqs], torch.int64)
        self.input_ids = self._stage(input_ids)
        self.seq_lens = self._stage(self.seq_lens_cpu)

    def prepare_for_prebuilt(self) -> None:
        """PREBUILT (a decode engine of a disaggregated pair): each request's KV arrived in the
        slots its row points at, so nothing is computed; seq_lens are what the rows hold."""
        self.forward_mode = ForwardMode.PREBUILT
        self.prefix_lens = [r.kv_len for r in self.reqs]
        self.extend_lens = [0] * len(self.reqs)
        self.seq_lens_cpu = list(self.prefix_lens)
        self.req_pool_indices = self._to_device([r.req_pool_idx for r in self.reqs], torch.int64)
        self.seq_lens = self._stage(self.seq_lens_cpu)
        self.input_ids = self.out_cache_loc = torch.empty(0, dtype=torch.int64, device=self.device)

    def prepare_for_idle(self) -> None:
        """No sequences: zero tokens, so an attention-DP rank can still join the collectives."""
        self.forward_mode = ForwardMode.IDLE
        self.reqs = []
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.input_ids = self.seq_lens = self.out_cache_loc = self.req_pool_indices = empty
        self.seq_lens_cpu, self.prefix_lens, self.extend_lens = [], [], []

    def check_decode_mem(self) -> bool:
        return self.cache.available_size() >= len(self.reqs)

    def retract_decode(self) -> list[Req]:
        """Take requests out until the rest can decode a few more steps; return them (re-queued
        by the caller and recomputed later from their fill_ids, so their output is unchanged)."""
        # Keep the requests with most progress; retract the ones with the least output first
        # (cheapest to recompute), longest prompt first among equals.
        order = sorted(range(len(self.reqs)),
                       key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)))
        retracted: list[Req] = []
        while len(self.reqs) - len(retracted) > 1:
            remaining = len(self.reqs) - len(retracted)
            if self.cache.available_size() >= 2 * remaining:
                break
            victim = self.reqs[order[len(retracted)]]
            retracted.append(victim)
            self.cache.cache_finished_req(victim)
            victim.num_retractions += 1
        gone = {id(r) for r in retracted}
        self.reqs = [r for r in self.reqs if id(r) not in gone]
        return retracted

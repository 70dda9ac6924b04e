"""ForwardMode and ForwardBatch: the pure tensor view of one forward pass."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.schedule_batch import ScheduleBatch
    from kernels.lora import LoRABatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill; the cached prefix is skipped
    DECODE = auto()  # one token per sequence
    MIXED = auto()  # chunked prefill and decode in one batch
    IDLE = auto()  # no sequences: an attention-DP rank joins the collectives with zero tokens
    TARGET_VERIFY = auto()  # speculative decoding: the target model checks draft tokens
    DRAFT_EXTEND_V2 = auto()  # speculative decoding: the draft model extends
    PREBUILT = auto()  # disaggregated decode side: the KV arrived already
    SPLIT_PREFILL = auto()  # layer-split prefill for prefill/decode multiplexing
    DLLM_EXTEND = auto()  # diffusion-LLM block extend

    def is_extend(self) -> bool:
        """Every mode whose attention is the extend kind (new tokens over a cached prefix)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND_V2,
                        ForwardMode.TARGET_VERIFY, ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_prebuilt(self) -> bool:
        return self == ForwardMode.PREBUILT

    def is_split_prefill(self) -> bool:
        return self == ForwardMode.SPLIT_PREFILL

    def is_dllm_extend(self) -> bool:
        return self == ForwardMode.DLLM_EXTEND



SUPPORTED_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE,
                             ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.PREBUILT,
                             ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND})


def require_supported(mode: ForwardMode) -> None:
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(f"ForwardMode.{mode.name} is not implemented in radixray yet")


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    # === Borrowed from ScheduleBatch (device tensors; under overlap they must stay alive
    # until the forward that reads them has finished) ===
    input_ids: torch.Tensor  # [num_tokens]
    seq_lens: torch.Tensor  # [bs] tokens with KV after this forward, prefix included
    out_cache_loc: torch.Tensor  # [num_tokens] KV slot written by each token
    req_pool_indices: torch.Tensor  # [bs] rows of req_to_token
    # === Built here ===
    positions: torch.Tensor  # [num_tokens]
    extend_seq_lens: torch.Tensor | None = None  # [bs] new tokens per request (extend modes)
    extend_start_loc: torch.Tensor | None = None  # [bs] offset of each request's first new token
    # CPU copies, so attention metadata needs no device sync.
    seq_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    # Index of each request's last token in the flat token dim: where logits are taken.
    last_token_indices: torch.Tensor | None = None
    # What the attention backend's init_forward_metadata returned for this forward (set by the
    # model runner before the model runs); the backend's forward reads it from here.
    attn_metadata: Any = None
    # SPLIT_PREFILL: the next layer to run, and the hidden state (the residual stream, [tokens,
    # hidden]) carried from one split to the next; None before the first and after the last.
    split_index: int = 0
    hidden_states: torch.Tensor | None = None
    # The rows' LoRA adapters (kernels.lora segments over the token rows, built with the batch
    # from each request's lora_name); None when no request of the batch names an adapter.
    lora_info: LoRABatchInfo | None = None
    # A DECODE batch of one row per token built from a batch of another mode (TARGET_VERIFY,
    # DLLM_EXTEND: `as_decode_rows`): that mode; None otherwise.
    rows_of: ForwardMode | None = None

    def resolve_forward_inputs(self, device: torch.device) -> None:
        """Copy the host-staged inputs to the device, on the current (forward) stream. The
        scheduler never waits for these copies; on the CPU this does nothing."""
        for name in ("input_ids", "seq_lens", "positions", "extend_seq_lens", "extend_start_loc",
                     "last_token_indices"):
            t = getattr(self, name)
            if t is not None and t.device != device:
                setattr(self, name, t.to(device, non_blocking=True))

    def set_extend_layout(self, prefix_lens: list[int], extend_lens: list[int]) -> list[int]:
        """An extend's positions and per-request lengths and offsets (each request's new tokens
        follow its cached prefix); returns the offsets. Built on the host: resolve_forward_inputs
        moves them (a no-op on the CPU)."""
        starts = list(itertools.accumulate(extend_lens, initial=0))[:-1]
        self.positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)])
        self.extend_seq_lens_cpu = extend_lens
        self.extend_seq_lens = torch.tensor(extend_lens)
        self.extend_start_loc = torch.tensor(starts)
        return starts

    def as_decode_rows(self, block_size: int = 1) -> ForwardBatch:
        """This TARGET_VERIFY or DLLM_EXTEND batch as a DECODE batch of one row per token: the
        row at position i attends over its request's first min((i // B + 1) * B, seq_len) keys,
        B = `block_size` (the decode kernels store every row's KV before any row attends, so a row
        sees the later positions of its block). B = 1 is causal attention, a verify batch's mask;
        a block-diffusion model's block size is its block-causal attention. Logits come back for
        every row, in the same order. On the CPU the fused decode kernel (and the decode graphs,
        where the rows fit the ladder) then runs these batches."""
        dev = self.req_pool_indices.device
        ext = self.extend_seq_lens.to(dev)
        rows = self.req_pool_indices.repeat_interleave(ext, output_size=self.num_tokens)
        ends = self.seq_lens.to(dev).repeat_interleave(ext, output_size=self.num_tokens)
        positions = self.positions.to(dev)
        seq_lens = torch.minimum((positions // block_size + 1) * block_size, ends)
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=self.num_tokens, input_ids=self.input_ids,
                            seq_lens=seq_lens, out_cache_loc=self.out_cache_loc, req_pool_indices=rows,
                            positions=positions, seq_lens_cpu=seq_lens.tolist(),
                            last_token_indices=torch.arange(self.num_tokens, device=dev),
                            lora_info=self.lora_info,  # the same rows in the same order
                            rows_of=self.forward_mode)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def init_new(cls, batch: ScheduleBatch, device: torch.device) -> ForwardBatch:
        mode = batch.forward_mode
        require_supported(mode)
        if mode.is_prebuilt():  # its KV arrived from a prefill engine: the scheduler runs no forward
            raise ValueError("a PREBUILT batch has no forward")
        fb = cls(
            forward_mode=mode,
            batch_size=len(batch.reqs),
            input_ids=batch.input_ids,
            seq_lens=batch.seq_lens,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            positions=torch.empty(0, dtype=torch.int64, device=device),
            seq_lens_cpu=batch.seq_lens_cpu,
        )
        if mode.is_idle():
            fb.last_token_indices = fb.positions
        elif mode.is_decode():
            fb.positions = (batch.seq_lens - 1).to(torch.int64)
            fb.last_token_indices = torch.arange(fb.batch_size)
        else:
            ext = batch.extend_lens
            starts = fb.set_extend_layout(batch.prefix_lens, ext)
            if mode.is_dllm_extend():  # no logit shift: each masked position's own row
                fb.last_token_indices = torch.tensor(
                    [s + j for s, rows in zip(starts, batch.dllm_logit_rows) for j in rows], dtype=torch.int64)
            elif mode.is_target_verify():  # every position's logits: each scores the draft after it
                fb.last_token_indices = torch.arange(sum(ext))
            elif any(r.needs_prompt_logits for r in batch.reqs):  # prompt logprobs: all their rows
                fb.last_token_indices = torch.tensor([
                    j for r, s, n in zip(batch.reqs, starts, ext)
                    for j in (range(s, s + n) if r.needs_prompt_logits else (s + n - 1,))])
            else:
                fb.last_token_indices = torch.tensor([s + n - 1 for s, n in zip(starts, ext)])
        lora = batch.lora_manager
        if lora is not None and not mode.is_idle():
            names = [getattr(r, "lora_name", None) for r in batch.reqs]
            if any(n is not None for n in names):
                # Slots are assigned here, on the scheduler thread, as the batch is launched.
                rows = None if mode.is_decode() else batch.extend_lens
                fb.lora_info = lora.batch_info(names, rows)
        return fb

"""What rank 0 of a tensor-parallel engine sends the other ranks each step: one msgspec message
(`TPStep`) per forward, broadcast over the group's object group before rank 0 runs its model.

It carries the ForwardBatch's tensors as rank 0 built them (forward mode, input ids, positions,
request rows, sequence lengths, KV slots, extend lengths, where the logits are taken) and the
entries of the request -> token table that the batch reads and the other ranks do not have yet
(`ReqToTokenMirror`: a diff against what was sent before, so a decode step sends one slot per
request, not whole rows). The other ranks allocate nothing: every KV slot and request row is rank
0's choice, valid on every rank because every rank's pool has the same number of slots.

With LoRA adapters it also carries the batch's adapter segments (`LoRABatchInfo`'s seg_indptr
and weight_indices) and the slot changes rank 0's LoRAManager made since its last message
(`engine.lora.PoolEvent`s: names and paths, never weights), which the other ranks apply before
the forward; `LoRASetup`, sent once at start, sizes their slots as rank 0's."""

from __future__ import annotations

import msgspec
import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.lora.pool import PoolEvent
from kernels.lora import LoRABatchInfo, batch_info

# TPStep.kind
FORWARD, SPLIT, STOP = 0, 1, 2

_DTYPES = {str(d): d for d in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool)}


class Tensor1D(msgspec.Struct, array_like=True):
    """A 1-D integer tensor's bytes (little-endian, as the host holds them)."""

    dtype: str
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor | None) -> Tensor1D | None:
        if t is None:
            return None
        t = t.detach().reshape(-1).cpu().contiguous()
        return cls(str(t.dtype), t.numpy().tobytes())

    def tensor(self, device: torch.device) -> torch.Tensor:
        dtype = _DTYPES[self.dtype]
        if not self.data:
            return torch.empty(0, dtype=dtype, device=device)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).to(device)


def _tensor(t: Tensor1D | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.tensor(device)


class TPStep(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's orders to the other ranks. kind FORWARD: run `forward_mode` over the batch;
    SPLIT: a SPLIT_PREFILL batch's layers up to `split_end` (the batch itself only with its first
    slice, `split_index` 0: the ranks keep it for the later slices); STOP: leave the loop."""

    kind: int
    forward_mode: int = 0
    batch_size: int = 0
    input_ids: Tensor1D | None = None
    positions: Tensor1D | None = None
    seq_lens: Tensor1D | None = None
    out_cache_loc: Tensor1D | None = None
    req_pool_indices: Tensor1D | None = None
    last_token_indices: Tensor1D | None = None
    extend_seq_lens: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # New entries of the request -> token table: req_to_token[rows[i], cols[i]] = slots[i].
    rt_rows: Tensor1D | None = None
    rt_cols: Tensor1D | None = None
    rt_slots: Tensor1D | None = None
    split_end: int = 0
    # The batch's adapter rows: segment bounds and each segment's slot (None: no adapter rows).
    lora_seg_indptr: list[int] | None = None
    lora_weight_indices: list[int] | None = None
    # Rank 0's LoRA slot and host changes since its last message, in order (any kind, STOP too).
    lora_events: list[PoolEvent] | None = None
    # Rank 0's device <-> host KV copies since its last message, in order (engine/hicache/
    # host_pool.py: (kind, device slots, host slots)); the other ranks make them first.
    host_copies: list[tuple[int, list[int], list[int]]] | None = None
    # The graph rank 0 runs this batch with: a CPU decode graph's padded batch size (the other
    # ranks run the same size, engine/cpu_graph.py), nonzero for a CUDA graph, 0: eagerly.
    graph_size: int = 0


class LoRASetup(msgspec.Struct, array_like=True, omit_defaults=True):
    """Rank 0's adapter slots as its LoRAManager resolved them (the defaults come from the
    adapters' files), sent once at start so every rank builds the same slots; `error`: rank 0
    could not start its adapters (the other ranks raise it too)."""

    max_lora_rank: int = 0
    target_modules: list[str] = []
    num_slots: int = 0
    error: str | None = None


def encode_batch(
    fb: ForwardBatch,
    kind: int = FORWARD,
    split_end: int = 0,
    table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> TPStep:
    """`fb` as rank 0 runs it (inputs resolved), with the table entries `table` (rows, cols, slots)."""
    rows, cols, slots = table if table is not None else (None, None, None)
    lora = fb.lora_info
    return TPStep(
        kind=kind,
        forward_mode=int(fb.forward_mode),
        batch_size=fb.batch_size,
        input_ids=Tensor1D.of(fb.input_ids),
        positions=Tensor1D.of(fb.positions),
        seq_lens=Tensor1D.of(fb.seq_lens),
        out_cache_loc=Tensor1D.of(fb.out_cache_loc),
        req_pool_indices=Tensor1D.of(fb.req_pool_indices),
        last_token_indices=Tensor1D.of(fb.last_token_indices),
        extend_seq_lens=fb.extend_seq_lens_cpu,
        seq_lens_cpu=fb.seq_lens_cpu,
        rt_rows=Tensor1D.of(rows),
        rt_cols=Tensor1D.of(cols),
        rt_slots=Tensor1D.of(slots),
        split_end=split_end,
        lora_seg_indptr=None if lora is None else list(lora.seg_indptr_host),
        lora_weight_indices=None if lora is None else list(lora.weight_indices_host),
    )


def decode_batch(msg: TPStep, device: torch.device) -> ForwardBatch:
    """The ForwardBatch rank 0 ran, on another rank (its own KV pool and table)."""
    fb = ForwardBatch(
        forward_mode=ForwardMode(msg.forward_mode),
        batch_size=msg.batch_size,
        input_ids=_tensor(msg.input_ids, device),
        seq_lens=_tensor(msg.seq_lens, device),
        out_cache_loc=_tensor(msg.out_cache_loc, device),
        req_pool_indices=_tensor(msg.req_pool_indices, device),
        positions=_tensor(msg.positions, device),
        seq_lens_cpu=msg.seq_lens_cpu,
        last_token_indices=_tensor(msg.last_token_indices, device),
    )
    if msg.extend_seq_lens is not None:
        ext = msg.extend_seq_lens
        starts = [0] * len(ext)
        for i in range(1, len(ext)):
            starts[i] = starts[i - 1] + ext[i - 1]
        fb.extend_seq_lens_cpu = list(ext)
        fb.extend_seq_lens = torch.tensor(ext, device=device)
        fb.extend_start_loc = torch.tensor(starts, device=device)
    fb.lora_info = decode_lora_info(msg, device)
    return fb


def decode_lora_info(msg: TPStep, device: torch.device) -> LoRABatchInfo | None:
    """The batch's adapter segments as rank 0 built them (neighbouring segments have different
    slots, so `batch_info` rebuilds the same ones)."""
    if msg.lora_seg_indptr is None:
        return None
    indptr = msg.lora_seg_indptr
    rows = [b - a for a, b in zip(indptr, indptr[1:])]
    return batch_info(msg.lora_weight_indices, rows, device)


def apply_table(msg: TPStep, req_to_token: torch.Tensor) -> None:
    """Write the message's table entries into this rank's request -> token table."""
    if msg.rt_rows is None:
        return
    rows, cols = msg.rt_rows.tensor(req_to_token.device), msg.rt_cols.tensor(req_to_token.device)
    if rows.numel():
        req_to_token[rows, cols] = msg.rt_slots.tensor(req_to_token.device).to(req_to_token.dtype)


class ReqToTokenMirror:
    """Rank 0's copy of what the other ranks' request -> token tables hold: `diff(fb)` returns the
    entries the batch reads (each row up to its sequence length) that differ from what was sent,
    and records them as sent. Rows are reused by later requests and prefixes come from the radix
    cache, so the diff compares values rather than tracking lengths."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.table = req_to_token
        self.sent = torch.zeros_like(req_to_token)

    def diff(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = fb.req_pool_indices.to(self.table.device, torch.int64)
        if rows.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty, empty.to(torch.int32)
        lens = fb.seq_lens.to(self.table.device, torch.int64)
        width = int(lens.max())
        cur, old = self.table[rows, :width], self.sent[rows, :width]
        mask = (cur != old) & (torch.arange(width, device=rows.device) < lens.unsqueeze(1))
        r, c = mask.nonzero(as_tuple=True)
        rr, slots = rows[r], cur[r, c]
        self.sent[rr, c] = slots
        return rr, c, slots

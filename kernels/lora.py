"""The segmented LoRA update (SGMV, as Punica/S-LoRA and SGLang's `sgemm_lora_a`/`_b`): a batch's
rows are split into segments of consecutive rows that share an adapter slot, and each row gets

    y[row, cols_j] += scaling[s, j] * (x[row] @ A[s, j].T) @ B[s, j].T

for every target j of the projection (one target for o/down, three for a fused q/k/v, two for a
fused gate/up), s the segment's slot. The base GEMM runs once for the whole batch; this adds the
low-rank parts on top, in place.

Layouts (one `LoRAWeights` per projection, every slot of the memory pool stacked):
- `lora_a` [slots, targets * R, in]: target j's A in rows [j R, j R + rank[s, j]), the rest zero
  (a fused projection shrinks every target with one pass over x, as SGLang's qkv buffers do).
- `lora_b` [slots, R, out]: B transposed, so a row of it is contiguous along the output columns:
  the CPU expand is an axpy over columns per rank (no horizontal sums), and Triton reads it as the
  [K, N] operand of its dot. Target j owns columns [out_offsets[j], out_offsets[j + 1]).
- `ranks` int32 [slots, targets] and `scalings` float32 [slots, targets]: rank 0 means no update
  (slot 0, the base model, or a target the adapter does not have); kernels read only the first
  rank rows of A and B, so ranks below R cost nothing, and a rank below R also works when the
  padding is zero.
A segment whose slot is negative gets no update either.

Three implementations with one contract: `sgmv_torch` (a loop over segments: the reference),
`kernels.cpu_kernels` `lora_sgmv` (C++, AVX2/FMA or scalar), `kernels.triton_lora` (shrink +
expand, CUDA; tested under TRITON_INTERPRET=1). `sgmv` picks one by device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels import cpu_kernels


class LoRABatchInfo(NamedTuple):
    """Where the adapters' rows are (SGLang's names). Built once per batch, shared by every
    projection of every layer."""

    # int32 [segments + 1]: segment i is rows [seg_indptr[i], seg_indptr[i + 1])
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor  # int32 [segments]: each segment's slot (negative: no update)
    max_seg_len: int  # the longest segment (the Triton grid's row extent; known on the host)
    seg_indptr_host: tuple[int, ...]  # seg_indptr as Python ints (the torch path loops over them)
    weight_indices_host: tuple[int, ...]

    @property
    def num_segments(self) -> int:
        return len(self.weight_indices_host)

    @property
    def num_rows(self) -> int:
        return self.seg_indptr_host[-1]


def _info(indptr: list[int], indices: list[int], device: torch.device | str) -> LoRABatchInfo:
    """The batch info of segment bounds `indptr` and their slots `indices` (on the host too)."""
    max_len = max((b - a for a, b in zip(indptr, indptr[1:])), default=0)
    return LoRABatchInfo(
        torch.tensor(indptr, dtype=torch.int32, device=device),
        torch.tensor(indices, dtype=torch.int32, device=device),
        max_len,
        tuple(indptr),
        tuple(indices),
    )


def batch_info(
    slots: Sequence[int], rows: Sequence[int] | None = None, device: torch.device | str = "cpu"
) -> LoRABatchInfo:
    """Segments for requests in batch order: request i has `rows[i]` rows (default 1: a decode
    step) under slot `slots[i]`. Neighbours with the same slot merge into one segment (longer
    segments: fewer weight reads); requests with no rows are dropped."""
    rows = [1] * len(slots) if rows is None else list(rows)
    if len(rows) != len(slots):
        raise ValueError(f"{len(slots)} slots for {len(rows)} requests")
    indptr, indices = [0], []
    for slot, n in zip(slots, rows):
        if n < 0:
            raise ValueError(f"a request has {n} rows")
        if n == 0:
            continue
        if indices and indices[-1] == slot:
            indptr[-1] += n
        else:
            indices.append(int(slot))
            indptr.append(indptr[-1] + n)
    return _info(indptr, indices, device)


class LoRAWeights(NamedTuple):
    """One projection's adapters, every slot stacked (the module docstring has the layouts)."""

    lora_a: torch.Tensor  # [slots, targets * R, in]
    lora_b: torch.Tensor  # [slots, R, out]
    ranks: torch.Tensor  # int32 [slots, targets]
    scalings: torch.Tensor  # float32 [slots, targets]
    out_offsets: torch.Tensor  # int32 [targets + 1], on the weights' device

    @property
    def num_targets(self) -> int:
        return self.ranks.shape[1]

    @property
    def max_rank(self) -> int:
        return self.lora_b.shape[1]

    @classmethod
    def empty(
        cls,
        slots: int,
        max_rank: int,
        in_features: int,
        out_sizes: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> LoRAWeights:
        """Zero buffers (every slot rank 0) for a projection whose output concatenates `out_sizes`."""
        offsets = [0]
        for n in out_sizes:
            offsets.append(offsets[-1] + n)
        t = len(out_sizes)
        return cls(
            torch.zeros(slots, t * max_rank, in_features, dtype=dtype, device=device),
            torch.zeros(slots, max_rank, offsets[-1], dtype=dtype, device=device),
            torch.zeros(slots, t, dtype=torch.int32, device=device),
            torch.zeros(slots, t, dtype=torch.float32, device=device),
            torch.tensor(offsets, dtype=torch.int32, device=device),
        )

    def check(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """ValueError unless x [T, in] and y [T, out] fit these weights."""
        s, tr, k = self.lora_a.shape
        t = self.num_targets
        if (
            tr != t * self.max_rank
            or self.lora_b.shape[0] != s
            or tuple(self.scalings.shape) != (s, t)
        ):
            raise ValueError(
                f"inconsistent LoRA buffers: A {tuple(self.lora_a.shape)}, B "
                f"{tuple(self.lora_b.shape)}, ranks {tuple(self.ranks.shape)}"
            )
        n = self.lora_b.shape[2]
        if x.dim() != 2 or y.dim() != 2 or x.shape[1] != k or y.shape != (x.shape[0], n):
            raise ValueError(
                f"x {tuple(x.shape)} and y {tuple(y.shape)} do not fit LoRA weights of "
                f"in={k}, out={n}"
            )


def sgmv_torch(
    y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, info: LoRABatchInfo
) -> torch.Tensor:
    """The reference: y += the LoRA update, one shrink and expand per (segment, target), computed in
    float32 (the ranks and scalings are read on the host)."""
    w.check(x, y)
    ranks, scalings = w.ranks.tolist(), w.scalings.tolist()
    offsets = w.out_offsets.tolist()
    r_max = w.max_rank
    for i, s in enumerate(info.weight_indices_host):
        if s < 0:
            continue
        lo, hi = info.seg_indptr_host[i], info.seg_indptr_host[i + 1]
        xs = x[lo:hi].float()
        for j in range(w.num_targets):
            r = ranks[s][j]
            if r == 0:
                continue
            a = w.lora_a[s, j * r_max : j * r_max + r].float()
            b = w.lora_b[s, :r, offsets[j] : offsets[j + 1]].float()
            cols = slice(offsets[j], offsets[j + 1])
            y[lo:hi, cols] = (y[lo:hi, cols].float() + scalings[s][j] * ((xs @ a.T) @ b)).to(
                y.dtype
            )
    return y


def sgmv_cpu(y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
    """The C++ kernel (kernels/csrc/lora.cpp); `cpu_kernels.load()` must have succeeded."""
    w.check(x, y)
    cpu_kernels.lora_sgmv(
        y,
        x,
        w.lora_a,
        w.lora_b,
        info.seg_indptr,
        info.weight_indices,
        w.ranks,
        w.scalings,
        w.out_offsets,
    )
    return y


def sgmv(y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
    """y [T, out] += the LoRA update of x [T, in] (in place; returned): Triton on CUDA, the C++
    kernel on the CPU where it is built, else the torch reference."""
    if x.device.type == "cuda":
        from kernels.triton_lora import triton_sgmv

        return triton_sgmv(y, x, w, info)
    if x.device.type == "cpu" and (torch.compiler.is_compiling() or cpu_kernels.load() is not None):
        return sgmv_cpu(y, x, w, info)
    return sgmv_torch(y, x, w, info)


def slice_batch_info(info: LoRABatchInfo, start: int, stop: int) -> LoRABatchInfo:
    """The segments of rows [start, stop) of a batch, renumbered from 0 (a CPU row block of a long
    prefill runs its projections on its own rows)."""
    indptr, indices = [0], []
    for i, s in enumerate(info.weight_indices_host):
        lo = max(info.seg_indptr_host[i], start)
        hi = min(info.seg_indptr_host[i + 1], stop)
        if lo < hi:
            indices.append(s)
            indptr.append(indptr[-1] + hi - lo)
    return _info(indptr, indices, info.seg_indptr.device)

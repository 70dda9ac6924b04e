"""Triton SGMV for the GPU: the segmented LoRA update of `kernels.lora` (contract and layouts
there) as two kernels, Punica/SGLang style:
- shrink: h[rows, j R : j R + rank] = scaling[s, j] * x[rows] @ A[s, j R : j R + rank].T, one program per
  (segment, row tile, target); float32 h.
- expand: y[rows, cols] += h[rows, target of cols] @ B[s, :rank, cols], one program per (segment, row
  tile, column tile); a column tile that spans two targets' columns takes each one's dot over its
  own columns (every output element belongs to exactly one program: no atomics).
Ranks below R are masked (only rank rows of A and B are read), a slot below zero or a target of rank
0 writes nothing. h is rounded to B's dtype before the expand dot (half precision runs on tensor
cores; float32 stays IEEE float32). Grids are sized by `max_seg_len`, known on the host."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # kernels.lora dispatches to this module on CUDA
    from kernels.lora import LoRABatchInfo, LoRAWeights


@triton.jit
def _shrink_kernel(
    x,
    a,
    h,
    seg_indptr,
    weight_indices,
    ranks,
    scalings,
    K,
    stride_xm,
    stride_as,
    stride_ar,
    stride_hm,
    NT: tl.constexpr,
    R: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    j = tl.program_id(2)
    slot = tl.load(weight_indices + seg)
    lo = tl.load(seg_indptr + seg)
    hi = tl.load(seg_indptr + seg + 1)
    rank = tl.load(ranks + slot * NT + j, mask=slot >= 0, other=0)
    if (slot < 0) | (rank == 0) | (lo + pid_m * BLOCK_M >= hi):
        return
    scaling = tl.load(scalings + slot * NT + j)
    offs_m = lo + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mm = offs_m < hi
    rm = offs_r < rank
    x_rows = x + offs_m.to(tl.int64)[:, None] * stride_xm
    a_rows = a + slot.to(tl.int64) * stride_as + (j * R + offs_r).to(tl.int64)[None, :] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        km = k < K
        xt = tl.load(x_rows + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        at = tl.load(
            a_rows + k[:, None], mask=km[:, None] & rm[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_R]
        acc += tl.dot(xt, at, input_precision=PRECISION)
    tl.store(
        h + offs_m.to(tl.int64)[:, None] * stride_hm + (j * R + offs_r)[None, :],
        acc * scaling,
        mask=mm[:, None] & rm[None, :],
    )


@triton.jit
def _expand_kernel(
    h,
    b,
    y,
    seg_indptr,
    weight_indices,
    ranks,
    out_offsets,
    N,
    stride_hm,
    stride_bs,
    stride_br,
    stride_ym,
    NT: tl.constexpr,
    R: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(weight_indices + seg)
    lo = tl.load(seg_indptr + seg)
    hi = tl.load(seg_indptr + seg + 1)
    if (slot < 0) | (lo + pid_m * BLOCK_M >= hi):
        return
    n0 = pid_n * BLOCK_N
    offs_m = lo + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mm = offs_m < hi
    nm = offs_n < N
    h_rows = h + offs_m.to(tl.int64)[:, None] * stride_hm
    b_rows = b + slot.to(tl.int64) * stride_bs + offs_r.to(tl.int64)[:, None] * stride_br
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    live = tl.full([], 0, tl.int32)  # targets that update this tile (none: y is not touched)
    for j in tl.static_range(NT):
        rank = tl.load(ranks + slot * NT + j)
        c0 = tl.load(out_offsets + j)
        c1 = tl.load(out_offsets + j + 1)
        overlaps = (rank > 0) & (c0 < n0 + BLOCK_N) & (c1 > n0)
        live += overlaps.to(tl.int32)
        if overlaps:
            rm = offs_r < rank
            cm = nm & (offs_n >= c0) & (offs_n < c1)
            bt = tl.load(
                b_rows + offs_n[None, :], mask=rm[:, None] & cm[None, :], other=0.0
            )  # [BLOCK_R, BLOCK_N]
            ht = tl.load(
                h_rows + (j * R + offs_r)[None, :], mask=mm[:, None] & rm[None, :], other=0.0
            )
            acc += tl.dot(ht.to(bt.dtype), bt, input_precision=PRECISION)
    if live > 0:
        y_ptrs = y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        ym = mm[:, None] & nm[None, :]
        yt = tl.load(y_ptrs, mask=ym, other=0.0)
        tl.store(y_ptrs, (yt.to(tl.float32) + acc).to(y.dtype.element_ty), mask=ym)


class SgmvConfig(NamedTuple):
    """Tile sizes of one update's two launches."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pick_config(max_seg_len: int) -> SgmvConfig:
    """A fixed heuristic: decode segments are a row or a few, so the row tile stays at tl.dot's
    minimum of 16 there; prefill segments take taller tiles that reuse each weight tile."""
    if _interpreting():  # the interpreter's cost grows with the tile, not the grid
        return SgmvConfig(16, 32, 32)
    block_m = 16 if max_seg_len <= 16 else 32 if max_seg_len <= 64 else 64
    return SgmvConfig(block_m, 64, 64, num_warps=4)


def triton_sgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    w: LoRAWeights,
    info: LoRABatchInfo,
    config: SgmvConfig | None = None,
) -> torch.Tensor:
    """y [T, out] += the LoRA update of x [T, in] (in place; returned). x, y and the weights share a
    dtype and a device; `config` overrides the tile choice (tests)."""
    w.check(x, y)
    if x.dtype != w.lora_a.dtype or y.dtype != x.dtype or w.lora_b.dtype != x.dtype:
        raise ValueError(
            f"x {x.dtype}, y {y.dtype} and the LoRA weights {w.lora_a.dtype} must share a dtype"
        )
    if info.num_segments == 0 or x.shape[0] == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("y's rows must be contiguous (it is updated in place)")
    cfg = config or pick_config(info.max_seg_len)
    r, nt, k, n = w.max_rank, w.num_targets, x.shape[1], y.shape[1]
    block_r = max(16, triton.next_power_of_2(r))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(x.shape[0], nt * r, dtype=torch.float32, device=x.device)
    a, b = w.lora_a.contiguous(), w.lora_b.contiguous()
    m_tiles = triton.cdiv(info.max_seg_len, cfg.block_m)
    _shrink_kernel[(info.num_segments, m_tiles, nt)](
        x,
        a,
        h,
        info.seg_indptr,
        info.weight_indices,
        w.ranks,
        w.scalings,
        k,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        h.stride(0),
        NT=nt,
        R=r,
        PRECISION=precision,
        BLOCK_M=cfg.block_m,
        BLOCK_R=block_r,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )
    _expand_kernel[(info.num_segments, m_tiles, triton.cdiv(n, cfg.block_n))](
        h,
        b,
        y,
        info.seg_indptr,
        info.weight_indices,
        w.ranks,
        w.out_offsets,
        n,
        h.stride(0),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        NT=nt,
        R=r,
        PRECISION=precision,
        BLOCK_M=cfg.block_m,
        BLOCK_R=block_r,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return y

"""Triton GEMM over a quantized weight for the GPU: y = x @ dequantize(w).T for the block format of
`kernels.quant` (4-bit nibble chunks or int8 codes, a scale and optional bias per group of G
elements along K), dequantizing each weight tile in registers and accumulating in float32. The
reference is `F.linear(x, w.dequantize())`; the tests compare them, on the CPU under
TRITON_INTERPRET=1 and on a GPU.

One kernel covers the formats through constexprs: BITS (4 or 8), G (the group size), HAS_BIAS.
A 4-bit tile of BLOCK_K elements is BLOCK_K // 2 contiguous bytes; its low nibbles are the first
16 elements of each 32-element chunk and its high nibbles the last 16, so the kernel gathers the
matching x columns for each half and issues two dots (no in-register shuffle of the weight).
Scales and biases are gathered per K row of the tile (index k // G), as in the GPTQ Triton
kernels, so any G the format allows works with any BLOCK_K. The dequantized tile is rounded to
x's dtype before tl.dot (float16/bfloat16 use tensor cores; float32 stays IEEE float32)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # kernels.quant dispatches to this module on CUDA
    from kernels.quant import QuantWeight


@triton.jit
def _qgemm_kernel(x, qw, scales, biases, y, M, N, K, stride_xm, stride_qn, stride_sn, stride_bn, stride_ym,
                  BITS: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m-tile, n-tile] = x[m-tile] @ dequantize(w)[n-tile].T; K is a multiple of BLOCK_K."""
    # Axis 0 walks M so programs launched together read the same weight columns (L2 reuse in prefill).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = offs_m < M
    nm = offs_n < N
    x_rows = x + offs_m.to(tl.int64)[:, None] * stride_xm
    q_cols = qw + offs_n.to(tl.int64)[None, :] * stride_qn
    s_cols = scales + offs_n.to(tl.int64)[None, :] * stride_sn
    b_cols = biases + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BITS == 4:
        HALF: tl.constexpr = BLOCK_K // 2
        offs_b = tl.arange(0, HALF)  # byte of the tile
        k_lo_in = (offs_b // 16) * 32 + offs_b % 16  # element of the tile held in that byte's low nibble
        for k0 in range(0, K, BLOCK_K):
            k_lo = k0 + k_lo_in
            packed = tl.load(q_cols + (k0 // 2 + offs_b)[:, None], mask=nm[None, :], other=0)  # [HALF, BLOCK_N]
            # Low and high nibble of a byte are in one 32-element chunk, so in one group (32 | G).
            grp = (k_lo // G)[:, None]
            s = tl.load(s_cols + grp, mask=nm[None, :], other=0.0).to(tl.float32)
            w_lo = (packed & 0xF).to(tl.float32) * s
            w_hi = (packed >> 4).to(tl.float32) * s
            if HAS_BIAS:
                b = tl.load(b_cols + grp, mask=nm[None, :], other=0.0).to(tl.float32)
                w_lo += b
                w_hi += b
            x_lo = tl.load(x_rows + k_lo[None, :], mask=mm[:, None], other=0.0)  # [BLOCK_M, HALF]
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=mm[:, None], other=0.0)
            acc += tl.dot(x_lo, w_lo.to(x_lo.dtype), input_precision=PRECISION)
            acc += tl.dot(x_hi, w_hi.to(x_hi.dtype), input_precision=PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            codes = tl.load(q_cols + k[:, None], mask=nm[None, :], other=0)  # [BLOCK_K, BLOCK_N] int8
            grp = (k // G)[:, None]
            w = codes.to(tl.float32) * tl.load(s_cols + grp, mask=nm[None, :], other=0.0).to(tl.float32)
            if HAS_BIAS:
                w += tl.load(b_cols + grp, mask=nm[None, :], other=0.0).to(tl.float32)
            xt = tl.load(x_rows + k[None, :], mask=mm[:, None], other=0.0)
            acc += tl.dot(xt, w.to(xt.dtype), input_precision=PRECISION)
    tl.store(y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


class QGemmConfig(NamedTuple):
    """Tile sizes and launch options of one qgemm launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pick_config(m: int, n: int, k: int, bits: int) -> QGemmConfig:
    """A fixed heuristic instead of autotuning (which the interpreter cannot afford, and which
    would time every new M bucket on the GPU). Decode (small M) is bound by reading the weight:
    narrow N tiles give enough programs to cover the SMs and a deep K step keeps loads in
    flight. Prefill is bound by the dots: square-ish tiles reuse each dequantized tile across
    many rows."""
    if _interpreting():  # small tiles: the interpreter's cost grows with the tile, not the grid
        block_m = 16 if m <= 16 else 32
        return QGemmConfig(block_m, 16 if n <= 16 else 32, _block_k(k, 32 if bits == 4 else 16, 64))
    if m <= 16:  # aim for about two programs per SM or more on a large GPU
        block_n = 16 if n <= 4096 else 32 if n <= 16384 else 64
        return QGemmConfig(16, block_n, _block_k(k, 32, 256), num_warps=4, num_stages=4)
    if m <= 64:
        return QGemmConfig(32 if m <= 32 else 64, 64, _block_k(k, 32, 128), num_warps=4, num_stages=4)
    return QGemmConfig(128 if m >= 256 else 64, 128, _block_k(k, 32, 64), num_warps=8, num_stages=3)


def _block_k(k: int, lo: int, hi: int) -> int:
    """The largest power of two in [lo, hi] that divides K (K is a multiple of 32): the loop then
    needs no mask along K."""
    bk = hi
    while bk > lo and k % bk:
        bk //= 2
    return bk


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its rows are contiguous (the kernel takes a row stride), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_qgemm(x: torch.Tensor, w: QuantWeight, config: QGemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (float16/bfloat16/float32, on w's device) @ dequantize(w).T -> [M, N] in x's dtype,
    float32 accumulation. `config` overrides the heuristic tile choice (tests, benchmarks). A
    weight with a column permutation (`w.perm`) reads x's columns in that order (one gather)."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    n = w.out_features
    y = x.new_empty(m, n)
    if m == 0 or n == 0:
        return y
    cfg = config or pick_config(m, n, k, w.bits)
    if k % cfg.block_k or cfg.block_k % (32 if w.bits == 4 else 16):
        raise ValueError(f"block_k={cfg.block_k} must divide K={k} and be a multiple of the code chunk")
    x, qw, scales = _unit_last_stride(x), _unit_last_stride(w.qweight), _unit_last_stride(w.scales)
    biases = _unit_last_stride(w.biases) if w.biases is not None else scales  # unread when HAS_BIAS is off
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (no TF32 rounding)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _qgemm_kernel[grid](x, qw, scales, biases, y, m, n, k, x.stride(0), qw.stride(0), scales.stride(0),
                        biases.stride(0), y.stride(0), BITS=w.bits, G=w.group_size, HAS_BIAS=w.biases is not None,
                        PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y

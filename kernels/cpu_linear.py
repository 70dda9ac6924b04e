"""Linear layers with weights prepacked once for the CPU: the project's own AVX-512 GEMM or oneDNN.

torch's `F.linear` on an x86 CPU calls MKL's sgemm, which takes a slow code path on non-Intel
CPUs: on an AMD EPYC oneDNN, with the weight reordered once at load time, runs the same fp32
GEMMs 2.4-2.6x faster (`python -m engine.bench --case linear`). The project's float32 GEMM
(`kernels.cpu_kernels`, CPUs with AVX-512) is faster again at the row counts of a decode step,
where a linear is a stream over its weight, and somewhat slower than oneDNN at prefill sizes
(docs/BENCHMARKS.md); its results do not depend on the batch size.

Kinds: "torch" (F.linear over the dense weight), "onednn" (oneDNN's packed weight), "native"
(float32: the project's GEMM over 16-column panels, one copy; bfloat16: the project's AVX512-BF16
kernel for up to NATIVE_BF16_MAX_ROWS rows beside oneDNN's packed weight for more, two copies:
oneDNN's bfloat16 kernels are several times slower for one to three rows than for four, and
faster than any of ours from four on, with AMX). Inside `torch.compile` the packed kinds are
opaque operators (`torch.ops.radixray.gemm*`, `.onednn_linear`): inductor's own lowering of
oneDNN's linear expects weights it packed itself."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels import cpu_kernels

LinearKind = Literal["torch", "onednn", "native"]
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
NATIVE_BF16_MAX_ROWS = 3  # a "native" bfloat16 linear's own kernel takes up to this many rows
ONEDNN_BF16_MIN_ROWS = 4  # a oneDNN bfloat16 linear pads fewer rows to this many


class Linear:
    """y = x @ W.T + b. Holds one copy of the weight: dense (torch) or packed (oneDNN, native)."""

    __slots__ = ("weight", "bias", "packed", "panels", "panel_rows", "out_features", "in_features", "pad_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, onednn: bool = False,
                 kind: LinearKind | None = None) -> None:
        kind = kind or ("onednn" if onednn else "torch")
        if kind not in ("torch", "onednn", "native"):
            raise ValueError(f"unknown linear kind {kind!r}")
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        bf16 = weight.dtype == torch.bfloat16
        self.panels, self.panel_rows, self.pad_rows = None, 0, 0
        if kind == "native" and not bf16:
            self.panels, self.panel_rows = cpu_kernels.load().gemm_pack(weight), 1 << 62
        elif kind == "native" and self.in_features % 2 == 0:
            self.panels, self.panel_rows = cpu_kernels.load().gemm_pack_bf16(weight), NATIVE_BF16_MAX_ROWS
        onednn = kind == "onednn" or (kind == "native" and bf16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn else None
        if onednn and bf16 and self.panels is None:
            self.pad_rows = ONEDNN_BF16_MIN_ROWS
        self.weight = weight if kind == "torch" else None

    @property
    def kind(self) -> LinearKind:
        return "native" if self.panels is not None else "onednn" if self.packed is not None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.shape[0] <= self.panel_rows:
            gemm = cpu_kernels.gemm if self.panels.dtype == torch.float32 else cpu_kernels.gemm_bf16
            return gemm(x, self.panels, self.bias, self.out_features)
        if self.packed is not None:
            rows = x.shape[0]
            if 0 < rows < self.pad_rows:
                x = torch.cat([x, x.new_zeros(self.pad_rows - rows, x.shape[1])])
            if torch.compiler.is_compiling():  # (the CPU graphs run only where the kernels are built)
                y = torch.ops.radixray.onednn_linear(x, self.packed, self.bias, self.out_features)
            else:
                y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y[:rows] if x.shape[0] != rows else y
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.out_features * self.in_features + (0 if self.bias is None else self.bias.numel())


def onednn_linear_works(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear exists in this torch build and matches F.linear on a probe."""
    if dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return _probe("onednn", dtype)


def native_linear_works(dtype: torch.dtype) -> bool:
    """The project's GEMM is built here (float32: AVX-512; bfloat16: AVX512-BF16, beside oneDNN)
    and matches F.linear on a probe."""
    mod = cpu_kernels.load()
    if mod is None or dtype not in _ONEDNN_DTYPES:
        return False
    if dtype == torch.float32 and not mod.gemm_available():
        return False
    if dtype == torch.bfloat16 and not (mod.gemm_bf16_available() and onednn_linear_works(dtype)):
        return False
    return _probe("native", dtype)


def _probe(kind: LinearKind, dtype: torch.dtype) -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        got = Linear(w, b, kind=kind)(x).float()
    except (RuntimeError, AttributeError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got, F.linear(x, w, b).float(), atol=tol, rtol=tol))

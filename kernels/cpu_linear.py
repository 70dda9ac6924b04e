"""Linear layers with weights prepacked once for the CPU: the project's own AVX-512 GEMM or oneDNN.

torch's `F.linear` on an x86 CPU calls MKL's sgemm, which takes a slow code path on non-Intel
CPUs: on an AMD EPYC oneDNN, with the weight reordered once at load time, runs the same fp32
GEMMs 2.4-2.6x faster (`python -m engine.bench --case linear`). The project's GEMM
(`kernels.cpu_kernels`, float32 on CPUs with AVX-512) is faster again at the row counts of a
decode step, where a linear is a stream over its weight, and matches oneDNN at prefill sizes;
its results do not depend on the batch size. Each Linear keeps only its packed copy and falls
back to `F.linear` wherever neither is available.

Kinds: "torch" (F.linear over the dense weight), "onednn" (oneDNN's packed weight), "native"
(the project's GEMM over 16-column panels). Inside `torch.compile` both packed kinds are opaque
operators (`torch.ops.radixray.gemm`, `radixray::onednn_linear`): inductor's own lowering of
oneDNN's linear expects weights it packed itself."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels import cpu_kernels

LinearKind = Literal["torch", "onednn", "native"]
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN's bfloat16 kernels are several times slower for one to three rows (with two threads)
# than for four, and faster than the project's from four rows on (AMX): a oneDNN bfloat16 linear
# also keeps the project's bfloat16 panels (AVX512-BF16) for inputs of up to NATIVE_BF16_MAX_ROWS
# rows, or, where that kernel is not built, pads them to ONEDNN_BF16_MIN_ROWS.
NATIVE_BF16_MAX_ROWS = 3
ONEDNN_BF16_MIN_ROWS = 4


@torch.library.custom_op("radixray::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


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
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if kind == "onednn" else None
        self.weight = weight if kind == "torch" else None
        self.panels, self.panel_rows, self.pad_rows = None, 0, 0
        if kind == "native":
            self.panels, self.panel_rows = cpu_kernels.load().gemm_pack(weight), 1 << 62
        elif kind == "onednn" and weight.dtype == torch.bfloat16:
            if native_bf16_works(weight.shape[1]):
                self.panels, self.panel_rows = cpu_kernels.load().gemm_pack_bf16(weight), NATIVE_BF16_MAX_ROWS
            else:
                self.pad_rows = ONEDNN_BF16_MIN_ROWS

    @property
    def kind(self) -> LinearKind:
        return "onednn" if self.packed is not None else "native" if self.panels is not None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.shape[0] <= self.panel_rows:
            gemm = cpu_kernels.gemm if self.panels.dtype == torch.float32 else cpu_kernels.gemm_bf16
            return gemm(x, self.panels, self.bias, self.out_features)
        if self.packed is not None:
            rows = x.shape[0]
            if 0 < rows < self.pad_rows:
                x = torch.cat([x, x.new_zeros(self.pad_rows - rows, x.shape[1])])
            if torch.compiler.is_compiling():
                y = _onednn_linear(x, self.packed, self.bias, self.out_features)
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
    """The project's GEMM is built here (float32, a CPU with AVX-512) and matches F.linear on a probe."""
    mod = cpu_kernels.load()
    if dtype != torch.float32 or mod is None or not mod.gemm_available():
        return False
    return _probe("native", dtype)


def native_bf16_works(in_features: int) -> bool:
    """The project's bfloat16 decode GEMM is built here (AVX512-BF16) and takes this K (even)."""
    mod = cpu_kernels.load()
    return in_features % 2 == 0 and mod is not None and mod.gemm_bf16_available()


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

"""Linear layers with weights prepacked for oneDNN on the CPU.

torch's `F.linear` on an x86 CPU calls MKL's sgemm, which takes a slow code path on non-Intel
CPUs: on the AMD EPYC development machine oneDNN, with the weight reordered once at load time,
runs the same fp32 GEMMs 2.4-2.6x faster at every batch size from 1 to 2048 rows
(`python -m engine.bench --case linear`). The reorder is what inductor's CPU fusion does; we do it
once per weight, keep only the packed copy and fall back to `F.linear` wherever oneDNN is absent
or disagrees with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class Linear:
    """y = x @ W.T + b. Holds either the dense weight (torch) or only oneDNN's packed copy."""

    __slots__ = ("weight", "bias", "packed", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, onednn: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn else None
        self.weight = None if onednn else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.out_features * self.in_features + (0 if self.bias is None else self.bias.numel())


def onednn_linear_works(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear exists in this torch build and matches F.linear on a probe."""
    if dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        got = Linear(w, b, onednn=True)(x).float()
    except (RuntimeError, AttributeError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got, F.linear(x, w, b).float(), atol=tol, rtol=tol))

"""`python -m kernels.triton_quant_bench`: the Triton quantized GEMM (kernels/triton_quant.py)
against the reference (dequantize, then F.linear) on CUDA."""

from __future__ import annotations

import torch

from kernels.quant import quantize_int4, quantize_int8
from kernels.triton_quant import pick_config, triton_qgemm


def _benchmark() -> None:
    """Times triton_qgemm against the reference (dequantize, then F.linear) on CUDA:
    `python -m kernels.triton_quant_bench`. Prints microseconds and the weight-read bandwidth."""
    from triton.testing import do_bench

    torch.manual_seed(0)
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (151936, 4096)):
        w32 = torch.randn(n, k, device="cuda") * 0.02
        for name, w in (("q4_g32", quantize_int4(w32, 32)), ("q8_g32", quantize_int8(w32, 32)),
                        ("q8_chan", quantize_int8(w32))):
            for m in (1, 8, 32, 256, 2048):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ms = do_bench(lambda: triton_qgemm(x, w))  # noqa: B023
                ref = do_bench(lambda: torch.nn.functional.linear(x, w.dequantize(x.dtype)))  # noqa: B023
                print(f"{name:8s} N={n:6d} K={k:5d} M={m:5d} {pick_config(m, n, k, w.bits)}: "
                      f"{ms * 1e3:9.1f} us ({w.nbytes() / ms / 1e6:7.1f} GB/s) reference {ref * 1e3:9.1f} us")


if __name__ == "__main__":
    _benchmark()

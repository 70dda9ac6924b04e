"""kernels/triton_quant.py: the quantized-weight GEMM vs F.linear over the dequantized weight, for
every layout of kernels.quant (TRITON_INTERPRET=1 on the CPU, see conftest; on the device where
CUDA is there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
from kernels import triton_quant as tq  # noqa: E402
from kernels.quant import QuantWeight, pack_nibbles, quantize_int4, quantize_int8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["q4_g32_f16_bias", "q4_g32_f32_bias", "q8_g32_f16", "q8_g16_f32", "q8_channel"]
# Output magnitudes are about 1 (x ~ N(0, 1), weights about 0.1, K <= 128). float32 runs IEEE dots,
# so only the order of additions differs; float16/bfloat16 round the dequantized weight (and y).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def make_weight(fmt: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    if fmt == "q4_g32_f16_bias":  # GGUF Q4_1-like: float16 scale and minimum
        w = quantize_int4(torch.randn(n, k, generator=g) * 0.1, 32)
    elif fmt == "q4_g32_f32_bias":  # random codes, float32 scales and biases (K-quant-like)
        codes = torch.randint(0, 16, (n, k), generator=g)
        scales = torch.rand(n, k // 32, generator=g) * 0.02 + 0.002
        biases = torch.randn(n, k // 32, generator=g) * 0.1
        w = QuantWeight(pack_nibbles(codes), scales, biases, 4, 32)
    elif fmt == "q8_g32_f16":  # GGUF Q8_0-like
        w = quantize_int8(torch.randn(n, k, generator=g) * 0.1, 32)
    elif fmt == "q8_g16_f32":  # random codes over the whole int8 range, groups of 16
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scales = torch.rand(n, k // 16, generator=g) * 1e-3 + 1e-4
        w = QuantWeight(codes, scales, None, 8, 16)
    elif fmt == "q8_channel":  # one scale per output channel (G = K)
        w = quantize_int8(torch.randn(n, k, generator=g) * 0.1)
    else:
        raise ValueError(fmt)
    return w.to(torch.device(DEV))


def reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return F.linear(x.float(), w.dequantize())


def check(x: torch.Tensor, w: QuantWeight, config: tq.QGemmConfig | None = None) -> None:
    got = tq.triton_qgemm(x, w, config)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.out_features)
    torch.testing.assert_close(got.float(), reference(x, w), **TOL[x.dtype])


def activations(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


@pytest.mark.parametrize("N", [48, 80])
@pytest.mark.parametrize("K", [64, 96])
@pytest.mark.parametrize("M", [1, 5, 33])
@pytest.mark.parametrize("fmt", FORMATS)
def test_qgemm_matches_dequantized_linear(fmt, M, K, N):
    check(activations(M, K, seed=M + K), make_weight(fmt, N, K, seed=N))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qgemm_half_activations(fmt, dtype):
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot on the raw uint16 bits; checked on CUDA")
    check(activations(5, 96, dtype), make_weight(fmt, 80, 96))


def test_qgemm_nibble_layout_by_hand():
    """Pins the 4-bit layout independently of QuantWeight.dequantize: x = I gives y = W.T."""
    k, n = 64, 16
    packed = torch.randint(0, 256, (n, k // 2), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    scales = torch.full((n, k // 32), 0.5)
    scales[:, 1] = 2.0
    biases = torch.zeros(n, k // 32)
    biases[:, 0] = -1.0
    want = torch.empty(n, k)
    for c in range(k // 32):
        for j in range(16):
            byte = packed[:, 16 * c + j].float()
            want[:, 32 * c + j] = torch.remainder(byte, 16) * scales[:, c] + biases[:, c]
            want[:, 32 * c + 16 + j] = torch.div(byte, 16, rounding_mode="floor") * scales[:, c] + biases[:, c]
    w = QuantWeight(packed, scales, biases, 4, 32).to(torch.device(DEV))
    got = tq.triton_qgemm(torch.eye(k, device=DEV), w)
    torch.testing.assert_close(got.cpu(), want.T, atol=0, rtol=0)


@pytest.mark.parametrize("fmt, cfg", [
    ("q8_g16_f32", tq.QGemmConfig(16, 16, 16)),    # a K step of one group of 16
    ("q8_g32_f16", tq.QGemmConfig(32, 64, 128)),   # several groups per K step, N tile past N
    ("q4_g32_f16_bias", tq.QGemmConfig(16, 32, 128)),  # four nibble chunks per K step
    ("q4_g32_f32_bias", tq.QGemmConfig(64, 16, 32)),   # M tile past M
    ("q8_channel", tq.QGemmConfig(16, 16, 32)),    # group spans several K steps
])
def test_qgemm_explicit_tiles(fmt, cfg):
    check(activations(20, 128, seed=7), make_weight(fmt, 48, 128, seed=2), cfg)


def test_qgemm_group_of_64_and_48():
    """Groups larger than a nibble chunk (4-bit G=64) and not a power of two (8-bit G=48)."""
    g = torch.Generator().manual_seed(5)
    w4 = QuantWeight(pack_nibbles(torch.randint(0, 16, (24, 192), generator=g)),
                     torch.rand(24, 3, generator=g).half() * 0.02, torch.randn(24, 3, generator=g).half() * 0.1, 4, 64)
    w8 = QuantWeight(torch.randint(-128, 128, (24, 192), generator=g, dtype=torch.int8),
                     torch.rand(24, 4, generator=g) * 1e-3, None, 8, 48)
    x = activations(3, 192, seed=5)
    check(x, w4.to(torch.device(DEV)))
    check(x, w8.to(torch.device(DEV)))
    check(x, w4.to(torch.device(DEV)), tq.QGemmConfig(16, 16, 64))


def test_qgemm_strided_activations_and_empty():
    w = make_weight("q4_g32_f16_bias", 48, 64)
    wide = activations(6, 128)
    check(wide[:, 32:96], w)  # row stride 128, not contiguous
    assert tq.triton_qgemm(wide[:0, :64], w).shape == (0, 48)
    with pytest.raises(ValueError):
        tq.triton_qgemm(wide, w)
    with pytest.raises(ValueError):
        tq.triton_qgemm(wide[:, :64], w, tq.QGemmConfig(16, 16, 128))  # block_k does not divide K


def test_pick_config_divides_k():
    for k in (32, 96, 4096, 11008, 14336):
        for m in (1, 16, 40, 300):
            cfg = tq.pick_config(m, 4096, k, 4)
            assert k % cfg.block_k == 0 and cfg.block_k % 32 == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("fmt", FORMATS)
def test_qgemm_on_cuda(fmt, M, dtype):
    x = activations(M, 1024, dtype)
    w = make_weight(fmt, 768, 1024)
    got = tq.triton_qgemm(x, w)
    ref = reference(x, w)
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), ref, **tol)


@pytest.mark.gpu
def test_qgemm_replays_in_a_cuda_graph():
    """No host sync: a decode step's projection captures as a CUDA graph."""
    w = make_weight("q4_g32_f16_bias", 256, 512)
    static_x = activations(4, 512, torch.float16)
    tq.triton_qgemm(static_x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tq.triton_qgemm(static_x, w)
    x2 = activations(4, 512, torch.float16, seed=9)
    static_x.copy_(x2)
    graph.replay()
    torch.testing.assert_close(out.float(), reference(x2, w), **TOL[torch.float16])


@pytest.mark.parametrize("fmt", ["q4_g32_f16_bias", "q8_g16_f32"])
def test_qgemm_with_a_column_permutation(fmt):
    """An act-order weight (`QuantWeight.perm`): the kernel reads x's columns in the stored order."""
    w = make_weight(fmt, 48, 96)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(2)).to(DEV)
    w = QuantWeight(w.qweight, w.scales, w.biases, w.bits, w.group_size, perm)
    check(activations(5, 96), w)

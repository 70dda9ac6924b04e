"""The CPU quantized-weight kernel (`torch.ops.radixray.qgemm`, kernels/csrc/qgemm.cpp) against the
reference, F.linear over `QuantWeight.dequantize()` computed in float64, for every block format
the engine computes: 4-bit G=32 with float16 scale and bias (GGUF Q4_0/Q4_1, our int4), 4-bit
G=32 float32 scale and bias (Q4_K), 8-bit G=32 float16 scale (Q8_0), 8-bit G=32 float32 scale and
bias (Q5_K, codes 0..31), 8-bit G=16 float32 scale (Q6_K, codes -32..31), 8-bit per channel
float16 scale (our int8), a 4-bit G=64 group spanning two blocks, and 8-bit G=48 (groups that
split 32-blocks).

Tolerance, with S = |x| @ |W|^T (the scale of each output): x is quantized to int16 per 32-element
block (dx = max|x|/32767, rounding error <= dx/2 per element) for every row count, so
|y - ref| <= 0.5 * dx @ |scale * q|^T (the bias term uses x's exact group sums) + 2e-6 S.
An output element's bits depend on its row of x and its column of W only: not on the row count,
the other rows, nor the other columns of the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.quant import (
    QuantLinear,
    QuantWeight,
    pack_nibbles,
    qgemm,
    quantize_int4,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None,
                                reason="CPU kernels disabled (RADIXRAY_CPU_KERNELS=0) or not buildable here")
ops = torch.ops.radixray

# name: (bits, group size (0: per channel), scale dtype, biased, code range [lo, hi))
FORMATS = {
    "q4_1": (4, 32, torch.float16, True, (0, 16)),
    "q4_k": (4, 32, torch.float32, True, (0, 16)),
    "q4_g64": (4, 64, torch.float16, True, (0, 16)),
    "q8_0": (8, 32, torch.float16, False, (-128, 128)),
    "q5_k": (8, 32, torch.float32, True, (0, 32)),
    "q6_k": (8, 16, torch.float32, False, (-32, 32)),
    "q8_g48": (8, 48, torch.float16, True, (-128, 128)),
    "int8": (8, 0, torch.float16, False, (-127, 128)),
}


def make_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    bits, g, sdt, biased, (lo, hi) = FORMATS[fmt]
    g = g or k
    codes = torch.randint(lo, hi, (n, k), generator=gen)
    scales = ((torch.rand(n, k // g, generator=gen) * 0.02 + 0.002) / (hi - lo) * 16).to(sdt)
    biases = (-(torch.rand(n, k // g, generator=gen) * 0.1)).to(sdt) if biased else None
    q = pack_nibbles(codes) if bits == 4 else codes.to(torch.int8)
    return QuantWeight(q, scales, biases, bits, g)


def run(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return ops.qgemm(x, w.qweight, w.scales, w.biases, w.bits, w.group_size, w.out_features)


def check_against_reference(y: torch.Tensor, x: torch.Tensor, w: QuantWeight) -> None:
    wd = w.dequantize()
    ref = x.double() @ wd.double().T
    scale = x.abs() @ wd.abs().T  # (bounds in float32: their own rounding is far below 1%)
    sq = (w.codes().float().view(w.out_features, -1, w.group_size)
          * w.scales.float().unsqueeze(2)).view(w.out_features, -1)
    dx = x.view(x.shape[0], -1, 32).abs().amax(dim=2) / 32767
    bound = 2e-6 * scale.double() + 0.5 * 1.01 * (dx.repeat_interleave(32, dim=1) @ sq.abs().T).double() + 1e-30
    err = (y.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the bound"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n, k, rows", [(193, 576, (1, 3, 8, 17, 64, 300)), (75, 1536, (1, 3, 17, 300)),
                                         (1030, 576, (1, 8, 17, 64))])  # the last: an LM head's shape
def test_qgemm_matches_the_reference(fmt, n, k, rows):
    gen = torch.Generator().manual_seed(n + k)
    w = make_weight(fmt, n, k, gen)
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        y = run(x, w)
        assert y.shape == (m, n) and y.dtype == torch.float32
        check_against_reference(y, x, w)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q6_k", "q8_g48"])
def test_a_row_does_not_depend_on_the_row_count_or_the_other_rows(fmt):
    """A row gives the same bits alone as inside any batch, wherever it sits: the row counts span
    the row tiles, the rows quantized per call and the old small/large split (16)."""
    gen = torch.Generator().manual_seed(7)
    w = make_weight(fmt, 203, 576, gen)  # 203: a last tile of 3 columns
    probe = torch.randn(1, 576, generator=gen)
    alone = run(probe, w)[0]
    for m in (1, 2, 3, 4, 5, 16, 17, 64, 300):
        for at in {0, m // 2, m - 1}:
            x = torch.randn(m, 576, generator=gen)
            x[at] = probe[0]
            assert torch.equal(run(x, w)[at], alone), (m, at)


def test_a_column_does_not_depend_on_the_other_columns():
    """Columns computed alone or inside a wider weight (a fused qkv) give the same bits."""
    gen = torch.Generator().manual_seed(1)
    w = make_weight("q4_1", 150, 576, gen)
    x = torch.randn(20, 576, generator=gen)
    full = run(x, w)
    for idx in (torch.arange(1), torch.arange(3, 10), torch.arange(77, 150), torch.tensor([5, 149, 0])):
        assert torch.equal(run(x, w.select_rows(idx)), full[:, idx])


def test_the_thread_count_does_not_change_the_bits():
    """Threads split the columns (few rows) or the rows (many): scheduling only."""
    gen = torch.Generator().manual_seed(9)
    w = make_weight("q4_k", 130, 576, gen)
    x = torch.randn(300, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append([run(x[:m], w) for m in (1, 8, 300)])
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_strided_and_bfloat16_inputs():
    gen = torch.Generator().manual_seed(2)
    w = make_weight("q4_k", 48, 576, gen)
    for m in (2, 40):
        wide = torch.randn(m, 2 * 576, generator=gen)
        for x in (wide[:, :576], wide[:, ::2]):  # a row stride, a non-unit inner stride
            assert torch.equal(run(x, w), run(x.contiguous(), w))
        xb = wide[:, :576].bfloat16()
        assert torch.equal(run(xb, w), run(xb.float(), w))
    assert run(torch.zeros(0, 576), w).shape == (0, 48)


def test_bad_arguments_are_refused():
    w = make_weight("q4_1", 16, 64, torch.Generator().manual_seed(3))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="columns"):
        ops.qgemm(torch.randn(2, 96), w.qweight, w.scales, w.biases, 4, 32, 16)
    with pytest.raises(RuntimeError, match="group size"):
        ops.qgemm(x, w.qweight, w.scales, w.biases, 4, 16, 16)
    with pytest.raises(RuntimeError, match="codes"):
        ops.qgemm(x, w.qweight.view(torch.int8), w.scales, w.biases, 4, 32, 16)
    with pytest.raises(RuntimeError, match="scales"):
        ops.qgemm(x, w.qweight, w.scales[:, :1].contiguous(), w.biases, 4, 32, 16)


def test_quant_qgemm_dispatches_to_the_kernel():
    """kernels.quant.qgemm (what QuantLinear calls) runs the kernel on the CPU: leading dims kept,
    x's dtype returned; int8/int4 quantization at load goes through it too."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(96, 128, generator=gen) * 0.05
    x = torch.randn(2, 3, 128, generator=gen)
    for qw in (quantize_int4(w), quantize_int8(w), quantize_int8(w, 32)):
        y = qgemm(x, qw)
        assert y.shape == (2, 3, 96)
        assert torch.equal(y.view(6, 96), run(x.view(6, 128), qw))
        torch.testing.assert_close(y, F.linear(x, qw.dequantize()), atol=0.02, rtol=0.02)
        assert qgemm(x.bfloat16(), qw).dtype == torch.bfloat16
    parts = [quantize_int4(w[:40]), quantize_int8(w[40:])]  # two formats: two kernel calls
    lin = QuantLinear(parts, bias=torch.ones(96))
    want = F.linear(x, torch.cat([p.dequantize() for p in parts]), torch.ones(96))
    torch.testing.assert_close(lin(x), want, atol=0.02, rtol=0.02)


def test_qgemm_is_one_opaque_node_under_torch_compile():
    """fullgraph tracing through kernels.quant.qgemm: the operator and its fake (aot_eager runs
    the traced graph as inductor's would call the operator, without the C++ codegen's seconds)."""
    gen = torch.Generator().manual_seed(5)
    qw = make_weight("q4_1", 40, 64, gen)

    def f(x: torch.Tensor) -> torch.Tensor:
        return qgemm(x, qw) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=False, backend="aot_eager")
    for m in (1, 20):
        x = torch.randn(m, 64, generator=gen)
        assert torch.equal(compiled(x), f(x))


def test_a_column_permutation_is_one_gather_of_x():
    """A weight stored with its input columns permuted (GPTQ act-order, `QuantWeight.perm`):
    qgemm gathers x's columns once and runs the kernel on the stored weight, bit for bit what
    the unpermuted weight gives on the gathered x; `dequantize` undoes the permutation; row
    selections, fusion and moves keep it; a column split must not cut through it."""
    gen = torch.Generator().manual_seed(6)
    base = make_weight("q4_1", 96, 128, gen)
    perm = torch.randperm(128, generator=gen)
    w = QuantWeight(base.qweight, base.scales, base.biases, 4, 32, perm)
    x = torch.randn(2, 3, 128, generator=gen)
    y = qgemm(x, w)
    assert torch.equal(y.view(6, 96), run(x.view(6, 128)[:, perm], base))
    want = torch.empty(96, 128)
    want[:, perm] = base.dequantize()
    assert torch.equal(w.dequantize(), want) and torch.equal(w.dequantize_rows(torch.tensor([3, 5])), want[[3, 5]])
    torch.testing.assert_close(y, F.linear(x, w.dequantize()), atol=0.02, rtol=0.02)
    assert w.nbytes() == base.nbytes() + 128 * 8 and torch.equal(w.to(torch.device("cpu")).perm, perm)
    lin = QuantLinear([w.select_rows(slice(0, 40)), w.select_rows(slice(40, 96))])
    assert len(lin.parts) == 1 and torch.equal(lin(x), y)  # same permutation: fused
    other = QuantWeight(base.qweight, base.scales, base.biases, 4, 32, torch.arange(128))
    lin = QuantLinear([w.select_rows(slice(0, 40)), other.select_rows(slice(40, 96))])
    assert len(lin.parts) == 2 and torch.equal(lin(x)[..., :40], y[..., :40])
    with pytest.raises(ValueError, match="act-order"):
        w.select_cols(0, 64)
    halves = torch.cat([torch.randperm(64, generator=gen), 64 + torch.randperm(64, generator=gen)])
    closed = QuantWeight(base.qweight, base.scales, base.biases, 4, 32, halves)
    right = closed.select_cols(64, 128)  # its stored columns [64, 128) are inputs [64, 128)
    assert torch.equal(right.dequantize(), closed.dequantize()[:, 64:])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_no_rows_looked_up(fmt):
    """An embedding lookup of no ids (an IDLE batch under attention-DP) is [0, K]."""
    w = make_weight(fmt, 16, 64, torch.Generator().manual_seed(8))
    assert w.dequantize_rows(torch.zeros(0, dtype=torch.long)).shape == (0, 64)


@pytest.mark.parametrize("fmt", ["q4_1", "int8", "q8_0", "q6_k", "q8_g48"])
@pytest.mark.parametrize("k", [192, 288, 384, 480, 1536])
def test_every_block_count_is_row_invariant_and_accurate(fmt, k):
    """Block counts 6, 9, 12, 15 and 48 span how the kernel packs a row's blocks into vectors
    (whole and padded groups of 2 and 4 blocks): a row gives the same bits alone as inside batches of
    2, 5, 17 and 32 rows, for an odd column count, with and without biases, within the bound."""
    gen = torch.Generator().manual_seed(k)
    w = make_weight(fmt, 37, k, gen)
    probe = torch.randn(1, k, generator=gen)
    alone = run(probe, w)[0]
    for m in (2, 5, 17, 32):
        x = torch.randn(m, k, generator=gen)
        at = m // 2
        x[at] = probe[0]
        y = run(x, w)
        assert torch.equal(y[at], alone), (m, at)
        check_against_reference(y, x, w)

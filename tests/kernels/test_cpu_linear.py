"""kernels/cpu_linear.py: the packed linears (oneDNN's, the project's GEMM) against F.linear, and
backend selection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig
from engine.errors import ConfigError
from engine.model_runner import resolve_linear, use_onednn
from kernels.cpu_linear import Linear, native_linear_works, onednn_linear_works

needs_onednn = pytest.mark.skipif(not onednn_linear_works(torch.float32), reason="no oneDNN linear in this build")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("shape", [(48, 40), (512, 96), (7, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_f_linear(rows, shape, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(*shape, generator=gen)
    b = torch.randn(shape[0], generator=gen) if bias else None
    x = torch.randn(rows, shape[1], generator=gen)
    lin = Linear(w, b, onednn=True)
    assert lin.weight is None and lin.packed is not None  # only the packed copy is kept
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    # A strided view (the model passes slices) gives the same result.
    wide = torch.randn(rows, 2 * shape[1], generator=gen)
    torch.testing.assert_close(lin(wide[:, ::2]), F.linear(wide[:, ::2], w, b), atol=1e-5, rtol=1e-5)
    assert lin.numel() == w.numel() + (0 if b is None else b.numel())


@pytest.mark.skipif(not native_linear_works(torch.float32), reason="the project's GEMM needs AVX-512")
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_native_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    lin = Linear(w, b, kind="native")
    assert lin.weight is None and lin.packed is None and lin.kind == "native"
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not onednn_linear_works(torch.bfloat16), reason="no bfloat16 oneDNN linear in this build")
@pytest.mark.parametrize("kind", ["onednn", "native"])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linears_few_and_many_rows(kind, rows, bias):
    """oneDNN's bfloat16 GEMM is several times slower for one to three rows than for four: a
    "native" bfloat16 linear runs those rows in the project's kernel (AVX512-BF16) and keeps
    oneDNN's weight for more; a "onednn" one pads them to four. Both give oneDNN's result within
    bfloat16 rounding."""
    from kernels.cpu_linear import NATIVE_BF16_MAX_ROWS

    if kind == "native" and not native_linear_works(torch.bfloat16):
        pytest.skip("no AVX512-BF16 here")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 64, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    lin = Linear(w, b, kind=kind)
    assert lin.kind == kind and lin.packed is not None and (lin.panels is not None) == (kind == "native")
    assert lin.pad_rows == (0 if kind == "native" else 4)
    got = lin(x)
    assert got.shape == (rows, 80) and got.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, atol=0.07, rtol=1e-2)
    if 0 < rows <= NATIVE_BF16_MAX_ROWS:  # against oneDNN's own rows
        many = lin(torch.cat([x, x.new_zeros(NATIVE_BF16_MAX_ROWS + 1, 64)]))[:rows]
        torch.testing.assert_close(got, many, atol=0.07, rtol=1e-2)


def test_torch_linear_is_f_linear():
    w, x = torch.randn(8, 4), torch.randn(2, 4)
    lin = Linear(w)
    assert lin.packed is None
    assert torch.equal(lin(x), F.linear(x, w))


def test_backend_selection():
    cpu = torch.device("cpu")
    assert use_onednn("torch", cpu, torch.float32) is False
    native, onednn = native_linear_works(torch.float32), onednn_linear_works(torch.float32)
    assert resolve_linear("auto", cpu, torch.float32) == ("native" if native else "onednn" if onednn else "torch")
    bf16 = "native" if native_linear_works(torch.bfloat16) else "onednn" if onednn_linear_works(torch.bfloat16) \
        else "torch"
    assert resolve_linear("auto", cpu, torch.bfloat16) == bf16
    assert resolve_linear("auto", cpu, torch.float16) == "torch"  # no packed fp16 path: F.linear
    assert resolve_linear("auto", torch.device("cuda"), torch.bfloat16) == "torch"
    for backend in ("onednn", "native"):
        with pytest.raises(ConfigError, match="device='cpu'"):
            resolve_linear(backend, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ConfigError, match="float16"):
        use_onednn("onednn", cpu, torch.float16)
    with pytest.raises(ConfigError, match="AVX-512"):
        resolve_linear("native", cpu, torch.float16)
    with pytest.raises(ConfigError, match="linear_backend"):
        EngineConfig(linear_backend="mkl")

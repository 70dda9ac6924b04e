"""kernels/cpu_linear.py: oneDNN's prepacked linear against F.linear, and backend selection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig
from engine.errors import ConfigError
from engine.model_runner import use_onednn
from kernels.cpu_linear import Linear, onednn_linear_works

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


def test_torch_linear_is_f_linear():
    w, x = torch.randn(8, 4), torch.randn(2, 4)
    lin = Linear(w)
    assert lin.packed is None
    assert torch.equal(lin(x), F.linear(x, w))


def test_backend_selection():
    cpu = torch.device("cpu")
    assert use_onednn("torch", cpu, torch.float32) is False
    assert use_onednn("auto", cpu, torch.float32) == onednn_linear_works(torch.float32)
    assert use_onednn("auto", cpu, torch.float16) is False  # no packed fp16 path: F.linear
    assert use_onednn("auto", torch.device("cuda"), torch.bfloat16) is False
    with pytest.raises(ConfigError, match="device='cpu'"):
        use_onednn("onednn", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ConfigError, match="float16"):
        use_onednn("onednn", cpu, torch.float16)
    with pytest.raises(ConfigError, match="linear_backend"):
        EngineConfig(linear_backend="mkl")

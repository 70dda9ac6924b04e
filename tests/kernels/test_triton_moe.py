"""kernels/triton_moe.py: the expert alignment and the fused-MoE grouped GEMM vs their torch
references (TRITON_INTERPRET=1 on the CPU, see conftest; on the device where CUDA is there)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernels import triton_moe as tm  # noqa: E402
from kernels.moe import moe_ref, select_experts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def problem(T: int, E: int, k: int, H: int, inter: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.15
    w2 = torch.randn(E, H, inter, generator=g) * 0.15
    weights, ids = select_experts(torch.randn(T, E, generator=g), k, renormalize=True)
    return [t.to(DEV) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("T, E, k, block_m", [(1, 4, 1, 16), (5, 8, 2, 16), (37, 6, 3, 16), (40, 3, 2, 32)])
def test_align_by_expert(T, E, k, block_m):
    *_, ids = problem(T, E, k, 8, 8, seed=T)
    sorted_pairs, block_experts, num_padded = tm.align_by_expert(ids, E, block_m)
    n = T * k
    total = int(num_padded)
    assert total % block_m == 0 and sorted_pairs.numel() >= total and block_experts.numel() * block_m == sorted_pairs.numel()
    real = sorted_pairs[:total].cpu()
    assert sorted(real[real < n].tolist()) == list(range(n))  # every pair exactly once
    assert bool((sorted_pairs[total:] == n).all())  # past the total: padding only
    flat = ids.reshape(-1).cpu()
    for b in range(total // block_m):
        tile = real[b * block_m:(b + 1) * block_m]
        tile = tile[tile < n]
        assert bool((flat[tile.long()] == int(block_experts[b])).all())  # one expert per tile
        assert tile.tolist() == sorted(tile.tolist())  # pair order within an expert


@pytest.mark.parametrize("T, E, k", [(1, 4, 1), (5, 8, 2), (19, 4, 3)])
def test_fused_moe_matches_references(T, E, k):
    x, w13, w2, weights, ids = problem(T, E, k, 64, 32, seed=T + E)
    got = tm.fused_moe(x, w13, w2, weights, ids, block_m=16)
    torch.testing.assert_close(got, tm.fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.cpu(), moe_ref(*(t.cpu() for t in (x, weights, ids, w13, w2))),
                               atol=1e-5, rtol=1e-4)


def test_fused_moe_empty_experts_and_no_tokens():
    x, w13, w2, weights, _ = problem(6, 8, 2, 32, 16, seed=3)
    ids = torch.tensor([[1, 2], [2, 1], [1, 5], [5, 2], [2, 5], [1, 2]], device=x.device)  # 5 of 8 idle
    torch.testing.assert_close(tm.fused_moe(x, w13, w2, weights, ids, block_m=16),
                               tm.fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-4)
    assert tm.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, k", [(1, 16, 2), (300, 16, 2), (1000, 64, 8)])
def test_fused_moe_on_cuda(T, E, k, dtype):
    x, w13, w2, weights, ids = problem(T, E, k, 256, 128, seed=T, dtype=dtype)
    got = tm.fused_moe(x, w13, w2, weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), tm.fused_moe_ref(x, w13, w2, weights, ids).float(), atol=tol, rtol=tol)


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph():
    """No host sync inside: the routing, alignment and both GEMMs capture as one CUDA graph."""
    x, w13, w2, weights, ids = problem(8, 16, 2, 128, 64, seed=1)
    static_x, static_w, static_ids = x.clone(), weights.clone(), ids.clone()
    tm.fused_moe(static_x, w13, w2, static_w, static_ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tm.fused_moe(static_x, w13, w2, static_w, static_ids)
    x2, _, _, w_2, ids2 = problem(8, 16, 2, 128, 64, seed=2)
    static_x.copy_(x2)
    static_w.copy_(w_2)
    static_ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(out, tm.fused_moe_ref(x2, w13, w2, w_2, ids2), atol=1e-4, rtol=1e-4)

"""Triton fused mixture-of-experts for the GPU: a grouped GEMM over the (token, k) pairs sorted
by expert, in the style of SGLang's and vLLM's fused_moe, with a plain-torch reference beside it
(the tests compare them, on the CPU under TRITON_INTERPRET=1 and on a GPU).

  align_by_expert  the pairs grouped by expert, each group padded to a multiple of BLOCK_M, so a
                   BLOCK_M tile of rows belongs to one expert; computed with device ops only and
                   static shapes (no host sync: a decode step replays as a CUDA graph)
  fused_moe        tile GEMM 1: x[token] @ w13[e].T -> [pairs, 2I]; silu(gate) * up (torch);
                   tile GEMM 2: act @ w2[e].T * routing weight -> [pairs, H]; sum over k.
Each pair is written by exactly one tile, and the k terms of a token are summed in k order
afterwards: no atomics, deterministic, and transformers' order of additions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.moe import expert_counts


@triton.jit
def _moe_gemm_kernel(a, w, c, pair_weights, sorted_pairs, block_experts, num_padded, num_pairs, rows_per_a,
                     N, K, stride_am, stride_we, stride_wn, stride_cm,
                     MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[pair, n-tile] = a[pair // rows_per_a] @ w[expert].T (x the pair's routing weight)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(num_padded):  # tiles past the padded total have no rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs + offs_m)
        valid = pairs < num_pairs  # padding rows hold num_pairs
        rows = (pairs // rows_per_a).to(tl.int64)
        e = tl.load(block_experts + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            km = offs_k < K
            at = tl.load(a + rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & km[None, :],
                         other=0.0)
            wt = tl.load(w + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                         mask=km[:, None] & nm[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] of w[e].T
            acc += tl.dot(at, wt, input_precision=PRECISION)
        if MUL_WEIGHT:
            acc = acc * tl.load(pair_weights + pairs, mask=valid, other=0.0)[:, None]
        tl.store(c + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c.dtype.element_ty),
                 mask=valid[:, None] & nm[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, counts: torch.Tensor | None = None,
                    held: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (sorted_pairs, block_experts, num_padded).

    sorted_pairs [P]: pair indices (t * k + j) grouped by expert, each expert's group padded with
    the value T * k to a multiple of block_m; P bounds the padded total from the shapes alone.
    block_experts [P / block_m]: the expert of each tile. num_padded [1]: the real padded total
    (tiles at or past it are skipped). `counts` = expert_counts(ids) when the caller has it. With
    `held`, experts >= held are pairs to leave out (they sort last, past num_padded)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    if counts is None:
        counts = expert_counts(ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]  # place in its group
    # At most min(n, E) experts are active, each padding fewer than block_m rows.
    blocks = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m)
    sorted_pairs = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_pairs[(ends - padded)[sorted_e] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(blocks, device=dev) * block_m
    block_experts = torch.searchsorted(ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    held = num_experts if held is None else held
    return sorted_pairs, block_experts.to(torch.int32), ends[held - 1:held].to(torch.int32)



def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pair_weights: torch.Tensor | None,
                  aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_pairs: int, rows_per_a: int,
                  block_m: int) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    n_out, k_in = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k_in)))
    grid = (block_experts.numel(), triton.cdiv(n_out, block_n))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (no TF32 rounding)
    _moe_gemm_kernel[grid](a, w, out, pair_weights if pair_weights is not None else out, sorted_pairs,
                           block_experts, num_padded, num_pairs, rows_per_a, n_out, k_in, a.stride(0),
                           w.stride(0), w.stride(1), out.stride(0), MUL_WEIGHT=pair_weights is not None,
                           PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              block_m: int = 64, counts: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """sum_k weights[t, k] * expert[ids[t, k]](x[t]) -> [T, H]. x [T, H]; w13 [E, 2I, H] (gate
    rows then up rows), w2 [E, H', I], both contiguous, of experts first .. first + E - 1 (expert
    parallelism: the experts one member holds; pairs routed to others add nothing); weights
    [T, k] float32; ids [T, k]; `counts` = expert_counts(ids) over every expert when the caller
    has it."""
    T, top_k = ids.shape
    held, two_i, _ = w13.shape
    if T == 0:
        return x.new_zeros(0, w2.shape[1])
    num_pairs = T * top_k
    block_m = max(16, min(block_m, triton.next_power_of_2(num_pairs)))  # tl.dot needs >= 16
    partial = first > 0 or counts is None or counts.numel() > held
    if partial:  # another member's pairs go to a bucket past the held experts, whose tiles are skipped
        local = ids - first
        local = torch.where((local >= 0) & (local < held), local, held)
        aligned = align_by_expert(local, held + 1, block_m, held=held)
    else:
        aligned = align_by_expert(ids, held, block_m, counts)
    x = x.contiguous()
    gate_up = x.new_empty(num_pairs, two_i)
    _grouped_gemm(x, w13, gate_up, None, aligned, num_pairs, top_k, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = (x.new_zeros if partial else x.new_empty)(num_pairs, w2.shape[1])
    _grouped_gemm(act, w2, out, weights.reshape(-1).float().contiguous(), aligned, num_pairs, 1, block_m)
    return out.view(T, top_k, -1).sum(dim=1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """fused_moe in plain torch (float32 math), one masked pass per expert."""
    T, top_k = ids.shape
    out = torch.zeros(T, top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        t, j = torch.where(ids == e)
        if t.numel():
            gate, up = (x[t].float() @ w13[e].float().T).chunk(2, dim=-1)
            out[t, j] = (F.silu(gate) * up) @ w2[e].float().T * weights[t, j, None].float()
    return out.sum(dim=1).to(x.dtype)

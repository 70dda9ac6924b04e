"""Mixture-of-experts pieces that know nothing of models: top-k routing and per-expert token
counts (every device), the grouped CPU forward (one GEMM pair per active expert) and the naive
per-token reference. The GPU forward is kernels/triton_moe.py.

An expert is a gated MLP: down(silu(gate(x)) * up(x)), gate and up fused into one projection
whose first half is the gate. The (token, k) pairs of a step are sorted by expert once; each
active expert runs its two projections over its contiguous rows; the rows are weighted, put back
in pair order and summed over k. That is transformers' default ("grouped_mm") order of operations,
so float32 results agree with it to the rounding of the GEMMs themselves."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.cpu_linear import Linear


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64): softmax
    over all experts in float32, the top k (largest first), divided by their sum if `renormalize`
    (Mixtral always; Qwen-MoE and OLMoE with norm_topk_prob)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(token, k) pairs per expert [E] int64. A scatter, not bincount: no host sync on CUDA."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def grouped_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                experts: Sequence[tuple[Linear, Linear]], counts: torch.Tensor | None = None,
                first: int = 0) -> torch.Tensor:
    """sum_k weights[t, k] * expert[ids[t, k]](x[t]) -> [T, out]. `experts[j]` = (gate_up, down)
    of expert first + j: with `first` or fewer experts than ids name (expert parallelism: the
    experts one member holds), pairs routed to other experts add nothing. `counts` =
    expert_counts(ids) over every expert when the caller has it. Loops over active experts, not tokens."""
    T, K = ids.shape
    out_features = experts[0][1].out_features
    if T == 0:
        return x.new_zeros(0, out_features)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within one
    if counts is None:
        counts = expert_counts(ids, max(first + len(experts), int(flat.max()) + 1))
    n_per = counts.tolist()
    lo = sum(n_per[:first])  # the sorted pairs of the experts held: [lo, hi)
    hi = lo + sum(n_per[first:first + len(experts)])
    local = order[lo:hi]
    xs = x[local // K]  # each held pair's token row
    ys = x.new_zeros(T * K, out_features) if hi - lo < T * K else x.new_empty(T * K, out_features)
    start = lo
    for j, (gate_up, down) in enumerate(experts):
        n = n_per[first + j]
        if n:
            gate, up = gate_up(xs[start - lo:start - lo + n]).chunk(2, dim=-1)
            ys[start:start + n] = down(F.silu(gate, inplace=True).mul_(up))
            start += n
    ys[lo:hi].mul_(weights.reshape(-1)[local].unsqueeze(1).to(ys.dtype))
    # Back to pair order, then summed over k in k order: transformers' grouped path does the same
    # (an index_add_ in expert order would add a token's k >= 3 terms in another order).
    out = torch.empty_like(ys)
    out[order] = ys
    return out.view(T, K, out_features).sum(dim=1)


def moe_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor) -> torch.Tensor:
    """The naive reference: per token, per chosen expert, in float32. w13 [E, 2I, H] (gate rows
    then up rows), w2 [E, H, I]."""
    T, K = ids.shape
    out = torch.zeros(T, w2.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += float(weights[t, k]) * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)

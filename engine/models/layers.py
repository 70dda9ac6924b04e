"""Blocks the model files are built from: RMSNorm, RoPE, attention, the gated MLP, the sparse
mixture-of-experts MLP, a pre-norm decoder layer, and the CPU row blocking of per-token work.

Weights are plain tensors and `kernels.cpu_linear.Linear` projections (no nn.Module). Numerics
follow transformers (RMSNorm in float32, rotate-half RoPE with the same inverse frequencies), so
greedy tokens match it exactly in float32."""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from kernels.cpu_linear import Linear, LinearKind
from kernels.lora import LoRABatchInfo, LoRAWeights, sgmv, slice_batch_info
from kernels.moe import expert_counts, grouped_moe, select_experts
from kernels.quant import QuantLinear, QuantWeight

# Long prefills on the CPU run the per-token parts of a layer (norms, projections, RoPE, MLP) in
# blocks of this many rows, so their intermediates (the MLP's [rows, 2 x intermediate] above
# all) stay in cache instead of streaming and page-faulting hundreds of MB per layer.
CPU_ROW_BLOCK = 512


def row_blocks(rows: int, device: torch.device) -> list[slice]:
    """CPU_ROW_BLOCK-row slices for long CPU inputs; else one slice over all rows."""
    if device.type != "cpu" or rows <= CPU_ROW_BLOCK:
        return [slice(None)]
    return [slice(s, s + CPU_ROW_BLOCK) for s in range(0, rows, CPU_ROW_BLOCK)]


def add_lora(y: torch.Tensor, x: torch.Tensor, w: LoRAWeights | None,
             info: LoRABatchInfo | None) -> torch.Tensor:
    """y (a projection's output for rows x) plus the LoRA update of each row's adapter (in place),
    when the batch has adapter rows and the projection has adapter slots."""
    if info is not None and w is not None:
        sgmv(y, x, w, info)
    return y


def make_linear(parts: torch.Tensor | QuantWeight | list[torch.Tensor | QuantWeight],
                bias: torch.Tensor | None = None, kind: LinearKind = "torch") -> Linear | QuantLinear:
    """One projection over the weights `parts` stacked by rows (a fused q/k/v or gate/up): a
    `QuantLinear` if they are all quantized, else a `Linear` of `kind` (quantized parts beside
    float ones are dequantized into the float parts' dtype)."""
    parts = parts if isinstance(parts, list) else [parts]
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantLinear(parts, bias)
    dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
    dense = [p.dequantize(dtype) if isinstance(p, QuantWeight) else p for p in parts]
    return Linear(dense[0] if len(dense) == 1 else torch.cat(dense), bias, kind=kind)


def embed_tokens(ids: torch.Tensor, table: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the embedding table (a quantized table dequantizes just those rows)."""
    if isinstance(table, QuantWeight):
        return table.dequantize_rows(ids, dtype)
    return F.embedding(ids, table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math
    dtype = x.dtype
    x = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """transformers' inverse frequencies: default, `linear` or `llama3` scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) & ~(wavelen > old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = roll(x, half) * [-1.., +1..] folded
    into `sin_signed` (bit-identical: negation is exact)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class RoPE:
    """cos and sign-folded sin tables for positions [0, max_positions), on the model's device."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, :head_dim // 2] = -sin[:, :head_dim // 2]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin_signed = sin.to(device=device, dtype=dtype)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) [T, 1, head_dim] for apply_rope over [T, heads, head_dim]."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


class Attention:
    """The projections around the attention backend: a fused q/k/v projection (optional bias),
    optional per-head q/k RMSNorm (Qwen3), RoPE on q and k, and the o-projection."""

    def __init__(self, qkv: Linear | QuantLinear, o: Linear | QuantLinear, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> None:
        self.qkv_proj, self.o_proj = qkv, o
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.qkv_heads = num_heads + 2 * num_kv_heads
        self.q_norm, self.k_norm = q_norm, k_norm
        # LoRA adapter slots of the two projections (engine.lora's pool; None: not adapted)
        self.lora_qkv: LoRAWeights | None = None
        self.lora_o: LoRAWeights | None = None

    def unroped_qkv(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """Normed hidden states [T, H] -> q, k, v as one [T, qkv_heads, head_dim] tensor, before
        RoPE (q/k norms applied); `lora`: the adapters of x's rows."""
        nq, nkv = self.num_heads, self.num_kv_heads
        qkv = add_lora(self.qkv_proj(x), x, self.lora_qkv, lora)
        qkv = qkv.view(x.shape[0], self.qkv_heads, self.head_dim)
        if self.q_norm is not None:
            qkv[:, :nq + nkv] = torch.cat([rms_norm(qkv[:, :nq], self.q_norm, self.eps),
                                           rms_norm(qkv[:, nq:nq + nkv], self.k_norm, self.eps)], dim=1)
        return qkv

    def roped_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """Normed hidden states [T, H] -> q, k, v as one [T, qkv_heads, head_dim] tensor, q and k roped."""
        qkv = self.unroped_qkv(x, lora)
        nqk = self.num_heads + self.num_kv_heads
        qkv[:, :nqk] = apply_rope(qkv[:, :nqk], cos, sin)  # q and k in one pass
        return qkv

    def out_proj(self, o: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """The o-projection of attention outputs o [T, q_size] (plus the rows' adapters)."""
        return add_lora(self.o_proj(o), o, self.lora_o, lora)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)

    def numel(self) -> int:
        norms = [t for t in (self.q_norm, self.k_norm) if t is not None]
        return self.qkv_proj.numel() + self.o_proj.numel() + sum(t.numel() for t in norms)


# How attention-DP splits an MoE MLP over the group: each member holds E/G whole experts, or a
# 1/G slice of every expert's intermediate dim (the dense split).
MoESplit = Literal["experts", "intermediate"]
# One projection of every expert: stacked float [E, out, in], or one QuantWeight per expert.
ExpertWeights = torch.Tensor | list[QuantWeight]


class GroupComm(Protocol):
    """attention-DP's collectives as the MLPs use them (engine.dp.DPComm)."""

    world: int
    moe_all_to_all: bool  # expert parallelism dispatches by all-to-all (else gather + reduce)

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor: ...

    def exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor: ...

    def gather_lora(self, info: LoRABatchInfo | None, rows: int) -> LoRABatchInfo | None: ...


class TPReduce(Protocol):
    """Tensor parallelism's reduction as the layers use it (engine.tp.TPGroup)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


class MLP(Protocol):
    """A layer's MLP slot: [T, H] -> [T, H] over the rows it is given. Under attention-DP the layer
    calls `split_forward` instead: this member's rows in, their outputs out, with whatever
    collectives the MLP's split over the group needs (none for an MLP every member holds whole).
    `lora`: the adapters of this member's rows; `group_lora`: those of every member's rows
    (`GroupComm.gather_lora`), for an MLP that computes the group's rows."""

    def __call__(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor: ...

    def split_forward(self, x: torch.Tensor, comm: GroupComm, lora: LoRABatchInfo | None = None,
                      group_lora: LoRABatchInfo | None = None) -> torch.Tensor: ...

    def numel(self) -> int: ...


def shard_range(size: int, shard: tuple[int, int], what: str = "intermediate_size") -> tuple[int, int]:
    """[lo, hi) of member `rank` of `world` over a dim of `size`."""
    rank, world = shard
    if size % world:
        raise ConfigError(f"{what} {size} is not divisible by the DP group size {world}")
    return rank * size // world, (rank + 1) * size // world


def _rows(w: torch.Tensor | QuantWeight, lo: int, hi: int) -> torch.Tensor | QuantWeight:
    return w.select_rows(slice(lo, hi)) if isinstance(w, QuantWeight) else w[lo:hi]


def _splits_cleanly(w: QuantWeight, lo: int, hi: int) -> bool:
    """Whether input columns [lo, hi) of `w` can be taken in its block format."""
    return w.perm is None and all(c % w.group_size == 0 and c % 32 == 0 for c in (lo, hi))


def _cols(w: torch.Tensor | QuantWeight, lo: int, hi: int) -> torch.Tensor | QuantWeight:
    if not isinstance(w, QuantWeight):
        return w[:, lo:hi].contiguous()
    try:
        return w.select_cols(lo, hi)
    except ValueError as e:  # a split inside a group, or across act-order's permuted groups
        raise ConfigError(f"down_proj cannot be split for attention-DP's MLP shard [{lo}, {hi}) while kept "
                          f"quantized ({e}); load it with quantization='none'") from None


class GatedMLP:
    """down(silu(gate(x)) * up(x)), gate and up fused into one projection; holds the `shard`
    (rank, world) slice of the intermediate dim."""

    def __init__(self, gate: torch.Tensor | QuantWeight, up: torch.Tensor | QuantWeight,
                 down: torch.Tensor | QuantWeight, shard: tuple[int, int] = (0, 1),
                 linear: LinearKind = "torch") -> None:
        lo, hi = shard_range(gate.shape[0], shard)
        self.sharded = shard[1] > 1
        if self.sharded:
            gate, up = (_rows(t, lo, hi) for t in (gate, up))
            down = _cols(down, lo, hi)
        self.gate_up = make_linear([gate, up], kind=linear)
        self.down = make_linear(down, kind=linear)
        # LoRA adapter slots (engine.lora's pool; None: not adapted)
        self.lora_gate_up: LoRAWeights | None = None
        self.lora_down: LoRAWeights | None = None

    def __call__(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """`lora`: the adapters of x's rows."""
        blocks = row_blocks(x.shape[0], x.device)  # > 1 only for attention-DP's gathered rows
        if len(blocks) == 1:
            return self._rows(x, lora)
        out = x.new_empty(x.shape[0], self.down.out_features)
        for blk in blocks:
            part = None if lora is None else slice_batch_info(lora, blk.start, min(blk.stop, x.shape[0]))
            out[blk] = self._rows(x[blk], part)
        return out

    def _rows(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        gate, up = add_lora(self.gate_up(x), x, self.lora_gate_up, lora).chunk(2, dim=-1)
        h = F.silu(gate, inplace=True).mul_(up)
        return add_lora(self.down(h), h, self.lora_down, lora)

    def split_forward(self, x: torch.Tensor, comm: GroupComm, lora: LoRABatchInfo | None = None,
                      group_lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """A slice of the intermediate dim: every member's rows in (adapted by `group_lora`: each
        member holds its slice of every adapter's gate/up B and down A, so the partial sums add up
        to the whole update too), partial sums reduced back to each member's own rows. Held whole
        (a dense layer under expert parallelism): local rows only, adapted by `lora`."""
        if not self.sharded:
            return self(x, lora)
        return comm.reduce_scatter(self(comm.gather(x), group_lora))

    def numel(self) -> int:
        return self.gate_up.numel() + self.down.numel()


class MoEMLP:
    """A sparse mixture-of-experts MLP slot: a router linear scores E experts per token, the top_k
    are chosen (softmax in float32, renormalised to sum to 1 if `renormalize`), and the output is
    the routing-weighted sum of those experts, each a gated MLP with gate and up fused; plus, if
    given, a shared expert scaled by sigmoid(shared_gate(x)) (Qwen2-MoE).

    gate and up are [E, I, H], down [E, H, I] (or lists of E quantized weights of those shapes,
    computed in their block format): every expert, or with `split="experts"` only this
    member's (`shard` (rank, world) -> experts [rank * E / world, (rank + 1) * E / world)), since
    the rest are never read. Under attention-DP (`split_forward`) every member routes the whole
    group's rows with the same router and computes only what it holds: with `split="experts"` its
    experts' (token, expert) pairs (expert parallelism; the shared expert is whole and runs on the
    member's own rows), with `split="intermediate"` a slice of every expert's intermediate dim (and
    of the shared expert's, passed in sliced); the partial outputs are summed over the group.
    With `fused` (default: on CUDA, float experts) the experts run in the Triton fused kernel
    (kernels.triton_moe) over stacked weights; otherwise grouped by expert, one GEMM pair per
    active expert (kernels.moe): oneDNN or torch for float experts, the quantized kernels
    (QuantLinear: C++ on the CPU, Triton on CUDA) for quantized ones. `expert_tokens` [E], if
    given, accumulates the (token, expert) pairs this member's experts computed (on the device,
    no host sync)."""

    def __init__(self, router: torch.Tensor, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights,
                 top_k: int, renormalize: bool, shard: tuple[int, int] = (0, 1), linear: LinearKind = "torch",
                 expert_tokens: torch.Tensor | None = None, shared: GatedMLP | None = None,
                 shared_gate: torch.Tensor | None = None, fused: bool | None = None,
                 split: MoESplit = "experts") -> None:
        if split not in ("experts", "intermediate"):
            raise ConfigError(f"moe_split must be 'experts' or 'intermediate', got {split!r}")
        self.num_experts, self.top_k, self.renormalize = router.shape[0], top_k, renormalize
        if not 1 <= top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {top_k} is not in [1, num_experts={self.num_experts}]")
        self.sharded, self.split = shard[1] > 1, split
        self.first, self.last = 0, self.num_experts  # the experts held: [first, last)
        quantized = isinstance(gate, list)
        given = len(gate) if quantized else gate.shape[0]
        lo, hi = 0, gate[0].shape[0]  # the intermediate rows held
        if split == "experts":
            self.first, self.last = shard_range(self.num_experts, shard, "num_experts")
            if given == self.num_experts:  # given every expert: keep ours
                gate, up, down = (t[self.first:self.last] for t in (gate, up, down))
            elif given != self.last - self.first:
                raise ConfigError(f"{given} experts given, expected {self.last - self.first} or {self.num_experts}")
            if shared is not None and shared.sharded:
                raise ConfigError("under moe_split='experts' the shared expert is held whole")
        else:
            lo, hi = shard_range(hi, shard)
        whole = (lo, hi) == (0, gate[0].shape[0])  # (no slice: no copy)
        if quantized and not whole and not all(_splits_cleanly(d, lo, hi) for d in down):
            # a slice of down's input inside a quantization group (or act-order's spread groups):
            # the experts as float, as unquantized experts load
            gate, up, down = (torch.stack([w.dequantize(router.dtype) for w in t]) for t in (gate, up, down))
            quantized = False
        self.router = Linear(router, kind=linear)
        self.fused = (not quantized and gate.device.type == "cuda") if fused is None else fused
        if quantized:
            if self.fused:
                raise ConfigError("the fused MoE kernel takes float experts; quantized ones run grouped")
            self.experts = [(QuantLinear([g, u] if whole else [_rows(g, lo, hi), _rows(u, lo, hi)]),
                             QuantLinear(d if whole else _cols(d, lo, hi))) for g, u, d in zip(gate, up, down)]
            self.expert_numel = sum(a.numel() + b.numel() for a, b in self.experts)
        else:
            w13 = torch.cat([gate[:, lo:hi], up[:, lo:hi]], dim=1)  # per expert: gate rows, then up rows
            w2 = down[:, :, lo:hi].contiguous()
            if self.fused:
                from kernels.triton_moe import fused_moe  # triton only where this path runs

                self.fused_moe, self.w13, self.w2 = fused_moe, w13, w2
            else:
                self.experts = [(Linear(w13[e], kind=linear), Linear(w2[e], kind=linear))
                                for e in range(w13.shape[0])]
            self.expert_numel = w13.numel() + w2.numel()
        self.expert_tokens = expert_tokens
        self.shared = shared
        self.shared_gate = Linear(shared_gate, kind=linear) if shared_gate is not None else None

    def __call__(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """`lora` is ignored: an MoE layer's MLP is never adapted (adapters are refused there)."""
        out = self.routed(x)
        if self.shared is not None:
            out = out + self.shared_out(x)
        return out

    def split_forward(self, x: torch.Tensor, comm: GroupComm, lora: LoRABatchInfo | None = None,
                      group_lora: LoRABatchInfo | None = None) -> torch.Tensor:
        """This member's rows -> their outputs, the routed part computed across the group (the
        adapters are ignored: an MoE layer's MLP is never adapted)."""
        if not self.sharded:
            return self(x)
        if self.split == "intermediate":
            return comm.reduce_scatter(self(comm.gather(x)))
        if comm.moe_all_to_all:
            out = self.dispatched(x, comm)
        else:
            out = comm.reduce_scatter(self.routed(comm.gather(x)))
        if self.shared is not None:  # whole on every member: its own rows, no collective
            out = out + self.shared_out(x)
        return out

    def dispatched(self, x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
        """Expert parallelism by all-to-all: this member routes its own rows and sends each
        (token, expert) pair's row to the member holding the expert (pairs sorted by expert are
        grouped by member, and each member learns how many rows per expert it gets, so no ids
        travel); the members run their experts and send the outputs back; the routing weights
        and the sum over k are applied here, in `grouped_moe`'s order."""
        weights, ids = select_experts(self.router(x), self.top_k, self.renormalize)
        T, K = ids.shape
        world, per = comm.world, self.last - self.first
        counts = expert_counts(ids, self.num_experts)
        order = torch.argsort(ids.reshape(-1), stable=True)
        send = counts.view(world, per).sum(1).tolist()
        got = comm.exchange(counts, [per] * world, [per] * world).view(world, per)  # [source, held expert]
        recv = got.sum(1).tolist()
        rows = comm.exchange(x[order // K], send, recv)  # by source, then by expert
        held = got.sum(0)
        if self.expert_tokens is not None:
            self.expert_tokens[self.first:self.last] += held
        local_ids = torch.repeat_interleave(torch.arange(per, device=x.device).repeat(world), got.reshape(-1))
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)  # weights apply at home
        if self.fused:
            ys = self.fused_moe(rows, self.w13, self.w2, ones, local_ids.unsqueeze(1), counts=held)
        else:
            ys = grouped_moe(rows, ones, local_ids.unsqueeze(1), self.experts, held)
        ys = comm.exchange(ys, recv, send)  # this member's pairs, sorted by expert
        ys.mul_(weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype))
        out = torch.empty_like(ys)
        out[order] = ys
        return out.view(T, K, ys.shape[1]).sum(dim=1)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum over the experts held (zero rows for pairs elsewhere)."""
        weights, ids = select_experts(self.router(x), self.top_k, self.renormalize)
        counts = expert_counts(ids, self.num_experts)
        if self.expert_tokens is not None:
            self.expert_tokens[self.first:self.last] += counts[self.first:self.last]
        if self.fused:
            return self.fused_moe(x, self.w13, self.w2, weights, ids, counts=counts, first=self.first)
        return grouped_moe(x, weights, ids, self.experts, counts, first=self.first)

    def shared_out(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return shared

    def numel(self) -> int:
        n = self.router.numel() + self.expert_numel
        if self.shared is not None:
            n += self.shared.numel() + (self.shared_gate.numel() if self.shared_gate is not None else 0)
        return n


class DecoderLayer:
    """Pre-norm layer: residual += o(attention(norm(residual))); residual += mlp(norm(residual))."""

    def __init__(self, input_norm: torch.Tensor, attn: Attention, post_norm: torch.Tensor, mlp: MLP,
                 eps: float) -> None:
        self.input_norm, self.attn, self.post_norm, self.mlp, self.eps = input_norm, attn, post_norm, mlp, eps

    def attn_inputs(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    blocks: list[slice], qkv_buf: torch.Tensor | None,
                    lora: list[LoRABatchInfo] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (views of one [T, heads, head_dim] tensor) after norm, projection and RoPE;
        with `qkv_buf`, computed block by block into it. `lora`: each block's adapter rows."""
        if qkv_buf is None:
            return self.attn.split(self.attn.roped_qkv(rms_norm(residual, self.input_norm, self.eps), cos, sin,
                                                       lora[0] if lora else None))
        for j, blk in enumerate(blocks):
            qkv_buf[blk] = self.attn.roped_qkv(rms_norm(residual[blk], self.input_norm, self.eps),
                                               cos[blk], sin[blk], lora[j] if lora else None)
        return self.attn.split(qkv_buf)

    def attn_out_and_mlp(self, residual: torch.Tensor, o: torch.Tensor,
                         mlp_comm: GroupComm | None = None, tp: TPReduce | None = None,
                         lora: LoRABatchInfo | None = None, group_lora: LoRABatchInfo | None = None) -> None:
        """o-projection, post-attention norm and MLP, added into `residual` (rows of it) in place;
        with `mlp_comm` (attention-DP) the MLP runs split over the group (`MLP.split_forward`);
        with `tp` (tensor parallelism) the o-projection's and the MLP's partial sums are
        all-reduced over the ranks (row-parallel); `lora`: the rows' adapters (`group_lora`:
        every member's rows', under attention-DP)."""
        a = self.attn.out_proj(o, lora)
        if tp is not None:
            tp.all_reduce(a)
        residual.add_(a)
        x = rms_norm(residual, self.post_norm, self.eps)
        if mlp_comm is not None:
            y = self.mlp.split_forward(x, mlp_comm, lora, group_lora)
        else:
            y = self.mlp(x) if lora is None else self.mlp(x, lora)
        if tp is not None:
            tp.all_reduce(y)
        residual.add_(y)

    def numel(self) -> int:
        return self.input_norm.numel() + self.post_norm.numel() + self.attn.numel() + self.mlp.numel()

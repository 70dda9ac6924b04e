"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a ForwardBatch.

Numerics follow transformers' implementation (RMSNorm in float32, rotate-half RoPE with the
same inverse-frequency formula) so greedy tokens match it exactly in float32."""

from __future__ import annotations

import glob
import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from kernels.cpu_linear import Linear

# Long prefills on the CPU run the per-token parts of a layer (norms, projections, RoPE, MLP) in
# blocks of this many rows, so their intermediates (the MLP's [rows, 2 x intermediate] above
# all) stay in cache instead of streaming and page-faulting hundreds of MB per layer.
CPU_ROW_BLOCK = 512


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math
    dtype = x.dtype
    x = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
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


class LlamaModel:
    """Weights as plain tensors (no nn.Module): fused qkv and gate_up projections."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, mlp_shard: tuple[int, int] = (0, 1),
                 onednn: bool = False) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # Attention-DP hook: set by the DP layer to gather/scatter hidden states around the MLP.
        self.mlp_comm = None

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ConfigError(f"checkpoint is missing weight {name!r}")
            return weights[name].to(device=device, dtype=dtype)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, onednn=onednn)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = linear(self.embed if self.tied else w("lm_head.weight"))
        rank, world = mlp_shard
        inter = cfg.intermediate_size
        if inter % world:
            raise ConfigError(f"intermediate_size {inter} is not divisible by the DP group size {world}")
        lo, hi = rank * inter // world, (rank + 1) * inter // world
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv_bias = (torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
                        if cfg.attention_bias else None)
            layer = {
                "input_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "qkv": linear(torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]), qkv_bias),
                "o": linear(w(p + "self_attn.o_proj.weight")),
                "gate_up": linear(torch.cat([w(p + "mlp.gate_proj.weight")[lo:hi],
                                             w(p + "mlp.up_proj.weight")[lo:hi]])),
                "down": linear(w(p + "mlp.down_proj.weight")[:, lo:hi].contiguous()),
            }
            if cfg.qk_norm:
                layer["q_norm"] = w(p + "self_attn.q_norm.weight")
                layer["k_norm"] = w(p + "self_attn.k_norm.weight")
            self.layers.append(layer)
        inv_freq = rope_inv_freq(cfg)
        freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = cfg.head_dim // 2
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin_signed = sin.to(device=device, dtype=dtype)

    def num_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        n += 0 if self.tied else self.lm_head.numel()
        return n + sum(t.numel() for layer in self.layers for t in layer.values())

    def forward(self, fb: ForwardBatch, attn) -> torch.Tensor:
        """Hidden states of the tokens at fb.last_token_indices -> logits [bs, vocab]."""
        cfg = self.cfg
        h = F.embedding(fb.input_ids, self.embed)
        cos = self.cos[fb.positions].unsqueeze(1)
        sin = self.sin_signed[fb.positions].unsqueeze(1)
        T = h.shape[0]
        residual = h  # a fresh tensor: updated in place below
        blocks = self._row_blocks(T)
        # Blocked: one q/k/v buffer per forward, filled block by block (not a new one per layer:
        # first-touch page faults on a fresh buffer cost as much as the RoPE itself).
        qkv_buf = None
        if len(blocks) > 1:
            qkv_buf = h.new_empty(T, cfg.num_attention_heads + 2 * cfg.num_key_value_heads, cfg.head_dim)
        tail_blocks = blocks if self.mlp_comm is None else [slice(None)]  # attention-DP's MLP needs all rows
        for i, layer in enumerate(self.layers):
            q, k, v = self._attn_inputs(residual, layer, cos, sin, blocks, qkv_buf)
            o = attn.forward(q, k, v, i, fb).reshape(T, self.q_size)
            for blk in tail_blocks:
                self._attn_out_and_mlp(residual[blk], o[blk], layer)
        h = residual[fb.last_token_indices]
        h = rms_norm(h, self.norm, cfg.rms_norm_eps)
        return self.lm_head(h)

    def _row_blocks(self, rows: int) -> list[slice]:
        """Long CPU prefills run per-token work in CPU_ROW_BLOCK-row blocks; else one block."""
        if self.device.type != "cpu" or rows <= CPU_ROW_BLOCK:
            return [slice(None)]
        return [slice(s, s + CPU_ROW_BLOCK) for s in range(0, rows, CPU_ROW_BLOCK)]

    def _attn_inputs(self, residual: torch.Tensor, layer: dict, cos: torch.Tensor, sin: torch.Tensor,
                     blocks: list[slice], qkv_buf: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (views of one [T, heads, head_dim] tensor) after norm, projection and RoPE;
        with `qkv_buf`, computed block by block into it."""
        cfg = self.cfg
        if qkv_buf is None:
            qkv = self._roped_qkv(residual, layer, cos, sin)
        else:
            qkv = qkv_buf
            for blk in blocks:
                qkv[blk] = self._roped_qkv(residual[blk], layer, cos[blk], sin[blk])
        return qkv.split([cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads], dim=1)

    def _roped_qkv(self, residual: torch.Tensor, layer: dict, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        nq, nkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
        qkv = layer["qkv"](rms_norm(residual, layer["input_norm"], eps)).view(residual.shape[0], nq + 2 * nkv,
                                                                               cfg.head_dim)
        qk = qkv[:, :nq + nkv]
        if cfg.qk_norm:
            qk = torch.cat([rms_norm(qk[:, :nq], layer["q_norm"], eps), rms_norm(qk[:, nq:], layer["k_norm"], eps)],
                           dim=1)
        qkv[:, :nq + nkv] = apply_rope(qk, cos, sin)  # q and k in one pass
        return qkv

    def _attn_out_and_mlp(self, residual: torch.Tensor, o: torch.Tensor, layer: dict) -> None:
        """o-projection, post-attention norm and MLP, added into `residual` (rows of it) in place."""
        residual.add_(layer["o"](o))
        residual.add_(self._mlp(rms_norm(residual, layer["post_norm"], self.cfg.rms_norm_eps), layer))

    def _mlp(self, x: torch.Tensor, layer: dict) -> torch.Tensor:
        if self.mlp_comm is not None:
            x = self.mlp_comm.gather(x)
        blocks = self._row_blocks(x.shape[0])  # > 1 only for attention-DP's gathered rows
        if len(blocks) == 1:
            out = self._mlp_rows(x, layer)
        else:
            out = x.new_empty(x.shape[0], layer["down"].out_features)
            for blk in blocks:
                out[blk] = self._mlp_rows(x[blk], layer)
        if self.mlp_comm is not None:
            out = self.mlp_comm.reduce_scatter(out)
        return out

    @staticmethod
    def _mlp_rows(x: torch.Tensor, layer: dict) -> torch.Tensor:
        gate, up = layer["gate_up"](x).chunk(2, dim=-1)
        return layer["down"](F.silu(gate, inplace=True).mul_(up))


def load_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a single or sharded safetensors checkpoint, on the CPU."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        paths = [os.path.join(model_dir, name) for name in files]
    else:
        paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        raise ConfigError(f"no *.safetensors weights in {model_dir!r}")
    weights: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
    return weights

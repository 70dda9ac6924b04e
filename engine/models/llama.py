"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), told
apart by ModelConfig flags; the lm_head is tied to the embedding or separate."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch
from engine.models.base import CausalLM, Weights, register_model
from engine.models.layers import (
    MLP,
    Attention,
    DecoderLayer,
    GatedMLP,
    MoESplit,
    RoPE,
    embed_tokens,
    make_linear,
    rms_norm,
    row_blocks,
)
from engine.tp.comm import TPGroup
from engine.tp.ops import vocab_parallel_embedding, vocab_parallel_logits
from kernels import cpu_kernels
from kernels.cpu_linear import LinearKind
from kernels.lora import LoRABatchInfo, LoRAWeights, slice_batch_info
from kernels.quant import QuantWeight


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(CausalLM):
    """Embedding, pre-norm decoder layers, final norm, lm_head. A model that differs only in its
    MLP (MoE) subclasses this and overrides `make_mlp`. Under tensor parallelism (`tp`) the
    weights are this rank's shards: its query and KV heads, a slice of every MLP's intermediate
    dim, its rows of the padded vocabulary (see CausalLM)."""

    cpu_graph_safe = True
    supports_split_prefill = True

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, mlp_shard: tuple[int, int] = (0, 1),
                 linear: LinearKind = "torch", moe_split: MoESplit = "experts", tp: TPGroup | None = None) -> None:
        super().__init__(cfg, weights, dtype, device, max_positions, mlp_shard, linear, moe_split, tp)
        w = Weights(weights, dtype, device)
        self.q_size = self.layout.q_size
        self.embed = w.linear("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.tied = cfg.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = make_linear(self.embed if self.tied else w.linear("lm_head.weight"), kind=linear)
        self.layers = [
            DecoderLayer(w(p + "input_layernorm.weight"), self.make_attention(w, p, linear),
                         w(p + "post_attention_layernorm.weight"), self.make_mlp(w, p, mlp_shard, linear),
                         cfg.rms_norm_eps)
            for p in (f"model.layers.{i}." for i in range(cfg.num_hidden_layers))
        ]
        self.rope = RoPE(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, dtype, device)

    def make_attention(self, w: Weights, p: str, linear: LinearKind) -> Attention:
        cfg = self.cfg
        bias = torch.cat([w(f"{p}self_attn.{x}_proj.bias") for x in "qkv"]) if cfg.attention_bias else None
        qkv = make_linear([w.linear(f"{p}self_attn.{x}_proj.weight") for x in "qkv"], bias, kind=linear)
        o = make_linear(w.linear(p + "self_attn.o_proj.weight"), kind=linear)
        q_norm, k_norm = ((w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight"))
                          if cfg.qk_norm else (None, None))
        return Attention(qkv, o, self.layout.num_heads, self.layout.num_kv_heads, cfg.head_dim,
                         cfg.rms_norm_eps, q_norm, k_norm)

    def make_mlp(self, w: Weights, p: str, mlp_shard: tuple[int, int], linear: LinearKind) -> MLP:
        """The MLP slot of layer prefix `p`."""
        down = w.linear(p + "mlp.down_proj.weight")
        if mlp_shard[1] > 1 and isinstance(down, QuantWeight) and down.perm is not None:
            # act-order's groups are spread over every member's slice of the input: held as float
            down = w(p + "mlp.down_proj.weight")
        return GatedMLP(w.linear(p + "mlp.gate_proj.weight"), w.linear(p + "mlp.up_proj.weight"), down, mlp_shard,
                        linear)

    def attach_lora(self, weights: Callable[[int, str], LoRAWeights | None]) -> None:
        """Give each layer's projections their LoRA slots: `weights(layer, group)` for the groups
        qkv_proj, o_proj, gate_up_proj, down_proj (engine.lora.LoRAMemoryPool.weights). A layer
        whose MLP is not a GatedMLP (MoE) keeps an unadapted MLP."""
        self.lora_split_mlp = any(isinstance(layer.mlp, GatedMLP) and layer.mlp.sharded for layer in self.layers)
        for i, layer in enumerate(self.layers):
            if type(layer.attn).unroped_qkv is not Attention.unroped_qkv:
                raise ConfigError(f"{type(self).__name__}'s attention cannot take LoRA adapters yet")
            layer.attn.lora_qkv = weights(i, "qkv_proj")
            layer.attn.lora_o = weights(i, "o_proj")
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.lora_gate_up = weights(i, "gate_up_proj")
                layer.mlp.lora_down = weights(i, "down_proj")

    def num_parameters(self) -> int:
        n = self.embed.shape.numel() + self.norm.numel() + (0 if self.tied else self.lm_head.numel())
        return n + sum(layer.numel() for layer in self.layers)

    def forward(self, fb: ForwardBatch, attn) -> torch.Tensor:
        """Hidden states of the tokens at fb.last_token_indices -> logits [bs, vocab]."""
        if getattr(attn, "fused_rope_decode", False) and (fb.forward_mode.is_decode() or fb.forward_mode.is_idle()):
            return self.forward_decode(fb, attn)
        residual = self.embed_rows(fb.input_ids)  # a fresh tensor: updated in place below
        self.run_layers(fb, attn, residual, 0, len(self.layers))
        return self.logits(fb, residual)

    def forward_split_prefill(self, fb: ForwardBatch, attn, end: int) -> torch.Tensor | None:
        """Layers [fb.split_index, end) of a SPLIT_PREFILL batch; the residual stream is the
        hidden state carried in fb.hidden_states. Logits after the last layer, else None."""
        if fb.split_index == 0:
            fb.hidden_states = self.embed_rows(fb.input_ids)
        self.run_layers(fb, attn, fb.hidden_states, fb.split_index, end)
        fb.split_index = end
        if end < len(self.layers):
            return None
        residual, fb.hidden_states = fb.hidden_states, None
        return self.logits(fb, residual)

    def run_layers(self, fb: ForwardBatch, attn, residual: torch.Tensor, start: int, end: int) -> None:
        """Layers [start, end) over every token of fb, updating `residual` [T, hidden] in place."""
        cos, sin = self.rope(fb.positions)
        T = residual.shape[0]
        blocks = row_blocks(T, self.device)
        # Blocked: one q/k/v buffer per call, filled block by block (not a new one per layer:
        # first-touch page faults on a fresh buffer cost as much as the RoPE itself).
        qkv_buf = None
        if len(blocks) > 1:
            qkv_buf = residual.new_empty(T, self.layers[0].attn.qkv_heads, self.cfg.head_dim)
        lora = self.block_lora(fb.lora_info, T, blocks)
        tail_blocks, tail_lora, group_lora = blocks, lora, None
        if self.mlp_comm is not None:  # attention-DP's MLP needs all rows
            tail_blocks, tail_lora = [slice(None)], [fb.lora_info] if fb.lora_info is not None else None
            group_lora = self.gather_lora(fb.lora_info, T)
        for i in range(start, end):
            layer = self.layers[i]
            q, k, v = layer.attn_inputs(residual, cos, sin, blocks, qkv_buf, lora)
            o = attn.forward(q, k, v, i, fb).reshape(T, self.q_size)
            for j, blk in enumerate(tail_blocks):
                layer.attn_out_and_mlp(residual[blk], o[blk], self.mlp_comm, self.tp_reduce,
                                       tail_lora[j] if tail_lora else None, group_lora)

    def gather_lora(self, info: LoRABatchInfo | None, rows: int) -> LoRABatchInfo | None:
        """Under attention-DP with adapters on a split MLP: every member's rows' adapters (a
        collective every member makes each forward, whether its own rows have adapters or not)."""
        if not self.lora_split_mlp:
            return None
        return self.mlp_comm.gather_lora(info, rows)

    @staticmethod
    def block_lora(info: LoRABatchInfo | None, rows: int,
                   blocks: list[slice]) -> list[LoRABatchInfo] | None:
        """The adapter segments of each row block (None: no adapter rows in the batch)."""
        if info is None:
            return None
        if len(blocks) == 1:
            return [info]
        return [slice_batch_info(info, b.start, min(b.stop, rows)) for b in blocks]

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids` (a fresh tensor); under TP the vocabulary-parallel lookup."""
        if self.tp_reduce is None:
            return embed_tokens(ids, self.embed, self.dtype)
        dtype = self.dtype if isinstance(self.embed, QuantWeight) else None
        return vocab_parallel_embedding(ids, self.embed, self.layout, self.tp, dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over normed hidden states; under TP every rank's vocabulary shard gathered
        (each rank gets the whole logits; padding masked and cut off)."""
        logits = self.lm_head(h)
        if self.tp_reduce is None:
            return logits
        return vocab_parallel_logits(logits, self.layout, self.tp).contiguous()

    def logits(self, fb: ForwardBatch, residual: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head at fb.last_token_indices."""
        h = rms_norm(residual[fb.last_token_indices], self.norm, self.cfg.rms_norm_eps)
        return self.head(h)

    def forward_decode(self, fb: ForwardBatch, attn) -> torch.Tensor:
        """A DECODE (or IDLE) batch through the CPU kernels: one token per request, so every row is
        a last token. Per layer: qkv projection, one call for RoPE + KV store + attention, the
        o-projection, then residual add and the next RMSNorm fused (twice), and the MLP: eight
        calls where the general path makes about twenty-five. This is what a CPU decode graph
        (engine/cpu_graph.py) compiles."""
        eps = self.cfg.rms_norm_eps
        residual = self.embed_rows(fb.input_ids)  # a fresh tensor: updated in place below
        T = residual.shape[0]
        x = cpu_kernels.rms_norm(residual, self.layers[0].input_norm, eps)
        cos, sin = self.rope.cos, self.rope.sin_signed
        lora = fb.lora_info
        group_lora = self.gather_lora(lora, T) if self.mlp_comm is not None else None
        for i, layer in enumerate(self.layers):
            qkv = layer.attn.unroped_qkv(x) if lora is None else layer.attn.unroped_qkv(x, lora)
            o = attn.forward_decode_rope(qkv, cos, sin, i, fb)
            a = layer.attn.out_proj(o.view(T, self.q_size), lora)
            if self.tp_reduce is not None:  # row-parallel: the ranks' partial sums
                self.tp_reduce.all_reduce(a)
            x = cpu_kernels.add_rms_norm(a, residual, layer.post_norm, eps)
            if self.mlp_comm is not None:
                y = layer.mlp.split_forward(x, self.mlp_comm, lora, group_lora)
            else:
                y = layer.mlp(x) if lora is None else layer.mlp(x, lora)
            if self.tp_reduce is not None:  # one reduction for the whole MLP (experts and shared expert too)
                self.tp_reduce.all_reduce(y)
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = cpu_kernels.add_rms_norm(y, residual, after, eps)
        return self.head(x)

"""GGUF files the tests write: a random Llama-family checkpoint (engine.builtin_model's weights and
byte-level tokenizer) in any tensor type, named and laid out as llama.cpp's converter writes it
(Q and K rows permuted for a Llama), with the K-quant encoders gguf-py does not ship."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter, TokenType
from gguf import quantize as gguf_quantize

from engine.builtin_model import CHAT_TEMPLATE, SPECIAL_TOKENS, byte_level_tokenizer

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
# The byte-level vocabulary plus a few merges (transformers' GGUF converter needs some).
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r")]


def vocabulary() -> list[str]:
    vocab = byte_level_tokenizer().get_vocab()
    return sorted(vocab, key=vocab.get) + ["".join(m) for m in MERGES]


VOCAB_SIZE = len(vocabulary())


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{suffix}"


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors (`...mlp.experts.{e}.{gate,up,down}_proj.weight`) stacked as llama.cpp
    stores them: one [E, out, in] tensor per layer and projection, named `blk.{i}.ffn_*_exps`."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in weights.items():
        if ".mlp.experts." not in name:
            out[name] = t
            continue
        _, _, layer, _, _, e, proj, _ = name.split(".")
        stacks.setdefault(f"blk.{layer}.{_EXPERTS[proj]}.weight", []).append((int(e), t))
    for name, parts in stacks.items():
        out[name] = torch.stack([t for _, t in sorted(parts, key=lambda p: p[0])])
    return out


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a Q or K projection's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit (scale, min) pairs per block -> 12 bytes (inverse of Q4_K.get_scale_min)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    b0 = sc[..., :4] | ((sc[..., 4:] & 0x30) << 2)
    b1 = mn[..., :4] | ((mn[..., 4:] & 0x30) << 2)
    b2 = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=-1)


def _k_affine(w: np.ndarray, levels: int):
    """Q4_K/Q5_K: per 32-element sub-block scale and min, 6-bit over fp16 super-block d / dmin."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32)
    lo = np.minimum(sub.min(axis=3), 0)
    s = (sub.max(axis=3) - lo) / levels
    m = -lo
    d = (s.max(axis=2) / 63).astype(np.float16)
    dmin = (m.max(axis=2) / 63).astype(np.float16)
    sc = np.clip(np.round(s / np.maximum(d.astype(np.float32), 1e-12)[..., None]), 0, 63)
    mn = np.clip(np.round(m / np.maximum(dmin.astype(np.float32), 1e-12)[..., None]), 0, 63)
    eff_s = d.astype(np.float32)[..., None] * sc
    eff_m = dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.round((sub + eff_m[..., None]) / np.maximum(eff_s, 1e-12)[..., None]), 0, levels)
    return q.astype(np.uint8).reshape(n, k // 256, 256), d, dmin, _pack_k_scales(sc, mn)


def _nibble_chunks(q: np.ndarray) -> np.ndarray:
    """Codes [n, blocks, 256] (low 4 bits) -> 128 bytes per block: chunk c, byte j = q[64c + j] | q[64c + 32 + j] << 4."""
    c = (q & 0x0F).reshape(*q.shape[:2], 4, 2, 32)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(*q.shape[:2], 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _k_affine(w, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _nibble_chunks(q)], axis=-1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _k_affine(w, 31)
    high = ((q >> 4) & 1).reshape(*q.shape[:2], 8, 32)
    qh = np.zeros((*q.shape[:2], 32), dtype=np.uint8)
    for i in range(8):
        qh |= high[:, :, i] << i
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, _nibble_chunks(q)],
                          axis=-1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    groups = w.reshape(n, k // 256, 16, 16)
    s = np.abs(groups).max(axis=3) / 32
    d = (s.max(axis=2) / 127).astype(np.float16)
    sc = np.clip(np.round(s / np.maximum(d.astype(np.float32), 1e-12)[..., None]), -128, 127).astype(np.int8)
    eff = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.round(groups / np.maximum(eff, 1e-12)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 128)  # two halves of 128
    low = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # [n, b, 2, 64]
    top = (q >> 4).reshape(n, k // 256, 2, 4, 32)
    qh = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    return np.concatenate([low.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8),
                           _f16_bytes(d)], axis=-1).reshape(n, -1)


K_QUANTS = {GGMLType.Q4_K: quantize_q4_k, GGMLType.Q5_K: quantize_q5_k, GGMLType.Q6_K: quantize_q6_k}


def encode(w: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """A float32 [n, k] weight in `ggml_type` (raw blocks, uint8 [n, bytes per row]; float types as such)."""
    if ggml_type == GGMLType.F32:
        return w.astype(np.float32)
    if ggml_type == GGMLType.F16:
        return w.astype(np.float16)
    if ggml_type in K_QUANTS:
        return K_QUANTS[ggml_type](w.astype(np.float32))
    return gguf_quantize(w.astype(np.float32), ggml_type)


def write_gguf(path: str, cfg: dict, weights: dict[str, torch.Tensor], ggml_type: GGMLType,
               embed_type: GGMLType | None = None) -> str:
    """A GGUF file of the HF-named random checkpoint (`cfg`, `weights`; vocab_size VOCAB_SIZE)
    with the byte-level tokenizer and MERGES: 2-D projections in `ggml_type` (the embedding in `embed_type`, default the same),
    norms and biases in F32."""
    arch = GGUF_ARCH[cfg["model_type"]]
    writer = GGUFWriter(path, arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer.add_name(f"radixray test {arch}")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("num_experts"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    if cfg.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, t in stack_experts(weights).items():
        w = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute_qk(w, heads if "q_proj" in name else kv)
        kind = embed_type or ggml_type if name == "model.embed_tokens.weight" else ggml_type
        if name.endswith("mlp.gate.weight"):  # the router: llama.cpp keeps it in F32
            kind = GGMLType.F32
        target = name if name.startswith("blk.") else gguf_name(name)
        if w.ndim == 1 or kind == GGMLType.F32:
            writer.add_tensor(target, w.astype(np.float32))
        else:  # (a stack of experts: each expert's rows encoded, stacked again)
            data = np.stack([encode(m, kind) for m in w.reshape(-1, *w.shape[-2:])]).reshape(
                *w.shape[:-2], w.shape[-2], -1)
            writer.add_tensor(target, data, raw_dtype=None if kind in (GGMLType.F16,) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

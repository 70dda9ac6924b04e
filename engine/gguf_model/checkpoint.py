"""A GGUF file as a checkpoint of the Llama family: its metadata as an HF `config.json` dict, and
its tensors under HF names (llama.cpp's row permutation of the Q and K projections undone), as
float tensors or, for the block types the engine computes, `kernels.quant.QuantWeight`s."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType

from engine.errors import ConfigError
from engine.gguf_model.header import TensorInfo
from engine.gguf_model.quants import FLOAT_TYPES, check_type, to_float, to_quant
from kernels.quant import QuantWeight

# general.architecture -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# llama.cpp's converter permutes these architectures' Q and K rows for its rotary layout.
PERMUTED_QK = ("llama", "mistral")

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def hf_config(metadata: dict, tensors: list[TensorInfo]) -> dict:
    """config.json of the file's model, from its metadata (the keys transformers reads)."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    names = {t.name for t in tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError("this GGUF file scales RoPE by a rope_freqs tensor (Llama 3.1 style), which is not supported")
    hf_arch, model_type = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        hf_arch, model_type = ARCHITECTURES["mistral"]

    def get(key: str, default=None):
        return metadata.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = metadata.get("tokenizer.ggml.tokens")
    cfg = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": get("vocab_size") or (len(tokens) if tokens else None),
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or hidden // heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": "float32" if all(GGMLType(t.ggml_type) in FLOAT_TYPES for t in tensors) else "bfloat16",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConfigError(f"GGUF rope scaling {scaling!r} is not supported")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if arch == "qwen3moe":
        cfg |= {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
                "moe_intermediate_size": get("expert_feed_forward_length"), "norm_topk_prob": True}
    missing = [k for k, v in cfg.items() if v is None and k not in ("bos_token_id", "eos_token_id")]
    if missing:
        raise ConfigError(f"GGUF metadata lacks {', '.join(missing)} for architecture {arch!r}")
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    return None


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (rows grouped per head as
    [head, 2, half] there, [head, half, 2] in HF)."""
    half = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, half, 2).transpose(1, 2).reshape(n_rows)


def check_types(tensors: list[TensorInfo]) -> None:
    """A type the engine cannot compute is a ConfigError naming the tensor (said when the file's
    folder is made, and again at each load)."""
    for t in tensors:
        check_type(t.name, GGMLType(t.ggml_type))


def read_tensors(path: str, index: list[TensorInfo], cfg: dict,
                 keep_quantized: Callable[[str], bool]) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of the GGUF file at `path` under its HF name. `keep_quantized(hf_name)` says
    whether a 2-D tensor of a block type stays a QuantWeight (else it is dequantized to float32).
    An unknown tensor name is a ConfigError naming it."""
    arch = cfg["model_type"]
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for t in index:
        ggml_type = GGMLType(t.ggml_type)
        check_type(t.name, ggml_type)
        raw = mapped[t.offset:t.offset + t.nbytes].reshape(math.prod(t.shape[:-1]), -1)
        if ".ffn_" in t.name and "_exps." in t.name:
            out |= _experts(t.name, raw, ggml_type, t.shape, keep_quantized)
            continue
        name = hf_name(t.name)
        if name is None:
            raise ConfigError(f"GGUF tensor {t.name!r} has no place in a {cfg['architectures'][0]} model")
        quant = ggml_type not in FLOAT_TYPES and len(t.shape) == 2 and keep_quantized(name)
        w = to_quant(raw, ggml_type, *t.shape) if quant else to_float(raw, ggml_type, t.shape)
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            order = unpermute_rows(t.shape[0], cfg["num_attention_heads"] if "q_proj" in name
                                   else cfg["num_key_value_heads"])
            w = w.select_rows(order) if quant else w[order]
        out[name] = w
    return out


def _experts(name: str, raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...],
             keep_quantized: Callable[[str], bool]) -> dict[str, torch.Tensor | QuantWeight]:
    """A stacked expert tensor [E, out, in] (raw rows [E * out, bytes per row]) as one weight per
    expert under its HF name: a QuantWeight (kept in its block format) or float32."""
    layer, kind = name.split(".")[1], name.split(".")[2]
    if kind not in _EXPERTS or len(shape) != 3:
        raise ConfigError(f"GGUF tensor {name!r} is not supported")
    n_experts, rows, cols = shape
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for e in range(n_experts):
        hf = f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[kind]}.weight"
        part = raw[e * rows:(e + 1) * rows]
        quant = ggml_type not in FLOAT_TYPES and keep_quantized(hf)
        out[hf] = to_quant(part, ggml_type, rows, cols) if quant else to_float(part, ggml_type, (rows, cols))
    return out

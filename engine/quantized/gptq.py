"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum; `quant_method: "gptq"`).

Per quantized projection `<prefix>` (in_features K, out_features N, `bits` b, group size G; G = K
where the config says -1):
- `qweight` int32 [K * b / 32, N]: packed along K, word i of column n holds the codes of rows
  i * (32 / b) + j, code j in bits j*b .. j*b + b - 1 (little end first).
- `qzeros` int32 [ceil(K / G), N * b / 32]: packed along N the same way (code j of word c is
  column c * (32 / b) + j).
- `scales` float16 [ceil(K / G), N]; `g_idx` int32 [K]: the group of each input column
  (k // G unless the checkpoint was quantized with act-order, `desc_act`).
- value[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k]. The v1 format
  (`checkpoint_format` "gptq", AutoGPTQ's and the default) stores zero - 1: the loaders add 1 to
  the masked code (AutoGPTQ's `zeros + 1`, so a stored code 2**b - 1 means 2**b); GPTQModel's
  "gptq_v2" stores the zero itself.
Bits 2, 4 and 8 are read; 3-bit (words straddling codes) and the kernel-specific formats
(marlin, bitblas, ...) are refused, as is GPTQModel's per-module `dynamic` override.

Act-order kept quantized: the input columns are sorted by g_idx (stably), which makes every group
a run of G consecutive stored columns, the engine's format; the QuantWeight keeps that order as
its `perm` and each projection reads x's columns in it (x[..., perm], one gather per call). The
values are the same as without the permutation, so only the summation order changes."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.quantized.packing import (
    check_packed,
    dequantize_groups,
    fits_quant_weight,
    to_quant_weight,
    unpack_cols,
    unpack_rows,
)
from kernels.quant import QuantWeight

SUPPORTED_BITS = (2, 4, 8)
FORMATS = {"gptq": 1, "gptq_v2": 0}  # the offset added to a stored zero point


def convert_gptq(weights: dict[str, torch.Tensor], qc: dict, keep: bool) -> dict[str, torch.Tensor | QuantWeight]:
    """Every `<prefix>.qweight/qzeros/scales/g_idx` group of `weights` -> `<prefix>.weight`. With
    `keep`, 2/4/8-bit projections whose group size is a multiple of 32 (16 for 8-bit) become
    QuantWeights holding exactly the reference's values (see `to_quant_weight`); with act-order
    (a g_idx other than k // G) their columns are permuted so each group is contiguous (`perm`,
    see the module docstring), provided every group has G columns. Other group structures are
    dequantized to float32, the exact value of scale * (q - zero) (the reference kernels compute
    it in float16, so within one float16 rounding of theirs). Without `keep` everything is
    dequantized to float32."""
    bits = int(qc.get("bits") or 0)
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"GPTQ checkpoint: bits={qc.get('bits')!r} is not supported "
                          f"(supported: {', '.join(map(str, SUPPORTED_BITS))})")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in FORMATS:
        raise ConfigError(f"GPTQ checkpoint: checkpoint_format {fmt!r} is not supported "
                          f"(supported: {', '.join(FORMATS)})")
    if qc.get("dynamic"):
        raise ConfigError("GPTQ checkpoint: per-module `dynamic` overrides are not supported")
    group_size = int(qc.get("group_size") or 128)
    if group_size != -1 and group_size <= 0:
        raise ConfigError(f"GPTQ checkpoint: group_size={group_size} is not supported")
    prefixes = [name[: -len(".qweight")] for name in weights if name.endswith(".qweight")]
    if not prefixes:
        raise ConfigError("GPTQ checkpoint: config.json has a quantization_config but no *.qweight tensors")
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for prefix in prefixes:
        out[prefix + ".weight"] = _projection(weights, prefix, bits, group_size, FORMATS[fmt], keep)
    out.update(weights)  # what is left: norms, embeddings, biases, unquantized projections
    return out


def _projection(weights: dict[str, torch.Tensor], prefix: str, bits: int, group_size: int, zero_offset: int,
                keep: bool) -> torch.Tensor | QuantWeight:
    """Pops the projection's tensors from `weights`; its weight [N, K]."""
    qweight = check_packed(prefix + ".qweight", weights.pop(prefix + ".qweight"))
    per = 32 // bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    g = k if group_size == -1 else group_size
    ngroups = -(-k // g)
    if n % per:
        raise ConfigError(f"GPTQ checkpoint: {prefix!r} has {n} output columns, not a multiple of {per}")
    qzeros = check_packed(prefix + ".qzeros", weights.pop(prefix + ".qzeros", None), (ngroups, n // per))
    scales = check_packed(prefix + ".scales", weights.pop(prefix + ".scales", None), (ngroups, n))
    g_idx = weights.pop(prefix + ".g_idx", None)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ConfigError(f"GPTQ checkpoint: {prefix!r} packs its codes in {qweight.dtype}, not int32")
    codes = unpack_rows(qweight, bits).t()  # [N, K]
    zeros = (unpack_cols(qzeros, bits) + zero_offset).t()  # [N, ngroups]
    scales_nk = scales.t()
    plain = torch.arange(k, dtype=torch.int32) // g
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise ConfigError(f"GPTQ checkpoint: {prefix + '.g_idx'!r} has shape {tuple(g_idx.shape)}, expected ({k},)")
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= ngroups:
            raise ConfigError(f"GPTQ checkpoint: {prefix + '.g_idx'!r} names groups outside 0..{ngroups - 1}")
    act_order = g_idx is not None and not torch.equal(g_idx.to(torch.int32), plain)
    if keep and fits_quant_weight(bits, k, g):
        if not act_order:
            return to_quant_weight(codes, scales_nk, zeros, bits, g)
        group_of = g_idx.long()
        if bool((torch.bincount(group_of, minlength=ngroups) == g).all()):  # every group G columns
            perm = torch.sort(group_of, stable=True).indices  # groups in order, columns ascending within
            return to_quant_weight(codes[:, perm], scales_nk, zeros, bits, g, perm=perm)
    return dequantize_groups(codes, scales_nk, zeros, g_idx if act_order else plain)

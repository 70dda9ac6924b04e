"""Quantized weights kept quantized: the engine's one block format (`QuantWeight`), its reference
dequantization, weight-only int8/int4 quantization of a float weight, and `QuantLinear`, the
projection that multiplies by it.

The format: a weight [N, K] is stored as unsigned/signed integer codes q with one scale and one
bias per group of G consecutive elements of a row, value = scale[n, k // G] * q[n, k] + bias[n, k // G].
- bits=4: `qweight` uint8 [N, K // 2], codes 0..15. Each 32-element chunk c of a row takes bytes
  16c..16c+15; byte j holds element 32c + j in its low nibble and 32c + 16 + j in its high one
  (GGUF's Q4_0/Q4_1 layout, so those blocks load without reshuffling). G is a multiple of 32.
- bits=8: `qweight` int8 [N, K], codes -128..127. G is a multiple of 16.
- `scales` and `biases`: [N, K // G], float16 where the source's scales are exactly float16
  (GGUF's Q8_0, Q4_0, Q4_1) else float32; `biases` None means zero (a symmetric format).
K is a multiple of 32. Every GGUF type the engine computes maps onto it exactly (same values as
the file's own dequantization); see `engine/models/gguf_quants.py`.
- `perm` (optional, int64 [K]): the stored columns are the weight's input columns in this order
  (stored column j is input column perm[j]), so that groups that are not runs of consecutive
  input columns (GPTQ's act-order) become runs; a projection gathers x[..., perm] once and then
  multiplies as for any other weight. None (the usual case) means the identity."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels import cpu_kernels


class QuantWeight:
    """One quantized weight [out_features, in_features] (see the module docstring)."""

    __slots__ = ("qweight", "scales", "biases", "bits", "group_size", "out_features", "in_features", "perm")

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                 bits: int, group_size: int, perm: torch.Tensor | None = None) -> None:
        n = qweight.shape[0]
        k = qweight.shape[1] * (2 if bits == 4 else 1)
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if k % 32 or group_size % (32 if bits == 4 else 16) or k % group_size:
            raise ValueError(f"bad quantized shape: K={k}, bits={bits}, group_size={group_size}")
        want = (n, k // group_size)
        if tuple(scales.shape) != want or (biases is not None and tuple(biases.shape) != want):
            raise ValueError(f"scales/biases must be {want}")
        if qweight.dtype != (torch.uint8 if bits == 4 else torch.int8):
            raise ValueError(f"{bits}-bit codes must be {'uint8' if bits == 4 else 'int8'}")
        if perm is not None and (perm.dtype != torch.int64 or tuple(perm.shape) != (k,)):
            raise ValueError(f"perm must be int64 [{k}], got {perm.dtype} {tuple(perm.shape)}")
        self.qweight, self.scales, self.biases = qweight, scales, biases
        self.bits, self.group_size = bits, group_size
        self.out_features, self.in_features = n, k
        self.perm = perm

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def to(self, device: torch.device) -> QuantWeight:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return QuantWeight(move(self.qweight), move(self.scales), move(self.biases), self.bits, self.group_size,
                           move(self.perm))

    def select_rows(self, index: torch.Tensor) -> QuantWeight:
        """Rows `index` of the weight (each row's blocks are its own)."""
        biases = None if self.biases is None else self.biases[index]
        return QuantWeight(self.qweight[index], self.scales[index], biases, self.bits, self.group_size, self.perm)

    def select_cols(self, lo: int, hi: int) -> QuantWeight:
        """Input columns [lo, hi) of the weight; both must fall on group (and 32-element chunk)
        bounds, and with a `perm`, the stored columns [lo, hi) must hold exactly those inputs."""
        g = self.group_size
        if lo % g or hi % g or lo % 32 or hi % 32:
            raise ValueError(f"columns [{lo}, {hi}) do not fall on the weight's {g}-element groups")
        perm = None
        if self.perm is not None:
            perm = self.perm[lo:hi] - lo
            if not torch.equal(perm.sort().values, torch.arange(hi - lo, device=perm.device)):
                raise ValueError(f"columns [{lo}, {hi}) are spread over the weight's permuted (act-order) groups")
        per = 2 if self.bits == 4 else 1
        biases = None if self.biases is None else self.biases[:, lo // g:hi // g]
        return QuantWeight(self.qweight[:, lo // per:hi // per].contiguous(),
                           self.scales[:, lo // g:hi // g].contiguous(),
                           None if biases is None else biases.contiguous(), self.bits, g, perm)

    def nbytes(self) -> int:
        """Bytes held in memory (codes, scales, biases, the column permutation)."""
        held = (self.qweight, self.scales, self.biases, self.perm)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def codes(self) -> torch.Tensor:
        """The integer codes [N, K] as int16 (unpacked), in stored column order (see `perm`)."""
        if self.bits == 8:
            return self.qweight.to(torch.int16)
        n = self.out_features
        chunks = self.qweight.view(n, -1, 16).to(torch.int16)
        return torch.cat([chunks & 0xF, chunks >> 4], dim=2).view(n, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (the reference every kernel is tested against)."""
        return self.dequantize_rows(slice(None), dtype)

    def dequantize_rows(self, rows: torch.Tensor | slice, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` of the float weight (an embedding lookup of a quantized table), its columns
        in input order."""
        w = self.dequantize_stored(rows, dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def dequantize_stored(self, rows: torch.Tensor | slice = slice(None),
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` of the float weight with its columns as stored (`perm` not undone)."""
        q = self.qweight[rows]
        k, g = self.in_features, self.group_size
        # (explicit sizes: no rows at all is a lookup too, an IDLE batch's under attention-DP)
        if self.bits == 4:
            chunks = q.view(q.shape[0], k // 32, 16)
            codes = torch.cat([chunks & 0xF, chunks >> 4], dim=2).view(q.shape[0], k)
        else:
            codes = q
        w = codes.float().view(q.shape[0], k // g, g) * self.scales[rows].float().unsqueeze(2)
        if self.biases is not None:
            w = w + self.biases[rows].float().unsqueeze(2)
        return w.view(q.shape[0], k).to(dtype)


def cat_rows(weights: Sequence[QuantWeight]) -> QuantWeight | None:
    """The weights stacked along out_features (a fused qkv or gate/up projection), or None if
    their formats differ (bits, group size, scale dtype, bias or none, column permutation): those
    stay separate."""
    first = weights[0]
    same = all(w.bits == first.bits and w.group_size == first.group_size and w.in_features == first.in_features
               and w.scales.dtype == first.scales.dtype and (w.biases is None) == (first.biases is None)
               and _same_perm(w.perm, first.perm) for w in weights)
    if not same:
        return None
    biases = None if first.biases is None else torch.cat([w.biases for w in weights])
    return QuantWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]),
                       biases, first.bits, first.group_size, first.perm)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [N, K] -> uint8 [N, K // 2] in the chunk layout above."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).view(n, k // 2)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> QuantWeight:
    """Weight-only int8, symmetric: one float16 scale per row (per channel) or per `group_size`
    elements, codes round(w / scale) in -127..127."""
    n, k = w.shape
    g = group_size or k
    wf = w.float().view(n, k // g, g)
    scale = (wf.abs().amax(dim=2) / 127).clamp_min(1e-8).half()
    q = torch.round(wf / scale.float().unsqueeze(2)).clamp(-127, 127).to(torch.int8).view(n, k)
    return QuantWeight(q, scale, None, 8, g)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantWeight:
    """Weight-only int4, asymmetric per group of `group_size` (GGUF's Q4_1): float16 scale and
    bias (the group's minimum), codes round((w - min) / scale) in 0..15."""
    n, k = w.shape
    wf = w.float().view(n, k // group_size, group_size)
    lo, hi = wf.amin(dim=2), wf.amax(dim=2)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    bias = lo.half()
    q = torch.round((wf - bias.float().unsqueeze(2)) / scale.float().unsqueeze(2)).clamp(0, 15)
    return QuantWeight(pack_nibbles(q.view(n, k)), scale, bias, 4, group_size)


class QuantLinear:
    """y = x @ W.T + b over quantized W: one QuantWeight, or several whose outputs are concatenated
    (a fused projection whose parts came in different formats). Mirrors `kernels.cpu_linear.Linear`."""

    __slots__ = ("parts", "bias", "out_features", "in_features")

    def __init__(self, weight: QuantWeight | Sequence[QuantWeight], bias: torch.Tensor | None = None) -> None:
        parts = [weight] if isinstance(weight, QuantWeight) else list(weight)
        fused = cat_rows(parts) if len(parts) > 1 else parts[0]
        self.parts = [fused] if fused is not None else parts
        self.bias = bias
        self.out_features = sum(p.out_features for p in self.parts)
        self.in_features = parts[0].in_features

    kind = "quant"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [qgemm(x, p) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self.bias is None else y + self.bias

    def numel(self) -> int:
        return self.out_features * self.in_features + (0 if self.bias is None else self.bias.numel())

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts) + (0 if self.bias is None else
                                                      self.bias.numel() * self.bias.element_size())


def qgemm(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T -> [..., N] in x's dtype: the format's kernel where one is built
    for x's device (CPU: `kernels.cpu_kernels.qgemm`; CUDA: Triton), else the reference
    (dequantize, then F.linear). On the CPU (int16 activations for every row count) an output's
    bits depend only on its row of x and its column of w, not on the batch around them. A weight
    with a column permutation (`QuantWeight.perm`) reads x's columns in that order: one gather."""
    if x.device.type == "cpu":
        # A compiled CPU graph exists only where the kernels are built (engine/cpu_graph.py).
        if torch.compiler.is_compiling() or cpu_kernels.load() is not None:
            if w.perm is not None:
                x = x.index_select(-1, w.perm)
            # (the decode path's [B, K] float32 input takes no reshape or copy: this runs per projection)
            x2 = x if x.dim() == 2 else x.reshape(-1, w.in_features)
            y = cpu_kernels.qgemm(x2, w.qweight, w.scales, w.biases, w.bits, w.group_size, w.out_features)
            if x.dim() != 2:
                y = y.view(*x.shape[:-1], w.out_features)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
    elif x.device.type == "cuda":
        from kernels.triton_quant import triton_qgemm

        return triton_qgemm(x, w)
    return F.linear(x, w.dequantize(x.dtype))

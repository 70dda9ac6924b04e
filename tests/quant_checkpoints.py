"""GPTQ, AWQ and FP8 safetensors checkpoints for the tests: small random Llamas quantized and
packed in each format's own layout (packers written from the formats' specs, not from the
loader), with the real `quantization_config` fields (`build`, `quant_config`)."""

from __future__ import annotations

import numpy as np
import torch

from engine.builtin_model import llama_config, random_llama_weights

ARCH = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def projections(weights: dict) -> list[str]:
    return [n[: -len(".weight")] for n in weights if n.endswith(".weight") and n.rsplit(".", 2)[-2] in
            {p.split(".")[1] for p in PROJ}]


# --- the test's own quantizers and packers -------------------------------------------------------


def quantize_groups(w: torch.Tensor, bits: int, group_of: np.ndarray, ngroups: int, zero_lo: int,
                    zero_hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max quantization of w [N, K] per (row, group): codes [K, N], float16 scales
    [ngroups, N], integer zeros [ngroups, N] in zero_lo..zero_hi (checkpoint orientation)."""
    wt = w.t().double().numpy()  # [K, N]
    maxq = 2 ** bits - 1
    codes = np.zeros(wt.shape, dtype=np.int64)
    scales = np.zeros((ngroups, wt.shape[1]), dtype=np.float16)
    zeros = np.zeros((ngroups, wt.shape[1]), dtype=np.int64)
    for g in range(ngroups):
        rows = np.nonzero(group_of == g)[0]
        lo, hi = wt[rows].min(axis=0), wt[rows].max(axis=0)
        s = np.maximum((hi - lo) / maxq, 1e-4).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float64)), zero_lo, zero_hi).astype(np.int64)
        codes[rows] = np.clip(np.round(wt[rows] / s.astype(np.float64)) + z, 0, maxq)
        scales[g], zeros[g] = s, z
    return codes, scales, zeros


def intended(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_of: np.ndarray) -> torch.Tensor:
    """The float32 weight [N, K] a checkpoint holds: scale * (q - zero), computed per element."""
    k_groups = group_of.astype(np.int64)
    w = scales.astype(np.float32)[k_groups] * (codes - zeros[k_groups]).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(w.T))


def as_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def pack_gptq_rows(codes_kn: np.ndarray, bits: int) -> torch.Tensor:
    """qweight: row i * (32 / bits) + j of the codes into bits j*bits.. of word row i."""
    per = 32 // bits
    out = np.zeros((codes_kn.shape[0] // per, codes_kn.shape[1]), dtype=np.uint64)
    for j in range(per):
        out |= codes_kn[j::per].astype(np.uint64) << np.uint64(bits * j)
    return as_int32(out)


def pack_gptq_cols(vals: np.ndarray, bits: int) -> torch.Tensor:
    """qzeros: column c * (32 / bits) + j into bits j*bits.. of word column c."""
    per = 32 // bits
    out = np.zeros((vals.shape[0], vals.shape[1] // per), dtype=np.uint64)
    for j in range(per):
        out |= (vals[:, j::per].astype(np.uint64) & np.uint64(2 ** bits - 1)) << np.uint64(bits * j)
    return as_int32(out)


def pack_awq(vals: np.ndarray) -> torch.Tensor:
    """AutoAWQ GEMM: column c * 8 + AWQ_ORDER[i] into bits 4i.. of word column c."""
    out = np.zeros((vals.shape[0], vals.shape[1] // 8), dtype=np.uint64)
    for i in range(8):
        out |= vals[:, AWQ_ORDER[i]::8].astype(np.uint64) << np.uint64(4 * i)
    return as_int32(out)


def build(kind: str, seed: int = 3) -> tuple[dict, dict, dict]:
    """(config.json dict, checkpoint tensors, float weights it holds) for one scheme."""
    cfg = llama_config(**ARCH, torch_dtype="float16")
    base = random_llama_weights(cfg, seed=seed, std=0.08)
    tensors = {n: t.half() for n, t in base.items()}  # norms and embeddings pass through
    ref = {n: t.half().float() for n, t in base.items()}
    rng = np.random.default_rng(seed)
    for prefix in projections(base):
        w = base.pop(prefix + ".weight")
        del tensors[prefix + ".weight"]
        n, k = w.shape
        if kind.startswith("gptq"):
            bits = {"gptq8": 8, "gptq2": 2}.get(kind, 4)
            g = 64 if kind == "gptq8" else 128
            v1 = kind != "gptq_v2"
            if kind == "gptq_act":  # act-order: column perm[i] is the i-th quantized, group i // G
                perm = rng.permutation(k)
                group_of = np.empty(k, dtype=np.int64)
                group_of[perm] = np.arange(k) // g
            else:
                group_of = np.arange(k) // g
            # v1 stores zero - 1 in `bits` bits: zeros 1 .. 2**bits (a stored all-ones means 2**bits)
            lo, hi = (1, 2 ** bits) if v1 else (0, 2 ** bits - 1)
            codes, scales, zeros = quantize_groups(w, bits, group_of, k // g, lo, hi)
            if v1:
                zeros[0, :4] = 2 ** bits  # the wrap-around case on purpose
            tensors |= {prefix + ".qweight": pack_gptq_rows(codes, bits),
                        prefix + ".qzeros": pack_gptq_cols(zeros - (1 if v1 else 0), bits),
                        prefix + ".scales": torch.from_numpy(scales),
                        prefix + ".g_idx": torch.from_numpy(group_of.astype(np.int32))}
            ref[prefix + ".weight"] = intended(codes, scales, zeros, group_of)
        elif kind == "awq":
            g = 128
            group_of = np.arange(k) // g
            codes, scales, zeros = quantize_groups(w, 4, group_of, k // g, 0, 15)
            tensors |= {prefix + ".qweight": pack_awq(codes), prefix + ".qzeros": pack_awq(zeros),
                        prefix + ".scales": torch.from_numpy(scales)}
            ref[prefix + ".weight"] = intended(codes, scales, zeros, group_of)
        elif kind == "fp8":  # 128 x 128 blocks, weight_scale_inv multiplies
            blocks = w.view(n // 128, 128, k // 128, 128)
            s = (blocks.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-8)
            q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn)
            tensors |= {prefix + ".weight": q.reshape(n, k), prefix + ".weight_scale_inv": s,
                        prefix + ".input_scale": torch.ones(())}
            ref[prefix + ".weight"] = (q.float() * s[:, None, :, None]).reshape(n, k)
        elif kind == "ct_fp8":  # compressed-tensors, per-channel float8
            s = (w.abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-8)
            q = (w / s).to(torch.float8_e4m3fn)
            tensors |= {prefix + ".weight": q, prefix + ".weight_scale": s}
            ref[prefix + ".weight"] = q.float() * s
    cfg["quantization_config"] = quant_config(kind)
    return cfg, tensors, ref


def quant_config(kind: str) -> dict:
    if kind.startswith("gptq"):
        return {"quant_method": "gptq", "bits": {"gptq8": 8, "gptq2": 2}.get(kind, 4),
                "group_size": 64 if kind == "gptq8" else 128, "desc_act": kind == "gptq_act", "sym": False,
                "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
                "checkpoint_format": "gptq_v2" if kind == "gptq_v2" else "gptq", "model_file_base_name": "model"}
    if kind == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
    if kind == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}

"""GPTQ, AWQ and FP8 safetensors checkpoints (engine/quantized/): small random Llamas quantized
and packed here in each format's own layout (packers written from the formats' specs, not from
the loader), with the real `quantization_config` fields in config.json.

- Unpacking recovers exactly the float weights each checkpoint was built to hold (value per value),
  dequantized (`quantization="none"`) and as QuantWeights (`auto`).
- `none` gives greedy output token-identical to a float checkpoint holding those weights.
- `auto` computes GPTQ/AWQ projections as QuantLinear; prompt log-probs stay within LOGPROB_TOL
  of the float reference (the CPU kernel rounds activations to int16 per 32-element block).
- Act-order GPTQ (a shuffled g_idx) stays quantized too, its input columns permuted so each group
  is contiguous (`QuantWeight.perm`): the same values, and greedy output equal to the same
  checkpoint dequantized at load.
- Unsupported settings are a ConfigError at load naming them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from engine import Engine, SamplingParams
from engine.builtin_model import llama_config, random_llama_weights, write_checkpoint
from engine.errors import ConfigError
from engine.quantized import convert_checkpoint
from kernels.quant import QuantLinear, QuantWeight
from tests.helpers import GREEDY, prompts

ARCH = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
DEQUANTIZED_TOL = 1e-3  # projections dequantized at load: float all the way
LOGPROB_TOL = 0.05  # kept quantized: the kernel's int16 activations, amplified by a random model


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


KINDS = ["gptq", "gptq_v2", "gptq8", "gptq2", "gptq_act", "awq", "fp8", "ct_fp8"]
KEPT = {"gptq", "gptq_v2", "gptq8", "gptq2", "gptq_act", "awq"}  # become QuantWeights with `auto`


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (quantized folder, float folder, tensors, float weights), built on first use."""
    root = tmp_path_factory.mktemp("quant_ckpt")
    made: dict[str, tuple] = {}

    def get(kind: str) -> tuple:
        if kind not in made:
            cfg, tensors, ref = build(kind)
            qdir = write_checkpoint(str(root / kind), cfg, tensors)
            fcfg = {k: v for k, v in cfg.items() if k != "quantization_config"} | {"torch_dtype": "float32"}
            fdir = write_checkpoint(str(root / (kind + "-float")), fcfg, ref)
            made[kind] = (qdir, fdir, tensors, ref)
        return made[kind]
    return get


@pytest.mark.parametrize("kind", KINDS)
def test_unpacking_is_exact(checkpoints, kind):
    _, _, tensors, ref = checkpoints(kind)
    qc = quant_config(kind)
    flat = convert_checkpoint(dict(tensors), qc, keep=False)
    assert set(flat) == set(ref)  # one `.weight` per projection, no packed leftovers
    for name, want in ref.items():
        assert flat[name].dtype == torch.float32 or name.endswith("norm.weight") or "embed" in name
        assert torch.equal(flat[name].float(), want), name
    kept = convert_checkpoint(dict(tensors), qc, keep=True)
    assert set(kept) == set(ref)
    for prefix in projections(ref):
        w = kept[prefix + ".weight"]
        if kind in KEPT:
            assert isinstance(w, QuantWeight) and w.bits == (8 if kind == "gptq8" else 4), prefix
            assert (w.perm is not None) == (kind == "gptq_act"), prefix
            assert torch.equal(w.dequantize(), ref[prefix + ".weight"]), prefix
        else:  # FP8 is dequantized whatever `keep` says
            assert isinstance(w, torch.Tensor) and torch.equal(w, ref[prefix + ".weight"]), prefix


@pytest.mark.parametrize("kind", ["gptq", "gptq_act", "awq", "fp8", "ct_fp8"])
def test_dequantized_matches_float_checkpoint(checkpoints, kind):
    qdir, fdir, _, _ = checkpoints(kind)
    ref = Engine(model_path=fdir, max_total_tokens=2048)
    eng = Engine(model_path=qdir, quantization="none", max_total_tokens=2048)
    ids = prompts(ref, 3, seed=7)
    want = ref.generate(input_ids=ids, sampling_params=GREEDY)
    got = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def worst_logprob_gap(a: Engine, b: Engine, ids: list[list[int]]) -> float:
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    worst = 0.0
    for p in ids:
        x, y = (e.generate(input_ids=p, sampling_params=params).prompt_logprobs for e in (a, b))
        assert x[0] is None and y[0] is None and len(x) == len(y) == len(p)
        worst = max(worst, *(abs(u.logprob - v.logprob) for u, v in zip(x[1:], y[1:])))
    return worst


@pytest.mark.parametrize("kind", ["gptq", "gptq8", "awq", "gptq_act", "fp8"])
def test_auto_keeps_quantized_close_to_float(checkpoints, kind):
    """GPTQ/AWQ projections (act-order GPTQ included) run as QuantLinear; FP8 as float (dequantized).
    Long and short prompts (the kernel computes every row count alike): log-probs within
    LOGPROB_TOL of the float model, DEQUANTIZED_TOL where nothing stayed quantized."""
    qdir, fdir, _, _ = checkpoints(kind)
    ref = Engine(model_path=fdir, max_total_tokens=2048)
    eng = Engine(model_path=qdir, max_total_tokens=2048)
    layer = eng.model_runner.model.layers[0]
    quant = kind in KEPT
    assert isinstance(layer.attn.qkv_proj, QuantLinear) == quant
    assert isinstance(layer.mlp.down, QuantLinear) == quant
    assert isinstance(layer.attn.o_proj, QuantLinear) == quant
    tol = LOGPROB_TOL if quant else DEQUANTIZED_TOL
    for lo, hi, seed in ((20, 40, 4), (4, 14, 5)):
        gap = worst_logprob_gap(ref, eng, prompts(ref, 3, seed=seed, lo=lo, hi=hi))
        assert gap < tol, f"{kind}: a prompt token's logprob moved by {gap:.5f}"


def test_act_order_kept_quantized_matches_dequantized(checkpoints):
    """Act-order GPTQ kept quantized (its columns permuted, x gathered per call) against the same
    checkpoint dequantized at load: each projection's output within the kernel's tolerance of
    F.linear over the dequantized weight, and greedy tokens equal."""
    qdir, _, _, ref = checkpoints("gptq_act")
    eng = Engine(model_path=qdir, max_total_tokens=2048)
    deq = Engine(model_path=qdir, quantization="none", max_total_tokens=2048)
    layer = eng.model_runner.model.layers[0]
    for lin, names in ((layer.attn.qkv_proj, ("q_proj", "k_proj", "v_proj")), (layer.mlp.down, ("down_proj",))):
        assert isinstance(lin, QuantLinear) and all(p.perm is not None for p in lin.parts)
        parts = [ref[f"model.layers.0.{'mlp' if n == 'down_proj' else 'self_attn'}.{n}.weight"] for n in names]
        x = torch.randn(7, lin.in_features, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(lin(x), x @ torch.cat(parts).t(), atol=2e-3, rtol=2e-3)
    ids = prompts(eng, 3, seed=7)
    want = deq.generate(input_ids=ids, sampling_params=GREEDY)
    got = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


BAD = [
    ("gptq", {"bits": 3}, r"bits=3"),
    ("gptq", {"checkpoint_format": "marlin"}, r"'marlin'"),
    ("awq", {"version": "gemv"}, r"'gemv'"),
    ("awq", {"zero_point": False}, r"zero_point"),
    ("fp8", {"quant_method": "bitsandbytes"}, r"'bitsandbytes'"),
    ("ct_fp8", {"format": "pack-quantized"}, r"'pack-quantized'"),
]


@pytest.mark.parametrize("kind, change, match", BAD, ids=[m for _, _, m in BAD])
def test_unsupported_config_is_named_at_load(checkpoints, tmp_path, kind, change, match):
    qdir, _, _, _ = checkpoints(kind)
    folder = tmp_path / "bad"
    folder.mkdir()
    for name in os.listdir(qdir):
        os.symlink(os.path.join(qdir, name), folder / name)
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] |= change
    os.unlink(folder / "config.json")
    with open(folder / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match=match):
        Engine(model_path=str(folder), max_total_tokens=2048)

"""GPTQ, AWQ and FP8 safetensors checkpoints (engine/quantized/): small random Llamas quantized
and packed in each format's own layout (tests/quant_checkpoints.py: packers written from the
formats' specs, not from the loader), with the real `quantization_config` fields in config.json.

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

import pytest
import torch

from engine import Engine, SamplingParams
from engine.builtin_model import write_checkpoint
from engine.errors import ConfigError
from engine.quantized import convert_checkpoint
from kernels.quant import QuantLinear, QuantWeight
from tests.helpers import GREEDY, prompts
from tests.quant_checkpoints import build, projections, quant_config

DEQUANTIZED_TOL = 1e-3  # projections dequantized at load: float all the way
LOGPROB_TOL = 0.05  # kept quantized: the kernel's int16 activations, amplified by a random model


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

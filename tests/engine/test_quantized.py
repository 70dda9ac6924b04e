"""Weights kept quantized through every batching mode: a Q4_K GGUF file (all projections, its
embedding / LM head too) and a float checkpoint quantized at load (int8, int4). Each mode's greedy
output equals the same engine's plain run, token for token (a row's result does not depend on the
rows batched with it), and the KV pool is whole afterwards."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from engine import Engine, SamplingParams
from engine.builtin_model import cached_random_checkpoint, llama_config, random_llama_weights
from engine.models.layers import GatedMLP
from kernels.quant import QuantLinear, quantize_int4, quantize_int8
from tests.gguf_files import VOCAB_SIZE, write_gguf
from tests.helpers import prompts, run_staggered

PARAMS = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
ARCH = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True)
MODES = {
    "chunked": dict(chunked_prefill_size=16),
    "mixed": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "overlap": dict(enable_overlap_schedule=True),
    "no_radix": dict(disable_radix_cache=True),
    "retraction": dict(max_total_tokens=260),
    "ngram": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4),
    # The checkpoint drafts for itself (quantized the same way): DRAFT_EXTEND_V2 and verify batches.
    "draft_model": dict(speculative_algorithm="draft_model", speculative_num_draft_tokens=3),
    "split": dict(enable_split_prefill=True, split_forward_token_budget=8),
    "cpu_graph": dict(cpu_graph="on", cpu_graph_max_bs=8),
}
MODE_BATCHES = {"mixed": "MIXED", "ngram": "TARGET_VERIFY", "draft_model": "DRAFT_EXTEND_V2",
                "split": "SPLIT_PREFILL"}  # a mode's batches that must have run


@pytest.fixture(scope="module")
def q4k_file(tmp_path_factory):
    cfg = llama_config(**ARCH, vocab_size=VOCAB_SIZE)
    path = str(tmp_path_factory.mktemp("quant") / "q4k.gguf")
    return write_gguf(path, cfg, random_llama_weights(cfg, seed=5, std=0.08), GGMLType.Q4_K)


@pytest.fixture(scope="module")
def float_dir():
    return cached_random_checkpoint("quant-test-llama-v1", llama_config(**ARCH, vocab_size=261), std=0.08)


def checkpoint(name: str, q4k_file: str, float_dir: str) -> tuple[str, dict]:
    return {"q4k": (q4k_file, {}), "int8": (float_dir, {"quantization": "int8"}),
            "int4": (float_dir, {"quantization": "int4"})}[name]


# Every mode on the GGUF file; the checkpoints quantized at load in the modes that batch rows of
# different kinds together.
CASES = [("q4k", m) for m in MODES] + [(w, m) for w in ("int8", "int4") for m in ("mixed", "cpu_graph")]


@pytest.mark.parametrize("weights, mode", CASES)
def test_batching_modes_keep_outputs(q4k_file, float_dir, weights, mode):
    path, kw = checkpoint(weights, q4k_file, float_dir)
    plain = Engine(model_path=path, max_total_tokens=4096, **kw)
    assert isinstance(plain.model_runner.model.layers[0].attn.qkv_proj, QuantLinear)
    ids = prompts(plain, 10, seed=11, lo=20, hi=60)
    ids += [ids[0][:30] + p[:5] for p in ids[1:4]]  # shared prefixes: radix hits
    want = [o.token_ids for o in plain.generate(input_ids=ids, sampling_params=PARAMS)]
    extra = {"speculative_draft_model_path": path} if mode == "draft_model" else {}
    eng = Engine(model_path=path, **{"max_total_tokens": 4096, **kw, **MODES[mode], **extra})
    got = [o.token_ids for o in run_staggered(eng, ids, PARAMS, every=2)]
    assert got == want
    if mode in MODE_BATCHES:
        assert eng.stats().batches_by_mode[MODE_BATCHES[mode]] > 0
    if mode == "retraction":
        assert eng.stats().num_retracted > 0
    if mode == "cpu_graph":
        assert eng.model_runner.graph_runner.replays > 0 and not eng.model_runner.graph_runner.failed
    eng.check_memory()


def test_quantize_at_load_bytes_and_closeness(float_dir):
    ref = Engine(model_path=float_dir, max_total_tokens=1024)
    ids = prompts(ref, 2, seed=12, lo=30, hi=40)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    want = [ref.generate(input_ids=p, sampling_params=params).prompt_logprobs for p in ids]
    full = ref.model_runner.model.weight_bytes()
    # mean |change| of the prompt tokens' logprobs: weight rounding on a random model's small margins
    for kind, ratio, tol in (("int8", 0.35, 0.03), ("int4", 0.25, 0.8)):
        eng = Engine(model_path=float_dir, quantization=kind, max_total_tokens=1024)
        assert eng.model_runner.model.weight_bytes() < ratio * full, kind
        errs = [abs(a.logprob - b.logprob) for p, w in zip(ids, want)
                for a, b in zip(eng.generate(input_ids=p, sampling_params=params).prompt_logprobs[1:], w[1:])]
        assert sum(errs) / len(errs) < tol, f"{kind}: {sum(errs) / len(errs):.3f}"


@pytest.mark.parametrize("quantize", [lambda w: quantize_int8(w, 32), quantize_int4], ids=["int8", "int4"])
def test_attention_dp_split_of_a_quantized_mlp_sums_to_whole(quantize):
    """Under attention-DP each member holds a slice of the intermediate dim, cut on the blocks:
    the members' partial outputs add up to the whole quantized MLP."""
    g = torch.Generator().manual_seed(0)
    gate, up, down = (quantize(torch.randn(*s, generator=g) * 0.1) for s in ((128, 64), (128, 64), (64, 128)))
    x = torch.randn(5, 64, generator=g)
    whole = GatedMLP(gate, up, down)
    parts = [GatedMLP(gate, up, down, shard=(r, 2)) for r in range(2)]
    assert isinstance(parts[0].down, QuantLinear) and parts[0].down.in_features == 64
    torch.testing.assert_close(parts[0](x) + parts[1](x), whole(x), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quantized_weights_run_through_triton(q4k_file):
    """On CUDA the Q4_K projections run the Triton kernel (CUDA graphs included): bfloat16
    prompt log-probabilities stay near the CPU's float32 ones, and the pool is whole after."""
    cpu = Engine(model_path=q4k_file, max_total_tokens=1024)
    gpu = Engine(model_path=q4k_file, device="cuda", dtype="bfloat16", max_total_tokens=1024)
    assert isinstance(gpu.model_runner.model.layers[0].mlp.down, QuantLinear)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    for p in prompts(cpu, 3, seed=13, lo=20, hi=40):
        a, b = (e.generate(input_ids=p, sampling_params=params).prompt_logprobs for e in (cpu, gpu))
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:])) < 0.3
    outs = gpu.generate(input_ids=prompts(gpu, 4, seed=14), sampling_params=PARAMS)
    assert all(len(o.token_ids) == 20 for o in outs)
    gpu.check_memory()

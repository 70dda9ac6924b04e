"""Mixture-of-experts models: greedy parity with transformers (Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE) in every batching mode, the grouped CPU path against the naive per-token reference, the
expert-load counter, the attention-DP intermediate split, and the built-in MoE model."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.builtin_model import (
    byte_level_tokenizer,
    llama_config,
    random_llama_weights,
    write_checkpoint,
)
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.model_path import MODEL_NAMES, resolve_model_path
from engine.models import build_model, load_weights
from engine.models.layers import MoEMLP
from kernels.cpu_linear import Linear, onednn_linear_works
from kernels.moe import expert_counts, grouped_moe, moe_ref, select_experts
from kernels.quant import QuantLinear, quantize_int4, quantize_int8
from tests.helpers import GREEDY, assert_matches_hf, prompts, run_staggered

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
MOE_CONFIGS = {
    # 8 experts, top-2, not renormalised; per-head q/k norm.
    "qwen3_moe": llama_config(**SMALL, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                              head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    # top-1 of 8 (a decode step leaves 7 experts of every layer without tokens), renormalised;
    # layer 0 dense through decoder_sparse_step.
    "qwen3_moe_top1": llama_config(**SMALL, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                                   num_experts=8, num_experts_per_tok=1, moe_intermediate_size=64,
                                   norm_topk_prob=True, decoder_sparse_step=2),
    # 4 experts, top-3 (three terms summed per token), always renormalised.
    "mixtral": llama_config(**{**SMALL, "intermediate_size": 48}, architectures=["MixtralForCausalLM"],
                            model_type="mixtral", num_local_experts=4, num_experts_per_tok=3, sliding_window=None),
    # a sigmoid-gated shared expert, q/k/v bias, layer 0 dense through mlp_only_layers.
    "qwen2_moe": llama_config(**SMALL, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                              num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, mlp_only_layers=[0]),
    # q/k norm over all heads, q/k/v clamped.
    "olmoe": llama_config(**{**SMALL, "intermediate_size": 32}, architectures=["OlmoeForCausalLM"],
                          model_type="olmoe", num_experts=8, num_experts_per_tok=2, clip_qkv=2.0),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    # std 0.15 as in conftest: peaked logits, so float32 rounding never decides a greedy tie.
    return {name: write_checkpoint(str(root / name), cfg, random_llama_weights(cfg, seed=1, std=0.15),
                                   byte_level_tokenizer())
            for name, cfg in MOE_CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_batch_matches_transformers(moe_dirs, hf, name):
    path = moe_dirs[name]
    eng = Engine(model_path=path)
    ids = prompts(eng, 6, seed=1, lo=1, hi=40)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert_matches_hf(eng, hf, path, ids, outs)
    model = eng.model_runner.model
    assert model.num_parameters() == sum(t.numel() for t in load_weights(path).values())
    cfg = eng.model_config
    sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    forwarded = sum(len(p) + 15 for p in ids)  # every prompt token and every output but the last
    assert model.expert_tokens.sum().item() == forwarded * cfg.num_experts_per_tok * sparse
    eng.check_memory()


MODES = {
    "no_radix_chunked": dict(disable_radix_cache=True, chunked_prefill_size=16, max_total_tokens=300),
    "chunked": dict(chunked_prefill_size=7),
    "retraction": dict(max_total_tokens=200),
    "overlap": dict(enable_overlap=True, chunked_prefill_size=8),
}


@pytest.mark.parametrize("mode, name", [("no_radix_chunked", "qwen3_moe"), ("chunked", "mixtral"),
                                        ("retraction", "qwen3_moe_top1"), ("retraction", "mixtral"),
                                        ("overlap", "qwen2_moe")])
def test_batching_modes_match_transformers(moe_dirs, hf, mode, name):
    path = moe_dirs[name]
    eng = Engine(model_path=path, **MODES[mode])
    n = 12 if mode == "retraction" else 6
    ids = prompts(eng, n, seed=7, lo=10, hi=40)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = eng.generate(input_ids=ids, sampling_params=params)
    if mode == "retraction":
        assert eng.stats().num_retracted > 0
    assert_matches_hf(eng, hf, path, ids, outs, n=24)
    eng.check_memory()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_mixed_batches_and_cached_prefix(moe_dirs, hf, name):
    path = moe_dirs[name]
    eng = Engine(model_path=path, enable_mixed_chunk=True, chunked_prefill_size=8)
    ids = prompts(eng, 6, seed=4, lo=10, hi=40)
    outs = run_staggered(eng, ids, GREEDY)
    assert eng.stats().batches_by_mode["MIXED"] > 0
    assert_matches_hf(eng, hf, path, ids, outs)
    again = eng.generate(input_ids=ids[:2], sampling_params=GREEDY)  # prefixes from the radix cache
    assert all(o.cached_tokens > 0 for o in again)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:2]]
    eng.check_memory()


def experts(w13: torch.Tensor, w2: torch.Tensor, onednn: bool) -> list[tuple[Linear, Linear]]:
    return [(Linear(w13[e], onednn=onednn), Linear(w2[e], onednn=onednn)) for e in range(w13.shape[0])]


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("E, k, renorm", [(4, 1, False), (8, 2, False), (8, 2, True), (6, 3, True)])
def test_grouped_moe_matches_naive_reference(E, k, renorm, onednn):
    if onednn and not onednn_linear_works(torch.float32):
        pytest.skip("this torch build has no working oneDNN linear")
    g = torch.Generator().manual_seed(E * 10 + k)
    H, inter = 64, 32
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) * 0.15, torch.randn(E, H, inter, generator=g) * 0.15
    layer = experts(w13, w2, onednn)
    for T in (0, 1, 5, 37):
        x = torch.randn(T, H, generator=g)
        weights, ids = select_experts(torch.randn(T, E, generator=g), k, renorm)
        if renorm and T:
            torch.testing.assert_close(weights.sum(-1), torch.ones(T))
        got = grouped_moe(x, weights, ids, layer)
        assert got.shape == (T, H)
        torch.testing.assert_close(got, moe_ref(x, weights, ids, w13, w2), atol=2e-5, rtol=1e-4)
    # Routing that leaves experts 0 and E-1 without tokens.
    x = torch.randn(9, H, generator=g)
    ids = 1 + (torch.arange(9)[:, None] + torch.arange(k)) % (E - 2)  # k distinct experts per token
    weights = torch.rand(9, k, generator=g)
    counts = expert_counts(ids, E)
    assert counts[0] == 0 and counts[-1] == 0 and counts.sum() == 9 * k
    torch.testing.assert_close(grouped_moe(x, weights, ids, layer, counts), moe_ref(x, weights, ids, w13, w2),
                               atol=2e-5, rtol=1e-4)


def test_select_experts_is_transformers_routing():
    """Mixtral's softmax over the top-k logits equals the renormalised top-k of the softmax."""
    logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(3))
    weights, ids = select_experts(logits, 2, renormalize=True)
    top_logits, top_ids = torch.topk(logits, 2, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top_logits, dim=-1))
    raw, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, ids))


def test_attention_dp_intermediate_split_sums_to_whole():
    """Under attention-DP with moe_split="intermediate" each member holds a slice of every
    expert's intermediate dim (and of the shared expert); the members' partial outputs add up to
    the whole MoE MLP."""
    g = torch.Generator().manual_seed(0)
    E, H, inter = 4, 32, 16
    router, down = torch.randn(E, H, generator=g), torch.randn(E, H, inter, generator=g)
    gate, up = torch.randn(E, inter, H, generator=g), torch.randn(E, inter, H, generator=g)
    x = torch.randn(11, H, generator=g)
    whole = MoEMLP(router, gate, up, down, 2, True)
    parts = [MoEMLP(router, gate, up, down, 2, True, shard=(r, 2), split="intermediate") for r in range(2)]
    torch.testing.assert_close(parts[0](x) + parts[1](x), whole(x), atol=1e-4, rtol=1e-4)
    assert parts[0].numel() + parts[1].numel() == whole.numel() + router.numel()
    with pytest.raises(ConfigError, match="num_experts_per_tok 5"):
        MoEMLP(router, gate, up, down, 5, True)


@pytest.mark.parametrize("E, k, world", [(4, 2, 2), (8, 1, 4), (6, 3, 3)])
def test_expert_parallel_split_sums_to_whole(E, k, world):
    """Expert parallelism: each member holds E/world whole experts, computes only their pairs and
    counts only them; the partial outputs add up to the whole MoE MLP (exactly for top-2, where a
    token's two terms are added once either way) and the counts to the whole routing."""
    g = torch.Generator().manual_seed(E + k)
    H, inter = 32, 16
    router, down = torch.randn(E, H, generator=g), torch.randn(E, H, inter, generator=g)
    gate, up = torch.randn(E, inter, H, generator=g), torch.randn(E, inter, H, generator=g)
    x = torch.randn(13, H, generator=g)
    counts = [torch.zeros(E, dtype=torch.int64) for _ in range(world + 1)]
    whole = MoEMLP(router, gate, up, down, k, True, expert_tokens=counts[-1])
    parts = [MoEMLP(router, gate, up, down, k, True, shard=(r, world), expert_tokens=counts[r])
             for r in range(world)]
    got = sum(p(x) for p in parts)
    if k <= 2:
        assert torch.equal(got, whole(x))
    else:
        torch.testing.assert_close(got, whole(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(sum(counts[:world]), counts[-1])
    for r, c in enumerate(counts[:world]):  # a member counts its own experts only
        held = slice(r * E // world, (r + 1) * E // world)
        assert c.sum() == c[held].sum()
    assert all(p.expert_numel * world == whole.expert_numel for p in parts)
    assert parts[0](x[:0]).shape == (0, H)  # an IDLE member's rows
    with pytest.raises(ConfigError, match="num_experts 4 is not divisible by the DP group size 3"):
        MoEMLP(router[:4], gate[:4], up[:4], down[:4], 1, True, shard=(0, 3))


def test_fused_triton_path_matches_grouped_cpu_path():
    """The CPU twin of the CUDA path: the same MoE MLP (both splits too: a member's experts, or
    slices of all) through the Triton kernel (interpreted here) and through the grouped CPU GEMMs."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    E, H, inter = 6, 64, 32
    router, down = torch.randn(E, H, generator=g), torch.randn(E, H, inter, generator=g) * 0.15
    gate, up = torch.randn(E, inter, H, generator=g) * 0.15, torch.randn(E, inter, H, generator=g) * 0.15
    x = torch.randn(13, H, generator=g)
    for shard, split in (((0, 1), "experts"), ((1, 2), "intermediate"), ((0, 2), "experts"), ((1, 3), "experts")):
        fused, grouped = (MoEMLP(router, gate, up, down, 2, False, shard, fused=f, split=split) for f in (True, False))
        assert fused.fused and not grouped.fused and fused.numel() == grouped.numel()
        torch.testing.assert_close(fused(x), grouped(x), atol=1e-5, rtol=1e-4)


def test_expert_count_errors_are_config_errors(tmp_path):
    cfg = dict(MOE_CONFIGS["qwen3_moe"], num_experts=0)
    path = write_checkpoint(str(tmp_path), cfg, random_llama_weights(MOE_CONFIGS["qwen3_moe"], seed=0))
    with pytest.raises(ConfigError, match="num_experts >= 1"):
        build_model(ModelConfig.from_dir(path), path, torch.float32, torch.device("cpu"), 64)


def test_builtin_moe_builds_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXRAY_CACHE_DIR", str(tmp_path))
    eng = Engine(model_path="builtin-moe", max_total_tokens=2048)
    assert type(eng.model_runner.model).__name__ == "Qwen3MoeForCausalLM"
    cfg = eng.model_config
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    out = eng.generate(prompt="Hello", sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                      ignore_eos=True))
    assert len(out.token_ids) == 8
    assert eng.model_runner.model.expert_tokens.sum().item() > 0
    folder = resolve_model_path("builtin-moe")
    assert folder.startswith(str(tmp_path)) and ModelConfig.from_dir(folder) == cfg
    assert resolve_model_path(folder) == folder and {"builtin", "builtin-moe"} <= set(MODEL_NAMES)
    eng.check_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_cuda_triton_moe_matches_transformers(moe_dirs, hf, name):
    """On CUDA the experts run in the Triton kernel (decode replays CUDA graphs): float32 greedy
    tokens equal transformers'; bfloat16 runs (its numerics: tests/kernels/test_triton_moe.py)."""
    path = moe_dirs[name]
    eng = Engine(model_path=path, device="cuda", dtype="float32", attention_backend="triton")
    assert eng.model_runner.model.layers[-1].mlp.fused
    ids = prompts(eng, 6, seed=1, lo=1, hi=40)
    assert_matches_hf(eng, hf, path, ids, eng.generate(input_ids=ids, sampling_params=GREEDY))
    bf16 = Engine(model_path=path, device="cuda", dtype="bfloat16", attention_backend="triton")
    assert all(len(o.token_ids) == 16 for o in bf16.generate(input_ids=ids, sampling_params=GREEDY))
    assert bf16.model_runner.model.expert_tokens.sum().item() > 0
    eng.check_memory()
    bf16.check_memory()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_experts_match_their_dequantized_weights(bits, device):
    """Experts kept quantized (one QuantWeight per expert projection, computed by the quantized
    kernels: C++ on the CPU, Triton on CUDA) give what the same MoE MLP over their dequantized
    weights gives, whole and split both ways (a member's experts; a slice of every expert's
    intermediate dim)."""
    g = torch.Generator().manual_seed(bits)
    E, H, inter = 4, 64, 64
    router = torch.randn(E, H, generator=g)
    gate, up = torch.randn(E, inter, H, generator=g) * 0.15, torch.randn(E, inter, H, generator=g) * 0.15
    down = torch.randn(E, H, inter, generator=g) * 0.15
    quantize = (lambda w: quantize_int8(w, 32)) if bits == 8 else quantize_int4
    q = [[quantize(t[e]).to(torch.device(device)) for e in range(E)] for t in (gate, up, down)]
    deq = [torch.stack([w.dequantize(torch.float32) for w in ws]) for ws in q]
    router, x = router.to(device), torch.randn(9, H, generator=g).to(device)
    for shard, split in (((0, 1), "experts"), ((0, 2), "experts"), ((1, 2), "experts"),
                         ((0, 2), "intermediate"), ((1, 2), "intermediate")):
        kept = MoEMLP(router, *q, 2, True, shard, split=split)
        ref = MoEMLP(router, *deq, 2, True, shard, split=split)
        assert isinstance(kept.experts[0][0], QuantLinear) and not kept.fused
        assert kept.numel() == ref.numel()
        scale = ref(x).abs().max().item()
        assert (kept(x) - ref(x)).abs().max().item() < 0.02 * scale, (shard, split)
    with pytest.raises(ConfigError, match="quantized ones run grouped"):
        MoEMLP(router, *q, 2, True, fused=True)


@pytest.mark.gpu
def test_cuda_quantized_experts_run_eagerly(moe_dirs):
    """int8 experts on CUDA run grouped through the Triton quantized GEMM, which reads routing
    counts on the host: the engine starts without CUDA graphs and agrees with the CPU's int8
    engine on nearly every greedy token."""
    path = moe_dirs["qwen3_moe"]
    eng = Engine(model_path=path, device="cuda", dtype="float32", quantization="int8", attention_backend="triton")
    assert eng.model_runner.graph_runner is None and not eng.model_runner.model.layers[-1].mlp.fused
    cpu = Engine(model_path=path, quantization="int8")
    ids = prompts(cpu, 4, seed=2, lo=5, hi=30)
    got, want = (e.generate(input_ids=ids, sampling_params=GREEDY) for e in (eng, cpu))
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g.token_ids, w.token_ids))
    assert same >= 0.8 * sum(len(w.token_ids) for w in want)


def test_quantized_experts_split_inside_a_group_are_held_as_float():
    """attention-DP's intermediate split at 48 of 96 falls inside int4's 32-wide groups of down's
    input: the member's experts are held as float (as unquantized experts load), the sums exact."""
    g = torch.Generator().manual_seed(3)
    E, H, inter = 4, 64, 96
    router = torch.randn(E, H, generator=g)
    weights = [torch.randn(E, inter, H, generator=g) * 0.15, torch.randn(E, inter, H, generator=g) * 0.15,
               torch.randn(E, H, inter, generator=g) * 0.15]
    q = [[quantize_int4(t[e]) for e in range(E)] for t in weights]
    deq = [torch.stack([w.dequantize(torch.float32) for w in ws]) for ws in q]
    x = torch.randn(7, H, generator=g)
    whole = MoEMLP(router, *deq, 2, True)
    parts = [MoEMLP(router, *q, 2, True, shard=(r, 2), split="intermediate") for r in range(2)]
    assert all(not isinstance(p.experts[0][0], QuantLinear) for p in parts)
    torch.testing.assert_close(parts[0](x) + parts[1](x), whole(x), atol=1e-4, rtol=1e-4)

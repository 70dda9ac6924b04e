"""Tensor-parallel engines (tp_size=2) against one rank: the same greedy tokens.

Rank 0 is an Engine in this process (`engine.tp.worker.rank0_engine`); rank 1 runs
`engine.tp.worker.run_worker` in one spawned process that serves every test's engine in turn (it
imports torch once). Each test builds a two-rank engine and a one-rank reference with the same
settings, runs the same requests through both (staggered, so prefills land beside running
decodes; repeated prefixes, so radix hits), and compares.

Tolerance: greedy tokens identical (the random models have peaked logits, std 0.15, so the
rounding of the sharded sums, which add K in two pieces and then the ranks' partial sums, never
decides a greedy choice); logprobs within LOGPROB_ATOL (float32 sums in another order), or
LOGPROB_ATOL_QUANTIZED with int8 weights."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.builtin_model import (
    llama_config,
    moe_config,
    write_checkpoint,
)
from engine.errors import ConfigError
from engine.hicache.config import HiCacheConfig
from engine.tp import TPGroup, rank_weight_bytes
from kernels.quant import QuantLinear
from tests.helpers import run_staggered, write_random_models
from tests.quant_checkpoints import build
from tests.tp_gang import BASE, Gang, gang_fixture

LOGPROB_ATOL = 1e-4
# int8 weights: the quantized GEMM rounds its activations per 32-element block, and a sharded
# projection's activations are other tensors (one rank's heads, one rank's intermediate slice).
LOGPROB_ATOL_QUANTIZED = 1e-3
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(
    max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
)

CASES = {
    "mha_tied": llama_config(**BASE, num_key_value_heads=4, tie_word_embeddings=True),
    # Qwen2: q/k/v biases split with their heads.
    "gqa_untied": llama_config(
        **BASE,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
    ),
    # One KV head: replicated on both ranks; Qwen3's per-head q/k norms.
    "mqa": llama_config(
        **BASE,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
    ),
    # Layer 0 dense, layer 1 sparse with a shared expert: the experts split inside (on int8's
    # 32-wide groups when quantized).
    "moe": moe_config(
        **dict(BASE, intermediate_size=128),
        num_key_value_heads=2,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        mlp_only_layers=[0],
        shared_expert_intermediate_size=48,
    ),
}
MODES = {
    "plain": {},
    "chunked_mixed": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "overlap": dict(enable_overlap_schedule=True),
    "split_prefill": dict(enable_split_prefill=True, split_forward_token_budget=40),
    "no_radix": dict(disable_radix_cache=True),
    # TARGET_VERIFY batches (run as decode rows on the CPU), prompt n-grams as drafts.
    "ngram_spec": dict(speculative_algorithm="ngram"),
    # Quantized at load (Q8_0's blocks of 32), then sharded on block boundaries.
    "int8": dict(quantization="int8"),
    # The model as its own draft, run whole on rank 0 (test_greedy_matches_one_rank sets its path).
    "draft_self": dict(speculative_algorithm="draft_model"),
}
RUNS = [
    ("mha_tied", "plain"),
    ("mha_tied", "overlap"),
    ("gqa_untied", "chunked_mixed"),
    ("gqa_untied", "split_prefill"),
    ("mqa", "plain"),
    ("mqa", "chunked_mixed"),
    ("moe", "plain"),
    ("moe", "overlap"),
    ("mha_tied", "ngram_spec"),
    ("mqa", "no_radix"),
    ("gqa_untied", "int8"),
    ("moe", "int8"),
    ("gqa_untied", "draft_self"),
]


def _rank1(jobs: mp.Queue, results: mp.Queue) -> None:
    """Rank 1 of every test's engine, one after another, until None."""
    torch.set_num_threads(1)
    from engine.tp.worker import run_worker

    while (job := jobs.get()) is not None:
        try:
            kwargs, init = job
            results.put(("ok", run_worker(kwargs, 1, init, 60.0)))
        except Exception:
            results.put(("error", traceback.format_exc()))


gang = gang_fixture(_rank1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_random_models(tmp_path_factory.mktemp("tp_models"), CASES, seed=1)


def requests() -> list[list[int]]:
    """Prompts of 4 to 60 tokens; the last two extend earlier ones (radix hits)."""
    g = torch.Generator().manual_seed(5)
    ids = [[1] + torch.randint(5, 250, (n,), generator=g).tolist() for n in (4, 23, 60, 9, 37)]
    return ids + [ids[2] + [7, 8, 9], ids[1][:12] + [11, 12]]


def workload(engine: Engine) -> tuple[list[list[int]], list]:
    outs = run_staggered(engine, requests(), GREEDY, every=2)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    lp = engine.generate(input_ids=requests()[3], sampling_params=WITH_LOGPROBS)
    return [o.token_ids for o in outs], lp.logprobs


def config(path: str, **kw) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_path=path, device="cpu", max_total_tokens=2048, max_running_requests=16, **kw
    )


@pytest.mark.parametrize("case, mode", RUNS, ids=[f"{c}-{m}" for c, m in RUNS])
def test_greedy_matches_one_rank(gang: Gang, models: dict[str, str], case: str, mode: str) -> None:
    kw = dict(MODES[mode], speculative_draft_model_path=models[case]) if mode == "draft_self" else MODES[mode]
    ref = Engine(config(models[case], **kw))
    want_ids, want_lp = workload(ref)
    ref.shutdown()
    tp = gang.engine(config(models[case], tp_size=2, **kw))
    try:
        got_ids, got_lp = workload(tp)
        stats = tp.stats()
        tp.check_memory()
    finally:
        steps = gang.stop(tp)
    assert got_ids == want_ids
    assert [t.token_id for t in got_lp] == [t.token_id for t in want_lp]
    atol = LOGPROB_ATOL_QUANTIZED if "quantization" in MODES[mode] else LOGPROB_ATOL
    for g, w in zip(got_lp, want_lp):
        assert abs(g.logprob - w.logprob) <= atol
        assert [i for i, _ in g.top_logprobs] == [i for i, _ in w.top_logprobs]
        assert all(abs(a - b) <= atol for (_, a), (_, b) in zip(g.top_logprobs, w.top_logprobs))
    # The draft model's batches run on rank 0 alone.
    batches = sum(stats.batches_by_mode.values()) - stats.batches_by_mode["DRAFT_EXTEND_V2"]
    if mode == "overlap":  # a decode batch launched after the last result may never run
        assert batches - 1 <= steps <= batches
    elif mode != "split_prefill":  # (a split batch counts once, its slices are steps)
        assert steps == batches
    if mode == "split_prefill":
        assert stats.batches_by_mode["SPLIT_PREFILL"] > 0
    if mode in ("ngram_spec", "draft_self"):
        assert stats.batches_by_mode["TARGET_VERIFY"] > 0
    if mode == "chunked_mixed":
        assert stats.batches_by_mode["MIXED"] > 0
    if case == "moe" and mode != "overlap":  # rank 0 counts every routing, as one rank does
        assert sum(stats.expert_tokens) == sum(ref.stats().expert_tokens)


@pytest.mark.parametrize("case", ["gqa_untied", "mqa", "moe"])
def test_rank_parameter_bytes(gang: Gang, models: dict[str, str], case: str) -> None:
    """Each rank holds about half the weights: its shards plus the replicated norms, routers,
    RoPE tables and (MQA) the replicated KV head; and the same number of KV slots, each with
    its share of the KV heads."""
    ref = Engine(config(models[case]))
    tp = gang.engine(config(models[case], tp_size=2))
    try:
        full, rank0 = ref.model_runner.model.weight_bytes(), tp.model_runner.model.weight_bytes()
        rope = 2 * ref.model_runner.model.rope.cos.numel() * 4
        mr = tp.model_runner
        # What the layout predicts: 1/2 of the model plus the replicated parts, the vocabulary
        # padding and (MQA) the replicated KV head's projections.
        # (as the model holds them: the same packing overhead as one rank's)
        want = rank_weight_bytes(mr.model_config, mr.layout, torch.float32)
        one = rank_weight_bytes(mr.model_config, ref.model_runner.layout, torch.float32)
        assert want < 0.6 * one
        assert abs((rank0 - rope) / want - (full - rope) / one) < 0.05, (rank0, want, full, one)
        assert rank0 - rope <= 0.6 * (full - rope), (rank0, full)
        assert tp.model_runner.max_total_tokens == ref.model_runner.max_total_tokens
        kv = CASES[case]["num_key_value_heads"]
        assert tp.model_runner.kv_cache.k[0].shape[1] == max(1, kv // 2)
        assert (
            tp.model_runner.model.num_parameters() < 0.6 * ref.model_runner.model.num_parameters()
        )
    finally:
        gang.stop(tp)
        ref.shutdown()


HOST_TIER_RUNS = {
    "write_through": dict(hicache_write_policy="write_through"),
    "write_back": dict(hicache_write_policy="write_back"),
    "write_back-overlap": dict(hicache_write_policy="write_back", enable_overlap_schedule=True),
}


@pytest.mark.parametrize("run", sorted(HOST_TIER_RUNS))
def test_host_tier_matches_one_rank(gang: Gang, models: dict[str, str], run: str) -> None:
    """Four tenants' 60-token documents, twice round, through a pool of 160 slots: the second
    round loads each document back from the host tier. Rank 1 makes rank 0's copies on its own
    KV head (GQA: one of two per rank), so its tokens are one rank's, with the tier or without."""
    g = torch.Generator().manual_seed(11)
    docs = [[1] + torch.randint(5, 250, (60,), generator=g).tolist() for _ in range(4)]
    prompts = [d + torch.randint(5, 250, (4,), generator=g).tolist() for d in docs + docs]

    def tokens(engine: Engine) -> list[list[int]]:
        return [engine.generate(input_ids=p, sampling_params=GREEDY).token_ids for p in prompts]

    path = models["gqa_untied"]
    small = dict(max_total_tokens=160, max_running_requests=4)
    tier = dict(HOST_TIER_RUNS[run], enable_hierarchical_cache=True, hicache_ratio=4)
    want = {}
    for name, kw in (("pool only", {}), ("tier", tier)):
        ref = Engine(EngineConfig.from_kwargs(model_path=path, device="cpu", **small, **kw))
        want[name] = tokens(ref)
        ref.shutdown()
    assert want["tier"] == want["pool only"]
    tp = gang.engine(EngineConfig.from_kwargs(model_path=path, device="cpu", tp_size=2, **small, **tier))
    try:
        got = tokens(tp)
        hicache = tp.stats().hicache
        tp.check_memory()  # every tier idle
        with pytest.raises(ConfigError, match="tensor-parallel"):  # its ranks' host tiers follow it
            tp.scheduler.cache.configure_cache(HiCacheConfig())
    finally:
        gang.stop(tp)
    assert got == want["tier"]
    assert hicache.host.hit_tokens >= 4 * 60, hicache  # the second round, from the host tier


def test_tp_refuses_what_its_other_ranks_would_miss(models: dict[str, str]) -> None:
    """Storage pages and prefill/decode KV transfers would carry rank 0's KV heads only."""
    with pytest.raises(ConfigError, match="hicache_storage_backend is not supported with tp_size > 1"):
        EngineConfig.from_kwargs(model_path=models["mqa"], device="cpu", tp_size=2, enable_hierarchical_cache=True,
                                 hicache_storage_backend="file", hicache_storage_path="/tmp/unused")
    for mode in ("prefill", "decode"):
        with pytest.raises(ConfigError, match="disaggregation_mode is not supported with tp_size > 1"):
            EngineConfig.from_kwargs(model_path=models["mqa"], device="cpu", tp_size=2, disaggregation_mode=mode)


def test_tp_needs_a_group(models: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="TPGroup"):
        Engine(config(models["mha_tied"], tp_size=2))
    with pytest.raises(ConfigError, match="rank 0 of 1 given for tp_rank 0 of tp_size 2"):
        from engine.model_runner import ModelRunner

        ModelRunner(config(models["mha_tied"], tp_size=2), models["mha_tied"], tp_group=TPGroup(0, 1))


def test_act_order_gptq_matches_one_rank(gang: Gang, tmp_path: Path) -> None:
    """An act-order GPTQ checkpoint (kept quantized on one rank) under tp_size=2: its groups are
    spread over every rank's slice of the row-parallel inputs, so those shards are held as float;
    the tokens are one rank's."""
    cfg, tensors, _ = build("gptq_act")
    path = write_checkpoint(str(tmp_path / "gptq_act"), cfg, tensors)
    ref = Engine(config(path))
    want_ids, _ = workload(ref)
    ref.shutdown()
    tp = gang.engine(config(path, tp_size=2))
    try:
        got_ids, _ = workload(tp)
        layer = tp.model_runner.model.layers[0]
        assert isinstance(layer.attn.qkv_proj, QuantLinear)  # column-parallel: still quantized
        tp.check_memory()
    finally:
        gang.stop(tp)
    assert got_ids == want_ids

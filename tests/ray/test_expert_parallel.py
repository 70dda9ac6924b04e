"""Expert parallelism in an attention-DP group (an MoE model: each member holds E/G of the experts,
attention stays data-parallel): outputs equal one engine holding every expert, an idle member's
experts keep serving the busy one, the parameter split, per-expert counts in the stats and on
/metrics, and a gang restart when a member dies."""

from __future__ import annotations

import time

import pytest
import ray

from actors.stats import EngineActorStats
from cluster import Cluster, ClusterConfig
from cluster.kv_index import KVIndexStats
from cluster.routing import RoutingStats
from cluster.stats import ClusterStats
from deploy.metrics import ServerMetrics
from engine import Engine, SamplingParams
from engine.builtin_model import (
    byte_level_tokenizer,
    llama_config,
    random_llama_weights,
    write_checkpoint,
)
from engine.engine import EngineStats
from engine.errors import ConfigError
from engine.models import load_weights
from tests.helpers import finals_after, prompts

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
# Qwen2-MoE: 8 experts, top-2 (a token's two expert terms add exactly once on either side, so the
# group's greedy tokens equal one engine's), a sigmoid-gated shared expert, and a dense layer 0.
MOE = llama_config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                   architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   mlp_only_layers=[0])
SPARSE_LAYERS = 2


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    # std 0.15 as in conftest: peaked logits, so float32 rounding never decides a greedy tie.
    return write_checkpoint(str(tmp_path_factory.mktemp("ep")), MOE, random_llama_weights(MOE, seed=2, std=0.15),
                            byte_level_tokenizer())


def ep_cluster(path: str, split: str = "experts", dispatch: str = "gather", **kw) -> Cluster:
    return Cluster(ClusterConfig(model_path=path, num_engines=2, routing="round_robin", dp_attention=True,
                                 moe_split=split, engine={"moe_dispatch": dispatch}, **kw))


def forwarded(e: EngineStats) -> int:
    """Tokens an engine's forwards ran: uncached prompt tokens and every output but the last."""
    return e.prompt_tokens - e.cached_tokens + e.generated_tokens - e.num_received


@pytest.mark.ray
@pytest.mark.parametrize("split, dispatch", [("experts", "gather"), ("experts", "all_to_all"),
                                             ("intermediate", "gather")])
def test_group_matches_one_engine_with_every_expert(ray_local, moe_path, split, dispatch):
    single = Engine(model_path=moe_path)
    ids = prompts(single, 6, seed=5, lo=3, hi=30)
    ref = single.generate(input_ids=ids, sampling_params=GREEDY)
    whole = single.model_runner.model.num_parameters()
    weights = load_weights(moe_path)
    expert_params = sum(t.numel() for name, t in weights.items() if ".experts." in name)
    with ep_cluster(moe_path, split, dispatch) as cl:
        both = cl.generate(input_ids=ids, sampling_params=GREEDY)  # round robin: both members busy
        assert [o.token_ids for o in both] == [r.token_ids for r in ref]
        before = cl.stats().engines
        one = cl.generate(input_ids=ids[0], sampling_params=GREEDY)  # member 0 only (6 % 2)
        assert one.token_ids == ref[0].token_ids
        after = cl.stats().engines
        idle = after[1].engine.batches_by_mode["IDLE"] - before[1].engine.batches_by_mode["IDLE"]
        assert after[1].engine.num_received == before[1].engine.num_received and idle >= GREEDY.max_new_tokens
        assert all(e.dp.collective_bytes > 0 for e in after)
        params = [i.num_parameters for i in cl.infos]
        assert params[0] == params[1] and all(i.weight_bytes == 4 * n for i, n in zip(cl.infos, params))
        counts = [e.engine.expert_tokens for e in after]
        group_rows = sum(forwarded(e.engine) for e in after)
        if split == "experts":
            # Each member holds its 4 experts whole (dense layer, shared expert, attention: whole).
            assert whole - params[0] == expert_params // 2
            assert sum(counts[0][4:]) == 0 and sum(counts[1][:4]) == 0  # its own experts only
            assert sum(map(sum, counts)) == group_rows * 2 * SPARSE_LAYERS
            # The idle member's experts computed the busy member's rows.
            assert sum(counts[1]) > sum(before[1].engine.expert_tokens)
        else:  # a slice of everything: every member ran every expert over the group's rows
            assert params[0] < whole - expert_params // 2
            assert counts[0] == counts[1] and sum(counts[0]) == group_rows * 2 * SPARSE_LAYERS
        cl.check_memory()


@pytest.mark.ray
def test_killed_member_restarts_the_expert_parallel_group(ray_local, moe_path):
    ref = Engine(model_path=moe_path).generate(prompt="Once upon a time", sampling_params=GREEDY)
    # all_to_all: the collective the dense split does not have (gather and all-reduce are
    # covered by tests/ray/test_dp_attention.py's kill test).
    with ep_cluster(moe_path, dispatch="all_to_all", request_timeout_s=120, health_check_period_s=0.5) as cl:
        long = SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True)
        finals = cl.run(finals_after(cl, [f"Story {i}" for i in range(4)], long,
                                     lambda: ray.kill(cl.actors[1], no_restart=False)))
        assert len(finals) == 4 and any(f.error for f in finals)  # the group went down under them
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (all(cl.healthy()) and cl.dp_stats()[0].epoch >= 1
                                                   and len(cl.dp_stats()[0].members) == 2):
            time.sleep(0.5)
        assert all(cl.healthy()) and cl.dp_stats()[0].restarts >= 1
        again = cl.generate(prompt=["Once upon a time"] * 2, sampling_params=GREEDY)
        assert [o.token_ids for o in again] == [ref.token_ids] * 2, [o.error for o in again]
        cl.check_memory()


@pytest.mark.ray
def test_other_expert_parallel_group_keeps_serving(ray_local, moe_path):
    """Two groups of 2 with expert parallelism: a member of group 0 dies; group 1 answers every
    request meanwhile, and group 0 restarts as a gang."""
    ref = Engine(model_path=moe_path).generate(prompt="Once upon a time", sampling_params=GREEDY)
    cfg = ClusterConfig(model_path=moe_path, num_engines=4, dp_group_size=2, routing="round_robin",
                        dp_attention=True, request_timeout_s=120, health_check_period_s=0.5)
    with Cluster(cfg) as cl:
        ray.kill(cl.actors[0], no_restart=False)  # group 0 goes down...
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and cl.healthy()[0]:
            time.sleep(0.1)
        # ...while group 1 (engines 2 and 3, each holding half of the experts) answers.
        outs = cl.generate(prompt=["Once upon a time"] * 4, sampling_params=GREEDY)
        assert all(o.token_ids == ref.token_ids and o.error is None for o in outs), [o.error for o in outs]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(cl.healthy()):
            time.sleep(0.5)
        assert all(cl.healthy()) and cl.dp_stats()[0].restarts >= 1 and cl.dp_stats()[1].restarts == 0
        cl.check_memory()


def test_expert_split_needs_experts_divisible_by_group(moe_path):
    with pytest.raises(ConfigError, match=r"num_experts \(8\) divisible by the DP group size \(3\)"):
        ClusterConfig(model_path=moe_path, num_engines=3, dp_attention=True)
    ClusterConfig(model_path=moe_path, num_engines=4, dp_attention=True)  # 2 experts per member
    ClusterConfig(model_path=moe_path, num_engines=3, dp_attention=False)  # no group: no split
    with pytest.raises(ConfigError, match="num_experts 8 is not divisible by the DP group size 3"):
        Engine(model_path=moe_path, mlp_shard=(0, 3))


def test_expert_tokens_on_metrics():
    engines = [EngineActorStats(engine_id=i, healthy=True, engine=EngineStats(expert_tokens=c))
               for i, c in enumerate([[5, 0], [0, 7]])]
    index = KVIndexStats(events_applied=[0, 0], resyncs=[0, 0], cached_tokens=[0, 0])
    routing = RoutingStats(policy="round_robin", decisions=[0, 0], prefix_hit_rate=0.0, kv_index=index)
    stats = ClusterStats(engines=engines, routing=routing)
    text = ServerMetrics().render(stats)
    assert "# TYPE radixray_engine_expert_tokens_total counter" in text
    assert 'radixray_engine_expert_tokens_total{engine="0",expert="0",replica="local"} 5' in text
    assert 'radixray_engine_expert_tokens_total{engine="1",expert="1",replica="local"} 7' in text

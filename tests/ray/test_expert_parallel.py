"""Expert parallelism in an attention-DP group (an MoE model: each member holds E/G of the experts,
attention stays data-parallel): outputs equal one engine holding every expert, an idle member's
experts keep serving the busy one, the parameter split, per-expert counts in the stats and on
/metrics, and a gang restart when a member dies.

The tests share one cluster per configuration (tests/ray/conftest.py `clusters`): counters
are compared as differences over a test's own run, and a fault test ends with its group
restarted and settled."""

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
from tests.ray.conftest import take_down_engine_0

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


@pytest.fixture(scope="module")
def cluster_configs(moe_path) -> dict[str, ClusterConfig]:
    """split-dispatch -> a cluster; quick health checks and bounded requests for the fault tests."""
    def ep(split: str, dispatch: str, **kw) -> ClusterConfig:
        return ClusterConfig(model_path=moe_path, routing="round_robin", enable_dp_attention=True, moe_split=split,
                             engine={"moe_dispatch": dispatch}, health_check_period_s=0.5, request_timeout_s=120,
                             **{"num_engines": 2, **kw})

    return {
        "intermediate-gather": ep("intermediate", "gather"),
        "experts-gather": ep("experts", "gather"),
        # Two groups of two (the fault tests': one group goes down while the other serves).
        "experts-all_to_all": ep("experts", "all_to_all", num_engines=4, dp_group_size=2),
    }


def forwarded(e: EngineStats) -> int:
    """Tokens an engine's forwards ran: uncached prompt tokens and every output but the last."""
    return e.prompt_tokens - e.cached_tokens + e.generated_tokens - e.num_received


def diff(after: list[EngineActorStats], before: list[EngineActorStats], get) -> list:
    return [get(a.engine) - get(b.engine) for a, b in zip(after, before)]


def expert_diff(after: list[EngineActorStats], before: list[EngineActorStats]) -> list[list[int]]:
    return [[x - y for x, y in zip(a.engine.expert_tokens, b.engine.expert_tokens)] for a, b in zip(after, before)]


@pytest.mark.ray
# The last one's cluster serves the next tests too.
@pytest.mark.parametrize("key", ["intermediate-gather", "experts-gather", "experts-all_to_all"])
def test_group_matches_one_engine_with_every_expert(clusters, single, moe_path, key):
    cl = clusters.get(key)
    split = cl.config.moe_split
    size = cl.config.dp_group_size or cl.config.num_engines
    engine = single(moe_path)
    ids = prompts(engine, 6, seed=5, lo=3, hi=30)
    ref = engine.generate(input_ids=ids, sampling_params=GREEDY)
    whole = engine.model_runner.model.num_parameters()
    weights = load_weights(moe_path)
    expert_params = sum(t.numel() for name, t in weights.items() if ".experts." in name)
    start = cl.stats().engines
    both = cl.generate(input_ids=ids, sampling_params=GREEDY)  # round robin: every member busy
    assert [o.token_ids for o in both] == [r.token_ids for r in ref]
    before = cl.stats().engines
    one = cl.generate(input_ids=ids[0], sampling_params=GREEDY)  # one member only
    assert one.token_ids == ref[0].token_ids
    after = cl.stats().engines
    received = diff(after, before, lambda e: e.num_received)
    busy = received.index(1)
    assert sum(received) == 1
    group = range(busy - busy % size, busy - busy % size + size)
    idle = diff(after, before, lambda e: e.batches_by_mode["IDLE"])
    assert all(idle[i] >= GREEDY.max_new_tokens for i in group if i != busy)  # its peers stepped along
    assert all(e.dp.collective_bytes > 0 for e in after)
    params = [i.num_parameters for i in cl.infos]
    assert len(set(params)) == 1 and all(i.weight_bytes == 4 * n for i, n in zip(cl.infos, params))
    counts = expert_diff(after, start)
    rows = diff(after, start, forwarded)
    per_member = len(counts[0]) // size
    for g in range(cl.config.num_engines // size):
        members = range(g * size, (g + 1) * size)
        group_rows = sum(rows[i] for i in members)
        if split == "experts":
            # Each member holds its 4 experts whole (dense layer, shared expert, attention: whole).
            assert whole - params[0] == expert_params // 2
            for i in members:  # its own experts only
                own = range((i % size) * per_member, (i % size + 1) * per_member)
                assert all(n == 0 for e, n in enumerate(after[i].engine.expert_tokens) if e not in own)
            assert sum(sum(counts[i]) for i in members) == group_rows * 2 * SPARSE_LAYERS
        else:  # a slice of everything: every member ran every expert over the group's rows
            assert params[0] < whole - expert_params // 2
            assert all(counts[i] == counts[g * size] for i in members)
            assert sum(counts[g * size]) == group_rows * 2 * SPARSE_LAYERS
    # The idle members' experts computed the busy member's rows.
    assert all(sum(x) > 0 for i, x in enumerate(expert_diff(after, before)) if i in group and i != busy)


def restart_and_serve(cl: Cluster, ref: list[int], before, timeout_s: float = 120) -> None:
    """Group 0 re-forms in a new epoch (before: its DPGroupStats), every engine is healthy, and
    requests on every engine get the single engine's tokens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            now = cl.dp_stats()[0]
        except Exception:  # a coordinator restarting
            now = None
        if now is not None and now.epoch > before.epoch and len(now.members) == 2 and all(cl.healthy()):
            break
        time.sleep(0.2)
    assert all(cl.healthy()) and cl.dp_stats()[0].restarts > before.restarts, cl.dp_stats()
    again = cl.generate(prompt=["Once upon a time"] * cl.config.num_engines, sampling_params=GREEDY)
    assert [o.token_ids for o in again] == [ref] * cl.config.num_engines, [o.error for o in again]


@pytest.mark.ray
def test_killed_member_restarts_the_expert_parallel_group(clusters, single, moe_path):
    """all_to_all: the collective the dense split does not have (gather and all-reduce are
    covered by tests/ray/test_dp_attention.py's kill test). Group 0's requests fail; group 1's
    run on."""
    cl = clusters.get("experts-all_to_all")
    ref = single(moe_path).generate(prompt="Once upon a time", sampling_params=GREEDY).token_ids
    before = cl.dp_stats()[0]
    long = SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)  # running at the kill (finals_after checks)
    finals = cl.run(finals_after(cl, [f"Story {i}" for i in range(4)], long,
                                 lambda: ray.kill(cl.actors[1], no_restart=False)))
    # Round robin: two requests on each group. Group 0 went down under its two; group 1's ran on.
    assert sorted(bool(f.error) for f in finals) == [False, False, True, True], finals
    restart_and_serve(cl, ref, before)


@pytest.mark.ray
def test_other_expert_parallel_group_keeps_serving(clusters, single, moe_path):
    """Two groups of 2 with expert parallelism: a member of group 0 dies; group 1 answers every
    request meanwhile, and group 0 restarts as a gang."""
    cl = clusters.get("experts-all_to_all")
    ref = single(moe_path).generate(prompt="Once upon a time", sampling_params=GREEDY).token_ids
    before = cl.dp_stats()
    take_down_engine_0(cl)  # group 0 goes down...
    # ...while group 1 (engines 2 and 3, each holding half of the experts) answers.
    outs = cl.generate(prompt=["Once upon a time"] * 4, sampling_params=GREEDY)
    assert all(o.token_ids == ref and o.error is None for o in outs), [o.error for o in outs]
    restart_and_serve(cl, ref, before[0])
    assert cl.dp_stats()[1].restarts == before[1].restarts


def test_expert_split_needs_experts_divisible_by_group(moe_path):
    with pytest.raises(ConfigError, match=r"num_experts \(8\) divisible by the DP group size \(3\)"):
        ClusterConfig(model_path=moe_path, num_engines=3, enable_dp_attention=True)
    ClusterConfig(model_path=moe_path, num_engines=4, enable_dp_attention=True)  # 2 experts per member
    ClusterConfig(model_path=moe_path, num_engines=3, enable_dp_attention=False)  # no group: no split
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

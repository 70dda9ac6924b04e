"""Exact routing on the engines' KV events, on a real Ray cluster (CPU, random-weight model):
requests sharing a prefix follow the engine that holds it; once that engine evicts the prefix
the router knows it; a KV event lost on purpose makes the router resync from a snapshot; a
request another front end sent is followed while it is still queued; every front end's
heartbeat gets every eviction (cache_aware's trees)."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from actors.protocol import GenerateRequest, decode_evictions, decode_kv_snapshot, encode
from cluster import Cluster, ClusterConfig
from engine import SamplingParams

pytestmark = pytest.mark.ray
SHORT = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)


def wait_for(condition, what: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def index_matches_engine(cl: Cluster, engine: int, probes: list[list[int]]) -> bool:
    """The router's view of the engine equals the engine's own cache, on every probe."""
    snap = decode_kv_snapshot(ray.get(cl.actors[engine].kv_snapshot.remote()))
    held = {tuple(p) for p in snap.paths}

    def held_len(probe: list[int]) -> int:
        best = 0
        for p in held:
            n = 0
            while n < min(len(p), len(probe)) and p[n] == probe[n]:
                n += 1
            best = max(best, n)
        return best

    with cl._lock:
        return all(cl.router.kv_index.match(engine, p) == held_len(p) for p in probes)


def test_routing_follows_the_engines_actual_cache(ray_local, model_dirs):
    cfg = ClusterConfig(model_path=model_dirs["llama"], num_engines=2, routing="kv_events",
                        engine={"max_total_tokens": 600})
    with Cluster(cfg) as cl:
        head = [7] * 200
        first = cl.generate(input_ids=head + [1, 2], sampling_params=SHORT)
        assert first.finish_reason == "length"
        owner = next(i for i in range(2) if cl.stats().engines[i].engine.prompt_tokens)
        wait_for(lambda: cl.router.kv_index.match(owner, head) == 200, "the stored event")
        for i in range(4):  # same head, either engine free: every one goes to the owner
            cl.generate(input_ids=head + [3, i], sampling_params=SHORT)
        decisions = cl.stats().routing.decisions
        assert decisions[owner] == 5 and decisions[1 - owner] == 0

        # Fill the owner's pool with other prompts until it evicts the head; the router learns it.
        probes = [head + [1, 2]]
        for k in range(12):
            other = [20 + k] * 150
            probes.append(other)
            _on_engine(cl, owner, other)
            if cl.router.kv_index.match(owner, head) < 200:
                break
        wait_for(lambda: index_matches_engine(cl, owner, probes), "the index to follow the evictions")
        assert cl.router.kv_index.match(owner, head) < 200

        # Lose an event on purpose: the next event reveals the gap, a snapshot resyncs the index.
        resyncs = cl.stats().routing.kv_index.resyncs[owner]
        ray.get(cl.actors[owner].debug_drop_kv_events.remote(1))
        for k in range(2):
            other = [60 + k] * 40
            probes.append(other)
            _on_engine(cl, owner, other)
        wait_for(lambda: cl.stats().routing.kv_index.resyncs[owner] > resyncs, "a resync")
        wait_for(lambda: index_matches_engine(cl, owner, probes), "the index to match the engine again")
        cl.check_memory()


def _on_engine(cl: Cluster, engine: int, ids: list[int]) -> None:
    """Run a request on one engine directly (its own per-request stream), bypassing the router."""
    payload = encode(GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling_params=SHORT))
    for ref in cl.actors[engine].generate.remote(payload):
        ray.get(ref)


def test_a_request_from_another_front_end_is_followed_while_queued(ray_local, model_dirs):
    """A request this router did not send (another front end's) is in the index from the moment
    its engine queues it until it ends: while it still waits there (nothing of it stored yet),
    a request sharing its prompt is routed to it; after its end, only what the cache stored
    counts."""
    # A light load weight: the 2,103 prompt tokens queued on engine 1 cost 42, its prefix saves 100.
    cfg = ClusterConfig(model_path=model_dirs["llama"], num_engines=2, routing="kv_events",
                        routing_options={"load_weight": 0.02}, engine={"max_total_tokens": 600})
    with Cluster(cfg) as cl:
        def direct(ids: list[int], max_new_tokens: int):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
            payload = encode(GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling_params=params))
            return cl.actors[1].generate.remote(payload)

        # Each blocker takes nearly all of engine 1's KV: they run one at a time, first come
        # first served, and the prompt queued behind them waits for all of them.
        streams = [direct([5 + k] * 500, 90) for k in range(4)]
        prompt = [9] * 100 + [1, 2, 3]
        streams.append(direct(prompt, 4))
        wait_for(lambda: cl.router.kv_index.views[1].queued.match(prompt) == len(prompt), "its queued event")
        with cl._lock:  # engine 1 holds none of it and is the busier engine: the queued prompt decides
            assert cl.router.kv_index.match(1, prompt) == 0
            assert cl.router.policy.choose(cl.router, prompt[:100] + [4], [0, 1]) == 1
        for stream in streams:
            for ref in stream:
                ray.get(ref)
        wait_for(lambda: cl.router.kv_index.views[1].queued.root == {}, "the done events")
        wait_for(lambda: cl.router.kv_index.match(1, prompt) == len(prompt), "the stored event")
        cl.check_memory()


def test_every_front_end_gets_every_eviction(ray_local, model_dirs):
    """The cluster's health loop and two more readers (other front ends) heartbeat the same
    engine: each gets every eviction, whoever asks first; the cluster's tree drops every
    prefix the engine evicted."""
    cfg = ClusterConfig(model_path=model_dirs["llama"], num_engines=1, routing="cache_aware",
                        health_check_period_s=0.1, engine={"max_total_tokens": 600})
    with Cluster(cfg) as cl:
        actor = cl.actors[0]
        with cl._lock:  # the tree forgets only what the engine evicted, never by its own LRU trim
            cl.router.trees[0].capacity = 1 << 20

        def heartbeat(cursor: tuple[str, int]) -> tuple[tuple[str, int], list[list[int]]]:
            reply = decode_evictions(ray.get(actor.heartbeat.remote(cursor[1], cursor[0])))
            assert not reply.lost
            return (reply.incarnation, reply.seq), reply.paths

        start, _ = heartbeat(("", -1))
        eager, lazy, seen = start, start, []
        heads = [[20 + k] * 150 for k in range(10)]
        for head in heads:
            cl.generate(input_ids=head, sampling_params=SHORT)
            eager, paths = heartbeat(eager)  # a busy front end, after every request
            seen += paths
        lazy, late = heartbeat(lazy)  # a quiet one, once
        assert seen and late == seen and eager == lazy and eager[1] - start[1] == len(seen)
        held = {tuple(p) for p in decode_kv_snapshot(ray.get(actor.kv_snapshot.remote())).paths}
        gone = [h for h in heads if not any(p[:len(h)] == tuple(h) for p in held)]
        assert gone  # the pool holds 3 of the 10 prompts at most
        wait_for(lambda: all(cl.router.trees[0].match(h) < len(h) for h in gone), "the cluster's tree to drop them")
        cl.check_memory()

"""LoRA adapters through the Ray cluster (issue 31): requests of several adapters and of the base
model in one call, routed over two engines, equal to one in-process Engine's greedy output; adapters
loaded and unloaded at run time on every engine; routing by adapter (only to engines serving it,
preferring the one holding it in host memory); batch lines naming an adapter. Real Ray, CPU."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import ray

pytest.importorskip("peft", reason="needs peft (python3 -m pip install --no-deps peft)")
pytest.importorskip("transformers")

from actors.protocol import adapter_path, adapter_root  # noqa: E402
from cluster import ClusterConfig  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from engine.lora import TARGET_MODULES, LoRAAdapterError, UnknownLoRAError  # noqa: E402
from tests.helpers import write_peft_adapters  # noqa: E402

pytestmark = pytest.mark.ray
N = 8
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)
# Loaded at start: every projection, rank 8; q and v only, rank 4. "extra" is loaded at run time.
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES)),
    "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "extra": dict(r=4, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
}
PROMPTS = [[5, 17, 33, 9, 60, 2, 11], [40, 41, 42, 43, 44], [7, 7, 8, 9, 10, 90], [1, 2, 3, 4, 5, 6],
           [200, 13, 13, 88], [33, 34, 35, 36, 37]]
NAMES = ["a", "b", None, "a", None, "b"]


@pytest.fixture(scope="module")
def folders(model_dirs, tmp_path_factory) -> dict[str, str]:
    """PEFT adapter folders of the "llama" checkpoint, by name."""
    return write_peft_adapters(model_dirs["llama"], tmp_path_factory.mktemp("cluster-loras"), ADAPTERS, seed=40)


@pytest.fixture(scope="module")
def cluster_configs(model_dirs, folders) -> dict[str, ClusterConfig]:
    # One adapter in host memory per engine (and one slot): where an adapter is held decides
    # the routing, and engines swap adapters as the requests ask.
    engine = {"lora_paths": {"a": folders["a"], "b": folders["b"]}, "max_loras_per_batch": 1,
              "max_loaded_loras": 1}
    return {"lora": ClusterConfig(model_path=model_dirs["llama"], num_engines=2, device="cpu",
                                  request_timeout_s=120, engine=engine)}


@pytest.fixture(scope="module")
def reference(model_dirs, folders) -> Engine:
    """One in-process engine with every adapter (its loop running, as a batch engine's)."""
    eng = Engine(model_path=model_dirs["llama"], lora_paths=dict(folders))
    eng.start_loop()
    yield eng
    eng.shutdown()


def decisions(cl) -> list[int]:
    return cl.stats().routing.decisions


# ---- the router alone (no Ray) ------------------------------------------------------------------
def _batch(first: int, *events, incarnation: str = "i"):
    from actors.protocol import KVEventBatch

    return KVEventBatch(incarnation, first, list(events))


@pytest.mark.parametrize("policy", ["kv_events", "cache_aware"])
def test_router_keeps_adapters_where_they_are_served_and_held(policy):
    from cluster.routing import Router

    r = Router(policy, 3)
    assert r.pick([1, 2, 3], 10, lora_name="a") is None  # nobody reported an adapter yet
    r.set_adapters(0, ["a", "b"], ["b"], 1)
    r.set_adapters(1, ["a", "b"], ["a"], 1)
    r.set_adapters(2, [], [], 0)  # LoRA off there
    assert r.adapter_names() == ["a", "b"]
    assert r.pick([1, 2, 3], 10, lora_name="a") == 1  # held there
    assert r.pick([4, 5, 6], 10, lora_name="a") == 1  # still, under some load
    assert r.pick([7, 8, 9], 10, lora_name="b") == 0
    assert r.pick([1, 2, 3], 10, lora_name="nope") is None
    assert {r.pick([9, 9, 9], 10) for _ in range(3)} >= {2}  # the base model goes anywhere
    assert r.stats().lora_warm == 3 and r.stats().lora_cold == 0
    # Overloaded: the adapter goes to the least loaded engine serving it, which then holds it.
    r.loads[1].requests, r.loads[1].tokens = 40, 40 * 400
    assert r.pick([3, 3, 3], 10, lora_name="a") == 0
    assert adapter_root("a") in r.adapters[0].resident and adapter_root("b") not in r.adapters[0].resident
    assert r.stats().lora_cold == 1
    r.done(0, 10, [3, 3, 3], "a")


def test_an_engine_that_went_down_serves_no_adapter_until_it_reports_again():
    from cluster.routing import Router

    r = Router("kv_events", 2)
    r.set_adapters(0, ["a"], ["a"], 1)
    r.set_adapters(1, ["a"], [], 1)
    r.set_healthy(0, False)
    r.set_healthy(0, True)  # back, perhaps restarted without "a" (loaded at run time)
    assert not r.serves(0, "a") and r.serves(1, "a")
    assert r.pick([1, 2, 3], 10, lora_name="a") == 1
    r.set_adapters(0, ["a"], ["a"], 1)  # its report, once the owner has loaded "a" there again
    assert r.serves(0, "a")


def test_kv_events_scores_affinity_with_the_cache_match():
    from cluster.routing import Router
    from engine.cache_manager import KVEvent

    r = Router("kv_events", 2, policy_options={"lora_load_cost": 64.0})
    r.set_adapters(0, ["a"], [], 1)
    r.set_adapters(1, ["a"], ["a"], 1)
    prompt = list(range(1, 201))
    # Engine 0 holds 150 of the prompt's tokens under the adapter (base-model KV does not count):
    # a load (64) is cheaper than computing them (150), so it wins over the engine holding "a".
    r.kv_index.apply(0, _batch(1, KVEvent("stored", prompt[:150], 0, lora_name="a"),
                               KVEvent("stored", prompt[:180], 0)))
    r.kv_index.apply(1, _batch(1, KVEvent("stored", prompt[:10], 0, lora_name="a")))
    assert r.kv_index.match(0, prompt, "a") == 150 and r.kv_index.match(0, prompt) == 180
    assert r.pick(prompt, 210, lora_name="a") == 0
    r.done(0, 210, prompt, "a")
    assert r.kv_index.match_with_in_flight(0, adapter_path(prompt, "a")) == 151  # (its root included)
    # Engine 0 (its report: no longer holding "a") has 40 of this prompt, engine 1 10 and the
    # adapter: 160 tokens to compute plus the load (64) cost more than 190.
    r.set_adapters(0, ["a"], [], 1)
    short = list(range(1, 41)) + list(range(500, 660))
    assert r.pick(short, 210, lora_name="a") == 1


def test_adapters_and_base_in_one_call_match_one_engine(clusters, reference):
    cl = clusters.get("lora")
    assert cl.lora_adapters() == ["a", "b"]
    ref = reference.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_name=NAMES)
    # The adapters change the output (else the comparison would prove nothing).
    base = reference.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert sum(r.token_ids != b.token_ids for r, b, n in zip(ref, base, NAMES) if n) >= 2
    before = decisions(cl)
    outs = cl.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_name=NAMES)
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(decisions(cl)) - sum(before) == len(PROMPTS)
    # One name for every prompt; an unknown one fails before anything runs.
    outs = cl.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY, lora_name="b")
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference.generate(
        input_ids=PROMPTS[:2], sampling_params=GREEDY, lora_name="b")]
    with pytest.raises(UnknownLoRAError, match="'nope'"):
        cl.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_name=["a", "nope", None, None, None, None])
    assert sum(decisions(cl)) - sum(before) == len(PROMPTS) + 2


def test_load_and_unload_at_run_time(clusters, reference, folders, tmp_path):
    cl = clusters.get("lora")
    prompts = PROMPTS[:3]
    with pytest.raises(UnknownLoRAError):
        cl.generate(input_ids=prompts, sampling_params=GREEDY, lora_name="extra")
    cl.load_lora_adapter("extra", folders["extra"])
    assert cl.lora_adapters() == ["a", "b", "extra"]
    ref = reference.generate(input_ids=prompts, sampling_params=GREEDY, lora_name="extra")
    outs = cl.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=["extra", None, "extra"])
    assert outs[0].token_ids == ref[0].token_ids and outs[2].token_ids == ref[2].token_ids
    # A bad adapter, or a name in use, is a typed error naming it; the engines go on unchanged.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoRAAdapterError, match="'broken'.*adapter_config.json"):
        cl.load_lora_adapter("broken", str(empty))
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        cl.load_lora_adapter("extra", folders["extra"])
    assert cl.lora_adapters() == ["a", "b", "extra"] and all(cl.healthy())
    assert cl.unload_lora_adapter("extra") is True
    assert cl.lora_adapters() == ["a", "b"]
    with pytest.raises(UnknownLoRAError):
        cl.generate(input_ids=prompts, sampling_params=GREEDY, lora_name="extra")
    with pytest.raises(UnknownLoRAError):
        cl.unload_lora_adapter("extra")
    assert all(s.engine.lora_adapters == ["a", "b"] for s in cl.stats().engines)


def test_affinity_routes_an_adapter_to_the_engine_holding_it(clusters, reference, folders):
    cl = clusters.get("lora")
    cl.refresh_lora_adapters()
    # Together, each adapter goes where it is held, or to the less loaded engine: one each.
    before = decisions(cl)
    longer = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)  # a load that tells them apart
    cl.generate(input_ids=[[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], sampling_params=longer, lora_name=["a", "b"])
    after = decisions(cl)
    assert [x - y for x, y in zip(after, before)] == [1, 1]
    warm = cl.stats().routing.lora_warm
    # Then each adapter's requests follow it: every "a" to one engine, every "b" to the other.
    picks = {}
    for i, name in enumerate(["a", "b", "a", "b", "a", "b"]):
        before = decisions(cl)
        out = cl.generate(input_ids=[50 + i, 60 + i, 70 + i], sampling_params=GREEDY, lora_name=name)
        assert out.error is None
        engine = [x - y for x, y in zip(decisions(cl), before)].index(1)
        picks.setdefault(name, set()).add(engine)
    assert len(picks["a"]) == len(picks["b"]) == 1 and picks["a"] != picks["b"], picks
    assert cl.stats().routing.lora_warm == warm + 6
    # The router's view agrees with the engines': each holds the adapter sent there.
    resident = [s.engine.lora_resident for s in cl.stats().engines]
    assert resident[picks["a"].pop()] == ["a"] and resident[picks["b"].pop()] == ["b"]

    # An adapter that only engine 1 serves (loaded on it alone) runs there only.
    ray.get(cl.actors[1].load_lora_adapter.remote("solo", folders["extra"]))
    cl.refresh_lora_adapters()
    assert cl.has_lora_adapter("solo", refresh=False)
    before = decisions(cl)
    outs = cl.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY, lora_name="solo")
    assert [x - y for x, y in zip(decisions(cl), before)] == [0, 4]
    ref = reference.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY, lora_name="extra")
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert cl.unload_lora_adapter("solo") is True  # (engine 0 never had it)
    assert not cl.has_lora_adapter("solo")


def test_batch_lines_name_adapters(clusters, reference, folders):
    """A batch line's `model` names an adapter of the job's lora_paths: its work row runs under it."""
    from cluster.batch import Generate, Preprocess

    cl = clusters.get("lora")
    config = msgspec.structs.asdict(cl.config.engine_config("cpu"))
    rows = [{"id": "a", "prompt": "Hi there", "model": "a", "max_tokens": N, "temperature": 0, "ignore_eos": True},
            {"id": "base", "prompt": "Hi there", "max_tokens": N, "temperature": 0, "ignore_eos": True},
            {"id": "other", "prompt": "Hi there", "model": "nope", "max_tokens": N}]
    raw = pa.table([[f"in:{i}" for i in range(len(rows))], [msgspec.json.encode(r).decode() for r in rows]],
                   names=["src", "row"])
    work = pa.concat_tables(Preprocess(config, [ray.put(np.zeros(0, dtype="S16"))], 8, 8)(raw))
    by_id = {r["id"]: r for r in work.to_pylist()}
    assert by_id["a"]["lora_name"] == "a" and by_id["base"]["lora_name"] is None
    assert "does not exist" in by_id["other"]["error"]
    gen = Generate.__new__(Generate)  # its engine: the reference (the job's own engine is the same code)
    gen.engine, gen._params_decoder = reference, msgspec.msgpack.Decoder(SamplingParams)
    got = {r["id"]: r for r in asyncio.run(gen(work)).to_pylist()}
    ref = reference.generate(prompt=["Hi there"] * 2, sampling_params=GREEDY, lora_name=["a", None])
    assert [got["a"]["text"], got["base"]["text"]] == [r.text for r in ref]
    assert got["a"]["text"] != got["base"]["text"]


def test_a_restarted_engine_gets_the_adapters_another_front_end_loaded(clusters, reference, folders):
    """The fleet's run-time adapters are the engines' (each reports those it loaded at run time,
    with their folders), not one front end's: an engine that restarts gets them from whichever
    front end sees it come back, here one that never loaded them itself."""
    import time
    import uuid

    from actors.protocol import GenerateRequest, decode_delta, encode
    from tests.ray.conftest import take_down_engine_0

    cl = clusters.get("lora")
    cl.load_lora_adapter("extra", folders["extra"])
    try:
        assert [s.engine.lora_adapters for s in cl.stats().engines] == [["a", "b", "extra"]] * 2
        cl._runtime_loras.clear()  # as a front end that did not load it sees the fleet
        take_down_engine_0(cl)
        deadline = time.monotonic() + 120
        while not (cl.healthy()[0] and cl.router.serves(0, "extra")):
            assert time.monotonic() < deadline, "the restarted engine never got the adapter back"
            time.sleep(0.2)
        assert cl.stats().engines[0].engine.lora_adapters == ["a", "b", "extra"]
        want = reference.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_name="extra").token_ids
        request = GenerateRequest(rid=uuid.uuid4().hex, input_ids=PROMPTS[0], sampling_params=GREEDY,
                                  lora_name="extra")
        got = [t for ref in cl.actors[0].generate.remote(encode(request)) for t in decode_delta(ray.get(ref)).token_ids]
        assert got == want  # on the restarted engine itself
    finally:
        cl.unload_lora_adapter("extra")


def test_an_unload_that_missed_a_joining_engine_is_undone_there(clusters, folders):
    """A load is known fleet-wide by its id. An unload through another front end that missed an
    engine (still joining, not in that front end's list yet) leaves the adapter there until a
    front end syncs the engine: the sync unloads it, since another engine reports that load
    unloaded; and that load is never restored on an engine that unloaded it."""
    from actors.protocol import decode_lora_adapters, decode_lora_update

    cl = clusters.get("lora")
    cl.load_lora_adapter("extra", folders["extra"])
    reports = [decode_lora_adapters(ray.get(cl.actors[i].lora_adapters.remote())) for i in range(2)]
    (load_id,) = {entry[3] for r in reports for entry in r.runtime if entry[0] == "extra"}  # one id on both
    # The other front end's unload reaches engine 0 only; this front end never sees it.
    ray.get(cl.actors[0].unload_lora_adapter.remote("extra"))
    assert load_id in decode_lora_adapters(ray.get(cl.actors[0].lora_adapters.remote())).unloaded
    cl.run(cl._sync_adapters(1))  # engine 1 seen joining by this front end
    assert "extra" not in decode_lora_adapters(ray.get(cl.actors[1].lora_adapters.remote())).names
    assert not cl.router.serves(1, "extra")
    # A restore of that load where it was unloaded is refused; a new load of the name is not.
    stale = decode_lora_update(ray.get(cl.actors[0].load_lora_adapter.remote("extra", folders["extra"], False,
                                                                             load_id)))
    assert stale.error and "this load was unloaded" in stale.error
    cl.load_lora_adapter("extra", folders["extra"])
    try:
        assert [s.engine.lora_adapters for s in cl.stats().engines] == [["a", "b", "extra"]] * 2
    finally:
        cl.unload_lora_adapter("extra")


def test_a_joining_engine_gets_the_fleets_newer_load_not_a_front_ends_stale_one(clusters, folders):
    """This front end loaded an adapter; another unloaded it and loaded it again (a new load id)
    while an engine was away. Syncing that engine loads the fleet's current load, and this front
    end forgets its own, unloaded one."""
    from actors.protocol import decode_lora_adapters

    cl = clusters.get("lora")
    cl.load_lora_adapter("extra", folders["extra"])
    (old_id,) = {e[3] for e in decode_lora_adapters(ray.get(cl.actors[0].lora_adapters.remote())).runtime
                 if e[0] == "extra"}
    try:
        # The other front end: unload from both engines, load again on engine 0 only (engine 1 away).
        for actor in cl.actors:
            ray.get(actor.unload_lora_adapter.remote("extra"))
        ray.get(cl.actors[0].load_lora_adapter.remote("extra", folders["extra"], False, "new-load"))
        cl.run(cl._sync_adapters(1))
        report = decode_lora_adapters(ray.get(cl.actors[1].lora_adapters.remote()))
        assert [e[3] for e in report.runtime if e[0] == "extra"] == ["new-load"]
        assert old_id not in [e[2] for e in cl._runtime_loras.values()]
    finally:
        cl.unload_lora_adapter("extra")

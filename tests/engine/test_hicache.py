"""The hierarchical KV cache (engine/hicache): the host tier's invariants and load-back KV under
random operations, real engines giving the same tokens with and without tiers (and hitting where a
pool alone misses), the shared storage tier (another engine's pages, corrupted or torn pages,
concurrent writers, prefetch policies), per-tier stats and the idle invariant over every tier."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, MemoryInvariantError, SamplingParams
from engine.cache_manager import CacheManager
from engine.errors import ConfigError
from engine.hicache.config import HiCacheConfig
from engine.hicache.hiradix_cache import HiRadixCache
from engine.hicache.storage import (
    FileStorageBackend,
    StorageTier,
    chain_seed,
    decode_page,
    encode_page,
    layout_of,
    page_keys,
)
from engine.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from engine.req import Req

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
WRITE_POLICIES = ["write_through", "write_back", "write_through_selective"]


def kv_value(path: tuple[int, ...]) -> float:
    """The fake KV of the last token of `path` (what a forward over that prefix would store)."""
    return float(hash(path) % 1_000_003)


# ---- the tree alone: invariants and KV after load-back -----------------------------------------
keys = st.lists(st.integers(0, 3), min_size=1, max_size=14)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), keys),
        st.tuples(st.just("load"), keys),
        st.tuples(st.just("lock"), keys),
        st.tuples(
            st.just("reload"), st.integers(0, 50)
        ),  # a key inserted before (likely evicted since)
        st.tuples(st.just("unlock"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(1, 20)),
        st.tuples(st.just("evict_host"), st.integers(1, 20)),
    ),
    min_size=15,
    max_size=50,
)


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@settings(max_examples=60, deadline=None)
@given(script=ops, policy=st.sampled_from(["lru", "lfu", "slru", "priority", "cost_aware"]))
def test_tiers_keep_invariants_and_load_back_the_right_kv(write_policy, script, policy):
    pool = 20
    kv = KVCache(pool, 2, 1, 1, torch.float32, CPU)
    alloc = TokenToKVPoolAllocator(pool, CPU)
    cfg = HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_ratio=1.5,
        hicache_write_policy=write_policy,
        radix_eviction_policy=policy,
    )
    cache = HiRadixCache(alloc, kv, cfg)
    locks, inserted = [], []

    def check_kv(key, slots):
        want = [kv_value(tuple(key[: i + 1])) for i in range(len(slots))]
        for layer in range(2):
            assert kv.k[layer][slots, 0, 0].tolist() == want
            assert kv.v[layer][slots, 0, 0].tolist() == [-w for w in want]

    for op, arg in script:
        if op == "insert":
            if alloc.available_size() < len(arg):
                cache.evict(len(arg) - alloc.available_size())
            slots = alloc.alloc(len(arg))
            if slots is None:
                continue
            for i, s in enumerate(slots.tolist()):  # the forward's KV for every position
                for layer in range(2):
                    kv.k[layer][s] = kv_value(tuple(arg[: i + 1]))
                    kv.v[layer][s] = -kv_value(tuple(arg[: i + 1]))
            have = cache.insert(arg, slots)
            alloc.free(slots[:have])
            cache.end_match_round()
            inserted.append(arg)
        elif op in ("load", "lock", "reload"):
            if op == "reload":
                if not inserted:
                    continue
                arg = inserted[arg % len(inserted)]
            slots, node, _, _ = cache.match_and_load(arg)
            check_kv(arg, slots)
            if op != "load" and len(slots):
                cache.inc_lock_ref(node)
                cache.record_hit(node)
                locks.append(node)
        elif op == "unlock" and locks:
            cache.dec_lock_ref(locks.pop(arg % len(locks)))
        elif op == "evict":
            cache.end_match_round()
            cache.evict(arg)
        elif op == "evict_host":
            cache.evict_host(arg)
        assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == pool
        assert cache.evictable_size() + cache.protected_size() == cache.total_tokens()
        if not locks:
            cache.check_host()
    for node in locks:
        cache.dec_lock_ref(node)
    cache.check_host()
    cache.evict(pool)
    assert alloc.available_size() == pool and cache.total_tokens() == 0
    cache.evict_host(cache.host.size)
    assert cache.host.used_size() == 0
    alloc.check_no_duplicates()
    cache.host.allocator.check_no_duplicates()


def _manager(
    pool: int, cfg: HiCacheConfig | None, layers: int = 2, model_id: str = "m"
) -> CacheManager:
    kv = KVCache(pool, layers, 1, 2, torch.float32, CPU)
    return CacheManager(
        ReqToTokenPool(4, 256, CPU),
        TokenToKVPoolAllocator(pool, CPU),
        hicache=cfg,
        kv_cache=kv,
        model_id=model_id,
    )


def _serve(cm: CacheManager, ids: list[int]) -> int:
    """Admit, 'compute' (fake KV per position) and finish a request; returns its cached prefix."""
    kv = cm.hicache.kv_cache if cm.hicache is not None else None
    req = Req("r", ids, GREEDY)
    cm.match_prefix(req)
    cm.lock(req)
    pre = len(req.prefix_indices)
    loc = cm.alloc_extend([req], [pre], [req.extend_input_len])
    if kv is not None:
        for i, s in enumerate(loc.tolist()):
            for layer in range(len(kv.k)):
                kv.k[layer][s] = kv_value(tuple(ids[: pre + i + 1]))
        slots = cm.kv_indices(req)
        assert kv.k[-1][slots, 0, 0].tolist() == [
            kv_value(tuple(ids[: i + 1])) for i in range(len(ids))
        ]
    cm.cache_finished_req(req)
    cm.check_idle()
    return pre


def test_idle_invariant_covers_the_host_tier():
    cm = _manager(16, HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=2))
    _serve(cm, list(range(1, 11)))
    assert cm.hicache.host.used_size() == 10  # write-through
    leaked = cm.hicache.host.alloc(2)
    with pytest.raises(MemoryInvariantError, match="host KV leak"):
        cm.check_idle()
    cm.hicache.host.free(leaked)
    cm.check_idle()
    node = next(iter(cm.hicache.root.children.values()))
    node.host_ref += 1
    with pytest.raises(MemoryInvariantError, match="pinned"):
        cm.check_idle()
    node.host_ref -= 1


def test_write_policies_decide_when_the_host_gets_a_copy():
    ids = list(range(1, 11))
    back = _manager(
        16, HiCacheConfig(enable_hierarchical_cache=True, hicache_write_policy="write_back")
    )
    _serve(back, ids)
    assert back.hicache.host.used_size() == 0  # only on eviction
    back.alloc_slots(16)  # evicts everything from the device: written back, kept on the host
    back.allocator.free(torch.arange(1, 17))
    assert back.hicache.host.used_size() == 10 and back.cached_size() == 0
    assert _serve(back, ids) == 9  # loaded back from the host

    sel = _manager(
        16,
        HiCacheConfig(
            enable_hierarchical_cache=True, hicache_write_policy="write_through_selective"
        ),
    )
    _serve(sel, ids)
    _serve(sel, ids)  # admitted once with a hit: one use so far
    assert sel.hicache.host.used_size() == 0
    _serve(sel, ids)  # the second use: copied
    assert sel.hicache.host.used_size() > 0


def test_cyclic_tenants_hit_with_the_host_tier_and_miss_without():
    tenants = [[100 * t + i for i in range(1, 13)] for t in range(3)]  # 36 tokens, pool 20
    plain = _manager(20, None)
    tiered = _manager(20, HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=3))
    hits = {"plain": [], "tiered": []}
    for rnd in range(3):
        for prefix in tenants:
            ids = prefix + [rnd + 1]
            hits["plain"].append(_serve(plain, ids))
            hits["tiered"].append(_serve(tiered, ids))
    assert hits["plain"] == [0] * 9  # LRU's worst case: each tenant is gone when it returns
    assert hits["tiered"][:3] == [0, 0, 0] and hits["tiered"][3:] == [12] * 6
    stats = tiered.hicache_stats()
    assert stats.host.hit_tokens == 72 and stats.host.loads == 6 and stats.host.load_bytes > 0
    assert stats.device.write_bytes > 0 and stats.host_used_tokens <= stats.host_total_tokens


def test_configure_cache_validation():
    with pytest.raises(ConfigError, match="needs enable_hierarchical_cache"):
        HiCacheConfig(hicache_storage_backend="file", hicache_storage_path="/tmp/x")
    with pytest.raises(ConfigError, match="hicache_storage_path"):
        HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file")
    with pytest.raises(ConfigError):
        HiCacheConfig(hicache_write_policy="sometimes")
    cm = CacheManager(ReqToTokenPool(2, 16, CPU), TokenToKVPoolAllocator(8, CPU))
    with pytest.raises(ValueError, match="kv_cache"):
        cm.configure_cache(HiCacheConfig(enable_hierarchical_cache=True))
    assert cm.hicache_stats() is None


# ---- storage ---------------------------------------------------------------------------------
def _storage_cfg(path: Path, policy: str = "wait_complete", page: int = 4) -> HiCacheConfig:
    return HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_path=str(path),
        hicache_storage_page_size=page,
        hicache_storage_prefetch_policy=policy,
    )


def _page_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*.kv"))


def test_a_second_manager_loads_pages_another_wrote(tmp_path):
    ids = list(range(1, 15))  # key = 13 tokens: 3 pages of 4 (the 1-token tail is not stored)
    first = _manager(32, _storage_cfg(tmp_path))
    _serve(first, ids)
    first.close()  # flushes the writes
    assert len(_page_files(tmp_path)) == 3 and first.hicache_stats().storage_pages_written == 3
    second = _manager(32, _storage_cfg(tmp_path))
    assert _serve(second, ids) == 12  # its pool and host were empty: every page from storage
    st_ = second.hicache_stats()
    assert (
        st_.storage.hit_tokens == 12 and st_.storage_pages_read == 3 and st_.device.hit_tokens == 0
    )
    second.close()
    assert len(_page_files(tmp_path)) == 3  # nothing written twice
    other_model = _manager(32, _storage_cfg(tmp_path), model_id="another")
    assert _serve(other_model, ids) == 0  # different model identity: different keys
    other_model.close()
    other_layout = _manager(32, _storage_cfg(tmp_path), layers=3)
    assert _serve(other_layout, ids) == 0
    other_layout.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_page_is_a_miss(tmp_path, damage):
    ids = list(range(1, 15))
    first = _manager(32, _storage_cfg(tmp_path))
    _serve(first, ids)
    first.close()
    keys = page_keys(chain_seed("m", layout_of((2, 1, 2), torch.float32, 4)), ids, 4, 3)
    victim = next(p for p in _page_files(tmp_path) if p.stem == keys[1])  # the second page
    data = victim.read_bytes()
    if damage == "flip":
        data = data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:]
    elif damage == "truncate":
        data = data[: len(data) - 5]
    else:  # a valid page of another position written under this key
        data = next(p for p in _page_files(tmp_path) if p.stem == keys[2]).read_bytes()
    victim.write_bytes(data)
    second = _manager(32, _storage_cfg(tmp_path))
    assert _serve(second, ids) == 4  # the first page only: the damaged one and all after it miss
    assert second.hicache_stats().storage_pages_corrupt == 1
    second.close()


def test_concurrent_writers_of_one_page_are_safe(tmp_path):
    layout, shape = "L1-H1-D2-float32-P4", (2, 1, 4, 1, 2)
    ids = [1, 2, 3, 4]
    key = page_keys(chain_seed("m", layout), ids, 4, 1)[0]
    kv = torch.arange(16, dtype=torch.float32).reshape(shape)
    data = encode_page(key, layout, ids, kv)
    backends = [FileStorageBackend(str(tmp_path), "ns") for _ in range(4)]
    seen, stop = [], threading.Event()

    def write(b):
        for _ in range(50):
            b.put(key, data)

    def read():
        while not stop.is_set():
            got = backends[0].get(key)
            if got is not None:
                seen.append(decode_page(got, key, layout, ids, shape, torch.float32))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(b,)) for b in backends]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and all(s is not None and torch.equal(s, kv) for s in seen)  # whole pages only
    files = os.listdir(tmp_path / "ns" / key[:2])
    assert files == [key + ".kv"]  # no temporary file left behind


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_prefetch_policies_deliver_the_pages(tmp_path, policy):
    ids = list(range(1, 15))
    first = _manager(32, _storage_cfg(tmp_path))
    _serve(first, ids)
    first.close()
    second = _manager(32, _storage_cfg(tmp_path, policy))
    if policy == "timeout":
        assert _serve(second, ids) == 12  # waited (up to the timeout) for the prefetch
    else:
        tier: StorageTier = second.hicache.storage
        got = tier.load(
            ids[:13], 0
        )  # starts the prefetch; takes whatever is ready now (maybe nothing)
        tier._fetcher.submit(lambda: None).result()  # the prefetch has run
        got += tier.load(ids[:13], len(got))  # a later match takes the rest
        assert len(got) == 3
    second.close()


# ---- real engines ----------------------------------------------------------------------------
def _engine(model_dir: str, pool: int, cfg: HiCacheConfig | None, **kwargs) -> Engine:
    """An engine with the cache settings of `cfg`, given as EngineConfig fields (as users do)."""
    fields = msgspec.structs.asdict(cfg) if cfg is not None else {}
    return Engine(model_path=model_dir, max_total_tokens=pool, **fields, **kwargs)


def test_overlap_caches_no_slot_the_launched_decode_still_writes(model_dirs):
    """Under overlap the decode batch after a request's last token is launched before that token
    is known, and takes a slot for it; the slot goes back to the pool instead of into the tree
    (a host-tier backup would copy it before that forward has written it)."""
    prompt = list(range(3, 43))
    eng = _engine(model_dirs["llama"], 256, HiCacheConfig(enable_hierarchical_cache=True,
                                                          hicache_write_policy="write_through"),
                  enable_overlap_schedule=True)
    out = eng.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=8, temperature=0,
                                                                        ignore_eos=True))
    assert eng.stats().overlapped_steps > 0
    # The prompt and every output token but the last, whose KV no forward had written when it ended.
    assert eng.scheduler.cache.snapshot() == [prompt + out.token_ids[:-1]]
    eng.check_memory()
    eng.shutdown()


def _conversation(tenants: int = 3, prefix: int = 40, rounds: int = 3) -> list[list[int]]:
    heads = [[(7 * t + 3 * i) % 200 + 3 for i in range(prefix)] for t in range(tenants)]
    return [heads[t] + [5 + r, 9 + t] for r in range(rounds) for t in range(tenants)]


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_engine_outputs_identical_with_and_without_tiers(model_dirs, model, tmp_path):
    prompts = _conversation()
    ref = _engine(model_dirs[model], 512, None)  # holds everything: the plain radix cache
    small = _engine(model_dirs[model], 96, None)  # fewer slots than the tenants' prefixes
    tiered = _engine(
        model_dirs[model], 96, HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=3)
    )
    stored = _engine(model_dirs[model], 96, _storage_cfg(tmp_path, page=16))
    got: dict[str, list] = {"ref": [], "small": [], "tiered": [], "stored": []}
    for ids in prompts:
        for name, eng in (("ref", ref), ("small", small), ("tiered", tiered), ("stored", stored)):
            out = eng.generate(input_ids=ids, sampling_params=GREEDY)
            got[name].append((out.token_ids, out.cached_tokens))
            eng.check_memory()
    tokens = {name: [t for t, _ in outs] for name, outs in got.items()}
    assert (
        tokens["small"] == tokens["ref"] and tokens["tiered"] == tokens["ref"] == tokens["stored"]
    )
    later = slice(3, None)  # rounds 2 and 3: each tenant returns after the two others
    assert all(c == 0 for _, c in got["small"][later])
    assert all(c >= 40 for _, c in got["tiered"][later])
    assert all(c >= 40 for _, c in got["stored"][later])
    for eng in (tiered, stored):  # every prompt token counted once, in the tier it came from
        st_ = eng.stats()
        tiers = st_.hicache
        assert (
            tiers.device.hit_tokens + tiers.host.hit_tokens + tiers.storage.hit_tokens
            == st_.cached_tokens
        )
        assert tiers.host.hit_tokens > 0 and tiers.host_used_tokens <= tiers.host_total_tokens
    assert small.stats().hicache is None
    stored.shutdown()  # flushes the storage tier's queued writes
    # A second engine with an empty pool: the shared storage tier holds the prefixes (whole pages).
    fresh = _engine(model_dirs[model], 96, _storage_cfg(tmp_path, page=16))
    for ids, want in zip(prompts[:3], tokens["ref"][:3]):
        out = fresh.generate(input_ids=ids, sampling_params=GREEDY)
        assert out.token_ids == want and out.cached_tokens == 32
    stats = fresh.stats()
    assert stats.hicache.storage.hit_tokens == 96 == stats.cached_tokens
    assert stats.hicache.storage_pages_read == 6 and stats.hicache.storage_pages_corrupt == 0
    fresh.check_memory()
    fresh.shutdown()


def test_the_ray_store_keeps_pages_within_its_budget():
    """The `ray` backend's store (actors/hicache_store.py) without Ray: bytes by key, LRU-bounded."""
    from actors.hicache_store import PageStore

    store = PageStore(capacity_bytes=10)
    store.put("a", b"1234")
    store.put("b", b"5678")
    assert store.get("a") == b"1234"  # a is now the most recent
    store.put("c", b"9012")  # 12 bytes > 10: b, the least recent, goes
    assert store.get("b") is None and store.exists("a") and store.exists("c")
    store.put("huge", b"x" * 11)  # larger than the store: not kept, nothing dropped for it
    assert not store.exists("huge") and store.stats()["used_bytes"] == 8


@pytest.mark.parametrize("policy, overlap", [("lpm", False), ("fcfs", True)])
def test_batched_admission_under_pressure_loads_back_correctly(model_dirs, policy, overlap):
    """Many requests matched in one scheduling round, each loading its prefix back while the pool
    is short (chunked prefill, lpm sorting every waiting request by its match, overlap): the
    tokens are those of an engine that holds everything, and nothing leaks in any tier."""
    prompts = _conversation(tenants=4, prefix=30, rounds=2)
    ref = Engine(model_path=model_dirs["llama"], max_total_tokens=1024)
    want = [o.token_ids for o in ref.generate(input_ids=prompts, sampling_params=GREEDY)]
    eng = Engine(
        model_path=model_dirs["llama"],
        max_total_tokens=100,
        schedule_policy=policy,
        chunked_prefill_size=16,
        enable_overlap_schedule=overlap,
        enable_hierarchical_cache=True,
        hicache_ratio=4,
        hicache_write_policy="write_back",
    )
    for ids in prompts[:4]:  # every tenant once: the pool keeps the last ones, the host the rest
        eng.generate(input_ids=ids, sampling_params=GREEDY)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == want
    eng.check_memory()
    stats = eng.scheduler.cache.hicache_stats()
    assert stats.host.hit_tokens > 0 and stats.host.loads > 0


# ---- EngineConfig, requests, events -----------------------------------------------------------
def test_engine_config_holds_the_settings_and_checks_them(model_dirs):
    from engine.config import EngineConfig
    from engine.flags import field_docs

    cfg = EngineConfig(
        enable_hierarchical_cache=True, hicache_ratio=3, radix_eviction_policy="slru"
    )
    assert HiCacheConfig.from_engine_config(cfg) == HiCacheConfig(
        enable_hierarchical_cache=True, hicache_ratio=3, radix_eviction_policy="slru"
    )
    assert HiCacheConfig.from_engine_config(EngineConfig()).is_default  # the same defaults
    docs = field_docs(EngineConfig)
    assert all(docs.get(name) for name in HiCacheConfig.__struct_fields__)  # every flag has help
    bad = [
        ({"hicache_storage_backend": "file", "hicache_storage_path": "/x"}, "needs enable_hier"),
        ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}, "storage_path"),
        ({"radix_eviction_policy": "mru"}, "radix_eviction_policy"),
        ({"hicache_ratio": 0}, "hicache_ratio"),
        ({"enable_hierarchical_cache": True, "hicache_ratio": 1.0}, "hicache_ratio must be > 1"),
        ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "radix cache"),
        ({"enable_hierarchical_cache": True, "tp_size": 2, "hicache_storage_backend": "file",
          "hicache_storage_path": "/tmp/unused"}, "tp_size"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ConfigError, match=match):
            EngineConfig.from_kwargs(**kwargs)
    with pytest.raises(ConfigError, match="one of"):
        EngineConfig.from_kwargs(hicache_write_policy="sometimes")
    # Without tiers the policy still applies; cost_aware is fitted to the model's hidden size.
    eng = Engine(
        model_path=model_dirs["llama"], max_total_tokens=64, radix_eviction_policy="cost_aware"
    )
    cache = eng.scheduler.cache
    assert cache.hicache is None and cache.tree.policy.name == "cost_aware"
    assert cache.tree.policy.attention_tokens == 6 * eng.model_config.hidden_size
    plain = Engine(model_path=model_dirs["llama"], max_total_tokens=64)
    assert plain.scheduler.cache.hicache is None and plain.scheduler.cache.tree.policy.name == "cost_aware"


def test_request_priority_reaches_the_priority_policy(model_dirs):
    """Two tenants whose prefixes do not both fit the pool: under `priority` the important one
    (lower value, vLLM's convention) stays cached whatever the recency; under lru it goes."""
    from engine import InvalidRequestError

    vip = [3 + i % 50 for i in range(40)]
    other = [[60 + (7 * t + i) % 100 for i in range(30)] for t in range(2)]
    hits = {}
    for policy in ("priority", "lru"):
        eng = Engine(
            model_path=model_dirs["llama"], max_total_tokens=96, radix_eviction_policy=policy
        )
        eng.generate(input_ids=vip + [1], sampling_params=GREEDY, priority=-1)
        assert eng.scheduler.cache.tree.root.children[vip[0]].priority == -1
        for ids in other:  # the second one needs room: the pool gives up a cached prefix
            eng.generate(input_ids=ids + [1], sampling_params=GREEDY, priority=5)
        hits[policy] = eng.generate(input_ids=vip + [2], sampling_params=GREEDY).cached_tokens
        eng.check_memory()
    assert hits["priority"] >= 40 and hits["lru"] == 0
    with pytest.raises(InvalidRequestError, match="priority"):
        eng.submit([1, 2, 3], GREEDY, lambda d: None, priority="high")
    with pytest.raises(InvalidRequestError, match="priority"):
        eng.generate(input_ids=[[1, 2], [3, 4]], sampling_params=GREEDY, priority=[1])


def test_openai_bodies_take_vllm_priority():
    from openai_api.protocol import ChatCompletionRequest, CompletionRequest

    body = msgspec.json.decode(b'{"prompt": "hi", "priority": -3}', type=CompletionRequest)
    assert body.priority == -3
    chat = msgspec.json.decode(
        b'{"messages": [{"role": "user", "content": "x"}]}', type=ChatCompletionRequest
    )
    assert chat.priority == 0
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"prompt": "hi", "priority": "high"}', type=CompletionRequest)


def test_events_name_their_tier_for_subscribers_that_ask(tmp_path):
    from engine.cache_manager import MEDIUMS, KVEvent

    cm = _manager(16, _storage_cfg(tmp_path, page=4))
    device_only, every = [], []
    cm.subscribe(device_only.append)
    cm.subscribe(every.append, MEDIUMS)
    with pytest.raises(ValueError, match="mediums"):
        cm.subscribe(every.append, ("disk",))
    ids = list(range(1, 11))
    _serve(cm, ids)
    assert device_only == [KVEvent("stored", ids, 0)]
    assert KVEvent("stored", ids, 0, "host") in every  # write-through
    assert KVEvent("stored", ids[:8], 0, "storage") in every  # two whole pages
    assert cm.snapshot("host") == [ids] and cm.snapshot() == [ids]
    cm.alloc_slots(16)  # the pool is emptied: the host keeps it
    assert device_only[-1] == KVEvent("removed", ids, 0) and every[-1].medium == "device"
    cm.hicache.evict_host(10)
    assert every[-1] == KVEvent("removed", ids, 0, "host") and device_only[-1].medium == "device"
    assert cm.snapshot("host") == []
    cm.allocator.free(torch.arange(1, 17))
    cm.close()


def test_shutdown_flushes_the_storage_writes(model_dirs, tmp_path):
    """Storage writes are queued in the background; Engine.shutdown waits for them, so the pages
    are there for the next engine. A backend that holds every write until released shows it."""
    from engine.hicache.storage import STORAGE_BACKENDS, register_storage_backend

    gate = threading.Event()

    class HeldFiles(FileStorageBackend):
        def put(self, key: str, data: bytes) -> None:
            gate.wait(10)
            super().put(key, data)

    register_storage_backend("held-file", HeldFiles)
    try:
        with pytest.raises(ConfigError, match="unknown hicache_storage_backend"):
            _engine(model_dirs["llama"], 64, None, **_tier_kwargs(tmp_path, backend="nope"))
        eng = _engine(model_dirs["llama"], 64, None, **_tier_kwargs(tmp_path, backend="held-file"))
        eng.generate(input_ids=list(range(3, 43)), sampling_params=GREEDY)
        assert _page_files(tmp_path) == []  # queued, held
        threading.Timer(0.1, gate.set).start()
        eng.shutdown()
        assert len(_page_files(tmp_path)) == 2  # 40 prompt tokens + 3 outputs: two 16-token pages
        assert eng.stats().hicache.storage_pages_written == 2
    finally:
        gate.set()
        STORAGE_BACKENDS.pop("held-file", None)


def _tier_kwargs(path: Path, backend: str) -> dict:
    return {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": backend,
        "hicache_storage_path": str(path),
        "hicache_storage_page_size": 16,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_cuda_host_tier_loads_back_through_pinned_buffers(model_dirs, write_policy):
    """On CUDA the host tier is pinned memory and its copies run on a copy stream: the tokens equal
    an engine whose pool holds everything, later rounds hit the host tier, and every slot returns."""
    prompts = _conversation()
    kw = {"device": "cuda", "dtype": "float32"}
    ref = _engine(model_dirs["llama"], 512, None, **kw)
    tiered = _engine(model_dirs["llama"], 96, HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=3,
                                                            hicache_write_policy=write_policy), **kw)
    host = tiered.scheduler.cache.hicache.host
    assert host.pinned and host.copy_stream is not None
    for ids in prompts:
        assert tiered.generate(input_ids=ids, sampling_params=GREEDY).token_ids == ref.generate(
            input_ids=ids, sampling_params=GREEDY).token_ids
        tiered.check_memory()
    assert tiered.stats().hicache.host.hit_tokens > 0

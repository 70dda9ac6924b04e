"""LoRA adapters under tensor parallelism (tp_size=2) against one rank with the same adapters: the
same greedy tokens, with adapters of different ranks and targets and base-model requests in one
batch, on GQA (KV heads split) and MQA (one KV head, replicated on both ranks); more adapters than
max_loras_per_batch and max_loaded_loras (slot and host evictions); load and unload at run time.
After each run both ranks' slots hold the same adapter loads (rank 1 reports its own) and the
idle invariant holds.

Rank 0 is an Engine in this process (`engine.tp.worker.rank0_engine`); rank 1 is a `TPWorker` in
one spawned process that serves every test's engine in turn. Adapters are PEFT folders written
here (adapter_config.json and adapter_model.safetensors, PEFT's names and layouts), without
importing peft. The sharding itself is checked without ranks: a shard's update is the shard of
the update (`TPLoRAShards`), and a `LoRAReplica` fed a manager's events holds the same slots."""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import Engine, EngineConfig, SamplingParams
from engine.builtin_model import (
    llama_config,
)
from engine.config import ModelConfig
from engine.engine import collect_output
from engine.errors import ConfigError
from engine.lora import TARGET_MODULES, LoRAConfig, LoRAManager, LoRAModule, LoRAReplica
from engine.lora.adapter import target_shapes, target_weight_name
from engine.tp.layout import TPLayout
from engine.tp.sharding import TPLoRAShards, shard_tensor
from tests.helpers import write_random_models
from tests.tp_gang import BASE, Gang, gang_fixture

CASES = {
    "gqa": llama_config(**BASE, num_key_value_heads=2, tie_word_embeddings=False),
    # One KV head: replicated on both ranks, so are k's and v's lora_B rows.
    "mqa": llama_config(**BASE, num_key_value_heads=1, tie_word_embeddings=True),
}
# name -> (r, lora_alpha, targets, adapter_config extras): every projection; q and v (rsLoRA);
# k and o (row-parallel o: A split by heads); the MLP with a per-module rank.
ADAPTERS = {
    "all8": (8, 16, TARGET_MODULES, {}),
    "qv4": (4, 8, ("q_proj", "v_proj"), {"use_rslora": True}),
    "ko2": (2, 4, ("k_proj", "o_proj"), {}),
    "mlp16": (16, 16, ("gate_proj", "up_proj", "down_proj"), {"rank_pattern": {"down_proj": 2}}),
}
NAMES = ["all8", "qv4", None, "ko2", "mlp16", "all8", None, "qv4"]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
MODES = {
    "plain": {},
    "overlap": dict(enable_overlap_schedule=True),
    "chunked_mixed": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "split_prefill": dict(enable_split_prefill=True, split_forward_token_budget=40),
}


def write_adapter(path: Path, cfg: ModelConfig, spec: tuple, seed: int) -> str:
    """A PEFT LoRA folder for `cfg` with random A and B (B nonzero: every update counts)."""
    r, alpha, targets, extra = spec
    ranks = extra.get("rank_pattern", {})
    shapes = target_shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for t in targets:
            rank, (d_in, d_out) = ranks.get(t, r), shapes[t]
            key = "base_model.model." + target_weight_name(layer, t).removesuffix(".weight")
            tensors[f"{key}.lora_A.weight"] = 0.1 * torch.randn(rank, d_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.1 * torch.randn(d_out, rank, generator=g)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=list(targets), **extra)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, str]]]:
    """case -> (checkpoint folder, adapter folders by name)."""
    root = tmp_path_factory.mktemp("tp_lora")
    out = {}
    for case, path in write_random_models(root, CASES, seed=1).items():
        mcfg = ModelConfig.from_dir(path)
        folders = {
            name: write_adapter(root / f"{case}-{name}", mcfg, spec, seed=30 + i)
            for i, (name, spec) in enumerate(ADAPTERS.items())
        }
        out[case] = (path, folders)
    return out


def _rank1(jobs: mp.Queue, results: mp.Queue) -> None:
    """Rank 1 of every test's engine, one after another, until None; reports its steps and its
    adapter slots as it left them."""
    torch.set_num_threads(1)
    from engine.tp.comm import TPGroup
    from engine.tp.worker import IDLE_WAIT_S, TPWorker

    while (job := jobs.get()) is not None:
        kwargs, init = job
        group = None
        try:
            config = EngineConfig.from_kwargs(**kwargs)
            group = TPGroup(
                1, 2, "cpu", init_method=init, timeout_s=60.0, object_timeout_s=IDLE_WAIT_S
            )
            worker = TPWorker(config, 1, group)
            worker.run()
            lora = worker.lora
            results.put(("ok", (worker.steps, lora.slot_ids(), sorted(lora.resident_ids()))))
        except Exception:
            results.put(("error", traceback.format_exc()))
        finally:
            if group is not None:
                group.destroy()


def stop(gang: Gang, engine: Engine) -> tuple[int, dict[int, int], list[int]]:
    """Shut the engine down (rank 1 leaves on STOP, with the last slot changes); rank 1's steps,
    slots (slot -> adapter id) and adapters in host memory (ids). Rank 0's slots must be rank 1's."""
    steps, slots, resident = gang.stop(engine, timeout_s=60)
    lora = engine.model_runner.lora_manager
    assert slots == lora.slot_ids()
    assert set(resident) <= {lora.adapter_id(n) for n in lora.resident()}
    return steps, slots, resident


gang = gang_fixture(_rank1)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    ids = [[1] + torch.randint(5, 250, (n,), generator=g).tolist() for n in (5, 23, 40, 9, 31, 14)]
    return ids + [ids[2] + [7, 8, 9], ids[1][:12] + [11, 12]]  # radix hits (same adapter or not)


def run(engine: Engine, names: list[str | None], every: int = 2) -> list[list[int]]:
    """Every prompt under its adapter, one submitted every `every` steps (prefills beside decodes)."""
    deltas: dict[str, list] = {}
    for i, (p, name) in enumerate(zip(prompts(), names)):
        deltas[f"r{i}"] = []
        engine.submit(p, GREEDY, lambda d: deltas[d.rid].append(d), rid=f"r{i}", lora_name=name)
        for _ in range(every):
            engine.step()
    while engine.step():
        pass
    outs = [collect_output(rid, ds) for rid, ds in deltas.items()]
    assert all(o.error is None and o.finish_reason == "length" for o in outs), [
        o.error for o in outs
    ]
    return [o.token_ids for o in outs]


def config(path: str, **kw) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_path=path, device="cpu", max_total_tokens=2048, max_running_requests=16, **kw
    )


RUNS = [
    ("gqa", "plain", 4),
    ("mqa", "overlap", 4),
    ("gqa", "split_prefill", 4),
    ("mqa", "chunked_mixed", 4),
    # 4 adapters, 2 slots, 3 in host memory: slot and host evictions, made alike on both ranks.
    ("gqa", "plain", 2),
    ("mqa", "overlap", 2),
]


@pytest.mark.parametrize("case, mode, slots", RUNS, ids=[f"{c}-{m}-{s}slots" for c, m, s in RUNS])
def test_adapters_match_one_rank(
    gang: Gang, models: dict, case: str, mode: str, slots: int
) -> None:
    path, folders = models[case]
    kw = dict(MODES[mode], lora_paths=folders, max_loras_per_batch=slots)
    if slots < len(folders):
        kw["max_loaded_loras"] = slots + 1
    ref = Engine(config(path, **kw))
    want = run(ref, NAMES)
    base = run(ref, [None] * len(NAMES))
    ref.shutdown()
    # The adapters change the output (else equal outputs would prove nothing).
    assert sum(w != b for w, b, n in zip(want, base, NAMES) if n is not None) >= 4
    tp = gang.engine(config(path, tp_size=2, **kw))
    try:
        got = run(tp, NAMES)
        tp.check_memory()
        lora = tp.model_runner.lora_manager
        assert lora.active() == set()
        loads, reloads = lora.slot_loads, lora.host_reloads
        batches = tp.stats().batches_by_mode
    finally:
        stop(gang, tp)
    assert got == want
    if slots < len(folders):
        assert loads > len(folders) and reloads > 0  # slots (and host memory) were reused
    if mode == "split_prefill":
        assert batches["SPLIT_PREFILL"] > 0
    if mode == "chunked_mixed":
        assert batches["MIXED"] > 0


def test_load_unload_at_run_time(gang: Gang, models: dict) -> None:
    path, folders = models["mqa"]
    ref = Engine(config(path, lora_paths=folders))
    ps = prompts()
    want = {
        name: [
            o.token_ids
            for o in ref.generate(input_ids=ps[:4], sampling_params=GREEDY, lora_name=name)
        ]
        for name in (None, "all8", "mlp16", "qv4")
    }
    ref.shutdown()
    tp = gang.engine(
        config(
            path,
            tp_size=2,
            enable_lora=True,
            max_loras_per_batch=2,
            max_loaded_loras=4,
            max_lora_rank=16,
        )
    )
    try:
        tp.load_lora_adapter("a", folders["all8"])
        tp.load_lora_adapter("m", folders["mlp16"], pinned=True)
        got: dict[str, list[int]] = {}

        def sink(d) -> None:
            got.setdefault(d.rid, []).extend(d.token_ids)

        rids = [tp.submit(p, GREEDY, sink, lora_name="a") for p in ps[:3]]
        rid_m = tp.submit(ps[3], GREEDY, sink, lora_name="m")
        rid_base = tp.submit(ps[0], GREEDY, sink)
        for _ in range(3):
            tp.step()
        assert tp.unload_lora_adapter("a") is False  # its requests still run, with it
        while tp.has_pending():
            tp.step()
        assert [got[r] for r in rids] == want["all8"][:3]
        assert got[rid_m] == want["mlp16"][3] and got[rid_base] == want[None][0]
        # Loaded again under the same name from another folder: every rank reads the new one.
        tp.load_lora_adapter("a", folders["qv4"])
        outs = tp.generate(input_ids=ps[:2], sampling_params=GREEDY, lora_name=["a", "m"])
        assert outs[0].token_ids == want["qv4"][0] and outs[1].token_ids == want["mlp16"][1]
        assert tp.unload_lora_adapter("a") is True and tp.unload_lora_adapter("m") is True
        assert tp.generate(input_ids=ps[1], sampling_params=GREEDY).token_ids == want[None][1]
        tp.check_memory()
        lora = tp.model_runner.lora_manager
        assert lora.active() == set() and lora.slot_ids() == {} and lora.resident() == []
    finally:
        _, slots, resident = stop(gang, tp)
    assert slots == {} and resident == []  # rank 1 dropped them too


def test_bad_adapter_fails_every_rank(gang: Gang, models: dict) -> None:
    """Rank 0 cannot start its adapters: rank 1, waiting for their setup, fails too (no hang)."""
    path, _ = models["gqa"]
    with pytest.raises(ConfigError, match="bad"):
        gang.engine(config(path, tp_size=2, lora_paths={"bad": "/nonexistent/adapter"}))
    status, value = gang.results.get(timeout=60)
    assert status == "error" and "rank 0 could not start its LoRA adapters" in value, value


@pytest.mark.parametrize("case", ["gqa", "mqa"])
def test_shard_updates_are_the_update_shards(case: str) -> None:
    """Per rank and target: the update of the sharded A and B is the shard (as the base weight is
    sharded) of the whole update; the shapes are the slots' shapes."""
    cfg = ModelConfig.from_hf(CASES[case])
    g = torch.Generator().manual_seed(3)
    for rank in range(2):
        layout = TPLayout.from_config(cfg, rank, 2)
        shards = TPLoRAShards(cfg, layout)
        for target, (d_in, d_out) in target_shapes(cfg).items():
            m = LoRAModule(
                torch.randn(4, d_in, generator=g), torch.randn(d_out, 4, generator=g), 0.5
            )
            part = shards.shard(1, target, m)
            want = shard_tensor(target_weight_name(1, target), m.delta_weight(), layout)
            torch.testing.assert_close(part.delta_weight(), want)
            assert (part.lora_a.shape[1], part.lora_b.shape[0]) == shards.target_shapes()[target]


def test_replica_follows_the_managers_events(models: dict) -> None:
    """A LoRAReplica fed a manager's events, batch by batch, holds the same slots, bit for bit,
    through slot evictions, host evictions and reloads, pinning, unload and a reload by name."""
    path, folders = models["gqa"]
    cfg = ModelConfig.from_dir(path)
    shards = TPLoRAShards(cfg, TPLayout.from_config(cfg, 1, 2))
    lora_paths = {n: folders[n] for n in ("all8", "qv4", "ko2")}
    manager = LoRAManager(
        LoRAConfig(
            lora_paths=lora_paths, max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=16
        ),
        cfg,
        shards=shards,
        record_events=True,
    )
    replica = LoRAReplica(
        cfg,
        manager.target_modules,
        manager.pool.num_slots,
        manager.max_lora_rank,
        torch.float32,
        "cpu",
        shards,
    )

    def check() -> None:
        replica.apply(manager.take_events())
        assert replica.slot_ids() == manager.slot_ids()
        assert replica.resident_ids() <= {manager.adapter_id(n) for n in manager.resident()}
        for mine, theirs in zip(manager.pool.layers, replica.pool.layers):
            for group, w in mine.items():
                for a, b in zip(w, theirs[group]):
                    assert torch.equal(a, b), group

    for names in (["all8", None, "qv4"], ["ko2"], ["all8", "ko2"], ["qv4", "qv4"], ["all8"]):
        manager.batch_info(names)
        check()
    manager.load_adapter("mlp", folders["mlp16"], pinned=True)
    manager.batch_info(["mlp", "qv4"])
    check()
    manager.acquire("qv4")
    assert manager.unload_adapter("qv4") is False  # draining
    manager.batch_info(["qv4", "mlp"])
    manager.release("qv4")  # dropped now: its slot is cleared
    check()
    manager.load_adapter("qv4", folders["all8"])  # the same name, another load
    manager.batch_info(["qv4"])
    check()
    assert manager.unload_adapter("mlp") and manager.unload_adapter("qv4")
    check()
    assert replica.slot_ids() == manager.slot_ids() == {}

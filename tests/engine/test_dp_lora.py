"""LoRA adapters under attention-DP (issue 31), in one process: two members (Engines holding half
of every MLP's intermediate dim) over real gloo collectives, each stepped by its DPLoop, waves
requested through an in-process stand-in for the coordinator. A member adapts its own rows in
attention and every member's rows in its slice of the split MLP, with each adapter in the same
slot on both members: greedy output per request equals one engine's with the same adapters (up to
a near-tie the split MLP's summation order may decide the other way), requests of both members,
of several adapters and of the base model in the same steps; both members idle and clean after."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest

pytest.importorskip("peft", reason="needs peft (python3 -m pip install --no-deps peft)")

from engine import Engine, SamplingParams  # noqa: E402
from engine.dp import DPComm, DPLoop  # noqa: E402
from engine.engine import collect_output  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.lora import TARGET_MODULES, LoRAAdapterError  # noqa: E402
from engine.tp.comm import make_store, serve_store  # noqa: E402
from tests.helpers import assert_greedy_agrees, prompts, write_peft_adapters  # noqa: E402

ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES)),
    "mlp4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


class Waves:
    """The coordinator's part in one process: a member's wave request signals every member."""

    def __init__(self) -> None:
        self.loops: list[DPLoop] = []
        self.wave = 0
        self._lock = threading.Lock()

    def request(self) -> None:
        with self._lock:
            self.wave += 1
            wave = self.wave
        for loop in self.loops:
            loop.signal(wave)


@contextmanager
def dp_group(path: str, **kw) -> Iterator[list[Engine]]:
    """Two members of one attention-DP group, their loops running."""
    members = [Engine(model_path=path, **kw, mlp_shard=(rank, 2)) for rank in range(2)]
    store, init = serve_store("127.0.0.1", 2, timeout_s=60)
    comms: list = [None, None]

    def join() -> None:
        comms[1] = DPComm(make_store(init, 1, 2, 60), 1, 2, members[1].model_runner.device, 60)

    joiner = threading.Thread(target=join)
    joiner.start()
    comms[0] = DPComm(store, 0, 2, members[0].model_runner.device, 60)
    joiner.join()
    waves, errors = Waves(), []
    for engine, comm in zip(members, comms):
        loop = DPLoop(engine, comm, waves.request, errors.append)
        engine.on_work = loop.wake
        waves.loops.append(loop)
    for loop in waves.loops:
        loop.start()
    try:
        yield members
        assert not errors, errors
    finally:
        for engine in members:
            engine.shutdown()


def run(members: list[Engine], ids: list[list[int]], names: list[str | None], params: SamplingParams) -> list:
    """Request i on member i % 2, all submitted at once; their outputs in order."""
    deltas: dict[str, list] = {str(i): [] for i in range(len(ids))}
    done: queue.SimpleQueue = queue.SimpleQueue()

    def sink(d) -> None:
        deltas[d.rid].append(d)
        if d.finish_reason is not None:
            done.put(d.rid)

    for i, (x, name) in enumerate(zip(ids, names)):
        members[i % 2].submit(x, params, sink, rid=str(i), lora_name=name)
    for _ in ids:
        done.get(timeout=120)
    return [collect_output(str(i), deltas[str(i)]) for i in range(len(ids))]


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> dict[str, str]:
    return write_peft_adapters(model_dirs["llama"], tmp_path_factory.mktemp("dp_loras"), ADAPTERS, seed=40)


@pytest.mark.parametrize("mode", ["plain", "chunked"])
def test_group_with_adapters_matches_one_engine(model_dirs, adapters, mode):
    path = model_dirs["llama"]
    kw = dict(lora_paths=adapters, max_total_tokens=2048)
    if mode == "chunked":
        kw |= dict(chunked_prefill_size=16, enable_mixed_chunk=True)
    single = Engine(model_path=path, **kw)
    # Two long prompts (one per member): the group's gathered prefill rows pass a CPU row block,
    # so the split MLP adapts them block by block.
    ids = prompts(single, 8, seed=41, lo=5, hi=40) + prompts(single, 2, seed=42, lo=300, hi=320)
    names = ["all8", "mlp4", None, "all8", "mlp4", "mlp4", None, "all8", "mlp4", "all8"]
    ref = [single.generate(input_ids=x, sampling_params=msgspec.structs.replace(GREEDY, logprobs=True, top_logprobs=2),
                           lora_name=n) for x, n in zip(ids, names)]
    base = single.generate(input_ids=ids, sampling_params=GREEDY)
    # Each adapter changes what its requests decode (the MLP-only one too): the comparison below
    # tests the adapters' updates, not only the base model's.
    for name in ("all8", "mlp4"):
        assert any(r.token_ids != b.token_ids for r, b, n in zip(ref, base, names) if n == name), name
    with dp_group(path, **kw) as members:
        for got, want in zip(run(members, ids, names, GREEDY), ref):
            assert got.finish_reason == "length", got.error
            assert_greedy_agrees(got.token_ids, want)
        # One member alone with adapter rows: the other's IDLE batch still joins the MLP's rows.
        alone = run([members[0], members[0]], ids[:2], names[:2], GREEDY)
        for got, want in zip(alone, ref[:2]):
            assert_greedy_agrees(got.token_ids, want)
        assert all(m.lora.slots() == {"all8": 1, "mlp4": 2} for m in members)  # the same slots on both
        assert sum(m.stats().batches_by_mode["IDLE"] for m in members) > 0
        for m in members:
            m.check_memory()


def test_run_time_loads_and_too_few_slots_are_refused(model_dirs, adapters):
    path = model_dirs["llama"]
    with dp_group(path, lora_paths={"all8": adapters["all8"]}) as members:
        with pytest.raises(LoRAAdapterError, match="under attention-DP"):
            members[0].load_lora_adapter("mlp4", adapters["mlp4"])
        with pytest.raises(LoRAAdapterError, match="under attention-DP"):
            members[1].unload_lora_adapter("all8")
    with pytest.raises(ConfigError, match="max_loras_per_batch and max_loaded_loras >= 2"):
        Engine(model_path=path, lora_paths=adapters, max_loras_per_batch=1, mlp_shard=(0, 2))

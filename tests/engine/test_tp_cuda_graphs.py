"""CUDA graphs under tensor parallelism (tp_size=2, NCCL): each rank captures the decode ladder
with its collectives inside, rank 0 chooses each batch's graph and rank 1 replays the same one.
Greedy tokens equal one rank's run eagerly (float32, peaked random models).

Needs two CUDA devices (NCCL refuses two ranks on one): rank 0 on cuda:0 in this process, rank 1
on cuda:1 in a spawned one. `scripts/gpu_check.sh` runs it; with one device it skips."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.builtin_model import llama_config
from engine.forward_batch import ForwardMode
from tests.helpers import run_staggered, write_random_models
from tests.tp_gang import BASE, Gang, gang_fixture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (NCCL takes one rank per device)",
    ),
]

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
CASES = {
    "gqa": llama_config(**BASE, num_key_value_heads=2, tie_word_embeddings=False),
    "mqa": llama_config(**BASE, num_key_value_heads=1, tie_word_embeddings=True),
}


def _rank1(jobs: mp.Queue, results: mp.Queue) -> None:
    """Rank 1 on cuda:1 of every test's engine, until None: its decode replays back."""
    from engine.tp.comm import TPGroup
    from engine.tp.worker import IDLE_WAIT_S, TPWorker

    while (job := jobs.get()) is not None:
        try:
            kwargs, init = job
            config = EngineConfig.from_kwargs(**{**kwargs, "device": "cuda:1"})
            group = TPGroup(
                1, 2, "cuda:1", init_method=init, timeout_s=60.0, object_timeout_s=IDLE_WAIT_S
            )
            worker = TPWorker(config, 1, group)
            graphs = worker.runner.graph_runner
            try:
                worker.run()
            finally:
                worker.close()
            results.put(("ok", graphs.replays[ForwardMode.DECODE] if graphs is not None else None))
        except Exception:
            results.put(("error", traceback.format_exc()))


gang = gang_fixture(_rank1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_random_models(tmp_path_factory.mktemp("tp_cuda_graph_models"), CASES, seed=3)


def workload(engine: Engine) -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    prompts = [[1] + torch.randint(5, 250, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 24)]
    outs = run_staggered(engine, prompts, GREEDY, every=2)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def config(path: str, **kw: Any) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_path=path,
        device="cuda:0",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=1024,
        max_running_requests=8,
        cuda_graph_max_bs=4,
        **kw,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_graphs_under_tp_match_one_rank_eagerly(
    gang: Gang, models: dict[str, str], case: str
) -> None:
    ref = Engine(config(models[case], disable_cuda_graph=True))
    try:
        expected = workload(ref)
    finally:
        ref.shutdown()
    tp = gang.engine(config(models[case], tp_size=2))
    try:
        graphs = tp.model_runner.graph_runner
        assert graphs is not None, "no CUDA graphs under TP"
        got = workload(tp)
        tp.check_memory()
    finally:
        rank1_replays = gang.stop(tp)
    assert got == expected
    assert graphs.replays[ForwardMode.DECODE] > 0
    assert rank1_replays == graphs.replays[ForwardMode.DECODE]

"""CPU decode graphs under tensor parallelism (tp_size=2): the collectives inside the compiled
graphs as opaque operators (engine/tp/graph_ops.py), rank 0 choosing each batch's graph size and
rank 1 replaying the same one.

Rank 0 is an Engine in this process; rank 1 runs a TPWorker in one spawned process that serves
every test's engine in turn and reports its graph counters. Greedy tokens are identical to one
rank run eagerly and to two ranks run eagerly (the random models' logits are peaked: std 0.15
weights). The ladder stops at 4 (sizes 1, 2, 4; 8 for the n-gram run's verify rows) and five
staggered requests make decode batches of 1 to 5 rows: several sizes replay, padded, and a batch
of 5 runs eagerly on both ranks."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.builtin_model import (
    llama_config,
)
from engine.cpu_graph import CpuGraphRunner
from engine.forward_batch import ForwardMode
from engine.tp import graph_ops
from kernels import cpu_kernels
from tests.helpers import run_staggered, write_random_models
from tests.tp_gang import BASE, Gang, gang_fixture

pytestmark = [
    pytest.mark.skipif(
        cpu_kernels.load() is None, reason="the CPU decode graphs need the CPU kernels"
    ),
    pytest.mark.slow,
]

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
LADDER_MAX = 4
CASES = {
    "gqa": llama_config(**BASE, num_key_value_heads=2, tie_word_embeddings=False),
    # One KV head, replicated on both ranks; Qwen3's per-head q/k norms.
    "mqa": llama_config(
        **BASE,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
    ),
}


def _rank1(jobs: mp.Queue, results: mp.Queue) -> None:
    """Rank 1 of every test's engine, one after another, until None: its graph counters back.
    A job's `fail_sizes` make those sizes' compiles fail on this rank only."""
    torch.set_num_threads(1)
    from engine.tp.comm import TPGroup
    from engine.tp.worker import IDLE_WAIT_S, TPWorker

    while (job := jobs.get()) is not None:
        try:
            kwargs, init, fail_sizes = job
            config = EngineConfig.from_kwargs(**kwargs)
            group = TPGroup(1, 2, init_method=init, timeout_s=60.0, object_timeout_s=IDLE_WAIT_S)
            worker = TPWorker(config, 1, group)
            graphs = worker.runner.graph_runner
            if graphs is not None and fail_sizes:
                compile_size = graphs._compile

                def fail(size: int, compile_size=compile_size, fail_sizes=fail_sizes) -> Any:
                    if size not in fail_sizes:
                        return compile_size(size)
                    real = torch.compile
                    torch.compile = _failing_compile  # (this process is this rank alone)
                    try:
                        return compile_size(size)
                    finally:
                        torch.compile = real

                graphs._compile = fail
            try:
                worker.run()
            finally:
                worker.close()
            results.put(
                (
                    "ok",
                    dict(
                        steps=worker.steps,
                        replays_by_size=dict(graphs.replays_by_size) if graphs else None,
                        padded_eager=graphs.padded_eager if graphs else 0,
                        failed=sorted(graphs.failed) if graphs else [],
                    ),
                )
            )
        except Exception:
            results.put(("error", traceback.format_exc()))


def _failing_compile(fn: Any, **kwargs: Any) -> Any:
    def compiled() -> Any:
        raise RuntimeError("failed on purpose")

    return compiled


gang = gang_fixture(_rank1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_random_models(tmp_path_factory.mktemp("tp_graph_models"), CASES, seed=3)


def requests() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [[1] + torch.randint(5, 250, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 24)]


def workload(engine: Engine) -> list[list[int]]:
    outs = run_staggered(engine, requests(), GREEDY, every=2)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def config(path: str, **kw: Any) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_path=path,
        device="cpu",
        max_total_tokens=1024,
        max_running_requests=8,
        **{"cpu_graph_max_bs": LADDER_MAX, **kw},
    )


@pytest.fixture(scope="module")
def eager_ids(models: dict[str, str]) -> dict[str, list[list[int]]]:
    """Each model's greedy tokens on one rank, eagerly."""
    out = {}
    for name, path in models.items():
        ref = Engine(config(path, cpu_graph="off"))
        out[name] = workload(ref)
        ref.shutdown()
    return out


def run_tp(gang: Gang, path: str, fail_sizes: tuple[int, ...] = (), **kw: Any):
    """Two ranks: their greedy tokens, rank 0's graph runner and rank 1's counters."""
    tp = gang.engine(config(path, tp_size=2, **kw), fail_sizes)
    try:
        ids = workload(tp)
        tp.check_memory()
        runner, stats = tp.model_runner, tp.stats()
    finally:
        rank1 = gang.stop(tp)
    return ids, runner, rank1, stats


RUNS = {  # (model, engine kwargs)
    "gqa-at-start-up": ("gqa", {}),
    "mqa-lazy": ("mqa", dict(enable_lazy_cpu_graph=True)),
    # The forward (and its graph choice) on the forward thread.
    "gqa-overlap": ("gqa", dict(enable_overlap_schedule=True)),
    # Verify batches run as decode rows (two per request here): they replay the graphs too,
    # where the rows fit the ladder (up to 8 for this run).
    "mqa-ngram": (
        "mqa",
        dict(speculative_algorithm="ngram", speculative_num_draft_tokens=1, cpu_graph_max_bs=8),
    ),
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_graphs_under_tp_match_one_rank(gang, models, eager_ids, run: str) -> None:
    case, kw = RUNS[run]
    ids, runner, rank1, stats = run_tp(gang, models[case], cpu_graph="on", **kw)
    assert ids == eager_ids[case]
    graphs = runner.graph_runner
    assert isinstance(graphs, CpuGraphRunner) and not graphs.failed
    if kw.get("enable_lazy_cpu_graph"):
        assert sorted(graphs.compiled) == sorted(graphs.replays_by_size)
    else:
        assert graphs.compiled.keys() == set(graphs.ladder)
    # Several sizes replayed, and rank 1 ran the very same graph sizes at every step.
    assert len(graphs.replays_by_size) >= 2, graphs.replays_by_size
    if "speculative_algorithm" in kw:
        assert stats.batches_by_mode["TARGET_VERIFY"] > 0
        assert graphs.replays_by_mode[ForwardMode.TARGET_VERIFY] > 0, stats.batches_by_mode
    assert rank1["replays_by_size"] == graphs.replays_by_size
    assert rank1["padded_eager"] == 0 and rank1["failed"] == []
    # Closed: the graphs' binding to the group is gone.
    handle = runner.graph_collectives.handle
    assert handle not in graph_ops._BINDINGS


def test_two_ranks_eager_match_too(gang, models, eager_ids) -> None:
    ids, runner, rank1, stats = run_tp(gang, models["gqa"], cpu_graph="off")
    assert ids == eager_ids["gqa"]
    assert runner.graph_runner is None and rank1["replays_by_size"] is None


def test_a_size_that_fails_on_one_rank_runs_padded_there(gang, models, eager_ids) -> None:
    """Rank 1's compile of size 2 fails (lazily, at the step that first needs it): rank 0 still
    replays its graph of size 2, and rank 1 runs the same padded batch eagerly, meeting the same
    collectives; from then on rank 0 keeps sending size 2 (it compiled)."""
    ids, runner, rank1, stats = run_tp(
        gang, models["mqa"], fail_sizes=(2,), cpu_graph="on", enable_lazy_cpu_graph=True
    )
    assert ids == eager_ids["mqa"]
    graphs = runner.graph_runner
    assert graphs.replays_by_size.get(2, 0) > 0
    assert rank1["failed"] == [2] and not graphs.failed
    assert rank1["padded_eager"] == graphs.replays_by_size[2]
    assert rank1["replays_by_size"] == {s: n for s, n in graphs.replays_by_size.items() if s != 2}

"""Two-rank engines for the tensor-parallel tests: rank 0 in the test's process, rank 1 in one
spawned process that serves every test of a module, one engine after another.

A module gives its own rank-1 loop (`rank1(jobs, results)`, importable by a spawned process: a
module-level function), which takes jobs `(engine config kwargs, init method, *extra)` until
None and puts `("ok", value)` or `("error", traceback)` for each."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch

from engine import Engine, EngineConfig
from engine.tp.comm import serve_store
from engine.tp.worker import rank0_engine

# The small models' shape the tensor-parallel test modules share (each adds its heads and head type).
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=512,
)


class Gang:
    def __init__(self, rank1: Callable[[mp.Queue, mp.Queue], None]) -> None:
        ctx = mp.get_context("spawn")
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=rank1, args=(self.jobs, self.results), daemon=True)
        self.proc.start()

    def engine(self, config: EngineConfig, *extra: Any) -> Engine:
        """Rank 0 of a new two-rank engine (rank 1 starts in the gang's process)."""
        store, init = serve_store("127.0.0.1", config.tp_size, timeout_s=60.0)
        self.jobs.put((msgspec.structs.asdict(config), init, *extra))
        return rank0_engine(config, store, timeout_s=60.0)

    def stop(self, engine: Engine, timeout_s: float = 120.0) -> Any:
        """Shut the engine down (rank 1 leaves on the STOP message); what rank 1 reported."""
        engine.shutdown()
        try:
            status, value = self.results.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError("rank 1 did not end") from None
        assert status == "ok", value
        return value


def gang_fixture(rank1: Callable[[mp.Queue, mp.Queue], None]) -> Any:
    """A module's `gang` fixture: one Gang for the module's tests (rank 1 run by `rank1`), torch
    on one thread meanwhile (two ranks on two cores)."""

    @pytest.fixture(scope="module")
    def gang() -> Iterator[Gang]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        g = Gang(rank1)
        try:
            yield g
        finally:
            g.jobs.put(None)
            g.proc.join(30)
            torch.set_num_threads(threads)

    return gang

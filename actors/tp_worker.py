"""The ranks 1..N-1 of a tensor-parallel engine as Ray actors, and the gang rank 0 (the
EngineActor) builds them into.

Rank 0 creates the other ranks in the other bundles of its placement group (`TPGang.start`),
each told a fresh `tcp://` rendezvous address on rank 0's node (a new one per incarnation, so a
restarted gang never meets a stale store), then builds its Engine over the group while they
build their ModelRunners. The workers are rank 0's children: when rank 0's process exits, Ray
takes them down with it. A worker that dies makes rank 0 die too (`TPGang.watch`, and its next
collective fails anyway): the engine fails its requests explicitly and exits, and Ray restarts
rank 0, which builds the gang again."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import Engine, EngineConfig
from engine.logs import log_to_stderr


class TPWorkerActor:
    """Rank `tp_rank` (> 0) of a tensor-parallel engine: `run` holds the actor's one task for
    the gang's whole life (engine.tp.worker.run_worker) and returns the steps it ran after rank
    0's STOP; it raises when the group breaks."""

    def __init__(
        self, engine_config: dict, tp_rank: int, init_method: str, timeout_s: float
    ) -> None:
        log_to_stderr()
        self.args = (engine_config, tp_rank, init_method, timeout_s)

    def run(self) -> int:
        from engine.tp.worker import run_worker

        return run_worker(*self.args)


class TPGang:
    """Rank 0's view of its engine's other ranks. `tp`: {"num_cpus", "num_gpus", "bundles" (the
    placement-group bundle of each rank 1..N-1; None: no placement group), "timeout_s"}."""

    def __init__(self, config: EngineConfig, tp: dict[str, Any] | None, name: str = "") -> None:
        self.config, self.tp = config, tp or {}
        self.name = name
        self.workers: list = []
        self.runs: list = []
        self._stopping = False

    def start(self, **engine_kwargs: Any) -> Engine:
        """Create ranks 1..N-1, then rank 0's Engine over the group (returns once every rank has
        its shards and the KV pools agree)."""
        from engine.tp.comm import serve_store
        from engine.tp.worker import rank0_engine

        size = self.config.tp_size
        timeout = float(self.tp.get("timeout_s", 30.0))
        store, init = serve_store(ray.util.get_node_ip_address(), size, timeout)
        pg = ray.util.get_current_placement_group()
        bundles = self.tp.get("bundles") or list(range(1, size))
        cls = ray.remote(TPWorkerActor)
        cfg = msgspec.structs.asdict(self.config)
        for rank in range(1, size):
            strategy = None
            if pg is not None:
                strategy = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=bundles[rank - 1]
                )
            worker = cls.options(
                num_cpus=self.tp.get("num_cpus", 1),
                num_gpus=self.tp.get("num_gpus", 0),
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=strategy,
                name=f"{self.name}-tp{rank}" if self.name else None,
                namespace="radixray" if self.name else None,
            ).remote(cfg, rank, init, timeout)
            self.workers.append(worker)
            self.runs.append(worker.run.remote())
        return rank0_engine(self.config, store, timeout_s=timeout, **engine_kwargs)

    def watch(self, engine: Engine, die: Callable[[BaseException], None]) -> None:
        """On a thread: when any other rank ends while the engine runs (it died, or its loop
        broke), the engine dies: its requests fail explicitly and `die` (the actor's exit) runs,
        so Ray restarts rank 0 and with it the gang."""

        def wait() -> None:
            try:
                ready, _ = ray.wait(self.runs, num_returns=1)
                ray.get(ready[0])
                error: BaseException = RuntimeError("a tensor-parallel rank left its loop")
            except Exception as e:  # the worker actor died
                error = e
            if self._stopping or engine.stopping:
                return
            if engine.dead is None:
                engine.die(
                    RuntimeError(f"tensor-parallel rank lost: {type(error).__name__}: {error}")
                )
            else:
                die(error)

        threading.Thread(target=wait, name="radixray-tp-watch", daemon=True).start()

    def stop(self, engine: Engine) -> None:
        """Stop the other ranks (after the engine's loop): STOP, then the group is shut down."""
        self._stopping = True
        engine.model_runner.close()

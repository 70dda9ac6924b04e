"""The ranks 1..N-1 of a tensor-parallel engine: no scheduler, no tokenizer, no sampler. Each
holds its ModelRunner (its shards, its share of the KV pool) and runs what rank 0 sends: every
step one `TPStep` over the group's object group, the batch rebuilt against this rank's own
request -> token table and KV pool, the forward run (its collectives meet rank 0's), the logits
dropped (rank 0 samples). With LoRA adapters each rank keeps its shards in slots of its own
(`engine.lora.LoRAReplica`), changed by the pool events of rank 0's LoRAManager that each message
carries, before the forward that reads them. A STOP message, or a broken group (rank 0 died: its
connections close), ends the loop."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from engine.builtin_model import builtin_model_path
from engine.config import EngineConfig
from engine.engine import Engine
from engine.hicache.host_pool import HostKVPool
from engine.model_runner import ModelRunner, resolve_device
from engine.tp.batch import FORWARD, SPLIT, STOP, TPStep, apply_table, decode_batch
from engine.tp.comm import TPGroup

log = logging.getLogger("radixray.engine")

# How long a rank other than 0 waits for the next step: an idle engine sends nothing.
IDLE_WAIT_S = 7 * 24 * 3600.0


class TPWorker:
    """Rank `tp_rank` (> 0) of a tensor-parallel engine over `group`."""

    def __init__(self, config: EngineConfig, tp_rank: int, group: TPGroup) -> None:
        if tp_rank < 1:
            raise ValueError("rank 0 of a tensor-parallel engine is its Engine, not a TPWorker")
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.runner = ModelRunner(
            config, config.model_path or builtin_model_path(), tp_rank=tp_rank, tp_group=group
        )
        self.group = group
        # Rank 0's Engine builds its LoRAManager right after its ModelRunner: its setup comes next.
        self.lora = self.runner.init_lora_replica() if config.lora_enabled else None
        # This rank's KV heads of rank 0's host tier, slot for slot (rank 0 sends its copies).
        self.host = (
            HostKVPool.for_device_pool(
                self.runner.kv_cache,
                self.runner.max_total_tokens,
                config.hicache_ratio,
                config.hicache_size,
            )
            if config.enable_hierarchical_cache
            else None
        )
        self.steps = 0  # forwards (and split-prefill slices) run
        self.forward_seconds = 0.0
        self._split = None  # the SPLIT_PREFILL batch whose slices are running

    @torch.inference_mode()
    def run(self) -> None:
        """Run rank 0's steps until it sends STOP; raises when the group breaks."""
        runner, device = self.runner, self.runner.device
        table = runner.req_to_token_pool.req_to_token
        layers = runner.model_config.num_hidden_layers
        while True:
            msg = self.group.broadcast_object(None, as_type=TPStep)
            if msg.lora_events:
                if self.lora is None:
                    raise RuntimeError("rank 0 sent LoRA slot changes to a rank without adapters")
                self.lora.apply(msg.lora_events)
            if msg.host_copies:
                if self.host is None:
                    raise RuntimeError("rank 0 sent host KV copies to a rank without a host tier")
                self.host.apply_copies(runner.kv_cache, msg.host_copies)
            if msg.kind == STOP:
                break
            t0 = time.perf_counter()
            if msg.kind == FORWARD:
                apply_table(msg, table)
                # The graph rank 0 runs it with (0: eagerly): every rank's collectives then have
                # the same shapes.
                runner.run_forward(decode_batch(msg, device), msg.graph_size)
            elif msg.kind == SPLIT:
                if msg.input_ids is not None:  # its first slice: the batch itself
                    apply_table(msg, table)
                    self._split = decode_batch(msg, device)
                fb = self._split
                if fb is None:
                    raise RuntimeError("a split-prefill slice arrived before its batch")
                runner.run_split_prefill(fb, msg.split_end)
                if msg.split_end >= layers:
                    self._split = None
            else:
                raise RuntimeError(f"unknown TP message kind {msg.kind}")
            self.forward_seconds += time.perf_counter() - t0
            self.steps += 1

    def close(self) -> None:
        self.runner.close()  # (its graphs' binding to the group, then the group)
        self.group.destroy()


def rank0_engine(
    config: EngineConfig, store: dist.Store, timeout_s: float = 30.0, **kwargs: Any
) -> Engine:
    """Rank 0 of a tensor-parallel engine: the Engine (scheduler, sampler, outputs) over the group
    whose rendezvous `store` rank 0 serves (`engine.tp.comm.serve_store`; the other ranks join its
    init method, `run_worker`, while this is built). A forward error is fatal (the other ranks
    may be inside a collective): the engine's loop dies, failing its requests, and its host
    restarts the gang. `engine.shutdown()` stops the other ranks."""
    group = TPGroup(
        0,
        config.tp_size,
        resolve_device(config.device),
        store=store,
        timeout_s=timeout_s,
    )
    try:
        engine = Engine(config, tp_group=group, **kwargs)
    except BaseException:
        group.destroy()
        raise
    engine.scheduler.isolate_batch_failures = False
    return engine


def run_worker(
    engine_config: dict[str, Any], tp_rank: int, init_method: str, timeout_s: float = 30.0
) -> int:
    """A rank's whole life (a spawned process's or a Ray actor's thread): join the group at
    `init_method`, build the rank, run until STOP; returns the steps run."""
    config = EngineConfig.from_kwargs(**engine_config)
    group = TPGroup(
        tp_rank,
        config.tp_size,
        resolve_device(config.device),
        init_method=init_method,
        timeout_s=timeout_s,
        object_timeout_s=IDLE_WAIT_S,
    )
    try:
        worker = TPWorker(config, tp_rank, group)
    except BaseException:
        group.destroy()
        raise
    try:
        worker.run()
    finally:
        worker.close()
    return worker.steps

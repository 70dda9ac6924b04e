"""The driver: the job's options, the Ray Data pipeline (`build_dataset`: read + Preprocess ->
windows -> Generate -> WriteShards) and the run that drives it and sums the shards' reports."""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
import numpy as np

from cluster.batch.files import PromptFiles, resolve_input
from cluster.batch.generate import Generate
from cluster.batch.ids import SeenIds, _load_done
from cluster.batch.preprocess import Preprocess
from cluster.batch.shards import (
    ShardReport,
    WriteShards,
    _remove_stale_temporaries,
    committed_shards,
)
from cluster.config import ClusterConfig
from engine.errors import ConfigError

# Windows an engine holds at once: enough queued that its batch stays full while one window's
# results travel on, few enough that the windows left are dealt to whichever engine is free.
WINDOWS_PER_ENGINE = 4


class BatchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The job's own options (the engines' come from ClusterConfig)."""

    input: str
    output: str
    output_format: Literal["jsonl", "parquet"] = "jsonl"
    window: int = 128  # rows sent to one engine together
    group_rows: int = 4096  # rows sorted by token ids together, so shared prefixes share windows
    rows_per_shard: int = 1000
    read_tasks: int | None = None  # concurrent read + tokenize tasks (default: max(2, engines))
    progress: bool = True
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None  # for rows with tool_choice "auto"

    def __post_init__(self) -> None:
        if self.output_format not in ("jsonl", "parquet"):
            raise ConfigError(f"output_format must be jsonl or parquet, got {self.output_format!r}")
        for name in ("window", "group_rows", "rows_per_shard", "read_tasks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")


class BatchSummary(msgspec.Struct, kw_only=True):
    """A run's totals (the final summary line)."""

    rows: int = 0  # written by this run, errors included
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    shards: int = 0
    skipped: int = 0  # ids already in the output before this run
    wall_s: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def add(self, shard: ShardReport) -> None:
        self.rows += shard.rows
        self.errors += shard.errors
        self.prompt_tokens += shard.prompt_tokens
        self.completion_tokens += shard.completion_tokens
        self.cached_tokens += shard.cached_tokens
        self.shards += 1

    def line(self) -> str:
        wall = max(self.wall_s, 1e-9)
        return (f"batch: rows={self.rows} errors={self.errors} prompt_tokens={self.prompt_tokens} "
                f"completion_tokens={self.completion_tokens} prefix_hit_rate={self.prefix_hit_rate:.1%} "
                f"wall={self.wall_s:.1f}s rows/s={self.rows / wall:.1f} tokens/s={self.completion_tokens / wall:.1f} "
                f"shards={self.shards} already_done={self.skipped}")


def _window_blocks(ds: Any, rows: int, compute: Any, remote_args: dict) -> Any:
    """Cut the stream into blocks of at most `rows` rows (Ray Data's streaming repartition), in the
    same tasks as the stage before. `repartition` takes neither a compute strategy nor resources
    (its tasks ask a CPU each, which engines holding every CPU would starve); Ray Data fuses it
    into the stage before only when both match, so they are set to that stage's here."""
    import dataclasses

    ds = ds.repartition(target_num_rows_per_block=rows)
    op = ds._logical_plan.dag
    if not (dataclasses.is_dataclass(op) and isinstance(getattr(op, "ray_remote_args", None), dict)
            and hasattr(op, "compute")):
        raise RuntimeError("Ray Data's StreamingRepartition changed shape; update cluster.batch.driver._window_blocks")
    op.ray_remote_args.update(remote_args)
    object.__setattr__(op, "compute", compute)  # a frozen dataclass: this op is ours, not yet planned
    return ds


def start_prefill_engines(cfg: ClusterConfig) -> tuple[Any, list[str]]:
    """Disaggregation: the job's prefill engines, engine actors of their own (the Generate stage's
    actors are the decode engines). Returns what to stop after the job (OwnedEngines) and their
    actor names."""
    from cluster.membership import OwnedEngines

    prefill_only = msgspec.structs.replace(cfg, prefill_engines=0, decode_engines=0, num_engines=cfg.prefill_engines,
                                           enable_dp_attention=False, dp_group_size=None,
                                           engine={**cfg.engine, "disaggregation_mode": "prefill"})
    owned = OwnedEngines()
    try:
        started = owned.start(prefill_only)
    except BaseException:
        owned.stop()
        raise
    return owned, [name for _, _, name in started]


def build_dataset(opts: BatchOptions, cfg: ClusterConfig, done_ref: Any, seen_ids: Any = None,
                  prefill_peers: dict | None = None) -> Any:
    """read -> Preprocess -> windows -> Generate -> WriteShards, as a lazy Ray Data dataset of
    ShardReport rows. seen_ids: the job's SeenIds actor (None: each read task keeps its own, so
    a duplicate id across tasks' files is not caught). prefill_peers: disaggregated, the prefill
    engines the Generate stage's decode engines fetch KV from."""
    import ray
    import ray.data

    if cfg.enable_dp_attention:
        raise ConfigError("the batch job runs independent engines: enable_dp_attention is not supported")
    files, filesystem = resolve_input(opts.input)
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
    device = "cuda" if use_gpu else "cpu"
    engine_config = msgspec.structs.asdict(cfg.engine_config(device, "decode" if cfg.disaggregated else "null"))
    engines = cfg.decode_engines if cfg.disaggregated else cfg.num_engines
    # The CPU stages ask no CPU: engines may hold every CPU of a CPU-only cluster, and these are
    # small next to generation. Their concurrency is capped instead; each task reads its share
    # of the files, so a task (one process, one tokenizer) is started at most read_tasks times.
    read_tasks = opts.read_tasks or max(2, cfg.num_engines)
    light, tasks = {"num_cpus": 0}, ray.data.TaskPoolStrategy(size=read_tasks)
    ds = ray.data.read_datasource(PromptFiles(files, filesystem=filesystem), compute=tasks,
                                  override_num_blocks=min(len(files), read_tasks), **light)
    # No batch size: a whole read block per call, which lets Ray Data fuse this into the read.
    ds = ds.map_batches(Preprocess(engine_config, [done_ref], opts.window, opts.group_rows, opts.tool_call_parser,
                                   seen_ids),
                        batch_size=None,
                        batch_format="pyarrow", compute=tasks, **light)
    # One block per window: the engine stage takes a block at a time, so a window is what goes
    # to one engine.
    ds = _window_blocks(ds, opts.window, tasks, light)
    engine_resources = {"num_gpus": 1} if use_gpu else {"num_cpus": cfg.cpus_per_engine}
    # A batch is a window (Ray Data wants a batch size with GPUs; a short window's block may
    # share a call with the next one).
    ds = ds.map_batches(Generate, batch_size=opts.window, batch_format="pyarrow",
                        fn_constructor_kwargs={"engine_config": engine_config, "prefill_peers": prefill_peers},
                        compute=ray.data.ActorPoolStrategy(size=engines,
                                                           max_concurrent_calls_per_actor=WINDOWS_PER_ENGINE,
                                                           max_tasks_in_flight_per_actor=WINDOWS_PER_ENGINE),
                        **engine_resources)
    ds = ds.map_batches(WriteShards, batch_size=opts.rows_per_shard, batch_format="pyarrow",
                        fn_constructor_kwargs={"output": opts.output, "output_format": opts.output_format},
                        compute=ray.data.ActorPoolStrategy(size=1), **light)
    ds.context.enable_progress_bars = False  # the job's own bar counts rows and tokens
    return ds


def run(opts: BatchOptions, cfg: ClusterConfig) -> BatchSummary:
    """Run the job on Ray (cfg.address, $RAY_ADDRESS, else a new local Ray) and summarise it."""
    import ray
    from tqdm import tqdm

    from cluster.cluster import ensure_ray

    owns_ray = ensure_ray(cfg.address)
    prefill = None
    try:
        t0 = time.monotonic()
        _remove_stale_temporaries(opts.output)
        if committed_shards(opts.output):
            # The resume set is read by a task while the pipeline starts (nothing waits for it here).
            done_ref, count_ref = ray.remote(_load_done).options(num_cpus=0, num_returns=2).remote(opts.output)
        else:
            done_ref, count_ref = ray.put(np.zeros(0, dtype="S16")), ray.put(0)
        summary = BatchSummary()
        # One claim a span of rows; it asks no CPU, as the read tasks that call it.
        seen_ids = ray.remote(SeenIds).options(num_cpus=0).remote()
        peers = None
        if cfg.disaggregated:
            from cluster.membership import ACTOR_NAMESPACE

            prefill, names = start_prefill_engines(cfg)
            peers = {"names": names, "namespace": ACTOR_NAMESPACE}
        ds = build_dataset(opts, cfg, done_ref, seen_ids, peers)
        with tqdm(disable=not opts.progress, unit="row", dynamic_ncols=True) as bar:
            for row in ds.iter_rows():
                shard = msgspec.convert(row, ShardReport)
                summary.add(shard)
                elapsed = max(time.monotonic() - t0, 1e-9)
                bar.update(shard.rows)
                bar.set_postfix(tok_s=f"{summary.completion_tokens / elapsed:.1f}", errors=summary.errors)
        ray.kill(seen_ids)  # on a cluster this job does not own, its memory goes back now
        summary.wall_s = time.monotonic() - t0
        summary.skipped = ray.get(count_ref)
        return summary
    finally:
        if prefill is not None:
            prefill.stop()
        if owns_ray:
            ray.shutdown()

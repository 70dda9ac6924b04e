"""Where adapters live while the engine serves them (SGLang's LoRAManager / LoRAMemoryPool):

- host memory: every adapter the engine knows (`lora_paths`, or loaded at run time) has a path;
  at most `max_loaded_loras` are read into host memory at once. Past that the least recently
  used adapter that is neither pinned nor in use by a running request is dropped (it is read
  again from its path when next needed).
- device slots: `LoRAMemoryPool` holds `max_loras_per_batch` adapter slots plus slot 0, the base
  model (rank 0: no update), stacked per projection in `kernels.lora`'s layouts. A batch's
  adapters are copied into free slots, or into the least recently used slot whose adapter has no
  running request (a slot of a running request's adapter may be read by a batch in flight).

Reference counts are per adapter: the scheduler `acquire`s a request's adapter when it admits it
and `release`s it when the request ends; an adapter with references is never evicted, and
unloading it lets its running requests finish (it is dropped at the last release).

Under tensor parallelism every rank holds its shards of each adapter (`LoRAShards`: A and B split
like the projection they attach to) in slots of its own. Rank 0's `LoRAManager` decides every
slot load and eviction and records each as a `PoolEvent`; the other ranks' `LoRAReplica`s apply
them in the same order (engine.tp sends them with each step), reading the adapter files
themselves, so the slots hold the same adapters on every rank."""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from engine.errors import ConfigError
from engine.lora.adapter import (
    PROJECTION_GROUPS,
    TARGET_MODULES,
    LoRAAdapter,
    LoRAAdapterError,
    LoRAModule,
    UnknownLoRAError,
    adapter_rank_and_targets,
    load_adapter,
    target_shapes,
)
from engine.lora.config import DEFAULT_MAX_LORA_RANK, LoRAConfig, LoRAPath
from kernels.lora import LoRABatchInfo, LoRAWeights, batch_info

if TYPE_CHECKING:  # (engine.config imports engine.lora.config: no import at run time)
    from engine.config import ModelConfig

BASE_SLOT = 0  # the base model's slot: rank 0 everywhere, never assigned


class LoRASlotsFullError(RuntimeError):
    """A batch needs more adapter slots than are free: the scheduler admitted more distinct
    adapters than max_loras_per_batch among running requests (a bug, never a user error)."""


_FIXED = ("adapters are not loaded or unloaded at run time under attention-DP (every member holds "
          "the adapters of lora_paths in the same slots)")


class LoRAShards(Protocol):
    """One rank's part of every adapter (engine.tp.sharding.TPLoRAShards for a tensor-parallel
    rank, engine.lora.mlp_shards.MLPSliceShards for an attention-DP member)."""

    def target_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each target projection on this rank."""
        ...

    def shard(self, layer: int, target: str, module: LoRAModule) -> LoRAModule:
        """This rank's A and B of one adapted projection (validated whole before)."""
        ...


class PoolEvent(NamedTuple):
    """A change to a LoRAManager's slots or host memory that the other tensor-parallel ranks
    repeat (`LoRAReplica.apply`). op "load": adapter `adapter_id` (`name`, read from `path`)
    copied into `slot`; "clear": `slot` emptied; "drop": adapter `adapter_id` left host memory."""

    op: str
    slot: int = 0
    adapter_id: int = 0
    name: str = ""
    path: str = ""


def read_adapter(
    name: str,
    path: str,
    model: ModelConfig,
    max_rank: int,
    targets: Iterable[str],
    dtype: torch.dtype,
    shards: LoRAShards | None = None,
) -> LoRAAdapter:
    """`load_adapter` (validated against the whole base model), then this rank's shards only."""
    adapter = load_adapter(name, path, model, max_rank, targets, dtype)
    if shards is not None:
        adapter.modules = {
            key: shards.shard(key[0], key[1], m) for key, m in adapter.modules.items()
        }
    return adapter


class LoRAMemoryPool:
    """Device buffers: per layer and per projection group (qkv_proj, o_proj, gate_up_proj,
    down_proj) one `kernels.lora.LoRAWeights` over `num_slots` slots (slot 0 the base model). A
    group exists where any of its targets is enabled; a fused group spans all of its targets'
    columns (a target an adapter lacks has rank 0). Knows nothing of names or requests."""

    def __init__(
        self,
        model: ModelConfig,
        targets: frozenset[str],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shapes: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """`shapes`: (in, out) per target (a tensor-parallel rank's, `LoRAShards.target_shapes`);
        default the whole model's."""
        self.num_slots, self.max_rank, self.targets = num_slots, max_rank, targets
        shapes = target_shapes(model) if shapes is None else shapes
        self.layers: list[dict[str, LoRAWeights]] = []
        for layer in range(model.num_hidden_layers):
            groups = {}
            for group, members in PROJECTION_GROUPS.items():
                if not targets & set(members):
                    continue
                if model.is_sparse_layer(layer) and group in ("gate_up_proj", "down_proj"):
                    continue  # an MoE layer's MLP has no single projection to adapt
                groups[group] = LoRAWeights.empty(
                    num_slots,
                    max_rank,
                    shapes[members[0]][0],
                    [shapes[t][1] for t in members],
                    dtype,
                    device,
                )
            self.layers.append(groups)

    def weights(self, layer: int, group: str) -> LoRAWeights | None:
        """The stacked adapters of projection `group` of `layer` (None: no slots for it)."""
        return self.layers[layer].get(group)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` (zero padding past each rank; rank 0 where it has no module)."""
        if not 0 < slot < self.num_slots:
            raise ValueError(f"slot {slot} is not an adapter slot (1..{self.num_slots - 1})")
        r_max = self.max_rank
        for layer, groups in enumerate(self.layers):
            for group, w in groups.items():
                offsets = w.out_offsets.tolist()
                w.lora_a[slot].zero_()
                w.lora_b[slot].zero_()
                for j, target in enumerate(PROJECTION_GROUPS[group]):
                    m = adapter.module(layer, target)
                    r = 0 if m is None else m.rank
                    if m is not None:
                        w.lora_a[slot, j * r_max : j * r_max + r].copy_(m.lora_a)
                        w.lora_b[slot, :r, offsets[j] : offsets[j + 1]].copy_(m.lora_b.T)
                    w.ranks[slot, j] = r
                    w.scalings[slot, j] = 0.0 if m is None else m.scaling

    def clear(self, slot: int) -> None:
        """Rank 0 everywhere in `slot` (its buffers stay as they are: no kernel reads past a rank)."""
        for groups in self.layers:
            for w in groups.values():
                w.ranks[slot].zero_()

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for groups in self.layers
            for w in groups.values()
            for t in (w.lora_a, w.lora_b)
        )


class LoRAManager:
    """The engine's adapters by name: host residency (LRU, pinning), reference counts, device
    slots for each batch. Not thread-safe: the scheduler thread owns it (`take_events` excepted).
    Under tensor parallelism (rank 0's): `shards` keeps this rank's part of each adapter, and
    `record_events` logs the slot and host changes the other ranks repeat. `fixed_slots`
    (attention-DP, whose members adapt each other's rows in the split MLP and so must hold every
    adapter in the same slot): the adapters of `lora_paths` go into slots 1.. in their order at
    start and stay there; none is loaded or unloaded at run time."""

    def __init__(
        self,
        config: LoRAConfig,
        model: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shards: LoRAShards | None = None,
        record_events: bool = False,
        fixed_slots: bool = False,
    ) -> None:
        self.fixed_slots = False  # (set once the adapters of lora_paths are in their slots)
        self.config, self.model, self.dtype, self.device = (
            config,
            model,
            dtype,
            torch.device(device),
        )
        self.max_loras_per_batch = config.max_loras_per_batch
        self.max_loaded_loras = config.loaded_capacity()
        paths = config.paths()
        ranks, union = [], set()
        for name, p in paths.items():  # the defaults come from the adapters' own files
            try:
                r, t = adapter_rank_and_targets(name, p.lora_path)
            except LoRAAdapterError as e:  # at start a bad adapter is a configuration error
                raise ConfigError(str(e)) from e
            ranks.append(r)
            union |= t
        self.max_lora_rank = config.max_lora_rank or max(ranks, default=DEFAULT_MAX_LORA_RANK)
        targets = config.target_modules()
        if targets is None:
            self.target_modules = frozenset(union) if paths else frozenset(TARGET_MODULES)
        elif "all" in targets or "all-linear" in targets:
            self.target_modules = frozenset(TARGET_MODULES)
        else:
            unknown = set(targets) - set(TARGET_MODULES)
            if unknown:
                raise ConfigError(
                    f"lora_target_modules: {', '.join(sorted(unknown))} not among "
                    f"{', '.join(TARGET_MODULES)} (or all)"
                )
            self.target_modules = frozenset(targets)
        self.shards = shards
        self.pool = LoRAMemoryPool(
            model,
            self.target_modules,
            self.max_loras_per_batch + 1,
            self.max_lora_rank,
            dtype,
            self.device,
            None if shards is None else shards.target_shapes(),
        )
        # Appended on the scheduler thread, taken on whichever thread sends a step (a deque's
        # append and popleft are atomic: no event is lost or sent twice).
        self._events: deque[PoolEvent] | None = deque() if record_events else None
        self._known: dict[
            str, LoRAPath
        ] = {}  # name -> where it is read from; what requests may name
        self._resident: OrderedDict[str, LoRAAdapter] = (
            OrderedDict()
        )  # host memory, least recently used first
        self._refs: dict[str, int] = {}  # running requests per adapter (absent: none)
        self._draining: dict[
            str, LoRAPath
        ] = {}  # unloaded with running requests: dropped at the last release
        self._slot_names: list[str | None] = [None] * (self.max_loras_per_batch + 1)
        self._slot_of: OrderedDict[str, int] = (
            OrderedDict()
        )  # device slots, least recently used first
        # Each load gets a new id (never reused): the radix cache's namespace for the adapter's KV,
        # so an adapter loaded again under the same name never meets the old one's KV.
        self._ids: dict[str, int] = {}
        self._id_names: dict[int, str] = {}
        self._next_id = 1
        # Reads of an evicted adapter back into host memory, and copies into a device slot: what
        # routing with adapter affinity saves.
        self.host_reloads = 0
        self.slot_loads = 0
        for name, p in paths.items():
            try:
                self.load_adapter(name, p.lora_path, pinned=p.pinned)
            except LoRAAdapterError as e:  # at start a bad adapter is a configuration error
                raise ConfigError(str(e)) from e
        if fixed_slots:
            if not paths:
                raise ConfigError("attention-DP serves the adapters of lora_paths only (no run-time loads): give them")
            if len(paths) > min(self.max_loras_per_batch, self.max_loaded_loras):
                raise ConfigError(
                    f"attention-DP holds every adapter in a slot: {len(paths)} adapters in lora_paths need "
                    f"max_loras_per_batch and max_loaded_loras >= {len(paths)}"
                )
            self.prepare_batch(list(paths))  # slots 1.. in order, the same on every member
            self.fixed_slots = True

    # -- names ---------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._known

    def names(self) -> list[str]:
        """The adapters requests may name (loaded at start or at run time, not unloaded)."""
        return list(self._known)

    def resident(self) -> list[str]:
        """Adapters in host memory, least recently used first."""
        return list(self._resident)

    def slots(self) -> dict[str, int]:
        """Adapters in device slots: name -> slot."""
        return dict(self._slot_of)

    def refs(self, name: str) -> int:
        return self._refs.get(name, 0)

    def active(self) -> set[str]:
        """Adapters with running requests: each needs a slot in every batch they are in, so the
        scheduler keeps this at most max_loras_per_batch."""
        return set(self._refs)

    def adapter_id(self, name: str) -> int:
        """The id of this load of adapter `name` (positive; UnknownLoRAError if not loaded)."""
        if name not in self._known:
            raise UnknownLoRAError(name)
        return self._ids[name]

    def name_of(self, adapter_id: int) -> str | None:
        """The name adapter id `adapter_id` was loaded under (None: 0, the base model)."""
        return self._id_names.get(adapter_id)

    def busy(self) -> set[str]:
        """Adapters that keep a device slot: those with running requests, and pinned ones
        already in a slot."""
        return set(self._refs) | {n for n in self._slot_of if self.is_pinned(n)}

    def can_admit(self, name: str | None, admitting: Iterable[str] = ()) -> bool:
        """Whether a request of adapter `name` may start running now, besides the adapters of
        requests `admitting` in the same round: the base model always; an adapter that keeps a
        slot; any other only while fewer than max_loras_per_batch adapters keep one (every batch
        then finds a slot for each of its adapters)."""
        if name is None:
            return True
        busy = self.busy() | set(admitting)
        return name in busy or len(busy) < self.max_loras_per_batch

    def is_pinned(self, name: str) -> bool:
        p = self._known.get(name) or self._draining.get(name)
        return p is not None and p.pinned

    # -- load, unload --------------------------------------------------------------------------

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and validate the adapter in `path` for this manager (LoRAAdapterError), changing
        nothing: safe off the step thread, so a run-time load reads its files while steps run."""
        if self.fixed_slots:
            raise LoRAAdapterError(name, _FIXED)
        return self._read(name, path)

    def load_adapter(
        self, name: str, path: str, pinned: bool = False, adapter: LoRAAdapter | None = None
    ) -> LoRAAdapter:
        """Read, validate and keep adapter `name` (LoRAAdapterError on a bad adapter, an existing
        name, no host room or too many pinned ones; nothing changes then). `adapter`: already
        read from `path` (`read`)."""
        if self.fixed_slots:
            raise LoRAAdapterError(name, _FIXED)
        if name in self._known or name in self._draining:
            raise LoRAAdapterError(name, "an adapter of that name is already loaded")
        if pinned:
            n_pinned = sum(p.pinned for p in self._known.values()) + sum(
                p.pinned for p in self._draining.values()
            )
            if n_pinned + 1 > min(self.max_loras_per_batch - 1, self.max_loaded_loras):
                raise LoRAAdapterError(
                    name,
                    f"cannot pin another adapter ({n_pinned} pinned, max_loras_per_batch "
                    f"{self.max_loras_per_batch}: one slot must rotate)",
                )
        if adapter is None:
            adapter = self._read(name, path)
        self._make_host_room(name)
        self._known[name] = LoRAPath(lora_path=path, pinned=pinned)
        self._resident[name] = adapter
        self._ids[name] = self._next_id
        self._id_names[self._next_id] = name
        self._next_id += 1
        return adapter

    def unload_adapter(self, name: str) -> bool:
        """Forget adapter `name`: new requests naming it fail (UnknownLoRAError). True if it is
        gone now; False if running requests still use it (it goes at their last release)."""
        if name not in self._known:
            raise UnknownLoRAError(name)
        if self.fixed_slots:
            raise LoRAAdapterError(name, _FIXED)
        path = self._known.pop(name)
        if self.refs(name):
            self._draining[name] = path
            return False
        self._drop(name)
        return True

    def _read(self, name: str, path: str) -> LoRAAdapter:
        return read_adapter(
            name,
            path,
            self.model,
            self.max_lora_rank,
            self.target_modules,
            self.dtype,
            self.shards,
        )

    def _drop(self, name: str) -> None:
        adapter_id = self._ids.pop(name, None)
        if self._resident.pop(name, None) is not None:
            self._record(PoolEvent("drop", adapter_id=adapter_id))
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> None:
        self._slot_names[slot] = None
        self.pool.clear(slot)
        self._record(PoolEvent("clear", slot=slot))

    def _record(self, event: PoolEvent) -> None:
        if self._events is not None:
            self._events.append(event)

    def take_events(self) -> list[PoolEvent]:
        """The PoolEvents recorded since the last call, oldest first (any thread)."""
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def slot_ids(self) -> dict[int, int]:
        """slot -> the id of the adapter load it holds (what every rank's slots must agree on)."""
        return {slot: self._ids[name] for name, slot in self._slot_of.items()}

    def _make_host_room(self, incoming: str) -> None:
        while len(self._resident) >= self.max_loaded_loras:
            victim = next(
                (n for n in self._resident if not self.is_pinned(n) and not self.refs(n)), None
            )
            if victim is None:
                raise LoRAAdapterError(
                    incoming,
                    f"max_loaded_loras={self.max_loaded_loras} adapters are in host "
                    "memory and every one is pinned or in use",
                )
            self._resident.pop(victim)
            self._record(PoolEvent("drop", adapter_id=self._ids[victim]))
            slot = self._slot_of.pop(victim, None)  # a slot is a copy of host memory: it goes too
            if slot is not None:
                self._clear_slot(slot)

    def _host(self, name: str) -> LoRAAdapter:
        """The adapter in host memory (read again from its path if it was evicted)."""
        adapter = self._resident.get(name)
        if adapter is None:
            p = self._known.get(name) or self._draining.get(name)
            if p is None:
                raise UnknownLoRAError(name)
            adapter = self._read(name, p.lora_path)
            self._make_host_room(name)
            self._resident[name] = adapter
            self.host_reloads += 1
        self._resident.move_to_end(name)
        return adapter

    # -- requests ------------------------------------------------------------------------------

    def acquire(self, name: str) -> None:
        """A request naming `name` starts running: it is kept in host memory until `release`."""
        if name not in self._known:
            raise UnknownLoRAError(name)
        self._host(name)
        self._refs[name] = self._refs.get(name, 0) + 1

    def release(self, name: str) -> None:
        n = self._refs.get(name, 0)
        if n <= 0:
            raise RuntimeError(f"LoRA adapter {name!r} released more often than acquired")
        if n == 1:
            del self._refs[name]
            if name in self._draining:
                del self._draining[name]
                self._drop(name)
        else:
            self._refs[name] = n - 1

    # -- batches -------------------------------------------------------------------------------

    def prepare_batch(self, lora_names: Sequence[str | None]) -> list[int]:
        """Each request's slot (None: the base model, slot 0), copying adapters not in a slot yet
        into free slots or ones whose adapter has no running request and is not pinned (least
        recently used first). LoRASlotsFullError if there are not enough."""
        distinct = list(dict.fromkeys(n for n in lora_names if n is not None))
        if len(distinct) > self.max_loras_per_batch:
            raise LoRASlotsFullError(
                f"a batch of {len(distinct)} adapters; max_loras_per_batch is "
                f"{self.max_loras_per_batch}"
            )
        needed = set(distinct)
        for name in distinct:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                self._host(name)  # (its host copy stays the most recently used too)
                continue
            adapter = self._host(name)
            slot = self._free_slot(needed)
            self.pool.write(slot, adapter)
            # (an absolute path: another rank on this node may run in another directory)
            path = os.path.abspath(adapter.path)
            self._record(PoolEvent("load", slot, self._ids[name], name, path))
            self.slot_loads += 1
            self._slot_names[slot] = name
            self._slot_of[name] = slot
        return [BASE_SLOT if n is None else self._slot_of[n] for n in lora_names]

    def _free_slot(self, needed: set[str]) -> int:
        for slot in range(1, len(self._slot_names)):
            if self._slot_names[slot] is None:
                return slot
        for name, slot in self._slot_of.items():
            if name not in needed and not self.refs(name) and not self.is_pinned(name):
                del self._slot_of[name]
                self._slot_names[slot] = None
                return slot
        raise LoRASlotsFullError(
            f"no free LoRA slot: {len(self._slot_of)} slots hold adapters that are pinned, "
            "running or in this batch"
        )

    def batch_info(
        self, lora_names: Sequence[str | None], rows: Sequence[int] | None = None
    ) -> LoRABatchInfo:
        """prepare_batch, then the segments of a batch whose request i has rows[i] rows (default
        1): base-model rows get weight index -1 (no kernel work at all)."""
        slots = self.prepare_batch(lora_names)
        return batch_info([-1 if s == BASE_SLOT else s for s in slots], rows, self.device)

    def weights(self, layer: int, group: str) -> LoRAWeights | None:
        return self.pool.weights(layer, group)


class LoRAReplica:
    """The adapter slots of a tensor-parallel rank other than 0: the same slots as rank 0's
    LoRAManager, holding this rank's shards, changed only by rank 0's PoolEvents (`apply`, in
    their order). An adapter is read from its path when first loaded into a slot and kept in
    host memory until rank 0 drops it from its own. Knows no requests."""

    def __init__(
        self,
        model: ModelConfig,
        targets: frozenset[str],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shards: LoRAShards | None = None,
    ) -> None:
        self.model, self.targets, self.max_rank, self.dtype = model, targets, max_rank, dtype
        self.shards = shards
        self.pool = LoRAMemoryPool(
            model,
            targets,
            num_slots,
            max_rank,
            dtype,
            device,
            None if shards is None else shards.target_shapes(),
        )
        self._resident: dict[int, LoRAAdapter] = {}  # adapter id -> this rank's shards
        self._slot_ids = [0] * num_slots  # the adapter id in each slot (0: none)
        self.slot_loads = 0

    def apply(self, events: Iterable[PoolEvent]) -> None:
        """Repeat rank 0's slot and host changes. An adapter that cannot be read here (its
        folder gone since rank 0 read it) is a RuntimeError: this rank cannot follow rank 0."""
        for e in events:
            if e.op == "load":
                self.pool.write(e.slot, self._host(e))
                self._slot_ids[e.slot] = e.adapter_id
                self.slot_loads += 1
            elif e.op == "clear":
                self.pool.clear(e.slot)
                self._slot_ids[e.slot] = 0
            elif e.op == "drop":
                self._resident.pop(e.adapter_id, None)
            else:
                raise RuntimeError(f"unknown LoRA pool event {e.op!r}")

    def _host(self, e: PoolEvent) -> LoRAAdapter:
        adapter = self._resident.get(e.adapter_id)
        if adapter is None:
            try:
                adapter = read_adapter(
                    e.name, e.path, self.model, self.max_rank, self.targets, self.dtype, self.shards
                )
            except LoRAAdapterError as err:
                raise RuntimeError(f"this rank cannot read what rank 0 serves: {err}") from err
            self._resident[e.adapter_id] = adapter
        return adapter

    def slot_ids(self) -> dict[int, int]:
        """slot -> adapter id, as LoRAManager.slot_ids."""
        return {slot: i for slot, i in enumerate(self._slot_ids) if i}

    def resident_ids(self) -> set[int]:
        return set(self._resident)

    def weights(self, layer: int, group: str) -> LoRAWeights | None:
        return self.pool.weights(layer, group)

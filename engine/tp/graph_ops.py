"""The tensor-parallel collectives as opaque operators, so that a CPU decode graph
(engine/cpu_graph.py) can hold them: `torch.ops.radixray_tp.all_reduce_` (in place) and
`torch.ops.radixray_tp.all_gather` (the ranks' tensors stacked), each with a fake implementation
for tracing. Inductor keeps them as calls into the dispatcher (with its C++ wrapper too), and
their Python implementations run the engine's own `TPGroup`.

An operator's arguments are tensors and numbers, so a graph names its group by an integer
handle: a `GraphCollectives` binds a group to a fresh handle (its owner, the ModelRunner,
unbinds it on close; a binding nobody holds any more is gone too) and the group, while bound,
traces its collectives as these operators. A binding can also run dry (`dry_run`): the
operators skip the collective, so that each rank compiles a graph (torch.compile runs it once)
without waiting inside a collective for a peer still compiling its own."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.tp.comm import TPGroup

# handle -> binding; weak: an engine that is dropped without closing leaves nothing behind.
_BINDINGS: weakref.WeakValueDictionary[int, GraphCollectives] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


class GraphCollectives:
    """`group` bound to a handle that compiled graphs pass to the collective operators."""

    def __init__(self, group: TPGroup) -> None:
        if group.graph_handle is not None:
            raise RuntimeError("this TPGroup is bound to graph operators already")
        self.group = group
        self.handle = next(_HANDLES)
        self.dry = False
        _BINDINGS[self.handle] = self
        group.graph_handle = self.handle

    @contextlib.contextmanager
    def dry_run(self) -> Iterator[None]:
        """Within: the operators leave their tensors as they are (all_reduce) or repeat this
        rank's (all_gather) instead of meeting the other ranks."""
        self.dry = True
        try:
            yield
        finally:
            self.dry = False

    def close(self) -> None:
        """Unbind; a graph that still runs raises. Idempotent."""
        if _BINDINGS.get(self.handle) is self:
            del _BINDINGS[self.handle]
        if self.group.graph_handle == self.handle:
            self.group.graph_handle = None


def _binding(handle: int) -> GraphCollectives:
    b = _BINDINGS.get(handle)
    if b is None:
        raise RuntimeError(f"no tensor-parallel group is bound to graph handle {handle} (closed?)")
    return b


@torch.library.custom_op("radixray_tp::all_reduce_", mutates_args=("x",))
def all_reduce_(x: torch.Tensor, handle: int) -> None:
    """`x` summed over the ranks of the group bound to `handle`, in place."""
    b = _binding(handle)
    if not b.dry:
        b.group.all_reduce_now(x)


@torch.library.custom_op("radixray_tp::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, handle: int, world: int) -> torch.Tensor:
    """Every rank's `x`, stacked in rank order: [world, *x.shape]."""
    b = _binding(handle)
    out = x.new_empty((world, *x.shape))
    if b.dry:
        out.copy_(x.expand_as(out))
    else:
        b.group.all_gather_into(out, x)
    return out


@all_gather.register_fake
def _(x: torch.Tensor, handle: int, world: int) -> torch.Tensor:
    return x.new_empty((world, *x.shape))

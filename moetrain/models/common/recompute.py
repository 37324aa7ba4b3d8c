"""Recomputed regions: small, cheap parts of a block whose activations backward rebuilds
(`train.activation_checkpoint=selective`).

A model marks a region by calling `recomputed(fn, *inputs)` where it would call
`fn(*inputs)`: an RMSNorm, SwiGLU's `silu(gate) * up`, the attention's inputs from its
projections (DeepSeek-V3: the MLA up-projections, RoPE and the concatenation). Outside a
block run under `selective_block()` (the `selective` mode's block forward), or without
grad, it is the plain call.

Inside one, the region runs once, as ordinary autograd ops, and keeps its inputs, but
for those that are an earlier region's outputs (chained regions: SwiGLU's output into the
experts' down-projection), which it links to that region instead. What it would keep
besides, it does not:

- a tensor an op inside the region saves for backward (say the norm's fp32 copy), unless
  it is a leaf (a weight) or shares a kept input's storage, is saved as a handle (of a
  linked input's, a handle to the earlier region);
- a tensor an op later in the block saves (the attention kernel's q, k, v; a projection's
  input) that is a view of one of the region's outputs is saved as a handle too.

A handle's unpack runs the region again from its kept inputs and its linked ones (rebuilt
first by their own regions), under grad, collecting what its ops save, in order, and hands
back the saved tensor, or the same view of the output.

NOTE: why not `torch.utils.checkpoint` per region: checkpoint rebuilds only what the
region's own ops saved, so the attention kernel's saved q, k, v (the up-projections'
outputs, the bulk of MLA's activations) would stay. And why not checkpoint the block: the
zero-bubble schedules' split backward (`stage_backward_input`, then
`stage_backward_weight`, two autograd passes) would replay it in both passes, all-to-alls
and ring transfers included, out of order between ranks. A region holds no communication
and no state: rebuilding it in either pass, any number of times, gives the same tensors.

Costs, by construction: a rebuild is cached per autograd pass (graph task) and dropped when
every handle of the region has been unpacked in that pass, or when the pass ends. The
weight pass of the split backward unpacks a projection's saved input, rebuilding that one
region (a norm or SwiGLU: element-wise); the up-projection GEMMs rerun only for the
attention kernel's backward, in the input pass. The registry of a block's region outputs
holds weak references to their storages (a live weak reference keeps a storage's address
from being reused, so a match is never a stranger), for the block's forward only.

The state is per thread: DualPipeV runs one micro-batch's forward beside another's
backward, on two threads.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

# .scope: the running block's _Scope, or None; .rebuilding: see `rebuilding`
_local = threading.local()


def recomputed(fn: Callable, *inputs):
    """`fn(*inputs)`; inside a `selective_block()`, a region whose activations are rebuilt
    in backward. `fn` must be a pure function of `inputs` and of module weights (no state,
    no randomness, no communication)."""
    scope = getattr(_local, "scope", None)
    if scope is None or not torch.is_grad_enabled():
        return fn(*inputs)
    return scope.run(fn, inputs)


def rebuilding():
    """What backward is rebuilding now: the module whose method the region runs (its
    function, if a plain one), or None. What the planner charges a recomputation's FLOPs
    to (moetrain/planner/traces.py)."""
    return getattr(_local, "rebuilding", None)


@contextmanager
def selective_block() -> Iterator[None]:
    """Run a block's forward with its `recomputed` regions recomputed in backward."""
    if getattr(_local, "scope", None) is not None:  # a block inside a block (MTP's)
        yield
        return
    scope = _Scope()
    _local.scope = scope
    try:
        with saved_tensors_hooks(scope.pack, _unpack):
            yield
    finally:
        _local.scope = None


@contextmanager
def _plain() -> Iterator[None]:
    """Nested `recomputed` calls run as plain calls (inside a region, and in a rebuild)."""
    scope = getattr(_local, "scope", None)
    _local.scope = None
    try:
        yield
    finally:
        _local.scope = scope


def _plain_tensor(t) -> bool:
    # NOTE: tensor subclasses (DTensor) have no storage of their own to match
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Handle:
    """What autograd keeps instead of a saved tensor: the region and how to find it again."""

    __slots__ = ("region", "index", "view")

    def __init__(self, region: _Region, index: int, view: tuple | None = None) -> None:
        self.region, self.index, self.view = region, index, view


def _unpack(saved):
    return saved.region.unpack(saved) if isinstance(saved, _Handle) else saved


class _Region:
    def __init__(self, fn: Callable, inputs: tuple, links: dict[int, _Handle]) -> None:
        """`links`: input index -> a handle to the earlier region output it is (not kept:
        rebuilt from that region when this one is)."""
        self.fn = fn
        self.links = links
        self.inputs = tuple(
            None if i in links else x.detach() if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(inputs)
        )
        self.grad = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
        kept = [x for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and i not in links]
        self.versions = [x._version for x in kept]
        self.kept = {_storage_id(x) for x in kept if _plain_tensor(x)}
        # storage -> the link of an input rebuilt from an earlier region: what this region's
        # ops save of it is a handle to that region, not to this one
        self.linked = {_storage_id(inputs[i]): h for i, h in links.items()}
        self.packs = 0  # saves by the region's own ops, in order
        self.handles = 0  # handles given out (inner and outputs)
        self.cache: tuple | None = None  # (graph task, saved, outputs, unpacks so far)

    def pack_inner(self, t: torch.Tensor):
        index, self.packs = self.packs, self.packs + 1
        base = t._base if t._base is not None else t
        if not _plain_tensor(t) or base.is_leaf or _storage_id(t) in self.kept:
            return t  # a weight, a constant or an input: kept anyway
        link = self.linked.get(_storage_id(t))
        if link is not None:  # an input from an earlier region: rebuilt by that one alone
            return link.region.pack_output(link.index, t)
        self.handles += 1
        return _Handle(self, index)

    def pack_output(self, index: int, t: torch.Tensor) -> _Handle:
        self.handles += 1
        return _Handle(self, index, (t.size(), t.stride(), t.storage_offset()))

    def unpack(self, handle: _Handle) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if self.cache is None or self.cache[0] != task:
            self.cache = (task, *self._rebuild(), 0)
            if task >= 0:  # dropped when this backward pass ends, at the latest
                torch.autograd.Variable._execution_engine.queue_callback(self._drop_for(task))
        task, saved, outputs, used = self.cache
        if handle.view is None:
            value = saved[handle.index]
        else:
            value = outputs[handle.index].as_strided(*handle.view)
        used += 1
        # every handle unpacked in this pass: nothing more will ask for the rebuild
        self.cache = None if used >= self.handles else (task, saved, outputs, used)
        return value

    def _drop_for(self, task: int) -> Callable[[], None]:
        # NOTE: a weak reference: the callback lives until the pass ends, and the region
        # (its kept inputs) must die with its last handle, not then.
        ref = weakref.ref(self)

        def drop() -> None:
            region = ref()
            if region is not None and region.cache is not None and region.cache[0] == task:
                region.cache = None

        return drop

    def _rebuild(self) -> tuple[list, list]:
        tensors = [x for x in self.inputs if isinstance(x, torch.Tensor)]
        if [x._version for x in tensors] != self.versions:
            raise RuntimeError(
                "selective recomputation: an input of a recomputed region was modified in "
                "place after the region ran, so backward cannot rebuild its activations"
            )
        given = [
            self.links[i].region.unpack(self.links[i]) if i in self.links else x
            for i, x in enumerate(self.inputs)
        ]
        inputs = tuple(
            x.detach().requires_grad_(g) if isinstance(x, torch.Tensor) else x
            for x, g in zip(given, self.grad, strict=True)
        )
        saved: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> None:
            saved.append(t.detach())

        outer = getattr(_local, "rebuilding", None)
        _local.rebuilding = getattr(self.fn, "__self__", self.fn)
        try:
            with _plain(), torch.enable_grad(), saved_tensors_hooks(collect, _unused):
                out = self.fn(*inputs)
        finally:
            _local.rebuilding = outer
        if len(saved) != self.packs:
            raise RuntimeError(
                f"selective recomputation: the region saved {len(saved)} tensors when rebuilt, "
                f"{self.packs} when it ran; it is not a pure function of its inputs"
            )
        return saved, [t.detach() for t in _tensors(out)]


def _unused(_saved):
    raise RuntimeError("selective recomputation: a rebuilt region's graph is not backpropagated")


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Scope:
    """One block's forward: the outputs of its regions, by storage, while it runs."""

    def __init__(self) -> None:
        self.outputs: dict[int, tuple[StorageWeakRef, _Region, int, torch.dtype]] = {}

    def run(self, fn: Callable, inputs: tuple):
        links = {}
        for i, x in enumerate(inputs):
            if not _plain_tensor(x):
                continue
            entry = self.outputs.get(_storage_id(x))
            if entry is not None and not entry[0].expired() and entry[3] == x.dtype:
                # an earlier region's output: linked, rebuilt from that region when this
                # one is, and not kept (SwiGLU's output into the experts' down-projection)
                links[i] = entry[1].pack_output(entry[2], x)
        region = _Region(fn, inputs, links)
        with _plain(), saved_tensors_hooks(region.pack_inner, _unpack):
            out = fn(*inputs)
        for index, t in enumerate(_tensors(out)):
            if _plain_tensor(t):
                ref = StorageWeakRef(t.untyped_storage())
                self.outputs[ref.cdata] = (ref, region, index, t.dtype)
        return out

    def pack(self, t: torch.Tensor):
        if not _plain_tensor(t):
            return t
        entry = self.outputs.get(_storage_id(t))
        if entry is None or entry[0].expired() or entry[3] != t.dtype:
            return t
        return entry[1].pack_output(entry[2], t)

"""A compiled batch's inputs: the buffers `run(bindings)` may replace, and what each call runs with.

`sched.compile(calls, inputs=...)` names some of the calls' buffers inputs. `Bindings` finds every call argument an
input reaches (the input itself, or a numpy view of it), and the Scalars the calls use; a rebinding is checked (the
same size, dtype and NIC, and no memory newly shared with the batch's other buffers, which the plan did not order)
and applied all or nothing. It keeps each call's prepared work: what its worker runs, computed once per binding, so
a replay only runs it.
"""
from __future__ import annotations

import bisect
import ctypes
import itertools
from typing import Any, Callable, Mapping, NamedTuple, Sequence, Union

import numpy as np

from .calls import Call, QPQueue, Scalar, host_address, queue_name
from .kernels import c_scalar
from .plan import Plan
from ..errors import BindingError
from ..verbs import MemoryRegion, QueuePair, RemoteRegion

Inputs = Union[Mapping[str, Any], Sequence[Any]]  # by name, or by position (named "0", "1", ...)


class _Containing:
    """Which of some byte extents contain a given one, in O(log n) for extents that do not nest (each is checked
    from the nearest start down, only while an extent that far back could still reach)."""

    def __init__(self, extents: list[tuple[tuple[int, int], int]]) -> None:
        extents = sorted(extents)
        self.starts = [start for (start, _), _ in extents]
        self.stops = [stop for (_, stop), _ in extents]
        self.labels = [label for _, label in extents]
        self.reach = list(itertools.accumulate(self.stops, max))  # the furthest stop among extents up to here

    def first(self, start: int, stop: int, accept: Callable[[int], bool]) -> int:
        """The lowest label whose extent holds [start, stop) and that `accept`s, or -1."""
        best = -1
        j = bisect.bisect_right(self.starts, start) - 1
        while j >= 0 and self.reach[j] >= stop:
            label = self.labels[j]
            if self.stops[j] >= stop and (best < 0 or label < best) and accept(label):
                best = label
            j -= 1
        return best


class _View(NamedTuple):
    """An array view of an input: where it starts in the input's bytes, and its layout."""
    offset: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, view: np.ndarray, base: int) -> _View:
        return cls(view.__array_interface__["data"][0] - base, view.dtype, view.shape, view.strides)


class _Slot:
    """Where an input reaches a call argument: the whole object, or an array view into it."""
    __slots__ = ("call", "arg", "input", "view")

    def __init__(self, call: int, arg: int, input: int, view: _View | None) -> None:
        self.call, self.arg, self.input, self.view = call, arg, input, view

    def resolve(self, value: Any) -> Any:
        view = self.view
        if view is None:
            return value
        return np.ndarray(view.shape, view.dtype, buffer=_bytes_of(value), offset=view.offset, strides=view.strides)


class Bindings:
    """The calls' current arguments, as compiled and then rebound: the inputs, the Scalars' values, the queues and
    devices (a QP input replaces its queues' and device's entries) and each call's prepared work."""

    def __init__(self, calls: list[Call], plan: Plan, inputs: Inputs | None) -> None:
        self.calls, self.plan = calls, plan
        self.queues, self.devices = list(plan.queues), list(plan.devices)
        self._args = [call.args for call in calls]
        self._collect_scalars()
        self.prepared: list[Any] = [None] * len(calls)
        for index in range(len(calls)):
            self._prepare(index)
        self._compile_inputs(inputs)

    def _collect_scalars(self) -> None:
        """The Scalars the calls use, by name: their current values, the calls to prepare again when one is
        rebound, and the most an RDMA size may become (its compiled value: the bytes the plan covers)."""
        self._scalar_values: dict[str, int | float] = {}
        self._scalar_calls: dict[str, list[int]] = {}
        self._scalar_limits: dict[str, int] = {}
        for index, call in enumerate(self.calls):
            size = call.options.get("size")
            for scalar in (*call.options.get("scalars", ()), size):
                if not isinstance(scalar, Scalar):
                    continue
                known = self._scalar_values.setdefault(scalar.name, scalar.value)
                if known != scalar.value or type(known) is not type(scalar.value):
                    raise ValueError(f"two Scalars named {scalar.name!r} with different values ({known!r} and "
                                     f"{scalar.value!r}): a name is one value")
                self._scalar_calls.setdefault(scalar.name, []).append(index)
            if isinstance(size, Scalar):
                self._scalar_limits[size.name] = int(size.value)

    def _check_scalar(self, name: str, value: Any) -> None:
        compiled = self._scalar_values[name]
        if isinstance(value, bool) or type(value) is not type(compiled):
            raise BindingError(f"scalar {name!r} is {type(compiled).__name__} (as compiled); got "
                               f"{type(value).__name__} {value!r}")
        limit = self._scalar_limits.get(name)
        if limit is not None and not 0 <= value <= limit:
            raise BindingError(f"scalar {name!r} sizes an RDMA call: it must be in [0, {limit}] (the compiled size, "
                               f"whose bytes the plan ordered), not {value}; compile with the largest size")

    def _compile_inputs(self, inputs: Inputs | None) -> None:
        if inputs is None:
            inputs = {}
        elif not isinstance(inputs, Mapping):
            inputs = {str(i): value for i, value in enumerate(inputs)}
        self.input_names = list(inputs)
        self._inputs = list(inputs.values())
        clash = sorted(set(self.input_names) & set(self._scalar_values))
        if clash:
            raise BindingError(f"inputs {clash} are also names of Scalars of the batch: a name is one thing")
        bases: list[np.ndarray | None] = []  # the bytes of each host input, to find the views of it the calls use
        for name, value in inputs.items():
            if isinstance(value, np.ndarray):
                if not value.flags.c_contiguous:
                    raise BindingError(f"input {name!r} must be C-contiguous")
                bases.append(value)
            elif isinstance(value, MemoryRegion):
                bases.append(_bytes_of(value))
            elif isinstance(value, RemoteRegion):
                bases.append(None)
            elif isinstance(value, QueuePair):
                if value not in self.qps():
                    raise BindingError(f"input {name!r}: {queue_name(value)} is not a queue of the batch")
                bases.append(None)
            else:
                raise BindingError(f"input {name!r} is a {type(value).__name__}; inputs are numpy arrays, "
                                   "MemoryRegions, RemoteRegions or QueuePairs")
        ranges = [_extent(base) if base is not None else None for base in bases]
        by_identity: dict[int, int] = {}
        for ii, value in enumerate(self._inputs):
            by_identity.setdefault(id(value), ii)
        containing = _Containing([(extent, ii) for ii, extent in enumerate(ranges) if extent is not None])
        def classify(arg: Any) -> tuple[int, Any]:
            """(the input it is or views, its _View or None) or (-1, the host extent of a constant, or None)."""
            ii = by_identity.get(id(arg), -1)
            if ii >= 0:
                extent = ranges[ii]
                return ii, _View.of(arg, extent[0]) if isinstance(arg, np.ndarray) and extent else None
            if isinstance(arg, np.ndarray):  # a view of a host input: the first input holding it
                start, stop = _extent(arg)
                ii = containing.first(start, stop, lambda i: bool(np.shares_memory(arg, bases[i])))
                if ii >= 0:
                    return ii, _View.of(arg, ranges[ii][0])  # type: ignore[index]
                return -1, (start, stop)
            return -1, _extent(arg) if isinstance(arg, MemoryRegion) else None

        self._slots: list[_Slot] = []
        constants: list[tuple[int, int, int, int]] = []  # host memory of every other argument: (start, stop, call, arg)
        known: dict[int, tuple[int, Any]] = {}  # id(arg) -> classify(arg): calls share buffers; args outlive this
        for ci, args in enumerate(self._args):
            for ai, arg in enumerate(args):
                kind = known.get(id(arg))
                if kind is None:
                    kind = known[id(arg)] = classify(arg)
                ii, what = kind
                if ii >= 0:
                    self._slots.append(_Slot(ci, ai, ii, what))
                elif what is not None:
                    constants.append((what[0], what[1], ci, ai))
        extents = np.array([c[:2] for c in constants], dtype=np.uint64).reshape(-1, 2)
        self._constant_starts, self._constant_stops = extents[:, 0], extents[:, 1]
        self._constants = [c[2:] for c in constants]
        # an input whose memory other (constant) arguments share cannot be rebound: they would stay behind
        self._entangled: list[str | None] = []
        for ii, extent in enumerate(ranges):
            hit = self._overlapping_constant(extent) if extent is not None else None
            self._entangled.append(None if hit is None else self._argument_text(*hit))
        used = {slot.input for slot in self._slots} | {i for i, v in enumerate(self._inputs)
                                                       if isinstance(v, QueuePair)}
        self._peers = {id(q.qp): q.qp.peer.gid for q in self.plan.queues  # remote memory was keyed by these peers
                       if isinstance(q, QPQueue) and q.qp.peer is not None}
        unused = [name for i, name in enumerate(self.input_names) if i not in used]
        if unused:
            raise BindingError(f"inputs {unused} are not arguments of any call of the batch")

    def qps(self, queues: Sequence[Any] | None = None) -> list[QueuePair]:
        """The QPs the batch's queues are sides of, each once, in plan order."""
        seen: dict[int, QueuePair] = {}
        for queue in self.queues if queues is None else queues:
            if isinstance(queue, QPQueue):
                seen.setdefault(id(queue.qp), queue.qp)
        return list(seen.values())

    def _overlapping_constant(self, extent: tuple[int, int]) -> tuple[int, int] | None:
        start, stop = extent
        if stop <= start:
            return None
        hits = np.flatnonzero((self._constant_starts < stop) & (self._constant_stops > start))
        return self._constants[hits[0]] if len(hits) else None

    def _argument_text(self, ci: int, ai: int) -> str:
        return f"argument {ai} of call {ci} ({self.calls[ci].name})"

    def bind(self, bindings: Inputs) -> None:
        """Rebind inputs and Scalars (see `Batch.bind`), all or nothing."""
        if not isinstance(bindings, Mapping):
            if len(bindings) != len(self._inputs):
                raise BindingError(f"run() got {len(bindings)} positional bindings for {len(self._inputs)} inputs "
                                   f"{self.input_names}")
            bindings = dict(zip(self.input_names, bindings))
        scalars = {name: value for name, value in bindings.items() if name in self._scalar_values}
        for name, value in scalars.items():
            self._check_scalar(name, value)
        inputs, queues = list(self._inputs), list(self.queues)
        changed = set()
        for name, value in bindings.items():
            if name in scalars:
                continue
            if name not in self.input_names:
                raise BindingError(f"no input named {name!r}; the inputs are {self.input_names} and the scalars "
                                   f"{sorted(self._scalar_values)}")
            index = self.input_names.index(name)
            old = inputs[index]
            if value is old:
                continue
            _check_binding(name, old, value)
            if self._entangled[index]:
                raise BindingError(f"input {name!r} cannot be rebound: {self._entangled[index]} shares its memory "
                                   "and is not an input (it would keep the old memory); make that one an input too")
            if isinstance(old, QueuePair):
                if value in self.qps(queues):
                    raise BindingError(f"input {name!r}: {queue_name(value)} is already a queue of the batch")
                compiled_peer = self._peers.get(id(self._compiled_qp(old)))
                if compiled_peer is not None and value.peer is not None and value.peer.gid != compiled_peer:
                    raise BindingError(f"input {name!r}: {queue_name(value)} is connected to another peer (GID "
                                       f"{value.peer.gid.hex()}) than the QP compiled (GID {compiled_peer.hex()}), "
                                       "whose remote memory the plan ordered; compile the batch again")
                queues = [QPQueue(value, q.side) if isinstance(q, QPQueue) and q.qp is old else q for q in queues]
            inputs[index] = value
            changed.add(index)
        if not changed:
            self._apply_scalars(scalars)  # checked above: all or nothing
            return
        args: dict[int, list[Any]] = {}
        for slot in self._slots:
            if slot.input in changed:
                call_args = args.setdefault(slot.call, list(self._args[slot.call]))
                call_args[slot.arg] = view = slot.resolve(inputs[slot.input])
                if isinstance(view, np.ndarray) and not view.flags.writeable and self._writes_to(slot.call, slot.arg):
                    raise BindingError(f"input {self.input_names[slot.input]!r} is read-only, and "
                                       f"{self._argument_text(slot.call, slot.arg)} writes it")
        self._check_no_new_sharing(inputs, changed)
        self._inputs, self.queues = inputs, queues
        # a QP's device (its timeline) is the QP: it follows a rebinding
        now = {id(compiled.qp): queue.qp for compiled, queue in zip(self.plan.queues, queues)
               if isinstance(compiled, QPQueue) and isinstance(queue, QPQueue)}
        self.devices = [now.get(id(d), d) for d in self.plan.devices]
        for index, call_args in args.items():
            self._args[index] = tuple(call_args)
            self._prepare(index)
        self._apply_scalars(scalars)

    def _apply_scalars(self, scalars: dict[str, Any]) -> None:
        self._scalar_values.update(scalars)
        for index in sorted({i for name in scalars for i in self._scalar_calls[name]}):
            self._prepare(index)

    def _compiled_qp(self, current: QueuePair) -> QueuePair | None:
        """The QP compiled in the place `current` is bound to now."""
        return next((c.qp for c, q in zip(self.plan.queues, self.queues)
                     if isinstance(c, QPQueue) and isinstance(q, QPQueue) and q.qp is current), None)

    def _writes_to(self, ci: int, ai: int) -> bool:
        call = self.calls[ci]
        return (call.kind == "kernel" and ai < call.options["outs"]) or (call.kind == "copy" and ai == 0) \
            or (call.kind in ("read", "recv") and ai == 0)

    def _check_no_new_sharing(self, inputs: list[Any], changed: set[int]) -> None:
        """The plan ordered calls by the memory they touched when compiled: a rebound input that now shares memory
        with another buffer of the batch would race it."""
        extents = [_extent(_bytes_of(v)) if isinstance(v, (np.ndarray, MemoryRegion)) else None for v in inputs]
        for index in changed:
            extent = extents[index]
            if extent is None or extent[1] <= extent[0]:
                continue
            hit = self._overlapping_constant(extent)
            other: str | None
            if hit is not None:
                other = self._argument_text(*hit)
            else:
                other = next((f"input {self.input_names[j]!r}" for j, e in enumerate(extents)
                              if j != index and e is not None and e[0] < extent[1] and extent[0] < e[1]), None)
            if other is not None:
                raise BindingError(f"input {self.input_names[index]!r}: its new memory overlaps {other}, which the "
                                   "plan did not order against it; bind separate memory, or compile the batch again")

    def _prepare(self, index: int) -> None:
        """What the worker needs to run call `index` with its current arguments, computed once per binding."""
        call, args = self.calls[index], self._args[index]
        if call.kind == "kernel":
            options = call.options
            values = [self._scalar_values[s.name] if isinstance(s, Scalar) else s for s in options["scalars"]]
            if options["c"]:
                self.prepared[index] = (options["fn"], (*(ctypes.c_void_p(a.__array_interface__["data"][0])
                                                            for a in args),
                                                          *(c_scalar(v, call.name, i) for i, v in enumerate(values))))
            else:
                self.prepared[index] = (options["fn"], (*args, *values))
        elif call.kind == "copy":
            dst, src = args
            self.prepared[index] = (_bytes_of(dst), _bytes_of(src))
        else:
            size = call.options["size"]
            self.prepared[index] = (*args, self._scalar_values[size.name] if isinstance(size, Scalar) else size)


def _bytes_of(value: np.ndarray | MemoryRegion) -> np.ndarray:
    """The bytes of a host buffer as a flat uint8 array (an MR: its mapped memory)."""
    if isinstance(value, MemoryRegion):
        return np.frombuffer(value.view, np.uint8)
    return value.reshape(-1).view(np.uint8)


def _extent(buffer: np.ndarray | MemoryRegion) -> tuple[int, int]:
    start, length = host_address(buffer)
    return start, start + length


def _check_binding(name: str, old: Any, new: Any) -> None:
    if isinstance(old, np.ndarray):
        if not isinstance(new, np.ndarray):
            raise BindingError(f"input {name!r} is a numpy array; got a {type(new).__name__}")
        if new.dtype != old.dtype or new.shape != old.shape:
            raise BindingError(f"input {name!r} must be {old.dtype} with shape {old.shape} (as compiled); got "
                               f"{new.dtype} with shape {new.shape}")
        if not new.flags.c_contiguous:
            raise BindingError(f"input {name!r} must be C-contiguous")
    elif isinstance(old, MemoryRegion):
        if not isinstance(new, MemoryRegion) or new.length != old.length:
            raise BindingError(f"input {name!r} must be a MemoryRegion of {old.length} bytes (as compiled); got "
                               f"{getattr(new, 'length', type(new).__name__)}")
        if new.device is not old.device:  # keys are per NIC: another NIC's MR would name a stranger's memory
            raise BindingError(f"input {name!r} must be an MR of {old.device.pci.address} (as compiled); got one "
                               f"of {new.device.pci.address}")
    elif isinstance(old, QueuePair):
        if not isinstance(new, QueuePair):
            raise BindingError(f"input {name!r} is a QueuePair; got a {type(new).__name__}")
        if new.device is not old.device:  # the calls' MRs are registered on the old QP's NIC
            raise BindingError(f"input {name!r} must be a QP of {old.device.pci.address} (as compiled), whose MRs "
                               f"the calls use; got one of {new.device.pci.address}")
    elif isinstance(old, RemoteRegion):
        if not isinstance(new, RemoteRegion) or new.length != old.length:
            raise BindingError(f"input {name!r} must be a RemoteRegion of {old.length} bytes (as compiled); got "
                               f"{getattr(new, 'length', type(new).__name__)}")

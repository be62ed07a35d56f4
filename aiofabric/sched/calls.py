"""The batch model: queues, and calls on them with the byte ranges they read and write.

Buffers are numpy arrays (host memory), registered `MemoryRegion`s (host memory too: their views are mapped) and
peers' `RemoteRegion`s. Host buffers are named by virtual address, so a numpy view of an MR's memory conflicts with
the MR itself. A `RemoteRegion` is named by the peer its QP is connected to (GID), its rkey and its address: every
rank of a collective may allocate alike, so equal rkeys and addresses of two peers are different memory. One whose
MR a NIC of this process registered (both ends here) is that MR's host memory, so a write to it orders against the
kernels that read the MR.

A QP is two in-order queues: its send side (writes, reads, sends) and its receive side (receives, immediates). A
receive listed before the send it waits for on the same QP does not hold that send up.
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .kernels import CKernel, c_scalar, check_flat
from .plan import PlannedCall, Span
from ..verbs import MemoryRegion, QueuePair, RemoteRegion

HOST = "host"
SEND, RECEIVE = "send", "recv"  # a QP's two queues
RECEIVE_VERBS = frozenset({"recv", "wait_imm"})
_tokens = itertools.count()  # control dependencies: one private "buffer" per call waited for
_byte_bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds  # moved in numpy 2; look up once


class Scalar:
    """A value a compiled batch can rebind by name, `run({"n": 7})`: a kernel scalar (an int stays an int, a float a
    float: a C kernel's signature is fixed) or the size of an RDMA call. The value given here is the one compiled:
    the plan covers the bytes of that size, so a size rebinds to at most it."""
    __slots__ = ("name", "value")

    def __init__(self, name: str, value: int | float) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a Scalar needs a name, not {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"Scalar {name!r}: the value is an int or a float, not {type(value).__name__}")
        self.name, self.value = name, value

    def __repr__(self) -> str:
        return f"Scalar({self.name!r}, {self.value!r})"


def value_of(value: Any) -> Any:
    """A Scalar's compiled value, anything else as it is."""
    return value.value if isinstance(value, Scalar) else value


class QPQueue(NamedTuple):
    """One side of a QP as the planner's queue: equal for every call on that side (a tuple hashes by content)."""
    qp: QueuePair
    side: str  # SEND or RECEIVE


class ComputeQueue:
    """An in-order queue running kernels: numpy kernels on the event loop, C kernels in a thread of their own.
    `device` groups queues that share a timeline (default: the queue alone, so batches on other queues never wait
    for it)."""

    def __init__(self, name: str = "compute", device: Any = None) -> None:
        self.name, self.device = name, device if device is not None else self

    def __repr__(self) -> str:
        return self.name


class CopyQueue(ComputeQueue):
    """An in-order queue of memory copies (large ones in a thread: memcpy releases the GIL)."""

    def __init__(self, name: str = "copy", device: Any = None) -> None:
        super().__init__(name, device)


def queue_name(queue: Any) -> str:
    if isinstance(queue, QPQueue):
        return qp_name(queue.qp) + (" recv" if queue.side == RECEIVE else "")
    return qp_name(queue) if isinstance(queue, QueuePair) else str(queue)


def qp_name(qp: QueuePair) -> str:
    return f"qp {qp.qpn:#x}"


def host_address(buffer: np.ndarray | MemoryRegion) -> tuple[int, int]:
    """(address, byte length) of a host buffer: an array's extent, or an MR's mapped memory."""
    if isinstance(buffer, MemoryRegion):
        return np.frombuffer(buffer.view, np.uint8).ctypes.data, buffer.length
    nbytes = buffer.nbytes
    if nbytes and buffer.flags.c_contiguous:  # the common case, without numpy's general byte_bounds (2 µs)
        if buffer.flags.writeable and buffer.dtype.isbuiltin == 1:  # ctypes reads the address in 0.3 µs,
            # __array_interface__ takes 1 µs; a dtype numpy does not build in (ml_dtypes') has no buffer format
            return ctypes.addressof(ctypes.c_char.from_buffer(buffer)), nbytes  # type: ignore[arg-type]
        return buffer.__array_interface__["data"][0], nbytes
    if nbytes == 0:
        return buffer.__array_interface__["data"][0], 0
    low, high = _byte_bounds(buffer)
    return low, high - low


def host_span(buffer: np.ndarray | MemoryRegion, offset: int = 0, size: int | None = None) -> Span:
    address, length = host_address(buffer)
    return Span(HOST, address + offset, address + offset + (length - offset if size is None else size))


def remote_span(qp: QueuePair, remote: RemoteRegion | MemoryRegion, offset: int, size: int) -> Span:
    """What a remote access through `qp` touches: host memory when the region's MR is registered in this process,
    else the peer's memory, named by the peer (its GID, or the QP itself while it is not connected) and rkey."""
    if isinstance(remote, MemoryRegion):
        return host_span(remote, offset, size)
    peer = qp.peer.gid if qp.peer is not None else None
    local = MemoryRegion.registered_here(peer, remote.rkey) if peer is not None else None
    if local is not None and not local.closed and local.addr <= remote.addr + offset \
            and remote.addr + offset + size <= local.addr + local.length:
        return host_span(local, remote.addr - local.addr + offset, size)
    return Span(("remote", peer if peer is not None else qp, remote.rkey), remote.addr + offset,
                remote.addr + offset + size)


@dataclasses.dataclass(eq=False)
class Call:
    """One step of a batch. `args` holds its buffers (rebindable through the batch's inputs), `options` the rest."""
    kind: str  # "kernel", "copy" or a verb
    queue: Any
    name: str
    args: tuple[Any, ...]
    options: dict[str, Any]
    reads: tuple[Span, ...] = ()
    writes: tuple[Span, ...] = ()
    earlier: tuple[Call, ...] = ()  # after(): calls this one waits for beyond what its memory says

    def after(self, *calls: Call) -> Call:
        """Run only once `calls` (earlier in the same batch) completed, though no memory says so: causality the
        planner cannot see, such as a peer's ready message (a `wait_imm`) before a write into its memory. Returns
        this call, so it chains: `sched.write(...).after(ready)`."""
        for call in calls:
            if not isinstance(call, Call):
                raise TypeError(f"{self.name}: after() takes calls, not {type(call).__name__}")
            if call is self:
                raise ValueError(f"{self.name}: a call cannot run after itself")
            token = next((s for s in call.writes if isinstance(s.key, tuple) and s.key[0] == "after"), None)
            if token is None:
                token = Span(("after", next(_tokens)), 0, 1)
                call.writes = (*call.writes, token)
            if token not in self.reads:
                self.reads = (*self.reads, token)
                self.earlier = (*self.earlier, call)
        return self

    @property
    def device(self) -> Any:
        return self.queue.qp if isinstance(self.queue, QPQueue) else self.queue.device

    def access(self) -> PlannedCall:
        return PlannedCall(self.queue, self.device, self.reads, self.writes)

    def __repr__(self) -> str:
        return f"{self.name} on {queue_name(self.queue)}"


def kernel(fn: CKernel | Callable[..., Any], outs: Sequence[np.ndarray] = (), ins: Sequence[np.ndarray] = (),
           scalars: Sequence[int | float | Scalar] = (), *, queue: ComputeQueue, name: str | None = None,
           threaded: bool | None = None) -> Call:
    """`fn(*outs, *ins, *scalars)` on `queue`: a `CKernel` (called with pointers, in a worker thread unless
    `threaded=False`), or a Python callable on numpy arrays (called on the event loop, or in a thread with
    `threaded=True`: worth it only for work that releases the GIL). The hop to a thread and back costs ~50 µs, and
    milliseconds on a loaded machine: run kernels of a few µs inline. Every buffer must be 0-d or 1-d (see
    `flatten`). A `Scalar` among the scalars is rebindable by name at run time."""
    name = name or f"kernel {getattr(fn, 'name', None) or getattr(fn, '__name__', 'fn')}"
    if not isinstance(queue, ComputeQueue) or isinstance(queue, CopyQueue):
        raise TypeError(f"{name}: kernels run on a ComputeQueue, not {queue!r}")
    outs = tuple(check_flat(a, name, f"outs[{i}]") for i, a in enumerate(outs))
    for i, a in enumerate(outs):
        if not a.flags.writeable:
            raise ValueError(f"{name}: outs[{i}] is read-only")
    ins = tuple(check_flat(a, name, f"ins[{i}]") for i, a in enumerate(ins))
    scalars = tuple(scalars)
    if isinstance(fn, CKernel):
        for label, arrays in (("outs", outs), ("ins", ins)):
            for i, a in enumerate(arrays):
                if not a.flags.c_contiguous:  # a C kernel gets the first element's address and steps by itemsize
                    raise ValueError(f"{name}: {label}[{i}] is not contiguous (strides {a.strides}); a C kernel "
                                     "would read its base memory as if it were: pass np.ascontiguousarray(x)")
        for i, v in enumerate(scalars):
            c_scalar(value_of(v), name, i)  # refused now, not at run time
        options = {"fn": fn.function, "c": True, "scalars": scalars, "outs": len(outs),
                   "threaded": threaded is not False}
    else:
        options = {"fn": fn, "c": False, "scalars": scalars, "outs": len(outs), "threaded": bool(threaded)}
    return Call("kernel", queue, name, outs + ins, options, tuple([host_span(a) for a in ins]),
                tuple([host_span(a) for a in outs]))


def copy(dst: np.ndarray | MemoryRegion, src: np.ndarray | MemoryRegion, *, queue: CopyQueue,
         name: str = "copy") -> Call:
    """Copy the bytes of `src` into `dst` (same byte size, both contiguous) on a copy queue."""
    if not isinstance(queue, CopyQueue):
        raise TypeError(f"{name}: copies run on a CopyQueue, not {queue!r}")
    for label, buffer in (("dst", dst), ("src", src)):
        if isinstance(buffer, np.ndarray) and not buffer.flags.c_contiguous:
            raise ValueError(f"{name}: {label} is not contiguous")
        if not isinstance(buffer, (np.ndarray, MemoryRegion)):
            raise TypeError(f"{name}: {label} is a {type(buffer).__name__}, not a numpy array or MemoryRegion")
    if isinstance(dst, np.ndarray) and not dst.flags.writeable:
        raise ValueError(f"{name}: dst is read-only")
    dst_bytes, src_bytes = host_address(dst)[1], host_address(src)[1]
    if dst_bytes != src_bytes:
        raise ValueError(f"{name}: dst has {dst_bytes} bytes, src has {src_bytes}")
    return Call("copy", queue, name, (dst, src), {}, (host_span(src),), (host_span(dst),))


def _verb(verb: str, qp: QueuePair, local: MemoryRegion | None, remote: RemoteRegion | MemoryRegion | None,
          size: int | Scalar | None, local_offset: int, remote_offset: int, name: str | None, **options: Any) -> Call:
    if not isinstance(qp, QueuePair):
        raise TypeError(f"{verb}: the queue of an RDMA call is a QueuePair, not {type(qp).__name__}")
    name = name or verb
    if local is not None and not isinstance(local, MemoryRegion):
        raise TypeError(f"{name}: local is a {type(local).__name__}; RDMA calls take a registered MemoryRegion")
    if size is None:
        size = (local.length - local_offset) if local is not None else 0
    planned = value_of(size)  # a Scalar size: the plan covers its compiled value, the most it rebinds to
    _check_range(name, "local", local, local_offset, planned)
    _check_range(name, "remote", remote, remote_offset, planned)
    local_span = host_span(local, local_offset, planned) if local is not None else None
    remote_span_ = remote_span(qp, remote, remote_offset, planned) if remote is not None else None
    reads, writes = {"write": ((local_span, remote_span_)), "write_with_imm": (local_span, remote_span_),
                     "read": (remote_span_, local_span), "send": (local_span, None),
                     "recv": (None, local_span), "wait_imm": (None, None)}[verb]
    return Call(verb, QPQueue(qp, RECEIVE if verb in RECEIVE_VERBS else SEND), name, (local, remote),
                dict(options, size=size, local_offset=local_offset, remote_offset=remote_offset),
                (reads,) if reads is not None else (), (writes,) if writes is not None else ())


def _check_range(name: str, label: str, region: MemoryRegion | RemoteRegion | None, offset: int, size: int) -> None:
    """At compile, not at run time: the bytes an RDMA call names lie within its region (a RemoteRegion of unknown
    length is the peer's to check)."""
    for what, value in (("size", size), (f"{label}_offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: {what} must be a non-negative integer, not {value!r}")
    length = getattr(region, "length", None)
    if region is not None and length is not None and offset + size > length:
        raise ValueError(f"{name}: {label}_offset {offset} + size {size} is past the {label} region's {length} bytes")


def write(qp: QueuePair, local: MemoryRegion, remote: RemoteRegion | MemoryRegion, size: int | Scalar | None = None, *,
          local_offset: int = 0, remote_offset: int = 0, name: str | None = None) -> Call:
    """RDMA WRITE of `size` bytes of `local` to `remote` (done once the peer acknowledged the placement)."""
    return _verb("write", qp, local, remote, size, local_offset, remote_offset, name)


def write_with_imm(qp: QueuePair, local: MemoryRegion, remote: RemoteRegion | MemoryRegion, imm: int,
                   size: int | Scalar | None = None, *, local_offset: int = 0, remote_offset: int = 0,
                   name: str | None = None) -> Call:
    return _verb("write_with_imm", qp, local, remote, size, local_offset, remote_offset, name, imm=imm)


def read(qp: QueuePair, local: MemoryRegion, remote: RemoteRegion | MemoryRegion, size: int | Scalar | None = None, *,
         local_offset: int = 0, remote_offset: int = 0, name: str | None = None) -> Call:
    return _verb("read", qp, local, remote, size, local_offset, remote_offset, name)


def send(qp: QueuePair, local: MemoryRegion, size: int | Scalar | None = None, *, local_offset: int = 0,
         name: str | None = None) -> Call:
    return _verb("send", qp, local, None, size, local_offset, 0, name)


def recv(qp: QueuePair, local: MemoryRegion, size: int | Scalar | None = None, *, local_offset: int = 0,
         name: str | None = None) -> Call:
    """Post a receive and complete when a peer's SEND lands in it. It runs on the QP's receive side, so a receive
    listed before a send of the same QP does not hold that send up."""
    return _verb("recv", qp, local, None, size, local_offset, 0, name)


def wait_imm(qp: QueuePair, landed: np.ndarray | MemoryRegion | None = None, *, imm: int | None = None,
             name: str | None = None) -> Call:
    """Complete when a peer's WRITE_WITH_IMM arrives on `qp`; `landed` is the memory it wrote (later readers wait).
    With `imm`, another immediate fails the call (`ImmediateMismatchError`, in the batch's `CallError`): the
    peers disagree about what runs. With a receive pool on the QP (`receive_pool`) it takes a pooled receive."""
    if imm is not None and (not isinstance(imm, int) or isinstance(imm, bool) or not 0 <= imm <= 0xFFFFFFFF):
        raise ValueError(f"{name or 'wait_imm'}: imm must be an integer in [0, 0xffffffff], not {imm!r}")
    call = _verb("wait_imm", qp, None, None, 0, 0, 0, name, imm=imm)
    if landed is not None:
        call.writes = (host_span(landed),)
    return call

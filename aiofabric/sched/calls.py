"""The batch model: queues, and calls on them with the byte ranges they read and write.

Buffers are numpy arrays (host memory), registered `MemoryRegion`s (host memory too: their views are mapped) and
peers' `RemoteRegion`s. Host buffers are named by virtual address, so a numpy view of an MR's memory conflicts with
the MR itself. A `RemoteRegion` is named by (rkey, address): when both ends live in this process, pass the peer's
`MemoryRegion` as the remote side so the planner sees that a write lands where a later kernel reads.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from ..queues import MemoryRegion, QueuePair, RemoteRegion
from .kernels import CKernel, c_scalar, check_flat
from .plan import PlannedCall, Span

HOST = "host"


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
    return f"qp {queue.qpn:#x}" if isinstance(queue, QueuePair) else str(queue)


def host_address(buffer: np.ndarray | MemoryRegion) -> tuple[int, int]:
    """(address, byte length) of a host buffer: an array's extent, or an MR's mapped memory."""
    if isinstance(buffer, MemoryRegion):
        return np.frombuffer(buffer.view, np.uint8).ctypes.data, buffer.length
    if buffer.nbytes == 0:
        return buffer.__array_interface__["data"][0], 0
    low, high = np.byte_bounds(buffer) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(buffer)
    return low, high - low


def host_span(buffer: np.ndarray | MemoryRegion, offset: int = 0, size: int | None = None) -> Span:
    address, length = host_address(buffer)
    return Span(HOST, address + offset, address + offset + (length - offset if size is None else size))


def remote_span(remote: RemoteRegion | MemoryRegion, offset: int, size: int) -> Span:
    if isinstance(remote, MemoryRegion):
        return host_span(remote, offset, size)
    return Span(("remote", remote.rkey), remote.addr + offset, remote.addr + offset + size)


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

    @property
    def device(self) -> Any:
        return self.queue if isinstance(self.queue, QueuePair) else self.queue.device

    def access(self) -> PlannedCall:
        return PlannedCall(self.queue, self.device, self.reads, self.writes)

    def __repr__(self) -> str:
        return f"{self.name} on {queue_name(self.queue)}"


def kernel(fn: CKernel | Callable[..., Any], outs: Sequence[np.ndarray] = (), ins: Sequence[np.ndarray] = (),
           scalars: Sequence[int | float] = (), *, queue: ComputeQueue, name: str | None = None,
           threaded: bool = False) -> Call:
    """`fn(*outs, *ins, *scalars)` on `queue`: a `CKernel` (called in a worker thread with pointers), or a Python
    callable on numpy arrays (called on the event loop, or in a thread with `threaded=True`: worth it only for
    work that releases the GIL). Every buffer must be 0-d or 1-d (see `flatten`)."""
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
        c_args = tuple(c_scalar(v, name, i) for i, v in enumerate(scalars))
        options = {"fn": fn.function, "c": True, "scalars": c_args, "outs": len(outs)}
    else:
        options = {"fn": fn, "c": False, "scalars": scalars, "outs": len(outs), "threaded": threaded}
    return Call("kernel", queue, name, outs + ins, options, tuple(host_span(a) for a in ins),
                tuple(host_span(a) for a in outs))


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
          size: int | None, local_offset: int, remote_offset: int, name: str | None, **options: Any) -> Call:
    if not isinstance(qp, QueuePair):
        raise TypeError(f"{verb}: the queue of an RDMA call is a QueuePair, not {type(qp).__name__}")
    name = name or verb
    if local is not None and not isinstance(local, MemoryRegion):
        raise TypeError(f"{name}: local is a {type(local).__name__}; RDMA calls take a registered MemoryRegion")
    if size is None:
        size = (local.length - local_offset) if local is not None else 0
    local_span = host_span(local, local_offset, size) if local is not None else None
    remote_span_ = remote_span(remote, remote_offset, size) if remote is not None else None
    reads, writes = {"write": ((local_span, remote_span_)), "write_with_imm": (local_span, remote_span_),
                     "read": (remote_span_, local_span), "send": (local_span, None),
                     "recv": (None, local_span), "wait_imm": (None, None)}[verb]
    return Call(verb, qp, name, (local, remote),
                dict(options, size=size, local_offset=local_offset, remote_offset=remote_offset),
                (reads,) if reads is not None else (), (writes,) if writes is not None else ())


def write(qp: QueuePair, local: MemoryRegion, remote: RemoteRegion | MemoryRegion, size: int | None = None, *,
          local_offset: int = 0, remote_offset: int = 0, name: str | None = None) -> Call:
    """RDMA WRITE of `size` bytes of `local` to `remote` (done once the peer acknowledged the placement)."""
    return _verb("write", qp, local, remote, size, local_offset, remote_offset, name)


def write_with_imm(qp: QueuePair, local: MemoryRegion, remote: RemoteRegion | MemoryRegion, imm: int,
                   size: int | None = None, *, local_offset: int = 0, remote_offset: int = 0,
                   name: str | None = None) -> Call:
    return _verb("write_with_imm", qp, local, remote, size, local_offset, remote_offset, name, imm=imm)


def read(qp: QueuePair, local: MemoryRegion, remote: RemoteRegion | MemoryRegion, size: int | None = None, *,
         local_offset: int = 0, remote_offset: int = 0, name: str | None = None) -> Call:
    return _verb("read", qp, local, remote, size, local_offset, remote_offset, name)


def send(qp: QueuePair, local: MemoryRegion, size: int | None = None, *, local_offset: int = 0,
         name: str | None = None) -> Call:
    return _verb("send", qp, local, None, size, local_offset, 0, name)


def recv(qp: QueuePair, local: MemoryRegion, size: int | None = None, *, local_offset: int = 0,
         name: str | None = None) -> Call:
    """Post a receive and complete when a peer's SEND lands in it. List it after the matching send: a call must
    never need a later call of the batch to complete."""
    return _verb("recv", qp, local, None, size, local_offset, 0, name)


def wait_imm(qp: QueuePair, landed: np.ndarray | MemoryRegion | None = None, *, name: str | None = None) -> Call:
    """Complete when a peer's WRITE_WITH_IMM arrives on `qp`; `landed` is the memory it wrote (later readers wait)."""
    call = _verb("wait_imm", qp, None, None, 0, 0, 0, name)
    if landed is not None:
        call.writes = (host_span(landed),)
    return call

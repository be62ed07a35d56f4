"""Posting work requests: `QueuePair`, a queue pair's life (qp.py) and the verbs it posts. One at a time (write,
write_with_imm, read, send, the atomics, recv; each also as its awaited form), or many of one kind at once
(`post_many`); `batch()` announces several with one doorbell."""
from __future__ import annotations

import contextvars
import operator
from typing import Any, Iterable, NamedTuple, Sequence, Union

from .completions import Completion
from .mr import MemoryRegion, local_sge, remote_address
from .qp import QueuePairLife
from .types import LocalBuffer, QPState, RemoteRegion, check_range
from .sq_runs import span
from .workqueue import ADDRESS_MAX, Sge
from ..autogen import bnxt
from ..errors import ClosedError
from ..hw import doorbell
from ..hw.wqe import ATOMIC_SIZE

__all__ = ["QueuePair"]


class Verb(NamedTuple):
    """A send-queue verb: the name its completions and errors give it, and the WQE type that carries it."""
    name: str
    wqe_type: int


WRITE = Verb("write", bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_WQE)
WRITE_IMM = Verb("write_with_imm", bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_W_IMMEAD)
READ = Verb("read", bnxt.SQ_RDMA_HDR_WQE_TYPE_READ_WQE)
SEND = Verb("send", bnxt.SQ_SEND_HDR_WQE_TYPE_SEND)
SEND_IMM = Verb("send", bnxt.SQ_SEND_HDR_WQE_TYPE_SEND_W_IMMEAD)  # a send with immediate is still a "send"
COMPARE_SWAP = Verb("compare_swap", bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_CS)
FETCH_ADD = Verb("fetch_add", bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_FA)
VERBS = {verb.name: verb for verb in (WRITE, WRITE_IMM, READ, SEND)}  # post_many's; send with imm=
WITH_IMM = {WRITE: WRITE_IMM, WRITE_IMM: WRITE_IMM, SEND: SEND_IMM}  # post_many's verb when imm= is given
RTS = QPState.RTS  # a module global: an Enum member lookup costs ~70 ns on the per-operation path
RECV_STATES = frozenset((QPState.INIT, QPState.RTR, QPState.RTS))  # where ibverbs accepts receives
ATOMIC_MAX = (1 << 8 * ATOMIC_SIZE) - 1  # atomics take and give unsigned 64-bit values
IMM_MAX = (1 << 32) - 1  # an immediate is 32 bits
NO_SIGNAL: tuple[int, ...] = ()  # post_many's default: only the last work request is signaled
Local = Union[MemoryRegion, LocalBuffer, Sequence[LocalBuffer]]  # what a work request's local side may be
_batching: contextvars.ContextVar[tuple[QueuePair, ...]] = contextvars.ContextVar("aiofabric_batching", default=())


class _Batch:
    """QueuePair.batch()'s block (a class, not a generator: it is entered once per batch of posts)."""

    __slots__ = ("qp", "outer", "token")

    def __init__(self, qp: QueuePair) -> None:
        self.qp = qp

    def __enter__(self) -> None:
        self.outer = _batching.get()
        self.token = _batching.set(self.outer + (self.qp,))

    def __exit__(self, *exc_info: object) -> None:
        _batching.reset(self.token)
        qp = self.qp
        if qp._doorbell_due and qp not in self.outer:
            qp._ring_sq()


class QueuePair(QueuePairLife):
    """An RC queue pair (see QueuePairLife) and the work requests it posts. Made by `NIC.create_qp`."""

    def batch(self) -> _Batch:
        """`with qp.batch():` posts several work requests and rings the SQ doorbell once, when the block ends (the
        outermost, if nested). Only the posts of the task in the block wait for its end: another task's post to the
        QP rings at once (and announces everything posted before it), so no task waits on a doorbell held by a block
        it cannot see. (A task started inside the block inherits it.)"""
        return _Batch(self)

    # -- one work request --------------------------------------------------------------------------------------------
    async def post_write(self, local: Local, remote: RemoteRegion | MemoryRegion, size: int | None = None, *,
                         local_offset: int = 0, remote_offset: int = 0, signaled: bool = True,
                         inline: bool = False) -> Completion:
        """Post an RDMA WRITE of `size` bytes from `local` (a region, a raw SGE, or a list of SGEs: `mr.sge()`) to
        `remote`; returns once posted (waits for SQ space). `inline` copies the bytes into the WQE (at most
        `max_inline_data`): the buffer is free again as soon as this returns."""
        if not inline:
            completion = self._post_one(WRITE, local, remote, size, local_offset, remote_offset, signaled)
            if completion is not None:
                return completion
        return await self._post(WRITE, local, remote, size, local_offset, remote_offset, signaled, inline=inline)

    async def post_write_with_imm(self, local: Local, remote: RemoteRegion | MemoryRegion, imm: int,
                                  size: int | None = None, *, local_offset: int = 0, remote_offset: int = 0,
                                  signaled: bool = True, inline: bool = False) -> Completion:
        """RDMA WRITE with immediate: the data lands at `remote`, `imm` completes a receive at the peer."""
        check_range("imm", imm, 0, IMM_MAX)
        return await self._post(WRITE_IMM, local, remote, size, local_offset, remote_offset, signaled, inline=inline,
                                imm=imm)

    async def post_read(self, local: Local, remote: RemoteRegion | MemoryRegion, size: int | None = None, *,
                        local_offset: int = 0, remote_offset: int = 0, signaled: bool = True) -> Completion:
        """Post an RDMA READ of `size` bytes from `remote` into `local`."""
        completion = self._post_one(READ, local, remote, size, local_offset, remote_offset, signaled)
        if completion is not None:
            return completion
        return await self._post(READ, local, remote, size, local_offset, remote_offset, signaled)

    async def post_fetch_add(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion, add: int, *,
                             local_offset: int = 0, remote_offset: int = 0, signaled: bool = True) -> Completion:
        """Post an atomic FETCH_AND_ADD: `add` (unsigned 64-bit; the sum wraps at 2^64) is added to the 8 bytes at
        `remote`, and their value before the add lands in the 8 bytes of `local` (a region at `local_offset`, or a
        raw 8-byte SGE), in host byte order. The remote address must be 8-byte aligned: as on hardware, that is the
        responder's to check, and a misaligned one fails the completion with REMOTE_INVALID_REQUEST_ERR. The remote
        region and the peer's QP need Access.REMOTE_ATOMIC (else REMOTE_ACCESS_ERR). Like a READ, it holds one of
        the `max_rd_atomic` outstanding read/atomic slots until answered."""
        check_range("add", add, 0, ATOMIC_MAX)
        return await self._post_atomic(FETCH_ADD, local, remote, local_offset, remote_offset, signaled, swap=add)

    async def post_compare_swap(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion,
                                compare: int, swap: int, *, local_offset: int = 0, remote_offset: int = 0,
                                signaled: bool = True) -> Completion:
        """Post an atomic COMPARE_AND_SWAP: the 8 bytes at `remote` become `swap` if they equal `compare`; their value
        before lands in `local` either way (it equals `compare` when the swap happened). As post_fetch_add
        otherwise."""
        check_range("compare", compare, 0, ATOMIC_MAX)
        check_range("swap", swap, 0, ATOMIC_MAX)
        return await self._post_atomic(COMPARE_SWAP, local, remote, local_offset, remote_offset, signaled, swap=swap,
                                       compare=compare)

    async def post_send(self, local: Local, size: int | None = None, *, local_offset: int = 0, imm: int | None = None,
                        signaled: bool = True, inline: bool = False) -> Completion:
        """Post a SEND (with immediate if `imm` is given) into the peer's next posted receive."""
        if imm is None:
            return await self._post(SEND, local, None, size, local_offset, 0, signaled, inline=inline)
        check_range("imm", imm, 0, IMM_MAX)
        return await self._post(SEND_IMM, local, None, size, local_offset, 0, signaled, inline=inline, imm=imm)

    async def post_recv(self, local: Local, size: int | None = None, *, local_offset: int = 0) -> Completion:
        """Post a receive buffer (a region, a raw SGE, or a list of up to `max_recv_sge` SGEs); its completion carries
        `byte_len` and `imm`."""
        size, sges = self._sges(local, local_offset, size, self.max_recv_sge)
        rq = self.recv_queue
        while self.state not in RECV_STATES or not rq.room():
            if self.state not in RECV_STATES:
                return self._refused("recv", "receives need INIT, RTR or RTS")
            await self._wait_for_space("recv")
        completion = Completion("recv")
        rq.post(sges, completion)
        self.recv_cq.outstanding += 1
        index, epoch = rq.doorbell()
        self.device.doorbells.write64_doorbell(self.device.db_offset, doorbell.encode(
            self.qpn, bnxt.DBC_DBC_TYPE_RQ, index, epoch))
        if self._poller.sleeping:
            self._poller.work_posted(self.recv_cq)
        return completion

    # -- many at once ------------------------------------------------------------------------------------------------
    async def post_many(self, verb: str, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion | None,
                        size: int, offsets: Sequence[int], *, remote_offsets: Sequence[int] | None = None,
                        imm: int | None = None, signal: Iterable[int] = NO_SIGNAL) -> list[Completion]:
        """Post len(`offsets`) work requests of one kind at once (perftest's post list, ibverbs' chained WRs): the
        i-th moves `size` bytes at `local_offset` `offsets[i]` to (write, write_with_imm) or from (read)
        `remote` at `remote_offsets[i]` (default: `offsets`), or sends them (send, with `imm` if given). They are
        packed into the SQ in one pass and announced by one doorbell.

        Returns completions in posting order: one for each index in `signal`, then one for the last work request,
        which completes when all of them have (`completions[-1]`; a failure anywhere in the batch fails it). Waits
        for room for the whole batch; one larger than half the send queue is refused (the other half may hold
        unsignaled work requests that no completion retires yet)."""
        kind = VERBS.get(verb)
        if kind is None:
            raise ValueError(f"post_many: verb must be one of {sorted(VERBS)}, not {verb!r}")
        if type(offsets) is not range:
            offsets = _integers("offsets", offsets)
        count = len(offsets)
        if remote_offsets is None:
            remote_offsets = offsets
        else:
            remote_offsets = _integers("remote_offsets", remote_offsets)
            if len(remote_offsets) != count:
                raise ValueError(f"post_many: {len(remote_offsets)} remote offsets for {count} work requests")
        if imm is not None:
            check_range("imm", imm, 0, IMM_MAX)
            with_imm = WITH_IMM.get(kind)
            if with_imm is None:
                raise ValueError("post_many: imm goes with write_with_imm or send")
            kind = with_imm
        elif kind is WRITE_IMM:
            raise ValueError("post_many: write_with_imm needs imm=")
        if not count:
            return []
        check_range("size", size, 0, 1 << 31)
        if not isinstance(local, (MemoryRegion, LocalBuffer)):
            raise TypeError(f"post_many: local must be a MemoryRegion or a LocalBuffer, not {type(local).__name__}")
        if isinstance(local, MemoryRegion):
            local.check_open()
        lo, hi = span(offsets)
        if lo < 0 or hi + size > local.length:
            raise ValueError(f"post_many: {size} bytes at local offsets {lo}..{hi} exceed the {local.length}-byte "
                             f"{'memory region' if isinstance(local, MemoryRegion) else 'buffer'}")
        check_range("local address", local.addr + hi, 0, ADDRESS_MAX - size + 1)  # keys: checked where made
        address, rkey = 0, 0
        if kind.name == "send":
            if remote is not None:
                raise ValueError("post_many: a send has no remote region")
        elif remote is None:
            raise ValueError(f"post_many: {verb} needs a remote region")
        else:
            lo, hi = (lo, hi) if remote_offsets is offsets else span(remote_offsets)
            if lo < 0:
                raise ValueError(f"post_many: remote offset {lo} is negative")
            remote_address(remote, hi, size)  # its length and the 64-bit address
            address, rkey = remote.addr, remote.rkey
        marks = [] if signal is NO_SIGNAL else sorted(set(_integers("signal", signal)))
        if marks and not 0 <= marks[0] <= marks[-1] < count:
            raise ValueError(f"post_many: signal indexes must be in [0, {count}), not {marks}")
        sq = self.send_queue
        taken = sq.taken(sq.wqe_slots(1 if size else 0)) * count
        if not sq.fits(taken, count):
            raise ValueError(f"post_many: {count} work requests do not fit QP {self.qpn:#x}'s send queue (a batch "
                             f"takes at most half its {sq.slots} slots and {sq.max_wqes} work requests)")
        while self.state is not RTS or not sq.room(taken, count):
            if self.state is not RTS:  # in ERR: as many flushed completions as it would have given
                return [self._refused(verb, "connect() it first")] * (len(marks) + (count - 1 not in marks))
            await self._wait_for_space(verb)
        tokens = {i: Completion(verb) for i in marks}
        if count - 1 not in tokens:
            tokens[count - 1] = Completion(verb)
        sq.post_run(kind.wqe_type, local.addr, local.lkey, address, rkey, size, offsets, remote_offsets, imm or 0,
                    tokens)
        self._posted(len(tokens))
        return list(tokens.values())  # in index order: the marks, then the last if it is not one

    # -- posted and awaited ------------------------------------------------------------------------------------------
    async def write(self, local, remote, size=None, **kw) -> Completion:
        return await (await self.post_write(local, remote, size, **kw))

    async def write_with_imm(self, local, remote, imm, size=None, **kw) -> Completion:
        return await (await self.post_write_with_imm(local, remote, imm, size, **kw))

    async def read(self, local, remote, size=None, **kw) -> Completion:
        return await (await self.post_read(local, remote, size, **kw))

    async def send(self, local, size=None, **kw) -> Completion:
        return await (await self.post_send(local, size, **kw))

    async def recv(self, local, size=None, **kw) -> Completion:
        return await (await self.post_recv(local, size, **kw))

    async def fetch_add(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion, add: int, *,
                        local_offset: int = 0, remote_offset: int = 0) -> int:
        """post_fetch_add, awaited: the remote value before the add."""
        await (await self.post_fetch_add(local, remote, add, local_offset=local_offset, remote_offset=remote_offset))
        return self._fetched(local, local_offset)

    async def compare_swap(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion, compare: int,
                           swap: int, *, local_offset: int = 0, remote_offset: int = 0) -> int:
        """post_compare_swap, awaited: the remote value before (`compare` if it was swapped)."""
        await (await self.post_compare_swap(local, remote, compare, swap, local_offset=local_offset,
                                            remote_offset=remote_offset))
        return self._fetched(local, local_offset)

    # -- the paths ---------------------------------------------------------------------------------------------------
    def _post_one(self, verb: Verb, local: Any, remote: Any, size: int | None, local_offset: int,
                  remote_offset: int, signaled: bool) -> Completion | None:
        """The per-operation hot path: a write or read of one SGE from a live MemoryRegion, a QP in RTS with room.
        None when anything is otherwise: `_post` then checks and explains it."""
        if type(local) is not MemoryRegion or local.closed or self.state is not RTS:
            return None
        if type(local_offset) is not int or type(remote_offset) is not int:  # a float or a bool: refused by _post
            return None
        if size is None:
            size = local.length - local_offset
        elif type(size) is not int:
            return None
        if not 0 < size <= local.length - local_offset or local_offset < 0:
            return None
        kind = type(remote)
        if kind is MemoryRegion:
            if remote.closed:
                return None
        elif kind is not RemoteRegion:
            return None
        length = remote.length
        if length is not None and not 0 <= remote_offset <= length - size:
            return None
        completion = Completion(verb.name)
        if not self.send_queue.post_one(verb.wqe_type, local.addr + local_offset, local.lkey, size,
                                        remote.addr + remote_offset, remote.rkey, 0, signaled, completion):
            return None
        self._posted(1)
        return completion

    async def _post(self, verb: Verb, local: Local, remote: RemoteRegion | MemoryRegion | None, size: int | None,
                    local_offset: int, remote_offset: int, signaled: bool, *, inline: bool = False, imm: int = 0,
                    swap: int = 0, compare: int = 0) -> Completion:
        """Any send-queue work request, checked: its SGEs (or `inline` bytes), its remote range, room in the ring;
        `imm` for the verbs with immediate, `swap` and `compare` for an atomic's operands."""
        size, sges = self._sges(local, local_offset, size, self.max_send_sge)
        if inline:
            if not isinstance(local, MemoryRegion):
                raise ValueError(f"{verb.name} inline: the data must come from a MemoryRegion (the CPU copies it)")
            if size > self.max_inline_data:
                raise ValueError(f"{verb.name} inline: {size} bytes exceed QP {self.qpn:#x}'s max_inline_data "
                                 f"({self.max_inline_data}; create_qp(max_inline_data=) sets it)")
        address, rkey = (0, 0) if remote is None else remote_address(remote, remote_offset, size)
        sq = self.send_queue
        taken = sq.taken(sq.wqe_slots(len(sges), size if inline else 0))
        while self.state is not RTS or not sq.room(taken):
            if self.state is not RTS:
                return self._refused(verb.name, "connect() it first")
            await self._wait_for_space(verb.name)
        completion = Completion(verb.name)
        data = None  # read after the wait: the WQE carries the buffer's bytes as they are when it is posted
        if inline and isinstance(local, MemoryRegion):
            data = bytes(local.view[local_offset:local_offset + size])
        sq.post(verb.wqe_type, sges, size, address, rkey, imm, signaled, completion, inline=data, swap=swap,
                compare=compare)
        self._posted(1)
        return completion

    async def _post_atomic(self, verb: Verb, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion,
                           local_offset: int, remote_offset: int, signaled: bool, *, swap: int,
                           compare: int = 0) -> Completion:
        """An atomic on the ATOMIC_SIZE bytes at `remote`: one local SGE of exactly that size takes the original
        value. The remote address's alignment is left to the responder, as hardware leaves it. A NIC whose PCIe path
        does not complete AtomicOps refuses it at once (UnsupportedError)."""
        self.device.atomic_ops.check(f"{verb.name} on QP {self.qpn:#x} of {self.device.pci.address}")
        if not isinstance(local, (MemoryRegion, LocalBuffer)):
            raise TypeError(f"{verb.name}: local must be a MemoryRegion or a LocalBuffer (mr.sge()), not "
                            f"{type(local).__name__}")
        size = ATOMIC_SIZE if isinstance(local, MemoryRegion) else local.length - local_offset
        if size != ATOMIC_SIZE:
            raise ValueError(f"{verb.name}: the local buffer takes the {ATOMIC_SIZE}-byte original value, not {size} "
                             "bytes")
        return await self._post(verb, local, remote, ATOMIC_SIZE, local_offset, remote_offset, signaled, swap=swap,
                                compare=compare)

    def _fetched(self, local: MemoryRegion | LocalBuffer, offset: int) -> int:
        """The original value an atomic wrote at `offset` of `local`, in host byte order (little-endian here)."""
        if isinstance(local, LocalBuffer):  # a raw SGE: read through the region its lkey names (lkey == rkey)
            region = MemoryRegion.registered_here(self.device.gid, local.lkey)
            if region is None:
                raise ClosedError(f"lkey {local.lkey:#x}: no memory region of this NIC holds the result any more")
            local, offset = region, local.addr + offset - region.addr
        return int.from_bytes(local.view[offset:offset + ATOMIC_SIZE], "little")

    def _sges(self, local: Local, offset: int, size: int | None, limit: int) -> tuple[int, list[Sge]]:
        """(message size, its SGEs) of a region (`size` bytes at `offset`), a raw SGE, or a list of them."""
        if not isinstance(local, (MemoryRegion, LocalBuffer)):
            if offset or not 1 <= len(local) <= limit:
                raise ValueError(f"QP {self.qpn:#x} takes 1 to {limit} SGEs per work request (create_qp's "
                                 f"max_send_sge/max_recv_sge), not {len(local)}" if not offset else
                                 "local_offset goes with one region; an SGE list names its own addresses")
            sges = []
            for element in local:
                if not isinstance(element, LocalBuffer):
                    raise TypeError("an SGE list holds LocalBuffers (MemoryRegion.sge()), not "
                                    f"{type(element).__name__}")
                if element.length:
                    sges.append((element.addr, element.lkey, element.length))
            total = sum(sge[2] for sge in sges)
            if size is not None and size != total:
                raise ValueError(f"size {size} is not the {total} bytes the SGE list holds")
            return total, sges
        size, one = local_sge(local, offset, size)
        return size, [] if one is None else [one]

    def _posted(self, tokens: int) -> None:
        """After WQEs are in the ring: count their completions, ring the doorbell (or leave it to the batch), wake
        a sleeping poller."""
        self.send_cq.outstanding += tokens
        if self in _batching.get():
            self._doorbell_due = True
        else:
            self._ring_sq()
        if self._poller.sleeping:
            self._poller.work_posted(self.send_cq)

    def _ring_sq(self) -> None:
        self._doorbell_due = False
        index, epoch = self.send_queue.doorbell()  # names a slot, or a static WQE
        self.device.doorbells.write64_doorbell(self.device.db_offset, doorbell.encode(
            self.qpn, bnxt.DBC_DBC_TYPE_SQ, index, epoch))

    async def _wait_for_space(self, verb: str) -> None:
        if self._doorbell_due:
            self._ring_sq()  # the WQEs we wait on must reach the NIC first
        self._refuse(verb)
        self._space_waiters += 1
        try:
            await self._space.wait()
        finally:
            self._space_waiters -= 1
        self._refuse(verb)


def _integers(name: str, values: Iterable[Any]) -> Sequence[int]:
    """`values` as a sequence of ints (a range as it is): anything else is refused, naming it."""
    if isinstance(values, range):
        return values
    result = []
    for value in values:
        if isinstance(value, bool):
            raise TypeError(f"post_many: {name} must be integers, not booleans")
        try:
            result.append(operator.index(value))
        except TypeError:
            raise TypeError(f"post_many: {name} must be integers, not {type(value).__name__}") from None
    return result

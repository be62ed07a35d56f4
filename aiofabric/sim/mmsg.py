"""Many UDP datagrams per system call: sendmmsg(2) and recvmmsg(2) through ctypes, over buffers allocated once.

Python's socket methods move one datagram per call, and at the emulator's packet rates the per-call costs (entering
the kernel, building or parsing an address tuple, allocating each received datagram) are a good part of the wire's
time. Here a batch is laid out once: `count` slots of `slot_size` bytes in one anonymous mapping, an iovec per slot
and an mmsghdr per slot pointing at it. A sender encodes packets straight into its slots and sends them all with one
call; a receiver gets up to `count` datagrams with one call and hands out views of its slots. Linux only:
`available()` is False where libc lacks the calls, and the UDP transport then uses the socket methods.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import struct


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.c_void_p),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", _Msghdr), ("length", ctypes.c_uint)]


_SOCKADDR_IN = struct.Struct("=H2s4s8x")  # sin_family (host order), sin_port and sin_addr (network order), zero
_SOURCE = struct.Struct("!H4s")  # sin_port, sin_addr: at byte 2 of a sockaddr_in
_SOCKADDR_SIZE = _SOCKADDR_IN.size
_MESSAGE_SIZE = ctypes.sizeof(_Mmsghdr)
_POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)
# Where the per-message fields sit, in units of the memoryviews below ("P" for pointers and sizes, "I" for u32s).
_NAME = _Mmsghdr.hdr.offset + _Msghdr.name.offset
_LENGTH = _Mmsghdr.length.offset
MESSAGE_SIZE, NAME_OFFSET, LENGTH_OFFSET = _MESSAGE_SIZE, _NAME, _LENGTH  # for code that fills the messages itself


def _libc_calls():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sendmmsg, recvmmsg = libc.sendmmsg, libc.recvmmsg
    except (OSError, AttributeError):
        return None
    sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    sendmmsg.restype = recvmmsg.restype = ctypes.c_int
    return sendmmsg, recvmmsg


_CALLS = _libc_calls()


def available() -> bool:
    """Whether this libc has sendmmsg and recvmmsg."""
    return _CALLS is not None and _MESSAGE_SIZE % _POINTER_SIZE == 0


class _Batch:
    """`count` datagram slots of `slot_size` bytes, each described by one iovec and one mmsghdr."""

    def __init__(self, sock: socket.socket, count: int, slot_size: int) -> None:
        self.count, self.slot_size = count, slot_size
        self._socket = sock  # kept so the descriptor stays this socket's while we hold its number
        self._memory = mmap.mmap(-1, count * slot_size)  # anonymous: pages cost nothing until a datagram touches them
        self.view = memoryview(self._memory)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        self._iovecs = (_Iovec * count)()
        self._messages = (_Mmsghdr * count)()
        for i in range(count):
            self._iovecs[i].base, self._iovecs[i].length = base + i * slot_size, slot_size
            self._messages[i].hdr.iov, self._messages[i].hdr.iovlen = ctypes.addressof(self._iovecs[i]), 1
        self._messages_at = ctypes.addressof(self._messages)
        self._iovec_words = memoryview(self._iovecs).cast("B").cast("P")  # [2 i + 1] is slot i's length
        self._message_words = memoryview(self._messages).cast("B").cast("P")
        self._message_u32 = memoryview(self._messages).cast("B").cast("I")
        # where the slots, the mmsghdrs and the iovecs are, for the compiled core (native.py) to fill or read
        self.slots_at, self.messages_at, self.iovecs_at = base, self._messages_at, ctypes.addressof(self._iovecs)


class Sender(_Batch):
    """Stages datagrams in slots (`view[i * slot_size:]`, then `stage(i, lengths, ip, port)`), sends them at once."""

    def __init__(self, sock: socket.socket, count: int, slot_size: int) -> None:
        super().__init__(sock, count, slot_size)
        for i in range(count):
            self._messages[i].hdr.namelen = _SOCKADDR_SIZE
        self._destinations: dict[tuple[str, int], int] = {}  # ip:port -> the address of its sockaddr_in (below)
        self._addresses: list[ctypes.Array] = []
        self._retired: list[ctypes.Array] = []

    def forget_retired(self) -> None:
        """Free the sockaddrs dropped from the cache: call when nothing staged names them any more."""
        self._retired = []

    def stage(self, i: int, lengths: list[int], ip: str, port: int) -> None:
        """Slots i, i + 1, ... hold datagrams of `lengths` bytes for ip:port."""
        pointer, iovecs, messages = self.destination(ip, port), self._iovec_words, self._message_words
        for i, length in enumerate(lengths, i):
            iovecs[2 * i + 1] = length
            messages[(i * _MESSAGE_SIZE + _NAME) // _POINTER_SIZE] = pointer

    def destination(self, ip: str, port: int) -> int:
        """The address of the sockaddr_in of ip:port, which a message's name points at (kept while in use)."""
        pointer = self._destinations.get((ip, port))
        if pointer is None:
            if len(self._destinations) >= 1024:  # peers come and go over a long life; their addresses need not stay
                self._destinations.clear()  # (those staged may still be named: they go after the next send_all)
                self._retired, self._addresses = self._addresses, []
            address = (ctypes.c_char * _SOCKADDR_SIZE).from_buffer_copy(
                _SOCKADDR_IN.pack(socket.AF_INET, port.to_bytes(2, "big"), socket.inet_aton(ip)))
            self._addresses.append(address)
            pointer = self._destinations[(ip, port)] = ctypes.addressof(address)
        return pointer

    def send(self, count: int) -> list[OSError]:
        """Send slots 0..count-1 in order. A datagram the kernel refuses (unreachable, too big for DF, ...) is lost,
        like on a wire, and its error returned; the rest still go. Blocks while the socket buffer is full."""
        errors, done = [], 0
        while done < count:
            sent = _CALLS[0](self._socket.fileno(), self._messages_at + done * _MESSAGE_SIZE, count - done, 0)
            if sent >= 0:
                done += sent
                continue
            code = ctypes.get_errno()
            if code != errno.EINTR:
                errors.append(OSError(code, os.strerror(code)))
                done += 1  # sendmmsg stops at the first datagram that fails: skip it
        return errors


class Receiver(_Batch):
    """Receives up to `count` datagrams per call into its slots; they stay valid until the next call."""

    def __init__(self, sock: socket.socket, count: int, slot_size: int = 1 << 16) -> None:
        super().__init__(sock, count, slot_size)
        self._names = (ctypes.c_char * (_SOCKADDR_SIZE * count))()
        names = ctypes.addressof(self._names)
        for i in range(count):
            self._messages[i].hdr.name, self._messages[i].hdr.namelen = names + i * _SOCKADDR_SIZE, _SOCKADDR_SIZE
        self._name_view = memoryview(self._names).cast("B")
        self.names_at = names

    def receive(self, budget: int) -> list[tuple[memoryview, bytes, int]]:
        """Up to `budget` (at most `count`) datagrams waiting on the socket, without blocking: (data, source address
        as 4 bytes, source port) each, the data a view of a slot that the next call overwrites."""
        received = self.receive_into_slots(budget)
        view, slot, lengths, names = self.view, self.slot_size, self._message_u32, self._name_view
        datagrams = []
        for i in range(received):
            start = i * slot
            port, address = _SOURCE.unpack_from(names, i * _SOCKADDR_SIZE + 2)
            datagrams.append((view[start:start + lengths[(i * _MESSAGE_SIZE + _LENGTH) // 4]], address, port))
        return datagrams

    def receive_into_slots(self, budget: int) -> int:
        """How many datagrams (up to `budget`, at most `count`) one recvmmsg without blocking put into slots 0, 1,
        ...: each one's length in its message, its source in `names_at` + 16 i (a sockaddr_in)."""
        while True:
            received = _CALLS[1](self._socket.fileno(), self._messages_at, min(budget, self.count),
                                 socket.MSG_DONTWAIT, None)
            if received >= 0:
                return received
            code = ctypes.get_errno()
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))

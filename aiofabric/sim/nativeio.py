"""The UDP transport's compiled path (native.py's core): outgoing Packets and Segments packed as descriptors that the
core encodes straight into the sendmmsg slots, and received datagrams checked and parsed by the core into records,
from which Packets are made. Byte for byte what the Python codec makes (tests/emulator/test_native.py holds them
together); udp.UdpTransport takes this path when the core is there and neither faults nor a pcap tap need each
packet on its own."""
from __future__ import annotations

import collections
import ctypes
import socket
import struct
from typing import Any

from . import mmsg
from .native import RECORD, RX_DROPS, TX_BURST, TX_PACKET, TX_SEGMENTS, TX_SIZE, WRITE_RUN, Core, address
from .packets import ROCE_PORT, Outgoing, Packet, Segments, expand
from .wqeblock import Burst

DESCRIPTORS = 256  # descriptors packed before the core encodes them
MALFORMED = frozenset(i for i, name in enumerate(RX_DROPS) if name not in ("", "dropped_source_port", "dropped_icrc"))


def ip_word(ip: str, words: dict[str, int]) -> int:
    """A dotted IPv4 address as the core takes it (the 4 bytes read big-endian), remembered in `words`."""
    word = words.get(ip)
    if word is None:
        if len(words) >= 1024:
            words.clear()
        word = words[ip] = int.from_bytes(socket.inet_aton(ip), "big")
    return word


class NativeSender:
    """Descriptors for the transport's burst, then `encode(first_slot_free)` in the sender's slots."""

    def __init__(self, core: Core, sender: mmsg.Sender, ip: str) -> None:
        self.core, self.sender, self.ip = core, sender, ip
        self.descriptors = bytearray(TX_SIZE * DESCRIPTORS)  # never resized: its address stays
        self.descriptors_at = address(self.descriptors)
        self.cursor = (ctypes.c_int32 * 3)()  # descriptor, its packet, and 1 when the core refused that descriptor
        self.cursor_at = ctypes.addressof(self.cursor)
        self.items: list[Outgoing] = []  # what the descriptors stand for
        self.words: dict[str, int] = {}
        self.source = ip_word(ip, self.words)

    @property
    def full(self) -> bool:
        return len(self.items) == DESCRIPTORS

    def add(self, item: Outgoing) -> bool:
        """Stamp `item` with the addressing the UDP wire carries and describe it for the core; False (nothing
        described) when its bytes are not in writable memory the core can read or a field does not fit."""
        item.src_ip, item.src_port, item.dst_port, item.ip_id = self.ip, ROCE_PORT, ROCE_PORT, 0  # as _stamp does
        try:
            name = self.sender.destination(item.dst_ip, ROCE_PORT)
            words, at = self.words, len(self.items) * TX_SIZE
            if isinstance(item, Burst):
                TX_BURST.pack_into(self.descriptors, at, 2, address(item.rows), item.pkt, item.count, item.noack,
                                   item.ack_every, item.mtu, item.dest_qp, item.pkey, self.source,
                                   ip_word(item.dst_ip, words), ROCE_PORT, ROCE_PORT, 0, name)
            elif isinstance(item, Segments):
                data = address(item.data) if item.dma_length else 0
                TX_SEGMENTS.pack_into(self.descriptors, at, 0, *item.opcodes, item.dest_qp, item.first_psn,
                                      item.npkts, item.mtu, data, item.dma_length, item.remote_addr, item.rkey,
                                      item.immediate, item.solicited, item.start, item.count, item.acks, item.pkey,
                                      self.source, ip_word(item.dst_ip, words), ROCE_PORT, ROCE_PORT, 0, name)
            elif isinstance(item, Packet):
                payload = item.payload
                data = address(payload) if len(payload) else 0
                TX_PACKET.pack_into(self.descriptors, at, 1, item.opcode, item.ack_req, item.solicited, item.migreq,
                                    item.fecn, item.becn, item.dest_qp, item.psn, item.pkey, item.remote_addr,
                                    item.rkey, item.dma_length, item.syndrome, item.msn, item.immediate,
                                    item.swap_add, item.compare, item.original, data, len(payload), self.source,
                                    ip_word(item.dst_ip, words), ROCE_PORT, ROCE_PORT, 0, name)
            else:  # a MessageRun of another kind: the Python path
                return False
        except (TypeError, ValueError, struct.error, OSError):  # ScatterGather or bytes data; a field out of range
            return False
        self.items.append(item)
        return True

    def encode(self, capacity: int) -> tuple[int, list[Packet]]:
        """Encode the described packets into slots 0.. of the sender, at most `capacity` of them: (slots filled,
        Packets the core refused to encode, to send the Python way after those). Call until nothing is left."""
        sender, cursor = self.sender, self.cursor
        filled = self.core.encode(self.descriptors_at, len(self.items), self.cursor_at, sender.slots_at,
                                  sender.slot_size, capacity, sender.messages_at, mmsg.MESSAGE_SIZE,
                                  mmsg.NAME_OFFSET, sender.iovecs_at)
        refused: list[Packet] = []
        if cursor[2]:  # the codec's: a message sent at a larger path MTU than counted at, or one it raises for
            item = self.items[cursor[0]]
            if isinstance(item, Packet):
                refused = [item]
            else:
                refused = expand([item])[cursor[1]:]
            cursor[0], cursor[1] = cursor[0] + 1, 0
        return filled, refused

    @property
    def pending(self) -> bool:
        return self.cursor[0] < len(self.items)

    def start(self) -> None:
        self.cursor[0] = self.cursor[1] = self.cursor[2] = 0

    def clear(self) -> None:
        self.items.clear()
        self.start()


class NativeReceiver:
    """recvmmsg into the receiver's slots and the core's checks and parse: `Arrivals`."""

    def __init__(self, core: Core, receiver: mmsg.Receiver, ip: str) -> None:
        self.core, self.receiver, self.ip = core, receiver, ip
        self.records = bytearray(RECORD.size * receiver.count)
        self.records_at = address(self.records)
        self.record_view = memoryview(self.records)
        self.counted = (ctypes.c_uint32 * len(RX_DROPS))()  # records by status
        self.counted_at = ctypes.addressof(self.counted)
        self.words: dict[str, int] = {}
        self.local = ip_word(ip, self.words)
        self.run_state = bytearray(WRITE_RUN.size)  # writeruns.place_run's, for the core
        self.run_state_at = address(self.run_state)
        self.names: dict[int, str] = {}  # source addresses as the core reads them -> as Packet.src_ip names them

    def arrivals(self, budget: int, counters: collections.Counter[str]) -> Arrivals | None:
        """Up to `budget` datagrams, checked and parsed; the dropped ones counted as the Python path counts them.
        None when nothing was waiting."""
        receiver = self.receiver
        count = receiver.receive_into_slots(budget)
        if not count:
            return None
        self.core.parse(receiver.slots_at, receiver.slot_size, receiver.messages_at, mmsg.MESSAGE_SIZE,
                        mmsg.LENGTH_OFFSET, receiver.names_at, count, self.local, self.records_at, self.counted_at)
        counted = self.counted
        good = counted[0]
        if good < count:
            for status in range(1, len(RX_DROPS)):
                if counted[status]:
                    counters[RX_DROPS[status]] += counted[status]
                    if status in MALFORMED:
                        counters["dropped_malformed"] += counted[status]
        counters["received"] += good
        return Arrivals(self, count, good)

    def source(self, word: int) -> str:
        """A source address as Packet.src_ip names it."""
        names = self.names
        name = names.get(word)
        if name is None:
            if len(names) >= 1024:
                names.clear()
            name = names[word] = socket.inet_ntoa(word.to_bytes(4, "big"))
        return name


class Arrivals:
    """One recvmmsg's datagrams as the core parsed them (a `RECORD` each, dropped ones with a nonzero status), valid
    until the receiver's next call: what the data path takes from the UDP transport when it places packets without
    making a Packet of each (datapath.Datapath.receive_arrivals)."""

    __slots__ = ("receiver", "count", "good")

    def __init__(self, receiver: NativeReceiver, count: int, good: int) -> None:
        self.receiver, self.count, self.good = receiver, count, good  # datagrams; those that passed

    def record(self, i: int) -> tuple[Any, ...]:
        return RECORD.unpack_from(self.receiver.records, i * RECORD.size)

    def packet(self, i: int, r: tuple[Any, ...]) -> Packet:
        """Datagram i (its record `r`, status 0) as a Packet, its payload a view of the receiver's slot."""
        (opcode, dest_qp, psn, ack_req, solicited, pkey, fecn, becn, remote_addr, rkey, dma_length, syndrome, msn,
         immediate, migreq, swap_add, compare, original, _, source, port, at, length) = r
        receiver = self.receiver
        at += i * receiver.receiver.slot_size
        return Packet(opcode, dest_qp, psn, ack_req, solicited, pkey, fecn, becn, remote_addr, rkey, dma_length,
                      syndrome, msn, immediate, receiver.receiver.view[at:at + length], receiver.source(source),
                      receiver.ip, port, ROCE_PORT, 0, 0, 64, migreq, swap_add, compare, original)

    def packets(self) -> list[Packet]:
        """The datagrams that passed, as Packets (what Transport.receive returns)."""
        view = self.receiver.record_view[:self.count * RECORD.size]
        return [self.packet(i, r) for i, r in enumerate(RECORD.iter_unpack(view)) if not r[18]]

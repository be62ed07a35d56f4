"""The compiled core (aiofabric/sim/native.py) driven without sockets, beside the Python reference it must match.

`encoded` encodes outgoing items the way the UDP transport's core path does, into a sender's slots (nothing is sent:
the sender's socket is never bound), and returns the datagrams; `staged` puts datagrams into a receiver's slots as
recvmmsg would have and parses them with the core (`Arrivals`). `TwinWire` is tests/support/emulator.py's wire with
the UDP transport's stamping, in one of two forms: `native=True` carries every packet through the core (encoded from
descriptors and block rows, parsed into records, delivered with `receive_arrivals`: WRITE runs placed by the core),
`native=False` through the Python codec and `receive`, and its hosts' data paths without the core (no WQE blocks).
Run the same script on both and everything must come out the same: every datagram, memory, CQEs, counters.
"""
from __future__ import annotations

import collections
import socket

from aiofabric.sim import codec, mmsg, native
from aiofabric.sim import packets as pk
from aiofabric.sim.nativeio import Arrivals, NativeReceiver, NativeSender
from aiofabric.sim.udp import BATCH, TX_SLOT
from tests.support.emulator import Host, Wire

NAME = mmsg._SOURCE  # sin_port and sin_addr, at byte 2 of a sockaddr_in
LIMIT = 50_000  # datagrams one run may send: a run that never settles fails instead of filling memory


def core() -> native.Core:
    found = native.core()
    assert found is not None, "no compiled core: a C compiler and a private ~/.cache are needed for these tests"
    return found


class Endpoint:
    """One IPv4 address's compiled-core sender and receiver, their socket never bound or used."""

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sender = mmsg.Sender(self.socket, BATCH, TX_SLOT)
        self.receiver = mmsg.Receiver(self.socket, BATCH)
        self.out = NativeSender(core(), self.sender, ip)
        self.inbound = NativeReceiver(core(), self.receiver, ip)
        self.counters: collections.Counter[str] = collections.Counter()  # the transport's, as parse counts them
        self.by_core = 0  # datagrams the core encoded (the rest came out of the Python codec)

    def close(self) -> None:
        self.socket.close()

    def encoded(self, items: list[pk.Outgoing]) -> list[tuple[bytes, str]]:
        """(UDP payload, destination IP) of every packet of `items`, as the core encodes them (stamped as the UDP
        transport stamps them); what the core refuses comes out of the Python codec, in order, as in udp.py."""
        datagrams: list[tuple[bytes, str]] = []
        sender, words = self.sender, self.sender._iovec_words
        for item in items:
            if not self.out.add(item):
                for p in pk.expand([item]):
                    p.src_ip, p.src_port, p.dst_port, p.ip_id = self.ip, pk.ROCE_PORT, pk.ROCE_PORT, 0
                    datagrams.append((codec.encode(p), p.dst_ip))
                continue
            self.out.start()
            try:
                while self.out.pending:
                    filled, refused = self.out.encode(sender.count)
                    self.by_core += filled
                    view, size = sender.view, sender.slot_size
                    datagrams += [(bytes(view[i * size:i * size + words[2 * i + 1]]), item.dst_ip)
                                  for i in range(filled)]
                    datagrams += [(codec.encode(p), p.dst_ip) for p in refused]
            finally:
                self.out.clear()
        return datagrams

    def staged(self, datagrams: list[tuple[bytes, str, int]]) -> Arrivals:
        """Datagrams (bytes, source IP, source port) as one recvmmsg would have left them, parsed by the core."""
        receiver = self.receiver
        assert len(datagrams) <= receiver.count
        names = memoryview(receiver._names).cast("B")
        for i, (data, source, port) in enumerate(datagrams):
            receiver.view[i * receiver.slot_size:i * receiver.slot_size + len(data)] = data
            receiver._message_u32[(i * mmsg.MESSAGE_SIZE + mmsg.LENGTH_OFFSET) // 4] = len(data)
            NAME.pack_into(names, i * 16 + 2, port, socket.inet_aton(source))
        receiver.receive_into_slots = lambda budget: len(datagrams)  # type: ignore[method-assign]
        found = self.inbound.arrivals(len(datagrams), self.counters)
        assert found is not None
        return found


class TwinWire(Wire):
    """Wire's rounds, every packet stamped as the UDP transport stamps it (source port 4791, IP ID 0) and carried
    as bytes: through the compiled core when `native`, else through the Python codec. `datagrams` keeps every
    datagram (bytes, destination) in the order sent; deliveries go in batches of up to BATCH, as recvmmsg delivers them."""

    def __init__(self, *hosts: Host, native: bool, **faults: float) -> None:
        super().__init__(*hosts, **faults)  # type: ignore[arg-type]
        self.native = native
        self.datagrams: list[tuple[bytes, str]] = []
        self.endpoints = {host.ip: Endpoint(host.ip) for host in hosts} if native else {}
        if not native:
            for host in hosts:  # the reference: no WQE blocks, no WRITE runs
                host.dp.core = None
                for ctx in host.dp.contexts.values():
                    ctx.core = ctx.requester.block = None

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()

    def step(self) -> bool:
        busy = False
        self.engines()
        for host in self.hosts.values():
            outbox = host.dp.take_outbox()
            if not outbox:
                continue
            busy = True
            if self.native:
                sent = self.endpoints[host.ip].encoded(outbox)
            else:
                sent = []
                for p in pk.expand(outbox):
                    p.src_ip, p.src_port, p.dst_port, p.ip_id = host.ip, pk.ROCE_PORT, pk.ROCE_PORT, 0
                    sent.append((codec.encode(p), p.dst_ip))
            self.datagrams += sent
            assert len(self.datagrams) < LIMIT, f"{len(self.datagrams)} datagrams: the wire never settles"
            batch: dict[str, list[bytes]] = {}
            for data, destination in sent:
                batch.setdefault(destination, []).extend([data] * self.copies())
            for ip, arriving in batch.items():
                self.reordered(arriving)
                for start in range(0, len(arriving), BATCH):
                    self.deliver(host.ip, ip, arriving[start:start + BATCH])
        return busy

    def deliver(self, source: str, ip: str, datagrams: list[bytes]) -> None:
        dp = self.hosts[ip].dp
        if self.native:
            dp.receive_arrivals(self.endpoints[ip].staged([(d, source, pk.ROCE_PORT) for d in datagrams]), self.now)
            return
        packets = []
        for data in datagrams:
            try:
                packets.append(codec.decode(data, source, ip, pk.ROCE_PORT))
            except codec.BadPacket:
                pass
        dp.receive(packets, self.now)

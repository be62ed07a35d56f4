"""What the emulated wire does to packets: the fault probabilities (`Faults`, the FAULTS options), and the seeded
`FaultInjector` a transport sends through while any is set (sans-IO but for the clock)."""
from __future__ import annotations

import collections
import dataclasses
import random
import time
from typing import Callable

from .options import FAULTS
from .packets import FECN_BECN_BYTE, Packet


@dataclasses.dataclass
class Faults:
    """What the wire does to packets, as independent per-packet probabilities (one per name in FAULTS); deterministic
    for a given seed.

    Every packet sent consumes one draw per fault, in FAULTS' order, whatever the probabilities, so with a fixed seed
    and traffic the loss pattern does not change when, say, the corruption rate does.
    """

    loss: float = 0.0  # the packet never arrives
    dup: float = 0.0  # it arrives twice
    reorder: float = 0.0  # it is held back and sent after the next packet (or after reorder_hold); one at a time
    corrupt: float = 0.0  # one bit flips after the ICRC was computed, so the receiver drops it
    seed: int = 0
    reorder_hold: float = 0.001  # how long a held packet waits for a successor before it goes out alone

    def __post_init__(self) -> None:
        for name in FAULTS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"fault probability {name}={getattr(self, name)} is not between 0 and 1")

    @property
    def active(self) -> bool:
        return any(getattr(self, name) for name in FAULTS)


@dataclasses.dataclass(slots=True)
class Held:
    """A packet the reorder fault holds back, with the bytes and copy count decided when it was sent."""

    packet: Packet
    udp_payload: bytes
    copies: int
    deadline: float


class FaultInjector:
    """The faults of one transport: each packet sent is lost, duplicated, held back or corrupted as the draws say, and
    what survives goes to `put` (the transport's: onto the wire, counted and tapped). Counts one per fault injected in
    the transport's counters: "lost", "duplicated", "reordered", "corrupted"."""

    def __init__(self, faults: Faults, counters: collections.Counter[str],
                 put: Callable[[Packet, bytes], None]) -> None:
        self._faults, self._counters, self._put = faults, counters, put
        self._decisions = random.Random(faults.seed)
        self._bit_flips = random.Random(f"{faults.seed}/bit flips")  # apart, so flips do not shift decisions
        self.held: Held | None = None

    def send(self, packet: Packet, udp_payload: bytes) -> None:
        """Put `packet` (encoded as `udp_payload`) on the wire, subject to the faults."""
        faults, draw = self._faults, self._decisions.random
        lost, duplicated, reordered, corrupted = [draw() < getattr(faults, name) for name in FAULTS]
        held, self.held = self.held, None
        if lost:
            self._counters["lost"] += 1
        else:
            if corrupted:
                udp_payload = self._flip_a_bit(udp_payload)
                self._counters["corrupted"] += 1
            copies = 2 if duplicated else 1
            if duplicated:
                self._counters["duplicated"] += 1
            if reordered and held is None:
                # A copy: the caller may reuse its Packet before this one goes out.
                deadline = time.monotonic() + faults.reorder_hold
                self.held = Held(dataclasses.replace(packet), udp_payload, copies, deadline)
                self._counters["reordered"] += 1
            else:
                for _ in range(copies):
                    self._put(packet, udp_payload)
        if held is not None:
            self._release(held)

    def flush(self) -> None:
        """Send the packet the reorder fault is holding back, if any."""
        held, self.held = self.held, None
        if held is not None:
            self._release(held)

    def _release(self, held: Held) -> None:
        for _ in range(held.copies):
            self._put(held.packet, held.udp_payload)

    def _flip_a_bit(self, udp_payload: bytes) -> bytes:
        """Flip one bit anywhere the ICRC covers (so anywhere but BTH byte 4), ICRC bytes included."""
        corrupted = bytearray(udp_payload)
        index = self._bit_flips.randrange(len(corrupted) - 1)
        index += index >= FECN_BECN_BYTE
        corrupted[index] ^= 1 << self._bit_flips.randrange(8)
        return bytes(corrupted)

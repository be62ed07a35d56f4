"""What a `lat` run is (LatConfig) and what it allows, checked before any NIC boots."""
from __future__ import annotations

import dataclasses
from typing import Callable

from .options import TESTS, PerftestOptions, queue_needs
from ..errors import BadOption
from ..verbs import NIC

MAX_SIZE = 1 << 28  # 256 MiB: a WRITE side holds two buffers, a SEND side up to three, each page touched
WARMUP = 8  # iterations run before measuring (perftest warms its latency loops up too)
SQ_DEPTH = 64
CQ_DEPTH = 256


@dataclasses.dataclass(kw_only=True)
class LatConfig(PerftestOptions):
    """`nic` "sim" or "sim:NAME": two emulated NICs; a PCI address: both ends on that NIC, its port in PHY loopback.
    One QP pair, one message in flight; `inject_fault` acts on the server NIC."""
    size: int = 2  # bytes per message (ib_*_lat's default)
    shared_emulator: bool = True  # both emulated NICs in one emulator process: a hop wakes one process, not two
    histogram: bool = False  # --histogram: an ASCII histogram of the samples, in the result and after the table
    warmup: int = WARMUP  # iterations before the measured ones, excluded from the numbers
    wait: float | None = None  # seconds one iteration may take before TimeoutError; None: wait_seconds decides
    unsorted: bool = False  # -U: the samples in the order measured, in the result ("samples") and the table
    sorted_samples: bool = False  # -H: the samples in the result ("samples") and, sorted, in the table
    cpu_mhz: float | None = None  # -C: report in CPU cycles at this clock instead of microseconds
    sampled: Callable[[int, list[float]], None] | None = None  # given each size and its samples (us), as measured

    def check(self) -> None:
        """Refuse a bad value before any NIC boots: errors.BadOption naming the option, the value and what it allows.
        The NIC's own limits are `check_caps`'."""
        if self.test not in TESTS:
            raise BadOption("test", self.test, f"must be one of {', '.join(TESTS)}")
        if not self.nic_named:
            raise BadOption("nic", self.nic, "use 'sim', 'sim:NAME' (two emulated NICs) or a PCI address like "
                                             "0000:41:00.0 (both ends on that NIC, its port in PHY loopback)")
        if self.inject_fault is not None and not self.emulated:
            raise BadOption("inject_fault", self.inject_fault, f"needs the emulator's debug channel, which the PCI "
                                                               f"NIC {self.nic} does not have")
        wire = self.wire_flags()
        if wire and not self.emulated:
            verb = "apply" if len(wire) > 1 else "applies"
            raise BadOption(wire[0], getattr(self, wire[0]), f"{', '.join('--' + name for name in wire)} {verb} to "
                                                             f"the emulated wire only, not to the PCI NIC {self.nic}")
        for size in self.sizes or [self.size]:
            if not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
                raise BadOption("size", size, f"must be an integer in [1, {MAX_SIZE}] bytes")
        if not isinstance(self.iters, int) or self.iters < 1:
            raise BadOption("iters", self.iters, "must be an integer of at least 1")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise BadOption("warmup", self.warmup, "must be an integer of at least 0")
        self.check_link()
        if self.wait is not None and not self.wait > 0:
            raise BadOption("wait", self.wait, "must be a positive number of seconds")
        # what bench checks alike; the NIC spec was checked above: lat runs a PCI NIC in PHY loopback, where bench
        # needs a partner host
        self.check_inline()
        self.check_messages()
        self.fault()

    def check_caps(self, nic: NIC) -> None:
        """Refuse what `nic` cannot hold (its firmware's limits), naming the option: one QP pair, SQ_DEPTH deep, on a
        CQ of CQ_DEPTH; the outstanding READs, the inline size and the GID index."""
        self.check_nic(nic, queue_needs(1, 1, SQ_DEPTH, CQ_DEPTH, None))

    @property
    def wait_seconds(self) -> float:
        """How long one iteration may take: `wait`, or `wait_bound` of a round trip's bytes (long enough for the
        QP's retransmissions to recover a lost packet)."""
        if self.wait is not None:
            return self.wait
        return self.wait_bound(2 * self.size)

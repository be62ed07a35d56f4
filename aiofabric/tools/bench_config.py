"""What a `bench` run is (BenchConfig) and what it allows, checked before any NIC boots; the sizes of its queues
and buffers, derived from it."""
from __future__ import annotations

import dataclasses
from typing import Any

from .options import TESTS, PerftestOptions, queue_needs
from .perftest_defaults import DEF_SIZE_BW, DEF_TX_BW, PEAK_ITERS_LIMIT, cq_moderation, tx_depth
from ..errors import BadOption
from ..verbs import NIC

MAX_NICS = 16  # emulated NICs of one run: each is a process with its own sparse DMA arena
MAX_SIZE = 1 << 30  # one message: source and target live in different NICs' 4 GiB DMA arenas
FULL_CHECK_BYTES = 64 << 20  # per NIC: up to this, every operation keeps its own bytes to compare at the end
REGION_BYTES = 256 << 20  # at most this much buffer per QP when slots are reused (a larger message gets one slot)


@dataclasses.dataclass(kw_only=True)
class BenchConfig(PerftestOptions):
    size: int = DEF_SIZE_BW
    shared_emulator: bool = False  # bench: a process per NIC runs them in parallel
    qps: int = 1
    depth: int = DEF_TX_BW  # -t; the run keeps `tx_depth` in flight (no more than -n, as perftest)
    post_list: int = 1  # -l: work requests per post call (QueuePair.post_many); 1: one call each
    nics: int = 2
    duration: float | None = None  # -D: seconds per size instead of `iters` (a warm-up share is not measured)
    bidirectional: bool = False  # -b: both NICs of a pair send at once
    run_infinitely: bool = False  # until `stop` is set: a report line every `duration` seconds
    stop: Any = None  # an anyio.Event that ends a --run-infinitely run (the CLI sets it on Ctrl-C)
    json: bool = False  # the caller prints one JSON object: interval reports go to stderr, not stdout
    report_gbits: bool = False  # table in Gb/sec (10^9 bits) instead of MB/sec (MiB)
    server_host: str | None = None  # perftest's client: the server side is `bench --server` there (then `remote`
                                    # is the Peer the caller connected to it, after opening the local NIC)
    margin: float | None = None  # -f: the warm-up of a -D run, in seconds (None: WARMUP_SHARE of it, up to 2 s)
    no_peak: bool = False  # -N: no peak bandwidth (reported as 0, as perftest)
    cq_mod: int | None = None  # -Q: one signaled work request every cq_mod (None: perftest's, `chunk`)
    rx_depth: int | None = None  # -r: the send test's receive queue depth (None: depth)
    stall_timeout: float | None = None  # seconds a QP may complete nothing with work outstanding (None: computed)

    def check(self) -> None:
        """Refuse a bad value before any NIC boots: errors.BadOption naming the option, the value and what it allows
        (the command line reports it under the spelling typed). The NIC's own limits are `check_caps`'."""
        def bad(dest: str, reason: str) -> BadOption:
            return BadOption(dest, getattr(self, dest), reason)
        if self.test not in TESTS:
            raise bad("test", f"must be one of {', '.join(TESTS)}")
        if not 2 <= self.nics <= MAX_NICS or self.nics % 2:
            raise bad("nics", f"must be an even number in [2, {MAX_NICS}] (NICs are paired; each is an emulator "
                              "process)")
        for name in ("qps", "iters", "depth"):
            if getattr(self, name) < 1:
                raise bad(name, "must be at least 1")
        if not 1 <= self.post_list <= self.depth:
            raise bad("post_list", f"must be in [1, --tx-depth {self.depth}] (a post list is in flight at once)")
        if self.cq_mod is not None and not 1 <= self.cq_mod <= self.depth:
            raise bad("cq_mod", f"must be in [1, --tx-depth {self.depth}] (a completion every N work requests, "
                                "at most a queue's worth)")
        if self.cq_mod is not None and self.post_list > 1 and self.cq_mod != self.post_list:
            raise bad("cq_mod", f"with -l {self.post_list} each post list signals its last work request: drop -Q "
                                f"or give -Q {self.post_list}")
        if self.rx_depth is not None and (self.test != "send" or self.rx_depth < self.tx_depth):
            raise bad("rx_depth", f"sizes the send test's receive queue: at least --tx-depth {self.tx_depth} (each "
                                  "send in flight has its receive posted)" if self.test == "send" else
                      "sizes the receive queue of the send test only")
        self.check_inline()
        if self.inline_size and self.post_list > 1:
            raise bad("inline_size", "post lists (-l) are not sent inline: drop one of them")
        self.check_messages()
        self.check_link()
        if self.inject_fault is not None:
            self.fault()
        if self.with_peer and self.nics != 2:
            raise bad("nics", "--peer pairs one NIC here with one there: must be 2")
        if self.with_peer and self.inject_fault is not None:
            raise bad("inject_fault", "needs the emulator's debug channel, which a peer does not offer")
        if self.stall_timeout is not None and not self.stall_timeout > 0:
            raise bad("stall_timeout", "must be a positive number of seconds")
        if self.duration is not None and not 0 < self.duration <= 86400:
            raise bad("duration", "must be in (0, 86400] seconds")
        if self.margin is not None and (self.duration is None or self.margin >= self.duration):
            raise bad("margin", "is the warm-up of a -D run: give -D longer than it")
        if self.bidirectional and self.with_peer:
            raise bad("bidirectional", "needs both NICs here (not with --peer)")
        if not self.nic_named:
            raise bad("nic", "use 'sim', 'sim:NAME' or a PCI address like 0000:41:00.0")
        if not self.emulated and not self.with_peer:
            raise bad("nic", "a PCI NIC needs its partner on another host: use --peer HOST or SERVER_HOST")
        if self.ip is not None and self.nics > 2 and not self.with_peer:
            raise bad("ip", "names NIC 0's address: with --nics > 2 let the emulated NICs pick theirs")
        for size in self.sizes or [self.size]:
            if not 1 <= size <= MAX_SIZE:
                raise BadOption("size", size, f"must be in [1, {MAX_SIZE}] bytes (one emulated NIC's DMA arena "
                                              "holds the buffers)")

    def check_atomic(self) -> None:
        """What the atomic test allows: 8-byte messages, one at a time per post, perftest's two operations."""
        super().check_atomic()
        if self.post_list > 1:
            raise BadOption("post_list", self.post_list, "atomics are posted one work request per call")

    def check_caps(self, nic: NIC) -> None:
        """Refuse what `nic` cannot hold (its firmware's limits), naming the option: the QPs and the CQ a NIC gets,
        the queue depth, the outstanding READs, the inline size and the GID index."""
        self.check_nic(nic, queue_needs(self.qps, self.qps_per_nic, self.tx_depth, self.cq_depth, self.rx_depth))

    @property
    def tx_depth(self) -> int:
        """Work requests in flight per QP: -t, but no more than -n unless the run is timed (perftest's rule)."""
        return tx_depth(self.depth, self.iters, self.duration is not None)

    @property
    def chunk(self) -> int:
        """Work requests per signaled completion: a post list, or perftest's CQ moderation (-Q, or 100, or 1 for
        messages above 8 KiB; at most `tx_depth`)."""
        if self.post_list > 1:
            return self.post_list
        return cq_moderation(self.cq_mod, self.size, self.tx_depth, self.sizes is not None, self.events)

    @property
    def measures_peak(self) -> bool:
        """Whether the run has a BW peak: perftest measures none with -N, -D, --run_infinitely or more than
        PEAK_ITERS_LIMIT iterations per QP (it reports 0)."""
        return not self.no_peak and self.duration is None and self.iters <= PEAK_ITERS_LIMIT

    @property
    def no_progress_seconds(self) -> float:
        """How long a QP with work outstanding may complete nothing before the run fails (`stall_timeout`, or
        `wait_bound` of a signaled chunk's bytes)."""
        if self.stall_timeout is not None:
            return self.stall_timeout
        return self.wait_bound(self.chunk * self.size)

    @property
    def qps_per_nic(self) -> int:
        """Flows whose client (or server) side lives on one NIC."""
        return -(-self.qps // (self.nics // 2)) * (2 if self.bidirectional else 1)

    @property
    def cq_depth(self) -> int:
        """Each NIC's CQ: room for every work request of its QPs, both queues, as a power of two."""
        return 1 << max(8, (self.qps_per_nic * self.tx_depth * 2 - 1).bit_length())

    @property
    def with_peer(self) -> bool:
        """The server side runs on another host (--peer or SERVER_HOST): one NIC here."""
        return self.remote is not None or self.server_host is not None

    @property
    def local_nics(self) -> int:
        """The NICs a run opens here: with a peer, the servers live there."""
        return 1 if self.with_peer else self.nics

    @property
    def slots(self) -> int:
        """Message slots per QP: one per operation when they fit in FULL_CHECK_BYTES per NIC, else `tx_depth` reused
        (fewer when `tx_depth` slots of a large message would not fit REGION_BYTES: in-flight messages then share)."""
        if self.duration is None and self.iters * self.size * self.qps_per_nic <= FULL_CHECK_BYTES:
            return self.iters
        return max(1, min(self.tx_depth, REGION_BYTES // self.size))

    @property
    def used_bytes(self) -> int:
        """Bytes of each QP's buffers that the run moves."""
        return self.slots * self.size

"""The options bench, lat and the collectives share: the emulated wire's (`WireOptions`, all three) and what a
perftest-style run is (`PerftestOptions`, bench's BenchConfig and lat's LatConfig), with the checks they make alike.

Each check raises errors.BadOption naming the option, the value and what it allows (the command line reports it
under the spelling typed); a config's `check` calls them in its own order, so which error a bad line meets first is
the command's.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from ..errors import BadOption
from ..pci.emulated import FAULTS
from ..verbs import NIC, PCI_ADDRESS

TESTS = ("write", "read", "send", "atomic")
DEFAULT_ITERS = 1000  # bench's and lat's -n
INLINE_TESTS = ("write", "send")  # tests whose local side a WQE can carry inline
ORDERED_TESTS = ("read", "atomic")  # tests whose requests take the QP's outstanding-READ slots (-o)
ATOMIC_TYPES = ("FETCH_AND_ADD", "CMP_AND_SWAP")  # perftest's -A
TEST_TITLES = {"write": "RDMA_Write", "read": "RDMA_Read", "send": "Send", "atomic": "Atomic"}  # perftest's banners
ATOMIC_SIZE = 8  # an atomic moves one 64-bit word
NO_ORIGINAL = b"\xff" * ATOMIC_SIZE  # the local slots before the atomics: a value no run's counter reaches
MTUS = (256, 512, 1024, 2048, 4096)
MAX_ACK_TIMEOUT = 31  # the QP's local ACK timeout is a 5-bit exponent
FAULT_KINDS = ("skip_placement", "misplace")  # --inject-fault's kinds (DebugClient.fault's)
RETRY_CNT = 7  # the QPs' retry count (perftest's default): a lost packet is resent up to 7 times
# how long a QP may wait for a completion: 5 s, plus every retransmission of a lost packet (4.096 us * 2^timeout,
# RETRY_CNT + 1 times, both ways), plus 1 s per MiB the completion waits for
WAIT_BASE_SECONDS, WAIT_SLOWEST_BPS = 5.0, 1 << 20
PATTERN_STRIDE = 7919  # a run's payload seeds: seed * PATTERN_STRIDE + index, distinct per QP (and side)

Options = TypeVar("Options", bound="WireOptions")
# what a run's QPs need of a NIC's firmware limits: (option, its value, the need, the cap, what it is)
Need = tuple[str, Any, int, str, str]


@dataclasses.dataclass(kw_only=True)
class WireOptions:
    """The emulated wire's faults (FAULTS: a probability per packet each), their seed, the capture file and the
    emulated NICs' firmware profile (arguments.add_wire_flags)."""
    loss: float = 0.0
    reorder: float = 0.0
    dup: float = 0.0
    corrupt: float = 0.0
    seed: int = 0
    pcap: str | None = None  # capture NIC 0's packets in FILE, NIC N's in FILE.N
    profile: str | None = None  # the firmware profile this host's emulated NICs play (None: the emulator's default)

    @classmethod
    def from_args(cls: type[Options], args: argparse.Namespace) -> Options:
        """The options a parsed command line gives (each field from the flag of its name)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def nic_options(self) -> dict[str, Any]:
        """open_nic's keywords for what was asked: the faults that are on (with the seed) and the capture. Nothing
        when nothing was: a PCI NIC takes no emulator option, not even a fault that is off."""
        return {**self.faults(), **self.chip(), **({"pcap": self.pcap} if self.pcap else {})}

    def faults(self, seed: int = 0) -> dict[str, Any]:
        """open_nic's keywords for the faults that are on, with the seed `seed` past ours (each NIC its own)."""
        faults: dict[str, Any] = {name: getattr(self, name) for name in FAULTS if getattr(self, name)}
        return dict(faults, seed=self.seed + seed) if faults else {}

    def chip(self) -> dict[str, Any]:
        """open_nic's keyword for the firmware profile this host's emulated NICs play, if one was asked (a peer's
        NICs play what its server chose)."""
        return {"profile": self.profile} if self.profile else {}

    def wire_flags(self) -> list[str]:
        """The options given that act on the emulated wire and NICs: the faults that are on, the capture, the
        profile."""
        return [name for name in (*FAULTS, "pcap", "profile") if getattr(self, name)]

    def check_faults(self) -> None:
        for name in FAULTS:
            if not 0 <= getattr(self, name) < 1:
                raise BadOption(name, getattr(self, name), "is a probability in [0, 1)")


@dataclasses.dataclass
class PerftestOptions(WireOptions):
    """What bench and lat runs are alike: the test, its sizes and iterations, the QPs' MTU and ACK timeout, the
    local NICs (and whether they share an emulator process), the peer running the server side, perftest's -e, -I,
    -o, -x and -A."""
    test: str = "write"
    _: dataclasses.KW_ONLY
    size: int
    iters: int = DEFAULT_ITERS
    mtu: int = 4096
    timeout: int = 14  # QP local ACK timeout: 4.096 us * 2^timeout (perftest's default); 0 waits forever, as in IB
    shared_emulator: bool  # the local emulated NICs in one emulator process (SimPCIDevice's `process`)
    inject_fault: str | None = None  # "KIND[:COUNT[:OFFSET]]": an emulator bug on the server side, to see verify fail
    nic: str = "sim"  # what the local NICs are: "sim", "sim:NAME" (numbered per NIC) or a PCI address
    ip: str | None = None  # NIC 0's IPv4 address
    sizes: list[int] | None = None  # a sweep (-a, ...): one row per size, the NICs booted once
    sweep_seconds: float | None = None  # -a without -n: iterations per size chosen to run about this long
    progress: bool = False  # a sweep's (and a long run's) progress on stderr
    events: bool = False  # -e: the pollers sleep on the completion interrupt without polling first
    inline_size: int = 0  # -I: messages up to this size are posted inline
    outs: int | None = None  # -o: outstanding READ/atomic requests per QP (None: the QP's default)
    gid_index: int | None = None  # -x: must be the NIC's GID index
    atomic_type: str = "FETCH_AND_ADD"  # -A: the atomic test's operation (ATOMIC_TYPES)
    remote: Any = None  # a connected aiofabric.peer Peer: the server side runs on its host (--peer, SERVER_HOST)
    remote_nic: str | None = None  # the NIC the server side opens there (None: the endpoint's default, "sim")
    remote_ip: str | None = None

    @property
    def emulated(self) -> bool:
        """The local NICs are emulated ("sim", "sim:NAME"), not a PCI function."""
        return self.nic.startswith("sim")

    @property
    def nic_named(self) -> bool:
        """`nic` is "sim", "sim:NAME" or a PCI address."""
        return self.nic == "sim" or self.nic.startswith("sim:") or PCI_ADDRESS.fullmatch(self.nic) is not None

    def check_link(self) -> None:
        """The path MTU, the ACK timeout and the wire's fault probabilities."""
        if self.mtu not in MTUS:
            raise BadOption("mtu", self.mtu, f"must be one of {', '.join(map(str, MTUS))}")
        if not isinstance(self.timeout, int) or not 0 <= self.timeout <= MAX_ACK_TIMEOUT:
            raise BadOption("timeout", self.timeout, f"must be in [0, {MAX_ACK_TIMEOUT}] (a 5-bit exponent: "
                                                     "4.096 us * 2^timeout, 0 waits forever)")
        self.check_faults()

    def check_inline(self) -> None:
        if self.inline_size and self.test not in INLINE_TESTS:
            raise BadOption("inline_size", self.inline_size, f"inline data goes with {' and '.join(INLINE_TESTS)} "
                                                             f"(the local side of a {self.test} is written by the NIC)")

    def check_messages(self) -> None:
        """-o's outstanding requests, the message size, and what the atomic test allows (`check_atomic`)."""
        if self.outs is not None and (self.outs < 1 or self.test not in ORDERED_TESTS):
            tests = " and ".join(ORDERED_TESTS)
            raise BadOption("outs", self.outs, f"counts outstanding {tests} requests: at least 1"
                            if self.test in ORDERED_TESTS else f"applies to {tests} only")
        if self.size < 1:
            raise BadOption("size", self.size, "must be at least 1 byte")
        if self.test == "atomic":
            self.check_atomic()

    def check_atomic(self) -> None:
        """What the atomic test allows: 8-byte messages, perftest's two operations."""
        if self.atomic_type not in ATOMIC_TYPES:
            raise BadOption("atomic_type", self.atomic_type, f"must be one of {', '.join(ATOMIC_TYPES)}")
        for size in self.sizes or [self.size]:
            if size != ATOMIC_SIZE:
                raise BadOption("size", size, f"an atomic moves {ATOMIC_SIZE} bytes (one 64-bit word), as in "
                                              "perftest's ib_atomic_*: drop -s and -a")

    def fault(self) -> tuple[str, int, int] | None:
        """(kind, count, offset) of --inject-fault KIND[:COUNT[:OFFSET]] (DebugClient.fault's), or None."""
        if self.inject_fault is None:
            return None
        kind, *numbers = self.inject_fault.split(":")
        if kind not in FAULT_KINDS or len(numbers) > 2 or not all(n.isdigit() for n in numbers):
            raise BadOption("inject_fault", self.inject_fault, f"must be KIND[:COUNT[:OFFSET]] with KIND one of "
                                                               f"{', '.join(FAULT_KINDS)}")
        count, offset = (int(n) for n in (numbers + ["1", "64"])[:2])
        return kind, count, offset

    def check_nic(self, nic: NIC, needs: tuple[Need, ...]) -> None:
        """Refuse what `nic` cannot hold (its firmware's limits), naming the option: the run's queues (`needs`,
        `queue_needs`'), the outstanding READs, the inline size and the GID index; the atomic test a NIC without
        atomics (UnsupportedError: its PCIe path does not complete AtomicOps)."""
        if self.test == "atomic":
            nic.device.atomic_ops.check(f"the atomic test on {nic.pci.address}")
        caps = nic.device.caps
        for dest, value, need, cap, what in (
                *needs,
                ("outs", self.outs, self.outs or 0, "max_qp_rd_atom", "outstanding READ/atomic requests per QP"),
                ("inline_size", self.inline_size, self.inline_size, "max_inline_data", "bytes of inline data")):
            if caps.get(cap) and need > caps[cap]:
                raise BadOption(dest, value, f"{what} exceed what {nic.pci.address} allows ({cap} {caps[cap]})")
        if self.gid_index is not None and self.gid_index != nic.device.gid_index:
            raise BadOption("gid_index", self.gid_index, f"{nic.pci.address}'s GID ::ffff:{nic.ip} is at index "
                                                         f"{nic.device.gid_index}")

    def rd_atomic(self) -> dict[str, int]:
        """connect()'s keywords for -o: the QP's outstanding READ/atomic requests."""
        return {} if self.outs is None else {"max_rd_atomic": self.outs}

    def pattern_seed(self, index: int) -> int:
        """The seed of payload `index` (a QP's, or a side's): distinct for each, and for each --seed."""
        return self.seed * PATTERN_STRIDE + index

    def wait_bound(self, moved: int) -> float:
        """How long a completion that waits for `moved` bytes may take: WAIT_BASE_SECONDS, plus every
        retransmission of a lost packet in both directions (4.096 us * 2^timeout, RETRY_CNT + 1 times each), plus 1 s
        per MiB."""
        ack = 4.096e-6 * 2 ** self.timeout if self.timeout else 0.0
        return WAIT_BASE_SECONDS + 2 * (RETRY_CNT + 1) * ack + moved / WAIT_SLOWEST_BPS


def queue_needs(qps: int, per_nic: int, depth: int, cq_depth: int, rx_depth: int | None) -> tuple[Need, ...]:
    """What a run's queues need of a NIC (`check_nic`): `per_nic` of its `qps` QPs on each NIC, each `depth` deep
    (receive queues `rx_depth`), and a CQ of `cq_depth` entries."""
    return (("qps", qps, per_nic, "max_qp", f"{per_nic} QPs on a NIC (--qps over --nics / 2, x2 with -b)"),
            ("depth", depth, depth, "max_qp_wr", "work requests per queue"),
            ("depth", depth, cq_depth, "max_cqe", f"a CQ of {cq_depth} entries (--qps x --tx-depth x 2 per NIC)"),
            ("rx_depth", rx_depth, rx_depth or 0, "max_qp_wr", "work requests per queue"))

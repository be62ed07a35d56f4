"""perftest-style RDMA tests on emulated NICs: the engines behind `aiofabric bench` and `aiofabric loopback`.

`bench` boots `nics` emulated NICs (one process each, talking RoCEv2 over UDP on 127.0.0.x), pairs them up
(NIC 0 with 1, 2 with 3, ...), spreads `qps` client/server QP pairs over the pairs and drives every QP from one
event loop with `depth` work requests in flight.

Verification can fail: every operation moves its own bytes. When a QP's `iters * size` fit in FULL_CHECK_BYTES per
NIC, each operation has its own slot of seeded random data and every operation's bytes are compared at its own
offset. Otherwise slots are reused every `depth` operations and each operation stamps its slot with (QP, iteration)
before it is posted; then the last pass is compared byte for byte, and the emulator's per-QP count of placed
messages and bytes (debug channel, "placed") must equal what was posted: a lost, duplicated or misplaced message
shows as a count or a byte that differs.

Placement counts, wire counters and --inject-fault exist only where a local NIC is emulated (`debug_client()` of its
seam). On a PCI NIC (with --peer) the bytes are still compared; the JSON says null for the counters and
`verification` says the placement counts were not available. The debug channel is asked only before and after a
run, never in its hot loop.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import struct
import sys
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import anyio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from .samples import percentile
from ..autogen import bnxt
from ..driver.close_budget import CLOSE_TIMEOUT
from ..errors import BadOption, FabricError
from ..hw.verbs import ROCE_OVERHEAD, path_mtu_for_port
from ..peer.protocol import fill_pattern
from ..verbs import ALL_ACCESS, ATOMIC_ACCESS, NIC, PCI_ADDRESS
from ..verbs import PROBE_SECONDS as FIRMWARE_PROBE_SECONDS
from ..verbs import QueuePair, open_nic, settle

log = logging.getLogger("aiofabric.tools.perftest")
TESTS = ("write", "read", "send", "atomic")
INLINE_TESTS = ("write", "send")  # tests whose local side a WQE can carry inline
ORDERED_TESTS = ("read", "atomic")  # tests whose requests take the QP's outstanding-READ slots (-o)
ATOMIC_TYPES = ("FETCH_AND_ADD", "CMP_AND_SWAP")  # perftest's -A
ATOMIC_SIZE = 8  # an atomic moves one 64-bit word
NO_ORIGINAL = b"\xff" * ATOMIC_SIZE  # the local slots before the atomics: a value no run's counter reaches
# perftest's names in its banners
TEST_TITLES = {"write": "RDMA_Write", "read": "RDMA_Read", "send": "Send", "atomic": "Atomic"}
MTUS = (256, 512, 1024, 2048, 4096)
MAX_ACK_TIMEOUT = 31  # the QP's local ACK timeout is a 5-bit exponent
FULL_CHECK_BYTES = 64 << 20  # per NIC: up to this, every operation keeps its own bytes to compare at the end
REGION_BYTES = 256 << 20  # at most this much buffer per QP when slots are reused (a larger message gets one slot)
MAX_NICS = 16  # emulated NICs of one run: each is a process with its own sparse DMA arena
MAX_SIZE = 1 << 30  # one message: source and target live in different NICs' 4 GiB DMA arenas
# a timed sweep's probe of its first size: 16 iterations per QP, then 4x as many until one run takes PROBE_SECONDS
# (a short run is mostly filling the pipeline, and would make the size's estimate too slow)
SWEEP_PROBE, SWEEP_PROBE_MAX, PROBE_SECONDS = 16, 4096, 0.1
SWEEP_MIN_ITERS = 5  # perftest's least -n
PEAK_SAMPLE = 0.05  # seconds between the samples of bytes done (the peak is the best tenth of the run)
WARMUP_SHARE = 0.2  # with -D, this share of the time (at most 2 s) runs before measuring starts
STAMP = struct.Struct("<Q")  # (flow << 40 | iteration) at the start of a reused slot, so each payload is distinct
FAULT_KINDS = ("skip_placement", "misplace")
LOOPBACK_BASE_SECONDS, LOOPBACK_SLOWEST_BPS = 10.0, 1 << 20  # loopback's time limit grows with the size
WIRE_COUNTERS = (("packets", "packets_sent"), ("retransmits", "retransmits"), ("dropped", "dropped"),
                 ("rx_overflow", "rx_overflow"))  # the JSON's name, the emulator's counter
NOT_COUNTED = "the NIC's placement counts were not available: it is not an emulated NIC"
# a QP with work outstanding that completes nothing for this long has stalled (the run fails naming it): 5 s, plus
# every retransmission of a lost packet (4.096 us * 2^timeout, RETRY_CNT + 1 times, both ways), plus 1 s per MiB
# a completion waits for (a signaled chunk of messages)
STALL_BASE_SECONDS, STALL_SLOWEST_BPS, RETRY_CNT = 5.0, 1 << 20, 7
REMOTE_CLOSE_AFTER_FAILURE = 2.0  # seconds for a peer's objects after a failure: its connection's end frees them too


class NoProgressError(FabricError, TimeoutError):
    """A QP had work outstanding and completed none of it for the run's no-progress timeout."""


class NICStoppedError(FabricError):
    """A NIC of the run stopped (its device gone, or its firmware silent): the message names it, then the failure
    the run saw."""


@dataclasses.dataclass
class BenchConfig:
    test: str = "write"
    qps: int = 1
    size: int = 65536
    iters: int = 1000
    depth: int = 32
    post_list: int = 1  # -l: work requests per post call (QueuePair.post_many); 1: one call each
    nics: int = 2
    mtu: int = 4096
    loss: float = 0.0
    reorder: float = 0.0
    dup: float = 0.0
    corrupt: float = 0.0
    seed: int = 0
    pcap: str | None = None
    shared_emulator: bool = False  # the local emulated NICs in one emulator process (SimPCIDevice's `process`)
    timeout: int = 14  # QP local ACK timeout: 4.096 us * 2^timeout (perftest's default); 0 waits forever, as in IB
    inject_fault: str | None = None  # "KIND[:COUNT[:OFFSET]]": an emulator bug on the servers, to see verify fail
    sizes: list[int] | None = None  # a sweep (-a, --min-size/--max-size/--factor): one row per size
    duration: float | None = None  # -D: seconds per size instead of `iters` (a warm-up share is not measured)
    bidirectional: bool = False  # -b: both NICs of a pair send at once
    run_infinitely: bool = False  # until `stop` is set: a report line every `duration` seconds
    stop: Any = None  # an anyio.Event that ends a --run-infinitely run (the CLI sets it on Ctrl-C)
    json: bool = False  # the caller prints one JSON object: interval reports go to stderr, not stdout
    report_gbits: bool = False  # table in Gb/sec (10^9 bits) instead of MB/sec (MiB)
    nic: str = "sim"  # what the local NICs are: "sim", "sim:NAME" (numbered per NIC) or a PCI address (with a peer)
    ip: str | None = None  # NIC 0's IPv4 address
    remote: Any = None  # a connected aiofabric.peer Peer: the server side runs on its host (bench --peer)
    server_host: str | None = None  # perftest's client: the server side is `bench --server` there (then `remote`
                                    # is the Peer the caller connected to it, after opening the local NIC)
    remote_nic: str | None = None  # the NIC the server side opens there (None: the endpoint's default, "sim")
    remote_ip: str | None = None
    progress: bool = False
    events: bool = False  # -e: the pollers sleep on the completion interrupt without polling first
    margin: float | None = None  # -f: the warm-up of a -D run, in seconds (None: WARMUP_SHARE of it, up to 2 s)
    no_peak: bool = False  # -N: no peak bandwidth (reported as 0, as perftest)
    outs: int | None = None  # -o: outstanding READ/atomic requests per QP (None: the QP's default)
    cq_mod: int | None = None  # -Q: one signaled work request every cq_mod (None: depth // 2)
    rx_depth: int | None = None  # -r: the send test's receive queue depth (None: depth)
    inline_size: int = 0  # -I: messages up to this size are posted inline
    gid_index: int | None = None  # -x: must be the NIC's GID index
    sweep_seconds: float | None = None  # -a without -n: iterations per size chosen to run about this long
    atomic_type: str = "FETCH_AND_ADD"  # -A: the atomic test's operation (ATOMIC_TYPES)
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
        if self.rx_depth is not None and (self.test != "send" or self.rx_depth < self.depth):
            raise bad("rx_depth", f"sizes the send test's receive queue: at least --tx-depth {self.depth} (each "
                                  "send in flight has its receive posted)" if self.test == "send" else
                      "sizes the receive queue of the send test only")
        if self.inline_size and self.test not in INLINE_TESTS:
            raise bad("inline_size", f"inline data goes with {' and '.join(INLINE_TESTS)} (the local side of "
                                     f"a {self.test} is written by the NIC)")
        if self.inline_size and self.post_list > 1:
            raise bad("inline_size", "post lists (-l) are not sent inline: drop one of them")
        if self.outs is not None and (self.outs < 1 or self.test not in ORDERED_TESTS):
            raise bad("outs", f"counts outstanding {' and '.join(ORDERED_TESTS)} requests: at least 1" if
                      self.test in ORDERED_TESTS else f"applies to {' and '.join(ORDERED_TESTS)} only")
        if self.size < 1:
            raise bad("size", "must be at least 1 byte")
        if self.test == "atomic":
            self.check_atomic()
        if self.mtu not in MTUS:
            raise bad("mtu", f"must be one of {', '.join(map(str, MTUS))}")
        if not 0 <= self.timeout <= MAX_ACK_TIMEOUT:
            raise bad("timeout", f"must be in [0, {MAX_ACK_TIMEOUT}] (a 5-bit exponent: 4.096 us * 2^timeout, "
                                 "0 waits forever)")
        for name in ("loss", "reorder", "dup", "corrupt"):
            if not 0 <= getattr(self, name) < 1:
                raise bad(name, "is a probability in [0, 1)")
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
        if not (self.nic == "sim" or self.nic.startswith("sim:") or PCI_ADDRESS.fullmatch(self.nic)):
            raise bad("nic", "use 'sim', 'sim:NAME' or a PCI address like 0000:41:00.0")
        if not self.nic.startswith("sim") and not self.with_peer:
            raise bad("nic", "a PCI NIC needs its partner on another host: use --peer HOST or SERVER_HOST")
        if self.ip is not None and self.nics > 2 and not self.with_peer:
            raise bad("ip", "names NIC 0's address: with --nics > 2 let the emulated NICs pick theirs")
        for size in self.sizes or [self.size]:
            if not 1 <= size <= MAX_SIZE:
                raise BadOption("size", size, f"must be in [1, {MAX_SIZE}] bytes (one emulated NIC's DMA arena "
                                              "holds the buffers)")

    def check_atomic(self) -> None:
        """What the atomic test allows: 8-byte messages, one at a time per post, perftest's two operations."""
        if self.atomic_type not in ATOMIC_TYPES:
            raise BadOption("atomic_type", self.atomic_type, f"must be one of {', '.join(ATOMIC_TYPES)}")
        for size in self.sizes or [self.size]:
            if size != ATOMIC_SIZE:
                raise BadOption("size", size, f"an atomic moves {ATOMIC_SIZE} bytes (one 64-bit word), as in "
                                              "perftest's ib_atomic_*: drop -s and -a")
        if self.post_list > 1:
            raise BadOption("post_list", self.post_list, "atomics are posted one work request per call")

    def check_caps(self, nic: NIC) -> None:
        """Refuse what `nic` cannot hold (its firmware's limits), naming the option: the QPs and the CQ a NIC gets,
        the queue depth, the outstanding READs, the inline size and the GID index."""
        caps, per_nic = nic.device.caps, self.qps_per_nic  # a NIC holds the client (or the server) QP of its flows
        limits = (("qps", per_nic, "max_qp", f"{per_nic} QPs on a NIC (--qps over --nics / 2, x2 with -b)"),
                  ("depth", self.depth, "max_qp_wr", "work requests per queue"),
                  ("depth", self.cq_depth, "max_cqe", f"a CQ of {self.cq_depth} entries (--qps x --tx-depth x 2 "
                                                      "per NIC)"),
                  ("rx_depth", self.rx_depth or 0, "max_qp_wr", "work requests per queue"),
                  ("outs", self.outs or 0, "max_qp_rd_atom", "outstanding READ/atomic requests per QP"),
                  ("inline_size", self.inline_size, "max_inline_data", "bytes of inline data"))
        for dest, need, cap, what in limits:
            if caps.get(cap) and need > caps[cap]:
                raise BadOption(dest, getattr(self, dest), f"{what} exceed what {nic.pci.address} allows "
                                                           f"({cap} {caps[cap]})")
        if self.gid_index is not None and self.gid_index != nic.device.gid_index:
            raise BadOption("gid_index", self.gid_index, f"{nic.pci.address}'s GID ::ffff:{nic.ip} is at index "
                                                         f"{nic.device.gid_index}")

    @property
    def no_progress_seconds(self) -> float:
        """How long a QP with work outstanding may complete nothing before the run fails (`stall_timeout`, or
        STALL_BASE_SECONDS + every retransmission of a lost packet both ways + 1 s per MiB of a signaled chunk)."""
        if self.stall_timeout is not None:
            return self.stall_timeout
        ack = 4.096e-6 * 2 ** self.timeout if self.timeout else 0.0
        chunk = self.post_list if self.post_list > 1 else self.cq_mod or max(1, self.depth // 2)
        return STALL_BASE_SECONDS + 2 * (RETRY_CNT + 1) * ack + chunk * self.size / STALL_SLOWEST_BPS

    @property
    def qps_per_nic(self) -> int:
        """Flows whose client (or server) side lives on one NIC."""
        return -(-self.qps // (self.nics // 2)) * (2 if self.bidirectional else 1)

    @property
    def cq_depth(self) -> int:
        """Each NIC's CQ: room for every work request of its QPs, both queues, as a power of two."""
        return 1 << max(8, (self.qps_per_nic * self.depth * 2 - 1).bit_length())

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

    @property
    def with_peer(self) -> bool:
        """The server side runs on another host (--peer or SERVER_HOST): one NIC here."""
        return self.remote is not None or self.server_host is not None

    @property
    def slots(self) -> int:
        """Message slots per QP: one per operation when they fit in FULL_CHECK_BYTES per NIC, else `depth` reused
        (fewer when `depth` slots of a large message would not fit REGION_BYTES: in-flight messages then share)."""
        if self.duration is None and self.iters * self.size * self.qps_per_nic <= FULL_CHECK_BYTES:
            return self.iters
        return max(1, min(self.depth if self.duration else min(self.iters, self.depth), REGION_BYTES // self.size))

    @property
    def used_bytes(self) -> int:
        """Bytes of each QP's buffers that the run moves."""
        return self.slots * self.size


@dataclasses.dataclass
class _Flow:
    client: QueuePair
    server: QueuePair
    source: Any  # MemoryRegion on the client
    target: Any  # MemoryRegion on the server
    index: int = 0
    direction: int = 0  # 0: NIC 2k -> 2k+1; 1: the reverse (-b)
    remote: Any = None  # the Peer the server side lives on (then server is a RemoteQP, target a RemoteMR)
    digest: str = ""  # sha256 of the remote bytes a READ run moves (the remote filled them)
    latencies: list[float] = dataclasses.field(default_factory=list)
    done: int = 0
    posted: int = 0
    progressed: float = 0.0  # perf_counter() of the last completion (or of the first post)

    def where(self) -> str:
        """The QP and the NICs it runs between, for errors."""
        there = f"the server at {self.remote.host}" if self.remote is not None else self.server.device.pci.address
        return f"QP {self.client.qpn:#x} ({self.client.device.pci.address} to {there})"

    @property
    def target_region(self) -> Any:
        """What the client's RDMA work names as remote memory: the server's MR, or a peer's region."""
        return self.target.remote() if self.remote is not None else self.target


_runs_started = itertools.count()


@contextlib.asynccontextmanager
async def open_bench_nics(config: BenchConfig) -> AsyncIterator[list[NIC]]:
    """The local NICs of a run (`run_bench` opens them itself unless it is given them). After a failure (or a
    cancellation) they are closed at once, together: one that stopped answering with no budget (`settle`), the
    others each within its own, so the whole close takes one budget, not one per NIC."""
    nics: list[NIC] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_exit(functools.partial(_close_after_failure, nics))
        shared = f"run{next(_runs_started)}"  # --shared-emulator: this run's NICs, not another's of this process
        for i in range(1 if config.with_peer else config.nics):  # with a peer, the servers live there
            if not config.nic.startswith("sim"):  # a real NIC: no emulator options
                nics.append(await stack.enter_async_context(open_nic(config.nic, ip=config.ip)))
                continue
            options = _faults(config, seed=i)
            if config.shared_emulator:
                options["process"] = shared
            if config.pcap:
                options["pcap"] = config.pcap if i == 0 else f"{config.pcap}.{i}"  # NIC N>0: FILE.N
            name = config.nic.partition(":")[2] or f"bench{os.getpid()}"
            nics.append(await stack.enter_async_context(open_nic(f"sim:{name}-{i}", ip=config.ip if i == 0 else None,
                                                                 **options)))
        for nic in nics:
            if config.events:  # perftest's -e: no polling before sleeping on the interrupt
                nic.poller.spin = 0.0
        yield nics


async def _close_after_failure(nics: list[NIC], kind: Any, error: Any, traceback: Any) -> bool:
    """An exit callback of open_bench_nics' stack, run before the NICs' own exits (which then find them closed)."""
    if error is None:
        return False
    await settle(nics)
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT + 5):
        async with anyio.create_task_group() as tasks:
            for nic in nics:
                tasks.start_soon(nic.close)
    return False


def first_error(error: BaseException) -> BaseException:
    """The first leaf of nested exception groups that is not a cancellation (anyio groups a task's error once per
    task group it crosses): the failure that came first, not the ones it caused."""
    cancelled = anyio.get_cancelled_exc_class()
    while isinstance(error, BaseExceptionGroup):
        real = [e for e in error.exceptions if not isinstance(e, cancelled)]
        error = (real or list(error.exceptions))[0]
    return error


def _text(error: BaseException) -> str:
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


async def after_failure(error: BaseException, nics: Iterable[NIC], peer: Any = None, remote_nic: Any = None
                        ) -> BaseException | None:
    """What stopped, once a run failed with `error` (shielded, a second or so): the local NICs that stopped
    answering (`settle` closes them at once, so the clean-up spends nothing on them) and, with a peer, the peer's
    NIC as its endpoint reports it (op nic_status). A `NICStoppedError` naming them, `error` after them; None when
    every NIC answers or the run was cancelled (the cancellation stays the outcome)."""
    stopped = [f"{address} stopped: {why}" for address, why in (await settle(nics)).items()]
    cancelled = isinstance(first_error(error), anyio.get_cancelled_exc_class())
    if peer is not None and remote_nic is not None and not cancelled and getattr(peer, "failure", None) is None:
        with anyio.CancelScope(shield=True):
            status = await remote_nic_status(peer, remote_nic)
        if status is not None and status.get("stopped"):
            stopped.append(f"the server's NIC {status.get('nic', '?')} at {peer.host} stopped: {status['stopped']}")
    if cancelled or not stopped:
        return None
    return NICStoppedError(f"{'; '.join(stopped)}; what the run saw: {_text(first_error(error))}")


async def remote_nic_status(peer: Any, remote_nic: Any) -> dict[str, Any] | None:
    """The peer's word on its NIC (op nic_status: {"nic", "stopped": why or null}), or None if it cannot say (an
    endpoint without the op, or no answer in time: the peer itself is then failed)."""
    from ..peer import PeerError
    try:
        return await peer.request("nic_status", nic=remote_nic.handle, probe=FIRMWARE_PROBE_SECONDS,
                                  timeout=FIRMWARE_PROBE_SECONDS + 4)
    except PeerError:
        return None


async def release_after_failure(release: Callable[[], Awaitable[None]], what: str) -> None:
    """Run a failed run's clean-up `release` within the close budget, shielded; its own error is logged, never
    raised: the run's first error stays the one reported."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
        try:
            await release()
        except Exception as exc:
            log.info("after the failure, %s: %s", what, _text(exc))


async def _connect(config: BenchConfig, nics: list[NIC], flows: list[_Flow]) -> list[_Flow]:
    """The QP pairs and buffers of one size, appended to `flows` as they are made (so a failure frees them too)."""
    span = config.used_bytes
    directions = 2 if config.bidirectional else 1
    cqs = {nic: await nic.create_cq(depth=config.cq_depth) for nic in nics}
    for i in range(config.qps * directions):
        pair, direction = divmod(i, directions)
        a, b = nics[2 * (pair % (config.nics // 2))], nics[2 * (pair % (config.nics // 2)) + 1]
        if direction:
            a, b = b, a
        client = await a.create_qp(cqs[a], sq_depth=config.depth, rq_depth=config.depth,
                                   max_inline_data=config.inline_size)
        server = await b.create_qp(cqs[b], sq_depth=config.depth, rq_depth=config.rx_depth or config.depth)
        flow = _Flow(client, server, None, None, i, direction)
        flows.append(flow)
        atomic = config.test == "atomic"
        if atomic:  # the responder's QP must allow remote atomics (INIT's access bits)
            await server.to_init(ATOMIC_ACCESS)
        await client.connect(server.info(), mtu=config.mtu, timeout=config.timeout, **outs(config))
        await server.connect(client.info(), mtu=config.mtu, timeout=config.timeout, **outs(config))
        flow.source = await a.register_mr(span)
        flow.target = await b.register_mr(span, ATOMIC_ACCESS if atomic else ALL_ACCESS)
        if atomic:
            flow.target.view[:ATOMIC_SIZE] = bytes(ATOMIC_SIZE)  # the counter starts at 0
            flow.source.view[:span] = NO_ORIGINAL * (span // ATOMIC_SIZE)  # what no atomic returns: unwritten shows
        else:
            fill_pattern((flow.target if config.test == "read" else flow.source).view[:span], config.seed * 7919 + i)
    fault = config.fault()
    if fault is not None:
        for server_nic in nics[1::2]:
            await emulator(server_nic, "--inject-fault").fault(*fault)
    return flows


def outs(config: Any) -> dict[str, int]:
    """connect()'s keywords for -o (bench's or lat's config): the QP's outstanding READ/atomic requests."""
    return {} if config.outs is None else {"max_rd_atomic": config.outs}


@contextlib.asynccontextmanager
async def _flows(config: BenchConfig, nics: list[NIC]) -> AsyncIterator[list[_Flow]]:
    """The run's QP pairs; with a peer, the server side is opened on its host and closed there afterwards. After a
    failure, what stopped is found first (`after_failure`: it heads the error) and the clean-up is bounded and
    quiet: its own errors are logged, the run's first error is raised."""
    flows: list[_Flow] = []
    remote = None
    try:
        if config.remote is None:
            yield await _connect(config, nics, flows)
        else:
            remote = await config.remote.open_nic(config.remote_nic, ip=config.remote_ip, **_faults(config, seed=1))
            yield await _connect_remote(config, nics[0], remote)
    except BaseException as exc:
        headline = await after_failure(exc, nics, config.remote, remote)
        if config.remote is None:
            await release_after_failure(functools.partial(_release, flows, quiet=True), "releasing the QPs")
        elif remote is not None and getattr(config.remote, "failure", None) is None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(REMOTE_CLOSE_AFTER_FAILURE):
                with contextlib.suppress(Exception):
                    await config.remote.close(remote)
        if headline is not None:
            raise headline from exc
        raise
    else:  # a sweep runs every size on the same NICs: give each size's QPs, CQs and memory back
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            if config.remote is None:
                await _release(flows)
            else:
                await config.remote.close(remote)


def _faults(config: BenchConfig, seed: int) -> dict[str, Any]:
    faults = {k: getattr(config, k) for k in ("loss", "reorder", "dup", "corrupt") if getattr(config, k)}
    return dict(faults, seed=config.seed + seed) if faults else {}


def emulator(nic: NIC, purpose: str) -> Any:
    """The debug client of `nic`'s emulator (DebugClient), for `purpose`; ValueError naming the NIC if it has none."""
    client = nic.pci.debug_client()
    if client is None:
        raise ValueError(f"{purpose} needs the emulator's debug channel, which {nic.pci.address} does not have (it "
                         "is not an emulated NIC)")
    return client


async def wire_counters(nics: Iterable[NIC]) -> list[collections.Counter[str]] | None:
    """The emulator's counters of each NIC, or None when one of them is not emulated (nothing counts its packets)."""
    clients = [nic.pci.debug_client() for nic in nics]
    if None in clients:
        return None
    return [await client.stats() for client in clients]


async def emulator_processes(nics: Iterable[NIC]) -> int | None:
    """How many emulator processes run `nics` (--shared-emulator: one), or None when one of them is not emulated."""
    clients = [nic.pci.debug_client() for nic in nics]
    if None in clients:
        return None
    return len({(await client.ping()).pid for client in clients})


def wire_delta(before: list[collections.Counter[str]] | None, after: list[collections.Counter[str]] | None,
               counters: Iterable[tuple[str, str]] = WIRE_COUNTERS) -> dict[str, int | None]:
    """How much each of `counters` (JSON name, emulator counter) grew, summed over the NICs; None if not counted."""
    if before is None or after is None:
        return {key: None for key, _ in counters}
    return {key: sum(new[name] - old[name] for new, old in zip(after, before)) for key, name in counters}


async def placement_counts(nic: NIC) -> collections.defaultdict[int, Any] | None:
    """What each QP of `nic` placed (DebugClient.placed), or None when it is not an emulated NIC."""
    client = nic.pci.debug_client()
    return None if client is None else await client.placed()


def count_text(value: int | None) -> str:
    """A counter for the tables: "n/a" where it was not counted."""
    return "n/a" if value is None else str(value)


async def _connect_remote(config: BenchConfig, local: NIC, remote: Any) -> list[_Flow]:
    """The server side on the peer's host: one QP and one MR per flow on its NIC, connected both ways."""
    peer = config.remote
    cq, remote_cq = await local.create_cq(depth=config.cq_depth), await peer.create_cq(remote, config.cq_depth)
    flows = []
    for i in range(config.qps):
        client = await local.create_qp(cq, sq_depth=config.depth, rq_depth=config.depth,
                                       max_inline_data=config.inline_size)
        server = await peer.create_qp(remote, remote_cq, sq_depth=config.depth,
                                      rq_depth=config.rx_depth or config.depth)
        atomic = config.test == "atomic"
        await client.connect(server.info, mtu=config.mtu, timeout=config.timeout, **outs(config))
        await peer.connect_qp(server, client.info(), mtu=config.mtu, timeout=config.timeout, atomic=atomic)
        source = await local.register_mr(config.used_bytes)
        target = await peer.register_mr(remote, config.used_bytes, atomic=atomic)
        flow = _Flow(client, server, source, target, i, remote=peer)
        if atomic:
            await peer.fill(target, byte=0, length=ATOMIC_SIZE)  # the counter starts at 0
            source.view[:config.used_bytes] = NO_ORIGINAL * (config.used_bytes // ATOMIC_SIZE)
        elif config.test == "read":
            flow.digest = await peer.fill(target, seed=config.seed * 7919 + i, length=config.used_bytes)
        else:
            fill_pattern(source.view[:config.used_bytes], config.seed * 7919 + i)
        flows.append(flow)
    return flows


async def _release(flows: list[_Flow], quiet: bool = False) -> None:
    """Destroy the flows' QPs, then their CQs and memory (a NIC close would, but a sweep keeps its NICs). `quiet`
    (after a failure): an object that cannot be released is logged and the rest still are."""
    cqs = {id(qp.send_cq): qp.send_cq for flow in flows for qp in (flow.client, flow.server)}
    steps: list[Callable[[], Awaitable[None]]] = []
    for flow in flows:
        steps += [flow.client.destroy, flow.server.destroy]
        steps += [mr.deregister for mr in (flow.source, flow.target) if mr is not None]
    steps += [cq.destroy for cq in cqs.values()]
    await release_steps(steps, quiet)


async def release_steps(steps: list[Callable[[], Awaitable[Any]]], quiet: bool) -> None:
    """Run each release step in order; `quiet` (after a failure): one that fails is logged and the rest still run,
    so the first error stays the one reported."""
    for step in steps:
        try:
            await step()
        except Exception as exc:
            if not quiet:
                raise
            log.info("after the failure: %s", _text(exc))


async def _drive(config: BenchConfig, flow: _Flow, deadline: float | None, stop: Any = None) -> None:
    """Keep `depth` work requests in flight on one QP: post in half-depth chunks (or `post_list` at a time, one
    post_many each), signal each chunk's last. Posts `iters` operations, or (deadline) until the deadline, then
    drains."""
    chunk = config.post_list if config.post_list > 1 else config.cq_mod or max(1, config.depth // 2)
    size = config.size
    inline = size <= config.inline_size  # -I: perftest inlines the messages that fit
    in_flight: list[tuple[float, Any, int]] = []
    posted = 0
    slots = config.slots
    limit = config.iters if deadline is None and stop is None else 1 << 62
    stamp = b"" if slots == config.iters or config.test in ("read", "atomic") or slots < config.depth else \
        (flow.index << 40).to_bytes(8, "little")[:size]  # reused slots: each write/send stamps its own
    data, target = flow.source.view, flow.target_region
    client, source = flow.client, flow.source
    write = functools.partial(client.post_write, inline=True) if inline else client.post_write
    one_sided = {"write": write, "read": client.post_read}.get(config.test)
    atomic, swap = config.test == "atomic", config.atomic_type == "CMP_AND_SWAP"
    flow.progressed = time.perf_counter()
    while True:
        if deadline is not None and time.perf_counter() >= deadline or stop is not None and stop.is_set():
            limit = posted
        while posted < limit and posted - flow.done < config.depth:
            count = min(chunk, limit - posted, config.depth - (posted - flow.done))
            started = time.perf_counter()
            if config.test == "send" and flow.remote is not None:  # the receives, posted there first
                for offset, run in _runs(posted, count, slots):
                    await flow.remote.post_recvs(flow.server, flow.target, run, size, offset=offset * size)
            if stamp:  # the slots' previous messages completed: posted - done < depth
                for k in range(count):
                    slot = (posted + k) % slots * size
                    data[slot:slot + len(stamp)] = STAMP.pack((flow.index << 40) | (posted + k))[:len(stamp)]
            if config.post_list > 1:
                if config.test == "send" and flow.remote is None:
                    for k in range(count):
                        await flow.server.post_recv(flow.target, size, local_offset=(posted + k) % slots * size)
                for first, run in _runs(posted, count, slots):
                    offsets = range(first * size, (first + run) * size, size)
                    completion = (await flow.client.post_many(
                        config.test, flow.source, None if config.test == "send" else target, size, offsets))[-1]
                in_flight.append((started, completion, count))
                posted += count
                flow.posted = posted
                continue
            with client.batch():
                last = count - 1
                for k in range(count):
                    slot = (posted + k) % slots * size
                    if atomic:  # operation n finds the counter at n: FA adds 1, CAS swaps n for n+1
                        n = posted + k
                        completion = await (client.post_compare_swap(source, target, n, n + 1, local_offset=slot,
                                                                     signaled=k == last) if swap else
                                            client.post_fetch_add(source, target, 1, local_offset=slot,
                                                                  signaled=k == last))
                    elif one_sided is not None:
                        completion = await one_sided(source, target, size, local_offset=slot, remote_offset=slot,
                                                     signaled=k == last)
                    else:
                        if flow.remote is None:
                            await flow.server.post_recv(flow.target, size, local_offset=slot)
                        completion = await client.post_send(source, size, local_offset=slot, signaled=k == last,
                                                            inline=inline)
            in_flight.append((started, completion, count))
            posted += count
            flow.posted = posted
        if not in_flight:
            break
        started, completion, count = in_flight.pop(0)
        await completion
        now = flow.progressed = time.perf_counter()
        flow.latencies.extend([now - started] * count)
        flow.done += count


async def _watch_progress(flows: list[_Flow], seconds: float, stalled: list[BaseException],
                          drivers: anyio.CancelScope) -> None:
    """Fail the run (`stalled`, then cancel the drivers) once a QP with work outstanding has completed nothing for
    `seconds`: a NIC, its partner or the wire between them stopped. Looks a few times per `seconds`; the hot path
    only stamps its completions."""
    while True:
        await anyio.sleep(min(1.0, seconds / 4))
        now = time.perf_counter()
        for flow in flows:
            quiet = now - flow.progressed
            if flow.posted > flow.done and quiet > seconds:
                stalled.append(NoProgressError(
                    f"{flow.where()} completed nothing for {quiet:.1f} s with {flow.posted - flow.done} work "
                    f"request(s) outstanding (the limit: {seconds:g} s)"))
                drivers.cancel()
                return


def _runs(first: int, count: int, slots: int) -> list[tuple[int, int]]:
    """Operations first .. first+count-1 as (first slot, how many) runs of consecutive slots (split where they wrap)."""
    start = first % slots
    head = min(count, slots - start)
    return [(start, head)] + ([(0, count - head)] if count > head else [])


async def _verify(config: BenchConfig, flows: list[_Flow], placed: dict[Any, Any]) -> str | None:
    """Why the run's bytes are wrong, or None: every slot's bytes (by sha256 where they live on a peer), then the
    emulator's per-QP placement counts where the placing NIC is ours and emulated (`placed`, by seam: None where it
    is not; a peer offers no debug channel)."""
    used = config.used_bytes
    for flow in flows:
        if config.test == "atomic":
            wrong = await _atomic_results(config, flow)
            if wrong:
                return wrong
        elif flow.remote is not None:
            here = hashlib.sha256(flow.source.view[:used]).hexdigest()
            there = flow.digest or await flow.remote.sha256(flow.target, 0, used)
            if here != there:
                return f"QP {flow.client.qpn:#x}: the bytes at {flow.remote.host} differ from the source (sha256)"
        elif flow.source.view[:used] != flow.target.view[:used]:
            offset = next(i for i in range(0, used, config.size)
                          if flow.source.view[i:i + config.size] != flow.target.view[i:i + config.size])
            return f"QP {flow.client.qpn:#x}: the bytes of message slot {offset // config.size} differ at the target"
        placer = flow.client if config.test == "read" else flow.server  # who places the data in memory
        if not isinstance(placer, QueuePair) or placed[placer.device.pci] is None:
            continue
        messages, size = placed[placer.device.pci][placer.qpn].of(config.test)
        if (messages, size) != (flow.done, flow.done * config.size):
            return (f"QP {placer.qpn:#x}: the NIC placed {messages} messages / {size} bytes, "
                    f"{flow.done} / {flow.done * config.size} were posted")
    return None


async def _atomic_results(config: BenchConfig, flow: _Flow) -> str | None:
    """What is wrong with an atomic run's results, or None: operation n found the counter at n (its original value,
    in its local slot: the last pass's where slots are reused), and the counter ends at the number done (compared by
    sha256 where it lives on a peer)."""
    slots, done = config.slots, flow.done
    for slot in range(min(slots, done)):
        n = slot + slots * ((done - 1 - slot) // slots)  # the last operation that used this slot
        got = int.from_bytes(flow.source.view[slot * ATOMIC_SIZE:(slot + 1) * ATOMIC_SIZE], "little")
        if got != n:
            return f"QP {flow.client.qpn:#x}: atomic {n} found the counter at {got}, not {n}"
    counter = done.to_bytes(ATOMIC_SIZE, "little")
    if flow.remote is not None:
        if await flow.remote.sha256(flow.target, 0, ATOMIC_SIZE) != hashlib.sha256(counter).hexdigest():
            return f"QP {flow.client.qpn:#x}: the counter at {flow.remote.host} is not {done} (sha256)"
    elif bytes(flow.target.view[:ATOMIC_SIZE]) != counter:
        return (f"QP {flow.client.qpn:#x}: the counter is {int.from_bytes(flow.target.view[:ATOMIC_SIZE], 'little')}"
                f" after {done} atomics")
    return None


def fit_mtu(requested: int, nics: Iterable[NIC], what: str) -> int:
    """The path MTU to connect with: `requested`, or, when a NIC's port cannot carry its packets, the largest path
    MTU every port carries (Linux picks a RoCE port's MTU so: iboe_get_mtu of the netdev's MTU), said on stderr. A
    port whose MTU is not known (0) limits nothing."""
    ports = {nic.pci.address: nic.device.port_mtu for nic in nics if nic.device.port_mtu}
    if not ports:
        return requested
    address, port_mtu = min(ports.items(), key=lambda item: item[1])
    fitting = path_mtu_for_port(port_mtu)
    if fitting >= requested:
        return requested
    if not fitting:
        raise ValueError(f"{address}'s port MTU {port_mtu} is too small for any RoCE packet (the headers take "
                         f"{ROCE_OVERHEAD} bytes, the smallest path MTU is 256)")
    print(f"{what}: path MTU {requested} does not fit the port MTU {port_mtu} of {address} (RoCE headers take "
          f"{ROCE_OVERHEAD} bytes): using {fitting}", file=sys.stderr, flush=True)
    return fitting


async def _report_every(config: BenchConfig, sampler: _Sampler, stop: Any) -> None:
    """--run-infinitely: a line on stdout every `duration` seconds with that interval's bandwidth, until `stop`."""
    last_time, last_done = time.perf_counter(), sampler.done()
    while not stop.is_set():
        with anyio.move_on_after(config.duration):
            await stop.wait()
        now, done = time.perf_counter(), sampler.done()
        rate = (done - last_done) * config.size / max(now - last_time, 1e-9)
        print(f" {config.size:<10} {done - last_done:<14} {rate / 2**20:<20.2f} {rate / config.size / 1e6:.6f} "
              f"(last {now - last_time:.1f} s)", file=sys.stderr if config.json else sys.stdout, flush=True)
        last_time, last_done = now, done


class _Sampler:
    """Bytes done over time, sampled every PEAK_SAMPLE: the average after the warm-up, and the best interval (peak);
    on a TTY also a live line on stderr (size, ops, MiB/s, ETA)."""

    def __init__(self, config: BenchConfig, flows: list[_Flow], started: float, warmup: float, total: int) -> None:
        self.config, self.flows, self.started, self.warmup, self.total = config, flows, started, warmup, total
        self.samples: list[tuple[float, int]] = []

    def done(self) -> int:
        return sum(flow.done for flow in self.flows)

    async def run(self) -> None:
        while True:
            await anyio.sleep(PEAK_SAMPLE)
            now, done = time.perf_counter(), self.done()
            if now - self.started >= self.warmup:
                self.samples.append((now, done))
            if self.config.progress and now - self.started > 2:
                rate = done * self.config.size / (now - self.started) / 2**20
                left = (f"ETA {max(0.0, (self.total - done) / max(done, 1) * (now - self.started)):.0f} s"
                        if self.total else "")
                print(f"\r  {self.config.size} B  {done} ops  {rate:.1f} MiB/s  {left}   ", end="", file=sys.stderr,
                      flush=True)

    def peak(self) -> float:
        """The best bytes/s over any window of a tenth of the run (at least one sample interval): long enough to hold
        several completions, which arrive in chunks of depth/2 messages (0 when the run was too short to sample)."""
        samples = self.samples
        if len(samples) < 2:
            return 0.0
        window = max(PEAK_SAMPLE, (samples[-1][0] - samples[0][0]) / 10)
        best, j = 0.0, 0
        for t0, done0 in samples:
            while j < len(samples) and samples[j][0] - t0 < window:
                j += 1
            if j == len(samples):
                break
            t1, done1 = samples[j]
            best = max(best, (done1 - done0) * self.config.size / (t1 - t0))
        return best


async def run_bench(config: BenchConfig, nics: list[NIC] | None = None) -> dict[str, Any]:
    """One size (`config.size`) or a sweep (`config.sizes`: one row per size in "rows", NICs booted once), on
    `nics` (from `open_bench_nics`) or on NICs it opens and closes."""
    config.check()
    sizes = config.sizes or [config.size]
    async with contextlib.nullcontext(nics) if nics is not None else open_bench_nics(config) as nics:
        for nic in nics:
            config.check_caps(nic)
        first = nics[0].info()
        mtu = fit_mtu(config.mtu, nics, "bench")
        rows = [{**row, "mtu_requested": config.mtu} for row in await run_sizes(
            dataclasses.replace(config, mtu=mtu), sizes, lambda sized: _run_size(sized, nics, first["fw_version"]))]
    if config.sizes is None:
        return rows[0]
    failed = [row for row in rows if "error" in row]
    return {"verified": all(row["verified"] for row in rows), "test": config.test, "sizes": sizes, "rows": rows,
            "fw_version": first["fw_version"], "mtu": mtu, "mtu_requested": config.mtu,
            **({"error": f"size {failed[0]['size']}: {failed[0]['error']}"} if failed else {})}


async def run_sizes(config: Any, sizes: list[int], run_one: Callable[[Any], Awaitable[dict[str, Any]]]
                    ) -> list[dict[str, Any]]:
    """`run_one(config for one size)` for each of `sizes` (bench's or lat's config): its rows. With
    `config.sweep_seconds` (a sweep without -n or -D), a probe of the first size (growing until it runs
    PROBE_SECONDS) and then iterations per size chosen to run about that long (`sweep_iterations`); on a TTY
    (`config.progress`) each size and its iterations on stderr."""
    timings: list[tuple[int, float]] = []  # (size, seconds per iteration) of the runs so far
    rows = []

    def per_iteration(sized: Any, row: dict[str, Any]) -> float:
        return row["seconds"] / (sized.iters + getattr(sized, "warmup", 0))

    for index, size in enumerate(sizes):
        sized = dataclasses.replace(config, size=size)
        if config.sweep_seconds is not None and not getattr(config, "duration", None):
            iters = SWEEP_PROBE
            while not timings:  # how long an iteration takes here
                probe = dataclasses.replace(sized, iters=iters)
                row = await run_one(probe)
                if row["seconds"] >= PROBE_SECONDS or iters >= SWEEP_PROBE_MAX:
                    timings.append((size, per_iteration(probe, row)))
                iters *= 4
            sized.iters = sweep_iterations(timings, size, config.sweep_seconds)
        if config.progress and len(sizes) > 1:
            print(f"\r  size {size} ({index + 1}/{len(sizes)}): {sized.iters} iterations   ", end="",
                  file=sys.stderr, flush=True)
        row = await run_one(sized)
        timings.append((size, per_iteration(sized, row)))
        rows.append(row)
    if config.progress and len(sizes) > 1:
        print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
    return rows


def sweep_iterations(timings: list[tuple[int, float]], size: int, seconds: float) -> int:
    """Iterations per QP for `size` to run about `seconds`, from earlier (size, seconds per iteration): a line
    through the last two sizes (a fixed cost plus a cost per byte), or, from one, a cost per byte alone (too
    few iterations rather than too many); at least SWEEP_MIN_ITERS."""
    (s1, t1) = timings[-1]
    per_byte, fixed = t1 / s1, 0.0
    if len(timings) > 1 and timings[-2][0] != s1:
        (s0, t0) = timings[-2]
        per_byte = max(0.0, (t1 - t0) / (s1 - s0))
        fixed = max(0.0, t1 - per_byte * s1)
    predicted = max(fixed + per_byte * size, 1e-9)
    return max(SWEEP_MIN_ITERS, int(seconds / predicted))


async def _run_size(config: BenchConfig, nics: list[NIC], fw_version: str) -> dict[str, Any]:
    async with _flows(config, nics) as flows:
        before = await wire_counters(nics)
        cpu_started, started = time.process_time(), time.perf_counter()
        warmup = 0.0 if not config.duration else \
            config.margin if config.margin is not None else min(2.0, config.duration * WARMUP_SHARE)
        deadline = started + warmup + config.duration if config.duration and not config.run_infinitely else None
        stop = config.stop if config.run_infinitely else None
        sampler = _Sampler(config, flows, started, warmup, 0 if config.duration else len(flows) * config.iters)
        stalled: list[BaseException] = []
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sampler.run)
            async with anyio.create_task_group() as drivers:
                tasks.start_soon(_watch_progress, flows, config.no_progress_seconds, stalled, drivers.cancel_scope)
                for flow in flows:
                    drivers.start_soon(_drive, config, flow, deadline, stop)
                if config.run_infinitely:
                    drivers.start_soon(_report_every, config, sampler, stop)
            tasks.cancel_scope.cancel()
        if stalled:
            raise stalled[0]
        ended = time.perf_counter()
        cpu = time.process_time() - cpu_started
        if config.progress:
            print("\r" + " " * 70 + "\r", end="", file=sys.stderr)
        placed = {nic.pci: await placement_counts(nic) for nic in nics}
        mismatch = await _verify(config, flows, placed)
        wire = wire_delta(before, await wire_counters(nics))
        processes = await emulator_processes(nics)
    ops = sum(flow.done for flow in flows)
    measured_ops, seconds = ops, ended - started
    if config.duration and sampler.samples:  # measure from the end of the warm-up
        measured_ops, seconds = ops - sampler.samples[0][1], ended - sampler.samples[0][0]
    seconds = max(seconds, 1e-9)
    bandwidth = measured_ops * config.size / seconds
    peak = 0.0 if config.no_peak else max(sampler.peak(), bandwidth)
    latencies = sorted(x for f in flows for x in f.latencies)
    iterations = measured_ops // max(len(flows), 1)  # perftest's #iterations: per QP (and direction), measured
    result = {
        "verified": mismatch is None, "test": config.test, "qps": config.qps, "size": config.size,
        "iterations": iterations, "iters": config.iters if not config.duration else iterations,
        "duration": config.duration, "warmup_seconds": warmup, "depth": config.depth, "post_list": config.post_list,
        "cq_mod": config.cq_mod or (config.post_list if config.post_list > 1 else max(1, config.depth // 2)),
        "inline_size": config.inline_size, "events": config.events, "mtu": config.mtu, "nics": config.nics,
        "emulator_processes": processes, "ops": ops, "measured_ops": measured_ops, "bytes": ops * config.size,
        "seconds": seconds,
        "msg_rate": measured_ops / seconds, "bw_MiBps": bandwidth / 2**20, "bw_peak_MiBps": peak / 2**20,
        "bw_Gbps": bandwidth * 8 / 1e9,
        "lat_us": {"p50": percentile(latencies, 50) * 1e6, "p99": percentile(latencies, 99) * 1e6},
        "driver_cpu_us_per_op": cpu / max(ops, 1) * 1e6, **wire, "fw_version": fw_version,
        "verification": _verification(config, None not in placed.values()),
        **({"remote_host": config.remote.host} if config.remote is not None else {}),
        **({"error": f"verification failed: {mismatch}"} if mismatch else {}),
    }
    if config.bidirectional:  # each direction's share of the same wall time
        result["directions"] = [
            {"from_nic": direction, "ops": sum(f.done for f in flows if f.direction == direction),
             "bw_MiBps": sum(f.done for f in flows if f.direction == direction) * config.size / seconds / 2**20}
            for direction in (0, 1)]
    return result


def _verification(config: BenchConfig, emulated: bool) -> str:
    """How `verified` was decided (README: bench verification); `emulated`: every local NIC has a debug channel."""
    every = "every operation's bytes" if config.slots == config.iters else "the last pass's bytes"
    if config.test == "atomic":
        every = "the counter and every atomic's original value" if config.slots == config.iters else \
            "the counter and the last pass's original values"
    counted = config.remote is None or config.test == "read"  # a local NIC places the data
    if counted and not emulated:
        return f"{every} ({NOT_COUNTED})"
    counts_add = config.slots != config.iters or config.test == "atomic"  # what the bytes alone do not show
    return every + (" and the NIC's placement counts" if counted and counts_add else "")


def bandwidth_unit(report_gbits: bool) -> tuple[str, float]:
    """The BW unit perftest labels its table with, and the factor from MiB/s to it."""
    return ("Gb/sec", 2**20 * 8 / 1e9) if report_gbits else ("MiB/sec", 1.0)


def perftest_report(result: dict[str, Any], config: BenchConfig) -> dict[str, Any]:
    """perftest's --out_json keys: "test_info" and "results" (one per size, a list for a sweep), BW in the table's
    unit."""
    unit, scale = bandwidth_unit(config.report_gbits)
    rows = result.get("rows", [result])
    results = [{"MsgSize": row["size"], "n_iterations": row["iterations"], "BW_peak": round(row["bw_peak_MiBps"] *
                scale, 2), "BW_average": round(row["bw_MiBps"] * scale, 2), "MsgRate": round(row["msg_rate"] / 1e6, 6)}
               for row in rows]
    name = f"{TEST_TITLES[config.test]}_{config.atomic_type + '_' if config.test == 'atomic' else ''}" \
           f"{'Bidirectional_' if config.bidirectional else ''}" \
           f"{'Post_List_' if config.post_list > 1 else ''}BW_Test"
    info = {"test": name, "Number of qps": config.qps, "Connection type": "RC", "TX depth": config.depth,
            "CQ Moderation": rows[0].get("cq_mod"), "Mtu": rows[0].get("mtu", config.mtu), "Link type": "Ethernet",
            "Max inline data": config.inline_size, "BW unit": unit}
    return {"test_info": info, "results": results if "rows" in result else results[0]}


def format_table(result: dict[str, Any], config: BenchConfig) -> str:
    """perftest's banner and BW table (MiB/sec, or Gb/sec), one row per size, then the loaded latency and the wire
    counters of each row. #iterations is per QP (and direction), warm-up excluded, as perftest counts them."""
    verb = TEST_TITLES[config.test]
    rows = result.get("rows", [result])
    rule = "-" * 103
    unit, scale = bandwidth_unit(config.report_gbits)
    first = rows[0]
    iterations = f"about {config.sweep_seconds:g} s per size (-n fixes them)" if config.sweep_seconds and not \
        config.duration else f"{config.iters}" if not config.duration else "as many as -D allows"
    lines = [rule, f"                    {verb} {'Bidirectional ' if config.bidirectional else ''}BW Test "
                   f"(aiofabric{', peer ' + result['remote_host'] if 'remote_host' in result else ''})",
             f" Number of qps   : {config.qps}\t\tTransport type : IB",
             " Connection type : RC\t\tUsing SRQ      : OFF",
             f" TX depth        : {config.depth}\t\tNICs           : {config.nics}",
             f" CQ Moderation   : {first.get('cq_mod', config.cq_mod)}\t\tPost List      : {config.post_list}",
             *([f" Atomic type     : {config.atomic_type}"] if config.test == "atomic" else []),
             f" Max inline data : {config.inline_size}[B]\t\tEvents         : {'ON' if config.events else 'OFF'}",
             f" Iterations      : {iterations}",
             f" Mtu             : {rows[0].get('mtu', config.mtu)}[B]\t\tLink type      : Ethernet (RoCEv2 over UDP)",
             f" Firmware        : {result['fw_version']}" + (f"\t\tDuration       : {config.duration:g} s"
                                                         if config.duration else ""), rule,
             f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]   "
             f"loaded lat p50/p99[usec]"]
    for row in rows:
        lines.append(f" {row['size']:<10} {row['iterations']:<14} {row['bw_peak_MiBps'] * scale:<18.2f} "
                     f"{row['bw_MiBps'] * scale:<21.2f} {row['msg_rate'] / 1e6:<15.6f} "
                     f"{row['lat_us']['p50']:.1f} / {row['lat_us']['p99']:.1f}")
        for direction in row.get("directions", []):
            lines.append(f"   NIC {direction['from_nic']} sending: {direction['bw_MiBps'] * scale:.2f} {unit}")
    lines.append(rule)
    for row in rows:
        lines.append(f" {row['size']:<10} verified: {'yes' if row['verified'] else 'NO'}   packets: "
                     f"{count_text(row['packets'])}   retransmits: {count_text(row['retransmits'])}   dropped: "
                     f"{count_text(row['dropped'])}   rx overflow: {count_text(row['rx_overflow'])}   driver CPU: "
                     f"{row['driver_cpu_us_per_op']:.2f} us/op")
        if "error" in row:
            lines.append(f"   {row['error']}")
    lines.append(rule)
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def phy_loopback(nic: NIC) -> AsyncIterator[None]:
    """`nic`'s port turned back on itself (port_phy_cfg LPBK_LOCAL) for the block: what it sends, it receives."""
    await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_LOCAL)
    try:
        yield
    finally:
        await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_NONE)


async def run_loopback(spec: str, size: int, ip: str | None = None) -> dict[str, Any]:
    """The seed's PHY-loopback test: two QPs on one NIC, port in LPBK_LOCAL, one RDMA WRITE, verified."""
    if not 1 <= size <= MAX_SIZE:
        raise ValueError(f"--size must be in [1, {MAX_SIZE}] bytes, not {size}")
    async with open_nic(spec, ip=ip) as nic:
        cq = await nic.create_cq(depth=64)
        sender, receiver = await nic.create_qp(cq), await nic.create_qp(cq)
        qpns = [sender.qpn, receiver.qpn]  # a destroyed QP's qpn is -1: keep them for the report
        await sender.connect(receiver.info(), mtu=4096)  # as bench: the loopback and the wire compare like for like
        await receiver.connect(sender.info(), mtu=4096)
        source, target = await nic.register_mr(size), await nic.register_mr(size)
        message = (b"Hello from BNXT RoCE PHY loopback! " * (size // 35 + 1))[:size]
        source.view[:size] = message
        async with phy_loopback(nic):
            started = time.perf_counter()
            limit = LOOPBACK_BASE_SECONDS + size / LOOPBACK_SLOWEST_BPS
            with anyio.move_on_after(limit) as waited:
                await sender.write(source, target, size)
            if waited.cancelled_caught:
                raise TimeoutError(f"PHY loopback: the {size}-byte RDMA WRITE did not complete within {limit:.0f} s "
                                   f"(allowed: {LOOPBACK_BASE_SECONDS:g} s + 1 s per "
                                   f"{LOOPBACK_SLOWEST_BPS // 2**20} MiB)")
        seconds = time.perf_counter() - started
        verified = bytes(target.view[:size]) == message
        counters = await wire_counters([nic])  # None on a PCI NIC: nothing counts its packets for us
    return {"verified": verified, "bytes": size, "seconds": seconds, "qpn": qpns,
            "packets": None if counters is None else counters[0]["packets_sent"],
            **({"error": "loopback data differs from what was written"} if not verified else {})}

"""perftest-style latency tests: the engine behind `aiofabric lat {write,read,send,atomic}`.

Two emulated NICs (RoCEv2 over UDP on 127.0.0.x; in one emulator process unless `shared_emulator` is off) and one RC
QP pair, driven as ib_*_lat drive theirs: one message at a time, `warmup` iterations first (excluded from the
numbers), then `iters` measured ones.
On a PCI NIC both ends run on that NIC with its port in PHY loopback (as `aiofabric loopback`): the NIC's own
latency, with no wire and no partner host.

- WRITE (ib_write_lat) and SEND (ib_send_lat): a ping-pong, its two halves in aiofabric/peer/pingpong.py.
- READ (ib_read_lat) and ATOMIC (ib_atomic_lat): one-sided; the client times each READ or atomic from post to
  completion.

With a peer (`config.remote`: `lat --peer HOST` over SSH, or `lat SERVER_HOST` against `lat --server` over TCP), the
client's NIC is here and the server's there: the server half of a ping-pong runs in the peer's endpoint (ops pong /
pong_wait), so a round trip never crosses the control connection, and the bytes there are checked by sha256.

Reported latency is ONE-WAY for WRITE and SEND: half the round trip the client measures (perftest reports RTT/2),
and the whole post-to-completion time for READ (perftest's rtt_factor 1). Fields, all in microseconds: t_min, t_max,
t_typical (the median), t_avg, t_stdev (population), p99 and p99.9, summarised by perftest's rules
(aiofabric/tools/samples.py: the two largest samples left out, its percentile index), so
t_min <= t_typical <= p99 <= p99.9 <= t_max always holds.

Every wait is bounded by `LatConfig.wait_seconds` (long enough for the QP's retransmissions to recover a lost
packet): a message that never arrives ends in a TimeoutError naming the side and the iteration, never a hang.
`verified` checks the last ping's bytes on both sides (and, for READ, that the server's bytes are unchanged), and
the emulator's count of messages each responder placed where the NICs are emulated (`verification` says which).

The run's options are lat_config.py's, its table lat_report.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import anyio.lowlevel
import numpy as np

from .introspect import (NOT_COUNTED, WIRE_COUNTERS, emulator, emulator_processes, placement_counts, wire_counters,
                         wire_delta)
from .lat_config import CQ_DEPTH, SQ_DEPTH, LatConfig
from .options import NO_ORIGINAL, RETRY_CNT
from .runs import (RELEASE_SECONDS, REMOTE_CLOSE_AFTER_FAILURE, after_failure, close_remote_after_failure, fit_mtu,
                   open_nics, phy_loopback, release_after_failure, release_steps)
from .samples import histogram, summarize
from .sweeps import run_sizes, sweep_result
from ..peer import pingpong
from ..peer.protocol import fill_pattern
from ..verbs import ALL_ACCESS, ATOMIC_ACCESS, NIC, PCI_ADDRESS, MemoryRegion, QueuePair, open_nic

log = logging.getLogger("aiofabric.tools.latency")
RX_SLOTS, RX_BYTES = 16, 64 << 20  # SEND: receives posted ahead, at most RX_BYTES of them (at least 2)
LAT_WIRE_COUNTERS = WIRE_COUNTERS[:3]  # packets, retransmits, dropped: lat reports no rx_overflow


@dataclasses.dataclass
class _Pair:
    """One QP pair and one MR per side. WRITE: [0, size) source, [size, 2*size) target. SEND: [0, size) source,
    then `rx_slots` receive slots. READ: the client's [0, size) receives the server's [0, size). With `remote` (a
    Peer), the server side lives in its endpoint: `server` is a RemoteQP, `server_mr` a RemoteMR."""
    client: QueuePair
    server: Any
    client_mr: MemoryRegion
    server_mr: Any
    rx_slots: int = 0
    remote: Any = None
    server_cq: Any = None

    @property
    def server_region(self) -> Any:
        """What the client names as the server's memory."""
        return self.server_mr.region if self.remote is not None else self.server_mr

    async def server_digest(self, offset: int, length: int) -> str:
        """sha256 of the server's bytes [offset, offset + length)."""
        if self.remote is not None:
            return str(await self.remote.sha256(self.server_mr, offset, length))
        return hashlib.sha256(self.server_mr.view[offset:offset + length]).hexdigest()


def _shape(config: LatConfig) -> tuple[int, int]:
    """(receive slots, bytes per side's region) of the test."""
    size = config.size
    rx_slots = max(2, min(RX_SLOTS, RX_BYTES // size)) if config.test == "send" else 0
    return rx_slots, {"write": 2 * size, "send": size * (1 + rx_slots), "read": size, "atomic": size}[config.test]


async def _connect(config: LatConfig, client_nic: NIC, server_nic: Any, peer: Any = None) -> _Pair:
    """The QP pair and regions of one size; with `peer`, the server's on `server_nic` there (a RemoteNIC).
    Distinct seeded payloads on the two sides, so a pong that carried the ping's bytes would not verify."""
    size, (rx_slots, span) = config.size, _shape(config)
    client_cq = await client_nic.create_cq(depth=CQ_DEPTH)
    client = await client_nic.create_qp(client_cq, sq_depth=SQ_DEPTH, rq_depth=max(rx_slots, 1),
                                        max_inline_data=config.inline_size)
    client_mr = await client_nic.register_mr(span)
    if config.test == "atomic":  # what no atomic returns, so an original never written back shows
        client_mr.view[:size] = NO_ORIGINAL
    elif config.test != "read":
        fill_pattern(client_mr.view[:size], config.pattern_seed(0))
    atomic = config.test == "atomic"  # the server's counter starts at 0; its QP and region allow atomics
    if peer is None:
        server_cq = await server_nic.create_cq(depth=CQ_DEPTH)
        server = await server_nic.create_qp(server_cq, sq_depth=SQ_DEPTH, rq_depth=max(rx_slots, 1),
                                            max_inline_data=config.inline_size)
        if atomic:
            await server.to_init(ATOMIC_ACCESS)
        await server.connect(client.info(), mtu=config.mtu, timeout=config.timeout, retry_cnt=RETRY_CNT,
                             **config.rd_atomic())
        server_mr = await server_nic.register_mr(span, ATOMIC_ACCESS if atomic else ALL_ACCESS)
        if atomic:
            server_mr.view[:size] = bytes(size)
        else:
            fill_pattern(server_mr.view[:size], config.pattern_seed(1))
        info = server.info()
    else:
        server_cq = await peer.create_cq(server_nic, CQ_DEPTH)
        server = await peer.create_qp(server_nic, server_cq, sq_depth=SQ_DEPTH, rq_depth=max(rx_slots, 1),
                                      max_inline_data=config.inline_size)
        await peer.connect_qp(server, client.info(), mtu=config.mtu, timeout=config.timeout, retry_cnt=RETRY_CNT,
                              atomic=atomic)
        server_mr = await peer.register_mr(server_nic, span, atomic=atomic)
        await peer.fill(server_mr, **({"byte": 0} if atomic else {"seed": config.pattern_seed(1)}), length=size)
        info = server.info
    await client.connect(info, mtu=config.mtu, timeout=config.timeout, retry_cnt=RETRY_CNT, **config.rd_atomic())
    return _Pair(client, server, client_mr, server_mr, rx_slots, peer, server_cq)


async def _run_pair(client: Callable[[], Awaitable[None]], server: Callable[[], Awaitable[None]]) -> None:
    """Run the two sides at once; the first failure cancels the other and is raised as itself (no ExceptionGroup)."""
    errors: list[BaseException] = []

    async def guarded(side: Callable[[], Awaitable[None]], scope: anyio.CancelScope) -> None:
        try:
            await side()
        except Exception as error:
            errors.append(error)
            scope.cancel()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(guarded, client, tasks.cancel_scope)
        tasks.start_soon(guarded, server, tasks.cancel_scope)
    if errors:
        raise errors[0]


def _side(config: LatConfig, pair: _Pair, name: str) -> pingpong.Side:
    """The client's or (local) server's half of the ping-pong, aiofabric/peer/pingpong.py."""
    qp, mr, other = (pair.client, pair.client_mr, pair.server_region) if name == "client" else \
        (pair.server, pair.server_mr, pair.client_mr)
    theirs = other if config.test == "write" else None
    return pingpong.Side(name, config.test, qp, mr, config.size, config.warmup, config.iters, config.wait_seconds,
                         theirs, pair.rx_slots, config.size <= config.inline_size)


async def _pingpong(config: LatConfig, pair: _Pair) -> list[float]:
    """ib_write_lat / ib_send_lat: the client's half here, the server's here too or in the peer's endpoint."""
    client = _side(config, pair, "client")
    await client.prepare()
    samples: list[float] = []

    async def run_client() -> None:
        samples.extend(await pingpong.client(client))

    if pair.remote is None:
        server = _side(config, pair, "server")
        await server.prepare()
        await _run_pair(run_client, lambda: pingpong.server(server))
        return samples
    peer = pair.remote
    region = pair.client_mr.remote().to_dict() if config.test == "write" else None
    started = await peer.request("pong", qp=pair.server.handle, mr=pair.server_mr.handle, test=config.test,
                                 size=config.size, iters=config.iters, warmup=config.warmup, wait=config.wait_seconds,
                                 remote=region, rx_slots=pair.rx_slots, inline=config.size <= config.inline_size)

    async def server_half() -> None:  # its failure (a ping it never got) surfaces now, not as the client's timeout
        await peer.request("pong_wait", pong=started["pong"],
                           timeout=config.wait_seconds * (config.warmup + config.iters + 1))

    await _run_pair(run_client, server_half)
    return samples


async def _one_sided_loop(config: LatConfig, pair: _Pair) -> list[float]:
    """ib_read_lat / ib_atomic_lat: each READ or atomic timed from post to completion. Atomic i finds the counter
    at i: FETCH_AND_ADD adds 1, CMP_AND_SWAP swaps i for i + 1."""
    size, total, seconds = config.size, config.warmup + config.iters, config.wait_seconds
    samples: list[float] = []
    clock, remote, client, local = time.perf_counter, pair.server_region, pair.client, pair.client_mr
    verb = "the RDMA READ" if config.test == "read" else f"the atomic {config.atomic_type}"
    name = functools.partial(pingpong.iteration, warmup=config.warmup, iters=config.iters)

    def post(i: int) -> Awaitable[Any]:
        if config.test == "read":
            return client.post_read(local, remote, size)
        if config.atomic_type == "CMP_AND_SWAP":
            return client.post_compare_swap(local, remote, i, i + 1)
        return client.post_fetch_add(local, remote, 1)

    for i in range(total):
        if i == total - 1 and config.test == "read":  # the last READ must bring every byte again: invert what the
            view = np.frombuffer(local.view, dtype=np.uint8, count=size)  # earlier ones brought
            np.bitwise_not(view, out=view)
        started = clock()
        completion = await pingpong.bounded(post(i), seconds, lambda: f"client: {name(i)}: no room to post {verb}")
        await pingpong.bounded(completion, seconds, lambda: f"client: {name(i)}: {verb} did not complete")
        if i >= config.warmup:
            samples.append((clock() - started) * 1e6)
    return samples


ENGINES = {"write": _pingpong, "send": _pingpong, "read": _one_sided_loop, "atomic": _one_sided_loop}


async def _verify(config: LatConfig, pair: _Pair, server_digest: str, placed: list[Any]) -> str | None:
    """Why the run's bytes are wrong, or None: the last ping's and pong's bytes (both sides; by sha256 where the
    server is a peer's), the server's untouched bytes for READ, and the emulator's count of messages each
    responder placed (each counted once), where `placed` has it (the client's NIC's, the server's:
    DebugClient.placed, None for a NIC that is not emulated or not here)."""
    size, total = config.size, config.warmup + config.iters
    client = pair.client_mr.view
    if config.test == "atomic":
        if await pair.server_digest(0, size) != hashlib.sha256(total.to_bytes(size, "little")).hexdigest():
            return f"the server's counter is not {total} after {total} atomics"
        if int.from_bytes(client[:size], "little") != total - 1:
            return f"the last atomic found the counter at {int.from_bytes(client[:size], 'little')}, not {total - 1}"
        checks = [("server", pair.server, 1)]
    elif config.test == "read":
        if await pair.server_digest(0, size) != server_digest:
            return "the server's buffer changed during the RDMA READs"
        if hashlib.sha256(client[:size]).hexdigest() != server_digest:
            return "the last RDMA READ's bytes at the client differ from the server's buffer"
        checks = [("client", pair.client, 0)]
    else:
        landed = pingpong.landed(config.test, size, total, pair.rx_slots)
        if await pair.server_digest(landed, size) != hashlib.sha256(client[:size]).hexdigest():
            return "the last ping's bytes at the server differ from what the client sent"
        if hashlib.sha256(client[landed:landed + size]).hexdigest() != await pair.server_digest(0, size):
            return "the last pong's bytes at the client differ from what the server sent"
        checks = [("server", pair.server, 1), ("client", pair.client, 0)]
    for side, qp, nic in checks:
        if placed[nic] is None:
            continue
        got = placed[nic][qp.qpn].of(config.test)
        if got != (total, total * size):
            return (f"the {side}'s NIC placed {got[0]} messages / {got[1]} bytes on QP {qp.qpn:#x}, "
                    f"{total} / {total * size} were sent")
    return None


def _verification(config: LatConfig, placed: list[Any]) -> str:
    """How `verified` was decided; `placed`: the client's and the server's placement counts (None where the NIC is
    not emulated, or is the peer's: its bytes are compared by sha256 there)."""
    checked = {"read": "the last RDMA READ's bytes and the server's unchanged buffer",
               "atomic": "the server's counter and the last atomic's original value"}.get(
        config.test, "the last ping's and pong's bytes")
    if config.remote is not None:
        counted = " and the client NIC's placement counts" if placed[0] is not None else ""
        return f"{checked} (the server's by sha256 there){counted}"
    return f"{checked} and the NICs' placement counts" if None not in placed else f"{checked} ({NOT_COUNTED})"


@contextlib.asynccontextmanager
async def _open_nics(config: LatConfig, client_nic: NIC | None = None) -> AsyncIterator[tuple[NIC, Any]]:
    """The client's NIC and the server's: two emulated NICs, or one PCI NIC for both with its port in PHY loopback
    (no partner host needed, as `aiofabric loopback`); with a peer, the client's here (`client_nic`, or one opened
    here) and the server's there (a RemoteNIC, closed there afterwards)."""
    if config.remote is not None:
        async with contextlib.AsyncExitStack() as stack:
            if client_nic is None:
                client_nic = (await stack.enter_async_context(open_nics(config, 1)))[0]
            remote = await config.remote.open_nic(config.remote_nic, ip=config.remote_ip, **config.faults(seed=1))
            try:
                yield client_nic, remote
            except BaseException:  # the end of the connection frees it: a stalled NIC there costs no more
                await close_remote_after_failure(config.remote, remote)
                raise
            else:
                with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_SECONDS):
                    await config.remote.close(remote)
    elif PCI_ADDRESS.fullmatch(config.nic):
        async with open_nic(config.nic, ip=config.ip) as nic, phy_loopback(nic):
            yield nic, nic
    else:
        async with open_nics(config, 2) as (client, server):
            yield client, server


async def run_latency(config: LatConfig, client_nic: NIC | None = None) -> dict[str, Any]:
    """Boot the NICs (`LatConfig.nic`; with `config.remote`, the server's in the peer's endpoint and the client's
    here, or `client_nic`), run `config.test`'s latency loop and report perftest's latency fields in us.

    WRITE and SEND report one-way latency, half the client's round trip (as perftest: RTT/2); READ reports each
    READ's post-to-completion time. Keys: samples.FIELDS, iters, size, test, mtu (the path MTU used: the
    requested one unless a port is too small for it, see runs.fit_mtu), mtu_requested, warmup, verified,
    verification (what `verified` checked), latency (what was measured), seconds, packets, retransmits, dropped
    (None on a PCI NIC: only an emulator counts them), fw_version; "histogram" with config.histogram, "samples"
    (in the order measured) with config.unsorted or config.sorted_samples; "remote_host" with a peer; "error" when
    verification failed. A
    sweep (config.sizes) has these per size in "rows". A lost message raises TimeoutError naming the side and the
    iteration."""
    config.check()
    requested = config.mtu
    async with _open_nics(config, client_nic) as (client_nic, server_nic):
        nics = [nic for nic in dict.fromkeys((client_nic, server_nic)) if isinstance(nic, NIC)]  # the ones here
        for nic in nics:
            config.check_caps(nic)
        config = dataclasses.replace(config, mtu=fit_mtu(requested, nics, "lat"))
        rows = await run_sizes(config, config.sizes or [config.size],
                               lambda sized: _run_size(sized, client_nic, server_nic))
    return sweep_result(config, rows, config.mtu, requested, warmup=config.warmup, latency=rows[0]["latency"],
                        **({"remote_host": config.remote.host} if config.remote is not None else {}))


async def _run_size(config: LatConfig, client_nic: NIC, server_nic: Any) -> dict[str, Any]:
    """One size's latency loop on a QP pair of its own, destroyed afterwards (a sweep keeps its NICs). After a
    failure, what stopped is found first (`runs.after_failure`: it heads the error) and the clean-up is bounded
    and quiet: its own errors are logged, the run's first error is raised."""
    here = [nic for nic in dict.fromkeys((client_nic, server_nic)) if isinstance(nic, NIC)]
    pair: _Pair | None = None
    try:
        pair = await _connect(config, client_nic, server_nic, config.remote)
        fault = config.fault()
        if fault is not None:
            await emulator(server_nic, "--inject-fault").fault(*fault)
        server_digest = await pair.server_digest(0, config.size)
        before = await wire_counters(here)
        started = time.perf_counter()
        samples = await ENGINES[config.test](config, pair)
        seconds = time.perf_counter() - started
        if config.sampled is not None:  # --plot's
            config.sampled(config.size, samples)
        placed = [await placement_counts(nic) if isinstance(nic, NIC) else None
                  for nic in (client_nic, server_nic)]
        mismatch = await _verify(config, pair, server_digest, placed)
        wire = wire_delta(before, await wire_counters(here), LAT_WIRE_COUNTERS)
        processes = await emulator_processes(here)
    except BaseException as exc:
        headline = await after_failure(exc, here, config.remote, server_nic if config.remote is not None else None)
        if pair is not None:
            await release_after_failure(functools.partial(_release, pair, quiet=True), "releasing the QP pair")
        if headline is not None:
            raise headline from exc
        raise
    else:
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_SECONDS):
            await _release(pair)
    return {
        **summarize(samples), "iterations": len(samples), "size": config.size,
        "test": config.test, "mtu": config.mtu, "warmup": config.warmup, "verified": mismatch is None,
        "verification": _verification(config, placed), "emulator_processes": processes,
        "latency": "one-way (RTT/2)" if config.test in pingpong.TESTS else f"{config.test.upper()} completion",
        "seconds": seconds, **wire, "fw_version": client_nic.info()["fw_version"],
        **({"remote_host": config.remote.host} if config.remote is not None else {}),
        **({"histogram": histogram(samples)} if config.histogram else {}),
        **({"samples": samples} if config.unsorted or config.sorted_samples else {}),
        **({"cycles": {key.replace("_us", ""): value * config.cpu_mhz for key, value in summarize(samples).items()},
            "cpu_mhz": config.cpu_mhz} if config.cpu_mhz else {}),
        **({"error": f"verification failed: {mismatch}"} if mismatch else {}),
    }


async def _release(pair: _Pair, quiet: bool = False) -> None:
    """Destroy the pair's QPs, then their CQs and memory (the server's in its endpoint, with a peer). `quiet` (after
    a failure): an object that cannot be released is logged and the rest still are; the peer's get
    REMOTE_CLOSE_AFTER_FAILURE s (the end of its connection frees them anyway)."""
    steps: list[Callable[[], Awaitable[Any]]] = [pair.client.destroy, pair.client_mr.deregister,
                                                 pair.client.send_cq.destroy]
    if pair.remote is None:
        steps += [pair.server.destroy, pair.server_mr.deregister]
        if pair.server.send_cq is not pair.client.send_cq:
            steps.append(pair.server.send_cq.destroy)
    await release_steps(steps, quiet)
    if pair.remote is None or quiet and getattr(pair.remote, "failure", None) is not None:
        return
    with anyio.move_on_after(REMOTE_CLOSE_AFTER_FAILURE if quiet else math.inf):
        for handle in (pair.server, pair.server_mr, pair.server_cq):
            try:
                await pair.remote.close(handle)
            except Exception as exc:
                if not quiet:
                    raise
                log.info("after the failure: %s: %s", type(exc).__name__, exc)



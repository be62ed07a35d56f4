"""The QP pairs of a bench run (`Flow`s) and their buffers: made for one size, released after it (a sweep keeps its
NICs). NIC 2k's clients talk to NIC 2k+1's servers (and back, with -b); with a peer, every server lives there."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio

from .bench_config import BenchConfig
from .introspect import emulator
from .options import ATOMIC_SIZE, NO_ORIGINAL
from .runs import RELEASE_SECONDS, after_failure, close_remote_after_failure, release_after_failure, release_steps
from ..peer.protocol import fill_pattern
from ..verbs import ALL_ACCESS, ATOMIC_ACCESS, NIC, QueuePair


@dataclasses.dataclass
class Flow:
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


@contextlib.asynccontextmanager
async def open_flows(config: BenchConfig, nics: list[NIC]) -> AsyncIterator[list[Flow]]:
    """The run's QP pairs; with a peer, the server side is opened on its host and closed there afterwards. After a
    failure, what stopped is found first (`after_failure`: it heads the error) and the clean-up is bounded and
    quiet: its own errors are logged, the run's first error is raised."""
    flows: list[Flow] = []
    remote = None
    try:
        if config.remote is None:
            yield await _connect(config, nics, flows)
        else:
            remote = await config.remote.open_nic(config.remote_nic, ip=config.remote_ip, **config.faults(seed=1))
            yield await _connect_remote(config, nics[0], remote)
    except BaseException as exc:
        headline = await after_failure(exc, nics, config.remote, remote)
        if config.remote is None:
            await release_after_failure(functools.partial(_release, flows, quiet=True), "releasing the QPs")
        elif remote is not None and getattr(config.remote, "failure", None) is None:
            await close_remote_after_failure(config.remote, remote)
        if headline is not None:
            raise headline from exc
        raise
    else:  # a sweep runs every size on the same NICs: give each size's QPs, CQs and memory back
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_SECONDS):
            if config.remote is None:
                await _release(flows)
            else:
                await config.remote.close(remote)


async def _connect(config: BenchConfig, nics: list[NIC], flows: list[Flow]) -> list[Flow]:
    """The QP pairs and buffers of one size, appended to `flows` as they are made (so a failure frees them too)."""
    span = config.used_bytes
    directions = 2 if config.bidirectional else 1
    cqs = {nic: await nic.create_cq(depth=config.cq_depth) for nic in nics}
    for i in range(config.qps * directions):
        pair, direction = divmod(i, directions)
        a, b = nics[2 * (pair % (config.nics // 2))], nics[2 * (pair % (config.nics // 2)) + 1]
        if direction:
            a, b = b, a
        client = await a.create_qp(cqs[a], sq_depth=config.tx_depth, rq_depth=config.tx_depth,
                                   max_inline_data=config.inline_size)
        server = await b.create_qp(cqs[b], sq_depth=config.tx_depth, rq_depth=config.rx_depth or config.tx_depth)
        flow = Flow(client, server, None, None, i, direction)
        flows.append(flow)
        atomic = config.test == "atomic"
        if atomic:  # the responder's QP must allow remote atomics (INIT's access bits)
            await server.to_init(ATOMIC_ACCESS)
        await client.connect(server.info(), mtu=config.mtu, timeout=config.timeout, **config.rd_atomic())
        await server.connect(client.info(), mtu=config.mtu, timeout=config.timeout, **config.rd_atomic())
        flow.source = await a.register_mr(span)
        flow.target = await b.register_mr(span, ATOMIC_ACCESS if atomic else ALL_ACCESS)
        if atomic:
            flow.target.view[:ATOMIC_SIZE] = bytes(ATOMIC_SIZE)  # the counter starts at 0
            flow.source.view[:span] = NO_ORIGINAL * (span // ATOMIC_SIZE)  # what no atomic returns: unwritten shows
        else:
            fill_pattern((flow.target if config.test == "read" else flow.source).view[:span], config.pattern_seed(i))
    fault = config.fault()
    if fault is not None:
        for server_nic in nics[1::2]:
            await emulator(server_nic, "--inject-fault").fault(*fault)
    return flows


async def _connect_remote(config: BenchConfig, local: NIC, remote: Any) -> list[Flow]:
    """The server side on the peer's host: one QP and one MR per flow on its NIC, connected both ways."""
    peer = config.remote
    cq, remote_cq = await local.create_cq(depth=config.cq_depth), await peer.create_cq(remote, config.cq_depth)
    flows = []
    for i in range(config.qps):
        client = await local.create_qp(cq, sq_depth=config.tx_depth, rq_depth=config.tx_depth,
                                       max_inline_data=config.inline_size)
        server = await peer.create_qp(remote, remote_cq, sq_depth=config.tx_depth,
                                      rq_depth=config.rx_depth or config.tx_depth)
        atomic = config.test == "atomic"
        await client.connect(server.info, mtu=config.mtu, timeout=config.timeout, **config.rd_atomic())
        await peer.connect_qp(server, client.info(), mtu=config.mtu, timeout=config.timeout, atomic=atomic)
        source = await local.register_mr(config.used_bytes)
        target = await peer.register_mr(remote, config.used_bytes, atomic=atomic)
        flow = Flow(client, server, source, target, i, remote=peer)
        if atomic:
            await peer.fill(target, byte=0, length=ATOMIC_SIZE)  # the counter starts at 0
            source.view[:config.used_bytes] = NO_ORIGINAL * (config.used_bytes // ATOMIC_SIZE)
        elif config.test == "read":
            flow.digest = await peer.fill(target, seed=config.pattern_seed(i), length=config.used_bytes)
        else:
            fill_pattern(source.view[:config.used_bytes], config.pattern_seed(i))
        flows.append(flow)
    return flows


async def _release(flows: list[Flow], quiet: bool = False) -> None:
    """Destroy the flows' QPs, then their CQs and memory (a NIC close would, but a sweep keeps its NICs). `quiet`
    (after a failure): an object that cannot be released is logged and the rest still are."""
    cqs = {id(qp.send_cq): qp.send_cq for flow in flows for qp in (flow.client, flow.server)}
    steps: list[Callable[[], Awaitable[None]]] = []
    for flow in flows:
        steps += [flow.client.destroy, flow.server.destroy]
        steps += [mr.deregister for mr in (flow.source, flow.target) if mr is not None]
    steps += [cq.destroy for cq in cqs.values()]
    await release_steps(steps, quiet)

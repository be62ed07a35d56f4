"""The flows behind `aiofabric connect`: a verified two-host RDMA WRITE + READ, and a verified write around a ring.

Built on `Peer` (any carrier) and the local public API, so the collectives can reuse the per-host endpoint: a host
here is a `Peer` plus a `RemoteNIC`, and nothing is SSH-specific.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, AsyncIterator, Callable, Sequence

import anyio

from . import protocol
from .client import Peer, RemoteMR, RemoteQP
from ..verbs import open_nic

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

SEED = 0x5EED
TRANSFER_TIMEOUT = 120.0


async def two_hosts(peer: Peer, *, nic: str = "sim", remote_nic: str = "sim", local_ip: str | None = None,
                    remote_ip: str | None = None, size: int = 1 << 20, local_options: dict[str, Any] | None = None,
                    remote_options: dict[str, Any] | None = None, started: float | None = None) -> dict[str, Any]:
    """A NIC on each side, QPs connected both ways, RDMA WRITE local -> remote (the remote checks the bytes by
    sha256) and READ back (checked here). `started`: when the handshake began (default: now), for handshake_ms."""
    started = time.perf_counter() if started is None else started
    async with open_nic(nic, ip=local_ip, **(local_options or {})) as local:
        remote = await peer.open_nic(remote_nic, ip=remote_ip, **(remote_options or {}))
        cq = await local.create_cq(64)
        qp = await local.create_qp(cq)
        remote_cq = await peer.create_cq(remote, 64)
        remote_qp = await peer.create_qp(remote, remote_cq)
        await qp.connect(remote_qp.info, mtu=4096)
        await peer.connect_qp(remote_qp, qp.info(), mtu=4096)
        handshake = time.perf_counter() - started
        source, back = await local.register_mr(size), await local.register_mr(size)
        target = await peer.register_mr(remote, size)
        protocol.fill_pattern(source.view[:size], SEED)
        expected = protocol.sha256_hex(source.view[:size])
        with anyio.fail_after(TRANSFER_TIMEOUT):
            begin = time.perf_counter()
            await qp.write(source, target.remote(), size)
            written = time.perf_counter() - begin
            remote_hash = await peer.sha256(target, 0, size)
            begin = time.perf_counter()
            await qp.read(back, target.remote(), size)
            read = time.perf_counter() - begin
        verified = remote_hash == expected and protocol.sha256_hex(back.view[:size]) == expected
        result = {"verified": verified, "bytes": size, "handshake_ms": round(handshake * 1e3, 3),
                  "transfer_ms": round((written + read) * 1e3, 3), "write_ms": round(written * 1e3, 3),
                  "read_ms": round(read * 1e3, 3), "write_MiBps": round(size / written / 2**20, 1),
                  "local_ip": local.ip, "remote_ip": remote.ip}
        if not verified:
            result["error"] = (f"data mismatch: remote sha256 {remote_hash[:16]}.., read back "
                               f"{protocol.sha256_hex(back.view[:size])[:16]}.., expected {expected[:16]}..")
        return result


@contextlib.asynccontextmanager
async def open_all(openers: Sequence[Callable[[], contextlib.AbstractAsyncContextManager[Peer]]]
                   ) -> AsyncIterator[list[Peer]]:
    """Enter several peers' blocks concurrently (each in its own task, which also leaves it); the peers in order.
    The first failure cancels the others and leaves as itself (its message names its host)."""
    peers: list[Peer | None] = [None] * len(openers)
    ready, done = anyio.Event(), anyio.Event()
    remaining = [len(openers)]

    async def hold(index: int) -> None:
        async with openers[index]() as peer:
            peers[index] = peer
            remaining[0] -= 1
            if not remaining[0]:
                ready.set()
            await done.wait()

    try:
        async with anyio.create_task_group() as tasks:
            for index in range(len(openers)):
                tasks.start_soon(hold, index)
            try:
                await ready.wait()
                yield [peer for peer in peers if peer is not None]
            finally:
                done.set()
    except BaseExceptionGroup as group:
        leaves = []
        stack: list[BaseException] = [group]
        while stack:
            error = stack.pop()
            stack.extend(error.exceptions) if isinstance(error, BaseExceptionGroup) else leaves.append(error)
        cancelled = anyio.get_cancelled_exc_class()
        errors = [leaf for leaf in leaves if not isinstance(leaf, cancelled)] or leaves
        raise errors[-1] from None


async def ring(peers: Sequence[Peer], *, nic: str = "sim", size: int = 1 << 20,
               options: Sequence[dict[str, Any]] | None = None, started: float | None = None) -> dict[str, Any]:
    """Host i writes to host i+1 (the last to host 0), in turn, each forwarding what it received; every host checks
    the bytes it got by sha256. Needs at least 2 hosts. `options[i]`: host i's open_nic arguments (ip=, netns=;
    ip="ssh" takes the address its SSH connection reached)."""
    if len(peers) < 2:
        raise ValueError(f"a ring needs at least 2 hosts, not {len(peers)}")
    started = time.perf_counter() if started is None else started
    count = len(peers)

    async def setup(index: int) -> tuple[Any, RemoteQP, RemoteQP, RemoteMR, RemoteMR]:
        peer = peers[index]
        remote = await peer.open_nic(nic, **((options or [{}] * count)[index]))
        cq = await peer.create_cq(remote, 64)
        out_qp, in_qp = await peer.create_qp(remote, cq), await peer.create_qp(remote, cq)
        inbox, outbox = await peer.register_mr(remote, size), await peer.register_mr(remote, size)
        return remote, out_qp, in_qp, inbox, outbox

    hosts: list[Any] = [None] * count

    async def setup_into(index: int) -> None:
        hosts[index] = await setup(index)

    async with anyio.create_task_group() as tasks:
        for index in range(count):
            tasks.start_soon(setup_into, index)

    async def link(index: int) -> None:
        following = (index + 1) % count
        await peers[index].connect_qp(hosts[index][1], hosts[following][2].info)
        await peers[following].connect_qp(hosts[following][2], hosts[index][1].info)

    async with anyio.create_task_group() as tasks:
        for index in range(count):
            tasks.start_soon(link, index)
    handshake = time.perf_counter() - started
    expected = await peers[0].fill(hosts[0][4], seed=SEED, length=size)
    hashes = []
    begin = time.perf_counter()
    for index in range(count):  # 0 -> 1 -> ... -> n-1 -> 0; host i forwards its inbox (host 0 its outbox)
        following = (index + 1) % count
        source = hosts[index][4] if index == 0 else hosts[index][3]
        await peers[index].post(hosts[index][1], "write", source, size, remote=hosts[following][3].region)
        hashes.append(await peers[following].sha256(hosts[following][3], 0, size))
    transfer = time.perf_counter() - begin
    verified = all(digest == expected for digest in hashes)
    result = {"verified": verified, "bytes": size, "hosts": [peer.host for peer in peers],
              "remote_ips": [host[0].ip for host in hosts], "handshake_ms": round(handshake * 1e3, 3),
              "transfer_ms": round(transfer * 1e3, 3)}
    if not verified:
        bad = [peers[(i + 1) % count].host for i, digest in enumerate(hashes) if digest != expected]
        result["error"] = f"data mismatch around the ring at {', '.join(bad)}"
    return result

"""Emulated NICs as the tests above the emulator use them: a name no other run takes, QP pairs connected both ways
(most data-path tests start from two NICs with one connected RC QP each), what the emulator counts, what an idle
NIC's driver wakes up for, commands known to be in flight, and a NIC that closes while a peer still sends into it."""
import contextlib
import os
import random
from typing import Any, AsyncIterator, Callable

import anyio

from aiofabric import NIC, MemoryRegion, QueuePair, open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver import rcfw_channel
from aiofabric.sim.options import FAULTS


def tag() -> str:
    """A suffix that makes an emulated NIC's name (`sim:NAME`) this run's own."""
    return f"{os.getpid()}-{random.getrandbits(20)}"


def stats(nic: NIC) -> dict[str, Any]:
    """What the emulated NIC counted (packets, drops, retransmits, commands, ...)."""
    return nic.pci.debug({"op": "stats"})["stats"]


def object_counts(nic: NIC) -> dict[str, Any]:
    """How many objects of each kind the emulated firmware holds."""
    return nic.pci.debug({"op": "objects"})["objects"]


def command_counters(nic: NIC) -> tuple[int, int]:
    """The driver's last RCFW cookie and HWRM sequence number: what `until_posted` counts from."""
    return nic.device.rcfw_channel._cookie, nic.device.hwrm_channel._seq


async def until_posted(nic: NIC, counters: tuple[int, int], rcfw: int = 0, hwrm: int = 0) -> None:
    """Until `rcfw` RoCE and `hwrm` HWRM commands were posted since `counters` were read. Watching the driver's own
    counters (set as each command is written, answered or not), not waiting for every task to block: anyio's
    wait_all_tasks_blocked polls every 0.1 s, and on a loaded machine a command can be answered before it returns."""
    cookie, seq = counters
    with anyio.fail_after(10):
        while (nic.device.rcfw_channel._cookie - cookie) % (bnxt.RCFW_MAX_COOKIE_VALUE + 1) < rcfw or \
                (nic.device.hwrm_channel._seq - seq) % 0x10000 < hwrm:
            await anyio.sleep(0.001)


async def connect(qa: QueuePair, qb: QueuePair, **options: Any) -> None:
    """Each QP to the other, both with `options` (mtu, timeout, ...; the driver's defaults where not given)."""
    await qa.connect(qb.info(), **options)
    await qb.connect(qa.info(), **options)


async def connected_qps(a: NIC, b: NIC, cq_depth: int = 256, qp: dict[str, Any] | None = None,
                        **options: Any) -> tuple[QueuePair, QueuePair]:
    """A CQ of `cq_depth` and an RC QP (created with `qp`: sq_depth, rq_depth, ...) on each of NICs a and b,
    connected to each other with `options`: (qa, qb)."""
    cq_a, cq_b = await a.create_cq(cq_depth), await b.create_cq(cq_depth)
    qa, qb = await a.create_qp(cq_a, **(qp or {})), await b.create_qp(cq_b, **(qp or {}))
    await connect(qa, qb, **options)
    return qa, qb


@contextlib.asynccontextmanager
async def connected_pair(mtu: int = 1024, sq_depth: int = 64, timeout: int | None = None,
                         **options: Any) -> AsyncIterator[tuple[NIC, NIC, QueuePair, QueuePair]]:
    """Two emulated NICs (both opened with `options`) with one connected RC QP each: (a, b, qa, qb).

    Unless `timeout` says otherwise, a wire with faults gets a short ACK timeout (exponent 8, about 1 ms: a lost tail
    is resent quickly) and a clean one perftest's 14 (67 ms), because eight 1 ms timeouts in a row are only an
    emulator process waiting for a CPU on a loaded machine, which then fails a write with RETRY_CNT_EXCEEDED (seen in
    CI beside a CPU hog)."""
    if timeout is None:
        timeout = 8 if any(options.get(fault) for fault in FAULTS) else 14
    name = tag()
    async with open_nic(f"sim:a{name}", **options) as a, open_nic(f"sim:b{name}", **options) as b:
        qa, qb = await connected_qps(a, b, qp={"sq_depth": sq_depth, "rq_depth": 64}, mtu=mtu, timeout=timeout)
        yield a, b, qa, qb


@contextlib.asynccontextmanager
async def closing_with_a_sender() -> AsyncIterator[tuple[NIC, QueuePair, MemoryRegion]]:
    """A NIC about to be closed whose QP has 256 receives of 64 bytes posted, and a peer NIC whose QP is connected
    to it, with a 4 KiB MR to send from: (closing NIC, peer's QP, peer's MR). For the tests that make the device
    write while or after the closing NIC frees its memory."""
    async with open_nic() as closing, open_nic() as peer:
        cq, peer_cq = await closing.create_cq(512), await peer.create_cq(512)
        qp, peer_qp = await closing.create_qp(cq, rq_depth=256), await peer.create_qp(peer_cq, sq_depth=256)
        await connect(qp, peer_qp)
        target, source = await closing.register_mr(1 << 20), await peer.register_mr(4096)
        for i in range(256):
            await qp.post_recv(target, 64, local_offset=i * 64)
        yield closing, peer_qp, source


def count_wakeups(monkeypatch: Any, *nics: NIC) -> Callable[[], tuple[int, int, int]]:
    """What an idle NIC's driver would wake up for: the poller's sleeps ending, the CREQ reader's interrupt waits
    starting (HWRM answers are polled only while a command waits), and doorbells or register writes reaching the
    emulator (each wakes it)."""
    device_waits = []
    original = rcfw_channel.wait_for_interrupt

    async def counting(fd, timeout):
        device_waits.append(timeout)
        return await original(fd, timeout)
    monkeypatch.setattr(rcfw_channel, "wait_for_interrupt", counting)
    writes = []
    for nic in nics:
        for bar, method in ((nic.device.doorbells, "write64"), (nic.device.bar0, "write32"),
                            (nic.device.bar0, "write64")):
            def written(*args, _write=getattr(bar, method)):
                writes.append(args)
                return _write(*args)
            monkeypatch.setattr(bar, method, written)
    return lambda: (sum(nic.poller.stats["wakeups"] for nic in nics), len(device_waits), len(writes))

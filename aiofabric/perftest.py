"""perftest-style RDMA tests on emulated NICs: the engines behind `aiofabric bench` and `aiofabric loopback`.

`bench` boots `nics` emulated NICs (one process each, talking RoCEv2 over UDP on 127.0.0.x), pairs them up
(NIC 0 with 1, 2 with 3, ...), spreads `qps` client/server QP pairs over the pairs and drives every QP from one
event loop with `depth` work requests in flight. Destination bytes are verified at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
from typing import Any, AsyncIterator

import anyio

from .autogen import bnxt
from .nic import NIC, open_nic
from .queues import QueuePair

TESTS = ("write", "read", "send")
MTUS = (256, 512, 1024, 2048, 4096)
MAX_ACK_TIMEOUT = 31  # the QP's local ACK timeout is a 5-bit exponent
PATTERN_CHUNK = 1 << 20  # random.randbytes(n) overflows a C int above 256 MiB: fill the pattern 1 MiB at a time


@dataclasses.dataclass
class BenchConfig:
    test: str = "write"
    qps: int = 1
    size: int = 65536
    iters: int = 1000
    depth: int = 32
    nics: int = 2
    mtu: int = 4096
    loss: float = 0.0
    reorder: float = 0.0
    dup: float = 0.0
    corrupt: float = 0.0
    seed: int = 0
    pcap: str | None = None
    timeout: int = 14  # QP local ACK timeout: 4.096 us * 2^timeout (perftest's default); 0 waits forever, as in IB
    progress: bool = False

    def check(self) -> None:
        """Refuse a bad value before any NIC boots, naming the flag and what it allows.

        Limits of the firmware (QPs, work requests per QP, DMA memory) are left to the driver, which reports them."""
        if self.test not in TESTS:
            raise ValueError(f"test must be one of {TESTS}")
        if self.nics < 2 or self.nics % 2:
            raise ValueError("--nics must be an even number >= 2 (NICs are paired)")
        for name in ("qps", "iters", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        if self.size < 1:
            raise ValueError("--size must be at least 1 byte")
        if self.mtu not in MTUS:
            raise ValueError(f"--mtu must be one of {MTUS}")
        if not 0 <= self.timeout <= MAX_ACK_TIMEOUT:
            raise ValueError(f"--timeout must be in [0, {MAX_ACK_TIMEOUT}] (a 5-bit exponent: 4.096 us * 2^timeout, "
                             f"0 waits forever), not {self.timeout}")
        for name in ("loss", "reorder", "dup", "corrupt"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name} is a probability in [0, 1)")

    @property
    def used_bytes(self) -> int:
        """Bytes of each QP's buffers that the run writes (slots are reused once `depth` messages are posted)."""
        return min(self.iters, self.depth) * self.size


@dataclasses.dataclass
class _Flow:
    client: QueuePair
    server: QueuePair
    source: Any  # MemoryRegion on the client
    target: Any  # MemoryRegion on the server
    latencies: list[float] = dataclasses.field(default_factory=list)
    done: int = 0


@contextlib.asynccontextmanager
async def _nics(config: BenchConfig) -> AsyncIterator[list[NIC]]:
    faults = {k: getattr(config, k) for k in ("loss", "reorder", "dup", "corrupt") if getattr(config, k)}
    async with contextlib.AsyncExitStack() as stack:
        nics = []
        for i in range(config.nics):
            options: dict[str, Any] = dict(faults, seed=config.seed + i) if faults else {}
            if config.pcap:
                options["pcap"] = config.pcap if i == 0 else f"{config.pcap}.{i}"  # NIC N>0: FILE.N
            nics.append(await stack.enter_async_context(open_nic(f"sim:bench{os.getpid()}-{i}", **options)))
        yield nics


async def _connect(config: BenchConfig, nics: list[NIC]) -> list[_Flow]:
    flows = []
    span = config.size * config.depth
    cqs = {}
    for nic in nics:
        per_nic = -(-config.qps // (config.nics // 2))
        cqs[nic] = await nic.create_cq(depth=1 << max(8, (per_nic * config.depth * 2 - 1).bit_length()))
    for i in range(config.qps):
        a, b = nics[2 * (i % (config.nics // 2))], nics[2 * (i % (config.nics // 2)) + 1]
        client = await a.create_qp(cqs[a], sq_depth=config.depth, rq_depth=config.depth)
        server = await b.create_qp(cqs[b], sq_depth=config.depth, rq_depth=config.depth)
        await client.connect(server.info(), mtu=config.mtu, timeout=config.timeout)
        await server.connect(client.info(), mtu=config.mtu, timeout=config.timeout)
        source, target = await a.register_mr(span), await b.register_mr(span)
        _fill_random((target if config.test == "read" else source).view, config.used_bytes, config.seed * 7919 + i)
        flows.append(_Flow(client, server, source, target))
    return flows


def _fill_random(view: memoryview, length: int, seed: int) -> None:
    """Seeded random bytes in view[:length], the data the run moves and then verifies."""
    rng = random.Random(seed)
    for start in range(0, length, PATTERN_CHUNK):
        end = min(length, start + PATTERN_CHUNK)
        view[start:end] = rng.randbytes(end - start)


async def _drive(config: BenchConfig, flow: _Flow) -> None:
    """Keep `depth` work requests in flight on one QP: post in half-depth chunks, signal each chunk's last."""
    chunk = max(1, config.depth // 2)
    in_flight: list[tuple[float, Any, int]] = []
    posted = 0
    size = config.size
    while flow.done < config.iters:
        while posted < config.iters and posted - flow.done < config.depth:
            count = min(chunk, config.iters - posted, config.depth - (posted - flow.done))
            started = time.perf_counter()
            with flow.client.batch():
                for k in range(count):
                    slot = (posted + k) % config.depth * size
                    last = k == count - 1
                    if config.test == "write":
                        completion = await flow.client.post_write(flow.source, flow.target, size, local_offset=slot,
                                                                  remote_offset=slot, signaled=last)
                    elif config.test == "read":
                        completion = await flow.client.post_read(flow.source, flow.target, size, local_offset=slot,
                                                                 remote_offset=slot, signaled=last)
                    else:
                        await flow.server.post_recv(flow.target, size, local_offset=slot)
                        completion = await flow.client.post_send(flow.source, size, local_offset=slot,
                                                                 signaled=last)
            in_flight.append((started, completion, count))
            posted += count
        started, completion, count = in_flight.pop(0)
        await completion
        flow.latencies.extend([time.perf_counter() - started] * count)
        flow.done += count


def _verify(config: BenchConfig, flows: list[_Flow]) -> bool:
    used = config.used_bytes
    return all(f.source.view[:used] == f.target.view[:used] for f in flows)


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else 0.0


async def _progress(flows: list[_Flow], total: int, started: float) -> None:
    while True:
        await anyio.sleep(0.5)
        done = sum(f.done for f in flows)
        elapsed = time.perf_counter() - started
        if elapsed > 2:
            print(f"\r  {done}/{total} ops  {done / elapsed / 1e6:.3f} Mpps", end="", file=sys.stderr, flush=True)


async def run_bench(config: BenchConfig) -> dict[str, Any]:
    config.check()
    async with _nics(config) as nics:
        flows = await _connect(config, nics)
        before = {nic: nic.pci.debug({"op": "stats"})["stats"] for nic in nics}
        cpu_started, started = time.process_time(), time.perf_counter()
        async with anyio.create_task_group() as tasks:
            if config.progress:
                tasks.start_soon(_progress, flows, config.qps * config.iters, started)
            async with anyio.create_task_group() as drivers:
                for flow in flows:
                    drivers.start_soon(_drive, config, flow)
            tasks.cancel_scope.cancel()
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        if config.progress:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
        verified = _verify(config, flows)
        wire = {key: 0 for key in ("packets", "retransmits", "dropped")}
        for nic in nics:
            stats, old = nic.pci.debug({"op": "stats"})["stats"], before[nic]
            wire["packets"] += stats.get("packets_sent", 0) - old.get("packets_sent", 0)
            wire["retransmits"] += stats.get("retransmits", 0) - old.get("retransmits", 0)
            wire["dropped"] += stats.get("dropped", 0) - old.get("dropped", 0)
        first = nics[0].info()
    ops = config.qps * config.iters
    latencies = [x for f in flows for x in f.latencies]
    return {
        "verified": verified, "test": config.test, "qps": config.qps, "size": config.size, "iters": config.iters,
        "depth": config.depth, "mtu": config.mtu, "nics": config.nics, "ops": ops, "bytes": ops * config.size,
        "seconds": seconds, "msg_rate": ops / seconds, "bw_MiBps": ops * config.size / seconds / 2**20,
        "lat_us": {"p50": _percentile(latencies, 50) * 1e6, "p99": _percentile(latencies, 99) * 1e6},
        "driver_cpu_us_per_op": cpu / ops * 1e6, **wire, "fw_version": first["fw_version"],
        **({"error": "destination bytes differ from the source"} if not verified else {}),
    }


def format_table(result: dict[str, Any], config: BenchConfig) -> str:
    """perftest's banner and BW table (MB/sec = MiB/s), plus latency and wire counters."""
    verb = {"write": "RDMA_Write", "read": "RDMA_Read", "send": "Send"}[config.test]
    rule = "-" * 95
    lines = [rule, f"                    {verb} BW Test (aiofabric, emulated BNXT)",
             f" Number of qps   : {config.qps}\t\tTransport type : IB",
             " Connection type : RC\t\tUsing SRQ      : OFF",
             f" TX depth        : {config.depth}\t\tNICs           : {config.nics}",
             f" Mtu             : {config.mtu}[B]\t\tLink type      : Ethernet (RoCEv2 over UDP)",
             f" Firmware        : {result['fw_version']}", rule,
             " #bytes     #iterations    BW average[MB/sec]   MsgRate[Mpps]   lat p50[usec]   lat p99[usec]",
             f" {config.size:<10} {result['ops']:<14} {result['bw_MiBps']:<20.2f} {result['msg_rate'] / 1e6:<15.6f}"
             f" {result['lat_us']['p50']:<15.1f} {result['lat_us']['p99']:.1f}", rule,
             f" verified: {'yes' if result['verified'] else 'NO'}   packets: {result['packets']}   "
             f"retransmits: {result['retransmits']}   dropped: {result['dropped']}   "
             f"driver CPU: {result['driver_cpu_us_per_op']:.2f} us/op", rule]
    return "\n".join(lines)


async def run_loopback(spec: str, size: int) -> dict[str, Any]:
    """The seed's PHY-loopback test: two QPs on one NIC, port in LPBK_LOCAL, one RDMA WRITE, verified."""
    if size < 1:
        raise ValueError("--size must be at least 1 byte")
    async with open_nic(spec) as nic:
        cq = await nic.create_cq(depth=64)
        sender, receiver = await nic.create_qp(cq), await nic.create_qp(cq)
        qpns = [sender.qpn, receiver.qpn]  # a destroyed QP's qpn is -1: keep them for the report
        await sender.connect(receiver.info())
        await receiver.connect(sender.info())
        source, target = await nic.register_mr(size), await nic.register_mr(size)
        message = (b"Hello from BNXT RoCE PHY loopback! " * (size // 35 + 1))[:size]
        source.view[:size] = message
        await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_LOCAL)
        started = time.perf_counter()
        try:
            with anyio.fail_after(10):
                await sender.write(source, target, size)
        finally:
            await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_NONE)
        seconds = time.perf_counter() - started
        verified = bytes(target.view[:size]) == message
        stats = nic.pci.debug({"op": "stats"})["stats"] if hasattr(nic.pci, "debug") else {}
    return {"verified": verified, "bytes": size, "seconds": seconds, "qpn": qpns,
            "packets": stats.get("packets_sent", 0),
            **({"error": "loopback data differs from what was written"} if not verified else {})}

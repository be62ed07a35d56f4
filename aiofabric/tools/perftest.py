"""perftest-style RDMA tests on emulated NICs: the engines behind `aiofabric bench` and `aiofabric loopback`.

`bench` boots `nics` emulated NICs (talking RoCEv2 over UDP on 127.0.0.x; one emulator process each, or one for all with
--shared-emulator), pairs them up (NIC 0 with 1, 2 with 3, ...), spreads `qps` client/server QP pairs over the pairs and
drives every QP from one event loop with `tx_depth` work requests in flight.

Verification can fail: every operation moves its own bytes. When a QP's `iters * size` fit in FULL_CHECK_BYTES per
NIC, each operation has its own slot of seeded random data and every operation's bytes are compared at its own
offset. Otherwise slots are reused every `tx_depth` operations and each operation stamps its slot with (QP, iteration)
before it is posted; then the last pass is compared byte for byte, and the emulator's per-QP count of placed
messages and bytes (debug channel, "placed") must equal what was posted: a lost, duplicated or misplaced message
shows as a count or a byte that differs.

Placement counts, wire counters and --inject-fault exist only where a local NIC is emulated (`debug_client()` of its
seam). On a PCI NIC (with --peer) the bytes are still compared; the JSON says null for the counters and
`verification` says the placement counts were not available. The debug channel is asked only before and after a
run, never in its hot loop.

Here: the loop that keeps each QP's work requests in flight, its sampler and stall watch, and the result of a run
(its BW peak and average by perftest's rules: peak.py). The run's options are bench_config.py's, its QP pairs
bench_flows.py's, its checks bench_verify.py's, its table bench_report.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import struct
import sys
import time
from typing import Any, AsyncContextManager

import anyio

from .bench_config import MAX_SIZE, BenchConfig
from .bench_flows import Flow, open_flows
from .bench_report import interval_row, table_head
from .bench_verify import verification, verify
from .introspect import emulator_processes, placement_counts, wire_counters, wire_delta
from .options import ORDERED_TESTS
from .peak import Timeline
from .perftest_defaults import DEFAULT_OUTS
from .runs import fit_mtu, open_nics, phy_loopback
from .samples import percentile
from .sweeps import run_sizes, sweep_result
from ..errors import FabricError
from ..verbs import NIC, open_nic

SAMPLE_SECONDS = 0.05  # seconds between the samples of operations done (-D's warm-up ends at one; progress)
WARMUP_SHARE = 0.2  # with -D, this share of the time (at most 2 s) runs before measuring starts
STAMP = struct.Struct("<Q")  # (flow << 40 | iteration) at the start of a reused slot, so each payload is distinct
LOOPBACK_BASE_SECONDS, LOOPBACK_SLOWEST_BPS = 10.0, 1 << 20  # loopback's time limit grows with the size


class NoProgressError(FabricError, TimeoutError):
    """A QP had work outstanding and completed none of it for the run's no-progress timeout."""


def open_bench_nics(config: BenchConfig) -> AsyncContextManager[list[NIC]]:
    """The local NICs of a run (`run_bench` opens them itself unless it is given them): `runs.open_nics`."""
    return open_nics(config, config.local_nics)


async def run_bench(config: BenchConfig, nics: list[NIC] | None = None) -> dict[str, Any]:
    """One size (`config.size`) or a sweep (`config.sizes`: one row per size in "rows", NICs booted once), on
    `nics` (from `open_bench_nics`) or on NICs it opens and closes."""
    config.check()
    async with contextlib.nullcontext(nics) if nics is not None else open_bench_nics(config) as nics:
        for nic in nics:
            config.check_caps(nic)
        fw_version = nics[0].info()["fw_version"]
        mtu = fit_mtu(config.mtu, nics, "bench")
        rows = await run_sizes(dataclasses.replace(config, mtu=mtu), config.sizes or [config.size],
                               lambda sized: _run_size(sized, nics, fw_version))
    return sweep_result(config, rows, mtu, config.mtu)


async def _run_size(config: BenchConfig, nics: list[NIC], fw_version: str) -> dict[str, Any]:
    async with open_flows(config, nics) as flows:
        before = await wire_counters(nics)
        cpu_started, started = time.process_time(), time.perf_counter()
        warmup = 0.0 if not config.duration else \
            config.margin if config.margin is not None else min(2.0, config.duration * WARMUP_SHARE)
        deadline = started + warmup + config.duration if config.duration and not config.run_infinitely else None
        stop = config.stop if config.run_infinitely else None
        sampler = _Sampler(config, flows, started, warmup, 0 if config.duration else len(flows) * config.iters)
        timeline = Timeline() if config.measures_peak else None
        stalled: list[BaseException] = []
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sampler.run)
            async with anyio.create_task_group() as drivers:
                tasks.start_soon(_watch_progress, flows, config.no_progress_seconds, stalled, drivers.cancel_scope)
                for flow in flows:
                    drivers.start_soon(_drive, config, flow, deadline, stop, timeline)
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
        mismatch = await verify(config, flows, placed)
        wire = wire_delta(before, await wire_counters(nics))
        processes = await emulator_processes(nics)
    ops = sum(flow.done for flow in flows)
    measured_ops, seconds = ops, ended - started
    if config.duration and sampler.first is not None:  # measure from the end of the warm-up
        measured_ops, seconds = ops - sampler.first[1], ended - sampler.first[0]
    elif timeline is not None and timeline.span() > 0:  # perftest's: the first post to the last completion
        seconds = timeline.span()
    seconds = max(seconds, 1e-9)
    bandwidth = measured_ops * config.size / seconds
    fastest = timeline.fastest() if timeline is not None else 0.0
    peak = config.size / fastest if fastest > 0 else 0.0  # perftest's rule (peak.py); 0 where it measures none
    latencies = sorted(x for f in flows for x in f.latencies)
    # perftest's #iterations: every QP's (print_report_bw: iters * num_of_qps; -D counts every completion), one
    # direction's with -b (each side of a perftest -b run reports its own); the warm-up of -D left out
    iterations = measured_ops // (2 if config.bidirectional else 1)
    result = {
        "verified": mismatch is None, "test": config.test, "qps": config.qps, "size": config.size,
        "iterations": iterations,
        "duration": config.duration, "warmup_seconds": warmup, "depth": config.tx_depth,
        "post_list": config.post_list, "cq_mod": config.chunk,
        **({"outs": config.outs or DEFAULT_OUTS} if config.test in ORDERED_TESTS else {}),
        "inline_size": config.inline_size, "events": config.events, "mtu": config.mtu, "nics": config.nics,
        "emulator_processes": processes, "ops": ops, "measured_ops": measured_ops, "bytes": ops * config.size,
        "seconds": seconds,
        "msg_rate": measured_ops / seconds, "bw_MiBps": bandwidth / 2**20, "bw_peak_MiBps": peak / 2**20,
        "bw_Gbps": bandwidth * 8 / 1e9,
        "lat_us": {"p50": percentile(latencies, 50) * 1e6, "p99": percentile(latencies, 99) * 1e6},
        "driver_cpu_us_per_op": cpu / max(ops, 1) * 1e6, **wire, "fw_version": fw_version,
        "verification": verification(config, None not in placed.values()),
        **({"remote_host": config.remote.host} if config.remote is not None else {}),
        **({"error": f"verification failed: {mismatch}"} if mismatch else {}),
    }
    if config.bidirectional:  # each direction's share of the same wall time
        result["directions"] = [
            {"from_nic": direction, "ops": sum(f.done for f in flows if f.direction == direction),
             "bw_MiBps": sum(f.done for f in flows if f.direction == direction) * config.size / seconds / 2**20}
            for direction in (0, 1)]
    return result


async def _drive(config: BenchConfig, flow: Flow, deadline: float | None, stop: Any = None,
                 timeline: Timeline | None = None) -> None:
    """Keep `tx_depth` work requests in flight on one QP: post in chunks of `chunk` (CQ moderation, or `post_list`
    at a time, one post_many each), signal each chunk's last. Posts `iters` operations, or (deadline) until the
    deadline, then drains. `timeline` (when the run measures a peak) gets each post and completion."""
    chunk = config.chunk
    size = config.size
    inline = size <= config.inline_size  # -I: perftest inlines the messages that fit
    in_flight: list[tuple[float, Any, int]] = []
    posted = 0
    slots = config.slots
    limit = config.iters if deadline is None and stop is None else 1 << 62
    depth = config.tx_depth
    stamp = b"" if slots == config.iters or config.test in ("read", "atomic") or slots < depth else \
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
        while posted < limit and posted - flow.done < depth:
            count = min(chunk, limit - posted, depth - (posted - flow.done))
            started = time.perf_counter()
            if timeline is not None:
                timeline.post(count, started)
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
        if timeline is not None:
            timeline.complete(count, now)
        flow.latencies.extend([now - started] * count)
        flow.done += count


async def _watch_progress(flows: list[Flow], seconds: float, stalled: list[BaseException],
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


async def _report_every(config: BenchConfig, sampler: _Sampler, stop: Any) -> None:
    """--run_infinitely: perftest's banner and result header first, then every `duration` seconds one row of its
    table for that interval (its completions, BW peak 0, its bandwidth and message rate), until `stop`. On stdout,
    or on stderr when stdout carries the JSON."""
    out = sys.stderr if config.json else sys.stdout
    print(table_head(config), file=out, flush=True)
    last_time, last_done = time.perf_counter(), sampler.done()
    while not stop.is_set():
        with anyio.move_on_after(config.duration):
            await stop.wait()
        now, done = time.perf_counter(), sampler.done()
        print(interval_row(config, done - last_done, now - last_time), file=out, flush=True)
        last_time, last_done = now, done


class _Sampler:
    """Operations done over time, sampled every SAMPLE_SECONDS: the first sample after the warm-up (where a -D run's
    measurement starts); on a TTY also a live line on stderr (size, ops, MiB/s, ETA)."""

    def __init__(self, config: BenchConfig, flows: list[Flow], started: float, warmup: float, total: int) -> None:
        self.config, self.flows, self.started, self.warmup, self.total = config, flows, started, warmup, total
        self.first: tuple[float, int] | None = None  # (time, operations done) when the warm-up ended

    def done(self) -> int:
        return sum(flow.done for flow in self.flows)

    async def run(self) -> None:
        while True:
            await anyio.sleep(SAMPLE_SECONDS)
            now, done = time.perf_counter(), self.done()
            if self.first is None and now - self.started >= self.warmup:
                self.first = (now, done)
            if self.config.progress and now - self.started > 2:
                rate = done * self.config.size / (now - self.started) / 2**20
                left = (f"ETA {max(0.0, (self.total - done) / max(done, 1) * (now - self.started)):.0f} s"
                        if self.total else "")
                print(f"\r  {self.config.size} B  {done} ops  {rate:.1f} MiB/s  {left}   ", end="", file=sys.stderr,
                      flush=True)


async def run_loopback(spec: str, size: int, ip: str | None = None) -> dict[str, Any]:
    """The PHY-loopback test of the synchronous driver this project grew from: two QPs on one NIC, port in LPBK_LOCAL,
    one RDMA WRITE, verified."""
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

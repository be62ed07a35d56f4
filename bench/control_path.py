"""Control-path benchmarks on the emulated NIC: firmware commands, object creation, an idle NIC.

    python bench/control_path.py [--backend asyncio|uvloop|trio] [--objects 256] [--idle 10] [--json]

Measures, in one run: open+close of an emulated NIC; HWRM round-trip latency (func_qcfg); and creating N CQ+QP pairs
(through INIT) concurrently vs one at a time, with the emulated firmware executing one command at a time at its
default latency. The concurrent/sequential ratio is the round trips the RCFW pipeline hides. Then the CPU an open NIC
costs doing nothing for --idle seconds (driver and emulator process, percent of one core), with nothing outstanding
and with one receive posted that nobody matches (quiet outstanding work, which keeps a backed-off safety poll).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import anyio
from datapath import cpu_seconds

from aiofabric import open_nic
from aiofabric.sim.emulator import DEFAULT_LATENCY_US

IDLE_SETTLE = 2.0  # seconds before an idle measurement: the poller's safety poll backs off over 1.5 s


async def open_close(rounds: int) -> list[float]:
    times = []
    for i in range(rounds):
        started = time.perf_counter()
        async with open_nic(f"sim:bench-open{i}"):
            pass
        times.append(time.perf_counter() - started)
    return times


async def hwrm_latency(nic, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        await nic.hwrm("func_qcfg", fid=0xFFFF)
        times.append(time.perf_counter() - started)
    return times


async def create_pairs(nic, count: int, concurrent: bool) -> float:
    objects = []

    async def pair():
        cq = await nic.create_cq(depth=64)
        objects.append((cq, await nic.create_qp(cq, sq_depth=16, rq_depth=16)))

    started = time.perf_counter()
    if concurrent:
        async with anyio.create_task_group() as tasks:
            for _ in range(count):
                tasks.start_soon(pair)
    else:
        for _ in range(count):
            await pair()
    elapsed = time.perf_counter() - started
    async with anyio.create_task_group() as tasks:
        for cq, qp in objects:
            tasks.start_soon(qp.destroy)
    for cq, _ in objects:
        await cq.destroy()
    return elapsed


async def idle_cpu(seconds: float, receive: bool) -> dict:
    """An open NIC with a CQ and a QP doing nothing for `seconds`: CPU of the driver process and of the emulator
    process in percent of one core, and the poller's wake-ups per second. With `receive`, one receive is posted."""
    async with open_nic("sim:bench-idle") as nic:
        cq = await nic.create_cq(256)
        qp = await nic.create_qp(cq)
        if receive:
            await qp.post_recv(await nic.register_mr(4096), 64)
        await anyio.sleep(IDLE_SETTLE)
        gc.collect()  # a collection of the earlier measurements' garbage is not the idle NIC's
        wakeups, driver, device = nic.poller.stats["wakeups"], time.process_time(), cpu_seconds(nic.pci.pid)
        started = time.perf_counter()
        await anyio.sleep(seconds)
        elapsed = time.perf_counter() - started
        return {"driver_pct": (time.process_time() - driver) / elapsed * 100,
                "emulator_pct": (cpu_seconds(nic.pci.pid) - device) / elapsed * 100,
                "poller_wakeups_per_s": (nic.poller.stats["wakeups"] - wakeups) / elapsed}


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def main(args) -> dict:
    opens = await open_close(args.opens)
    async with open_nic("sim:bench") as nic:
        hwrm = await hwrm_latency(nic, args.hwrm)
        sequential = await create_pairs(nic, args.objects, concurrent=False)
        concurrent = await create_pairs(nic, args.objects, concurrent=True)
    idle = {"seconds": args.idle, "nothing_outstanding": await idle_cpu(args.idle, receive=False),
            "receive_posted": await idle_cpu(args.idle, receive=True)} if args.idle else None
    return {
        "backend": args.backend, "fw_latency_us": DEFAULT_LATENCY_US,
        "open_close_ms": {"p50": statistics.median(opens) * 1e3, "min": min(opens) * 1e3},
        "hwrm_rtt_us": {"p50": statistics.median(hwrm) * 1e6, "p99": percentile(hwrm, 99) * 1e6},
        "objects": args.objects, "sequential_s": sequential, "concurrent_s": concurrent,
        "speedup": sequential / concurrent, "idle": idle,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--opens", type=int, default=5)
    parser.add_argument("--hwrm", type=int, default=500)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of each idle measurement (0: skip)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    backend, options = ("asyncio", {"use_uvloop": True}) if args.backend == "uvloop" else (args.backend, {})
    result = anyio.run(main, args, backend=backend, backend_options=options)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"open+close of an emulated NIC   p50 {result['open_close_ms']['p50']:8.1f} ms "
              f"(min {result['open_close_ms']['min']:.1f} ms)")
        print(f"HWRM round trip (func_qcfg)     p50 {result['hwrm_rtt_us']['p50']:8.1f} us "
              f"p99 {result['hwrm_rtt_us']['p99']:.1f} us (firmware latency {DEFAULT_LATENCY_US:g} us)")
        print(f"{args.objects} CQ+QP (through INIT)   sequential {result['sequential_s'] * 1e3:8.1f} ms   "
              f"concurrent {result['concurrent_s'] * 1e3:8.1f} ms   speedup {result['speedup']:.2f}x")
        for case, idle in (result["idle"] or {}).items():
            if case != "seconds":
                print(f"idle open NIC, {case.replace('_', ' '):19} driver {idle['driver_pct']:6.3f}% "
                      f"emulator {idle['emulator_pct']:6.3f}% of a core, {idle['poller_wakeups_per_s']:.1f} "
                      f"poller wake-ups/s (over {args.idle:g} s)")

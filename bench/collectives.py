"""Collectives benchmarks (bench/RESULTS.md, Collectives), ratios measured in one run:

1. allreduce bus bandwidth of 4 ranks (4 emulated NICs in this process), 1-64 MiB of float32, against the
   point-to-point RDMA WRITE bandwidth of the same fabric (two emulated NICs, 4 QPs x depth 8, MTU 4096);
2. the same allreduce written with plain awaits, no scheduler (a user's ring: per step, write every piece and await
   it, await every piece's immediate, reduce), on the same communicators, against the compiled one;
3. torch.distributed's gloo backend, 4 processes on this machine, float32 all_reduce, when a python with torch is
   given (`--torch-python`; torch is never a dependency of aiofabric);
4. DMA memory held before and after 100 steady-state replays (the NICs' DmaBudget);
5. small messages: the 4-rank allreduce of 1 KiB (one-shot, and the ring's 2 (N - 1) steps; each rank looping on
   its own, as `aiofabric allreduce` times it) against seven one-way hops of `lat write` (its typical one-way
   latency, 2 bytes), measured by turns in the same run: the ring's six steps and its ready message are seven hops.

The ranks' NICs share one emulator process (`collectives.local`'s default); `--no-shared-emulator` gives each its
own. The load average of the machine is recorded before and after.

    python bench/collectives.py [--json] [--sizes 1M,4M,16M,64M] [--torch-python PATH] [--no-shared-emulator]
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import textwrap
import time

import anyio
import numpy as np

from aiofabric import DmaBudget, collectives
from aiofabric.collectives import layout
from aiofabric.collectives.oneshot import ONESHOT_BYTES
from aiofabric.sched import pool
from aiofabric.sched.reduce import reduction
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.lat_config import LatConfig
from aiofabric.tools.latency import run_latency
from aiofabric.tools.perftest import run_bench
from aiofabric.tools.units import parse_size

RANKS = 4
HOPS = 7  # the ring allreduce's 2 (N - 1) steps and its ready message, one after another
SMALL = 1024


async def p2p_bandwidth(size=1 << 20):
    result = await run_bench(BenchConfig(test="write", size=size, qps=4, depth=8, cq_mod=4, iters=64))
    return result["bytes"] / result["seconds"] / 1e9


async def timed(comms, fn, reps):
    """Median seconds of `reps` runs of fn(comm) on every rank at once (after one warm-up), and the driver
    process's CPU time over those runs' wall time (the emulators share the same 2 cores)."""
    seconds = []
    cpu = 0.0
    for rep in range(reps + 1):
        started, cpu_started = time.perf_counter(), time.process_time()
        await collectives.run_ranks([functools.partial(fn, comm) for comm in comms])
        if rep:
            seconds.append(time.perf_counter() - started)
            cpu += time.process_time() - cpu_started
    return float(np.median(seconds)), cpu / sum(seconds)


async def plain_allreduce(comm, x, piece_bytes):
    """The ring allreduce with plain awaits on the communicator's own QPs, MRs and receive pools (same messages,
    same order), one step after another: what the scheduler's overlap is measured against."""
    n, rank, isz = comm.size, comm.rank, x.itemsize
    w = np.frombuffer(comm.work.view, x.dtype, x.size)
    lands = np.frombuffer(comm.landing.view, x.dtype, comm.landing.length // isz)
    chunks = layout.chunks(x.size, n)
    slot = max(c.length for c in chunks) * isz
    nq, pq = comm.next.qp, comm.prev.qp
    ready_in, data_in = pool.pool_of(nq), pool.pool_of(pq)
    add = reduction("sum", x.dtype)
    np.copyto(w, x)
    await pq.write_with_imm(comm.work, comm.prev.work, 0, 0)
    await (await ready_in.take())
    for phase in ("rs", "ag"):
        for step in range(n - 1):
            sent, got = (layout.reduce_scatter_chunks if phase == "rs" else layout.allgather_chunks)(rank, n, step)
            for at in layout.pieces(chunks[sent], isz, piece_bytes):
                remote, offset = ((comm.next.landing, step * slot + (at.start - chunks[sent].start) * isz)
                                  if phase == "rs" else (comm.next.work, at.start * isz))
                await nq.write_with_imm(comm.work, remote, 1, at.length * isz, local_offset=at.start * isz,
                                        remote_offset=offset)
            for at in layout.pieces(chunks[got], isz, piece_bytes):
                await (await data_in.take())
                if phase == "rs":
                    low = step * slot // isz + at.start - chunks[got].start
                    acc = w[at.start:at.start + at.length]
                    add(acc, acc, lands[low:low + at.length])
    np.copyto(x, w)


async def per_rank(comms, fn, reps):
    """Seconds per collective as `aiofabric allreduce` reports it (nccl-tests' way): each rank runs `reps` of them
    in a loop of its own (after one warm-up), and the ranks' means are averaged."""
    async def loop(comm):
        await fn(comm)
        started = time.perf_counter()
        for _ in range(reps):
            await fn(comm)
        return (time.perf_counter() - started) / reps
    return float(np.mean(await collectives.run_ranks([functools.partial(loop, comm) for comm in comms])))


async def small_messages(rounds, reps, lat_iters, shared):
    """Median one-way `lat write` latency and 4-rank allreduce times of SMALL bytes (one-shot, ring; per_rank),
    taken in turns `rounds` times; the ratios of their medians to HOPS one-way hops."""
    lat, times = [], {"oneshot": [], "ring": []}
    async with collectives.local(RANKS, buffer_bytes=SMALL, shared_emulator=shared) as comms:
        xs = [np.ones(SMALL // 4, np.float32) for _ in comms]
        for _ in range(rounds):
            lat.append((await run_latency(LatConfig(test="write", iters=lat_iters)))["t_typical_us"])
            for name, limit in (("oneshot", ONESHOT_BYTES), ("ring", 0)):
                for comm in comms:
                    comm.oneshot_bytes = limit
                times[name].append(await per_rank(comms, lambda comm: comm.allreduce(xs[comm.rank]), reps) * 1e6)
    hop = float(np.median(lat))
    out = {"lat_write_one_way_us": hop, "lat_rounds_us": lat}
    for name, values in times.items():
        out[f"allreduce_{SMALL}_{name}_us"] = float(np.median(values))
        out[f"allreduce_{SMALL}_{name}_vs_{HOPS}_hops"] = float(np.median(values)) / (HOPS * hop)
        out[f"allreduce_{SMALL}_{name}_rounds_us"] = values
    return out


async def measure(sizes, reps, shared, small):
    budget = DmaBudget(1 << 40, "bench")
    result = {"load_average_before": os.getloadavg(), "shared_emulator": shared}
    if small:
        result["small"] = await small_messages(*small, shared)
    result |= {"p2p_write_GBps": await p2p_bandwidth(), "rows": []}
    async with collectives.local(RANKS, buffer_bytes=max(sizes), dma_budget=budget, shared_emulator=shared) as comms:
        for size in sizes:
            count = size // 4
            xs = [np.ones(count, np.float32) for _ in range(RANKS)]
            compiled, driver_cpu = await timed(comms, lambda comm: comm.allreduce(xs[comm.rank]), reps)
            plain, plain_cpu = await timed(
                comms, lambda comm: plain_allreduce(comm, xs[comm.rank], comms[0].piece_bytes), reps)
            busbw = layout.bus_bandwidth("allreduce", RANKS, size / compiled / 1e9)
            # every link carries busbw's bytes at once: on 2 cores all 4 links share the emulators' CPU
            aggregate = busbw * RANKS
            result["rows"].append({"size": size, "compiled_ms": compiled * 1e3, "plain_ms": plain * 1e3,
                                   "compiled_vs_plain": compiled / plain, "busbw_GBps": busbw,
                                   "busbw_vs_p2p": busbw / result["p2p_write_GBps"],
                                   "all_links_vs_p2p": aggregate / result["p2p_write_GBps"],
                                   "driver_cpu_share": driver_cpu, "plain_driver_cpu_share": plain_cpu})
        # steady state: replays allocate no DMA memory (max keeps the values: the last run is checked)
        xs = [np.arange(1 << 16, dtype=np.float32) + comm.rank for comm in comms]
        await collectives.run_ranks([functools.partial(comm.allreduce, xs[comm.rank], op="max") for comm in comms])
        before = budget.in_use
        for _ in range(100):
            await collectives.run_ranks([functools.partial(comm.allreduce, xs[comm.rank], op="max")
                                         for comm in comms])
        result["dma_bytes_before_after_100_replays"] = [before, budget.in_use]
        expected = np.arange(1 << 16, dtype=np.float32) + RANKS - 1
        result["verified"] = all(np.array_equal(x, expected) for x in xs)
    result["load_average_after"] = os.getloadavg()
    return result


GLOO = textwrap.dedent("""
    import os, sys, time, json, numpy, torch, torch.distributed as dist
    rank, size, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    out = {}
    for nbytes in map(int, sys.argv[4].split(",")):
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        dist.all_reduce(x)
        times = []
        for _ in range(int(sys.argv[5])):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - started)
        out[nbytes] = float(numpy.median(times))
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
""")


def gloo(python, sizes, reps):
    """torch.distributed gloo all_reduce of float32, 4 processes; median seconds per size (rank 0's)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [subprocess.Popen([python, "-c", GLOO, str(rank), str(RANKS), str(port), ",".join(map(str, sizes)),
                                   str(reps)], stdout=subprocess.PIPE, text=True) for rank in range(RANKS)]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    return {int(k): v for k, v in json.loads(outputs[0].strip().splitlines()[-1]).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--torch-python", help="a python with torch, for the gloo comparison")
    parser.add_argument("--shared-emulator", action=argparse.BooleanOptionalAction, default=True,
                        help="the ranks' emulated NICs in one emulator process (default), or one each")
    parser.add_argument("--small-rounds", type=int, default=3, help="turns of lat and the 1 KiB allreduce (0: none)")
    parser.add_argument("--small-reps", type=int, default=100, help="1 KiB allreduces per turn, rank and algorithm")
    parser.add_argument("--lat-iters", type=int, default=1000, help="lat write iterations per turn")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    small = (args.small_rounds, args.small_reps, args.lat_iters) if args.small_rounds else None
    result = anyio.run(measure, sizes, args.reps, args.shared_emulator, small)
    if args.torch_python:
        times = gloo(args.torch_python, sizes, args.reps)
        for row in result["rows"]:
            seconds = times[row["size"]]
            row["gloo_ms"] = seconds * 1e3
            row["gloo_busbw_GBps"] = layout.bus_bandwidth("allreduce", RANKS, row["size"] / seconds / 1e9)
            row["compiled_vs_gloo"] = row["compiled_ms"] / row["gloo_ms"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"load average {result['load_average_before'][0]:.1f} before, {result['load_average_after'][0]:.1f} after; "
          f"emulator: {'one process for the 4 NICs' if result['shared_emulator'] else 'a process per NIC'}")
    if "small" in result:
        small = result["small"]
        print(f"lat write one-way {small['lat_write_one_way_us']:.1f} us; 4-rank allreduce of {SMALL} B: "
              + ", ".join(f"{name} {small[f'allreduce_{SMALL}_{name}_us']:.0f} us "
                          f"({small[f'allreduce_{SMALL}_{name}_vs_{HOPS}_hops']:.2f} x {HOPS} hops)"
                          for name in ("oneshot", "ring")))
    print(f"point-to-point RDMA WRITE (2 NICs, 4 QPs x 8, 1 MiB): {result['p2p_write_GBps']:.3f} GB/s")
    for row in result["rows"]:
        extra = (f"  gloo {row['gloo_ms']:.1f} ms (busbw {row['gloo_busbw_GBps']:.3f}), compiled/gloo "
                 f"{row['compiled_vs_gloo']:.2f}" if "gloo_ms" in row else "")
        print(f"{row['size']:>10} B: compiled {row['compiled_ms']:.1f} ms (busbw {row['busbw_GBps']:.3f} GB/s, "
              f"{row['busbw_vs_p2p']:.2f} of p2p), plain awaits {row['plain_ms']:.1f} ms, compiled/plain "
              f"{row['compiled_vs_plain']:.2f}, all links {row['all_links_vs_p2p']:.2f} of p2p, driver CPU "
              f"{row['driver_cpu_share']:.2f} / {row['plain_driver_cpu_share']:.2f}{extra}")
    print(f"DMA bytes before / after 100 replays: {result['dma_bytes_before_after_100_replays']}, verified "
          f"{result['verified']}")


if __name__ == "__main__":
    sys.exit(main())

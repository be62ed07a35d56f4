"""Collectives benchmarks (bench/RESULTS.md, Collectives), ratios measured in one run:

1. allreduce bus bandwidth of 4 ranks (4 emulated NICs in this process), 1-64 MiB of float32, against the
   point-to-point RDMA WRITE bandwidth of the same fabric (two emulated NICs, 4 QPs x depth 8, MTU 4096);
2. the same allreduce written with plain awaits, no scheduler (a user's ring: per step, write every piece and await
   it, await every piece's immediate, reduce), on the same communicators, against the compiled one;
3. torch.distributed's gloo backend, 4 processes on this machine, float32 all_reduce, when a python with torch is
   given (`--torch-python`; torch is never a dependency of aiofabric);
4. DMA memory held before and after 100 steady-state replays (the NICs' DmaBudget).

    python bench/collectives.py [--json] [--sizes 1M,4M,16M,64M] [--torch-python PATH]
"""
import argparse
import functools
import json
import subprocess
import sys
import textwrap
import time

import anyio
import numpy as np

from aiofabric import DmaBudget, collectives
from aiofabric.collectives import layout
from aiofabric.sched import pool
from aiofabric.sched.reduce import reduction
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.perftest import run_bench
from aiofabric.tools.units import parse_size

RANKS = 4


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


async def measure(sizes, reps):
    budget = DmaBudget(1 << 40, "bench")
    result = {"p2p_write_GBps": await p2p_bandwidth(), "rows": []}
    async with collectives.local(RANKS, buffer_bytes=max(sizes), dma_budget=budget) as comms:
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
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    result = anyio.run(measure, sizes, args.reps)
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
